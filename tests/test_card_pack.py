"""The card against real shards: the demo corpus curated, packed by the pack stage (real decoding into the frame
cache), then `card build` and `card verify`. Also checks the card's frames-per-video against the pack stage's own
summary in stats.json and that the licences reach the shards and the card.
"""
from __future__ import annotations

import json
import os

import pytest

from longreel.pipelines.card.build import build_card, claims_by_id
from longreel.pipelines.card.verify import verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.testing import pack_tables as fixtures
    from longreel.pipelines.pack.config import PackConfig
    from longreel.pipelines.stages.pack import run_pack
    from longreel.pipelines.sample_corpus import demo_items

    run_dir = str(tmp_path_factory.mktemp("packed") / "run")
    run_curate(demo_items(), run_dir, CurateConfig(stages=[]))
    videos = read_table(run_dir, "videos").to_pylist()
    qras = fixtures.qra_rows(videos, per_video=4)
    fixtures.write_tables(run_dir, {"qras": ("qra", qras), "pass_rate": ("pass_rate", fixtures.pass_rate_rows(qras))})
    cfg = PackConfig(dataset="demo", fps=1.0, max_frames=8, min_frames=2, max_pixels=32 * 28 * 28,
                     target_shard_bytes=400_000)
    stats = run_pack(run_dir, cfg)
    card_dir = str(tmp_path_factory.mktemp("packed_card"))
    build_card(run_dir, card_dir, command="pytest tests/test_card_pack.py")
    return run_dir, card_dir, stats


def test_card_of_real_pack_output_verifies(packed):
    run_dir, card_dir, stats = packed
    rep = verify(card_dir, os.path.join(run_dir, "shards"))
    assert rep.ok, rep.table()
    with open(os.path.join(card_dir, "card.json")) as fh:
        cl = claims_by_id(json.load(fh))
    # every stage of curate and pack is in the card and balanced
    assert {"ingest", "dedup", "segment", "pack_select", "frame_cache", "pack_write"} <= set(cl["funnel/stages"])
    for s in cl["funnel/stages"]:
        st = cl[f"funnel/{s}"]
        assert st["in"] == st["out"] + st["rejected_total"], s
    # frames per cached video: the card (read back from the shards) agrees with the pack stage's own summary
    hist = stats["pack"]["frames_per_video"]["histogram"]
    assert cl["dist/released_frames_per_video"] == {k: v for k, v in hist.items() if v}
    # licences and attributions travel from the sample corpus into the shards and the card
    assert cl["dist/released_license"] == {"BSD-3-Clause": 2, "CC-BY-3.0": 1, "LPPL-1.3c": 1}
    bbb = [k for k in cl["dist/released_attribution"] if "Big Buck Bunny" in k]
    assert bbb and bbb[0].startswith("CC-BY-3.0 | ") and "Blender Foundation" in bbb[0]
    with open(os.path.join(card_dir, "README.md")) as fh:
        text = fh.read()
    assert "Big Buck Bunny (c) copyright 2008, Blender Foundation" in text
