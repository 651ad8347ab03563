"""benchmarks/scale.py's output comparison (issue 16): when the 1-worker and 2-worker outputs differ it names the
files and table rows, and it tells a change of checkout between the two runs (the recorded code version: stats.json
and the card) from a worker count computing something else."""
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import load_benchmark


def _scale():
    return load_benchmark("scale")


def _run(out: Path, version: str, reason: str) -> str:
    (out / "card").mkdir(parents=True)
    (out / "stats.json").write_text(json.dumps({"code_version": version, "totals": {"videos_in": 2},
                                                "run": {"caption": {"latency_total_s": len(reason)}}}))
    (out / "card" / "README.md").write_text(f"code version: {version}\n")
    pq.write_table(pa.Table.from_pylist([{"key": "v1", "reason": "too_short"}, {"key": "v2", "reason": reason}]),
                   out / "rejects-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"video_id": "v3", "n": 1}]), out / "videos-00000-of-00001.parquet")
    return str(out)


def test_a_changed_checkout_is_told_apart_from_different_outputs(tmp_path):
    scale = _scale()
    a = _run(tmp_path / "a", "0.1.0+g1234", "decode_timeout")
    b = _run(tmp_path / "b", "0.1.0+g1234.dirty", "decode_timeout")
    d = scale.compare(a, b)
    assert not d["identical"]
    assert d["files_differing"] == [os.path.join("card", "README.md"), "stats.json"]  # the run record is left out
    assert d["code_version_differs"] == ["0.1.0+g1234", "0.1.0+g1234.dirty"]
    assert d["identical_but_code_version"] is True and d["files_differing_but_code_version"] == []


def test_differing_rejects_are_named_with_their_reasons(tmp_path):
    scale = _scale()
    a = _run(tmp_path / "a", "0.1.0+g1234", "decode_timeout")
    b = _run(tmp_path / "b", "0.1.0+g1234", "too_short")
    d = scale.compare(a, b)
    assert d["files_differing"] == ["rejects-00000-of-00001.parquet"] and "code_version_differs" not in d
    t = d["tables"]["rejects"]
    assert t["rows"] == [2, 2] and t["keys"] == ["v2"]
    assert t["reasons"] == {"v2": [["decode_timeout"], ["too_short"]]}
    assert scale.compare(a, a) == {"identical": True, "files_differing": []}
