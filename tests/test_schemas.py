import pyarrow as pa
import pytest

from longreel.schemas import KINDS, SCHEMA_VERSION, SchemaError, reject, to_table, validate_row

CLIP = {"clip_id": "abc-00000-1234abcd", "video_id": "abc", "index": 0, "start_s": 0.0, "end_s": 10.0,
        "start_frame": 0, "end_frame": 300, "mode": "virtual", "cut": "none", "clip_uri": None,
        "actual_start_s": None, "actual_end_s": None, "segment_params": "{}"}


def test_valid_row_passes_and_table_has_version():
    validate_row("clip", CLIP)
    t = to_table("clip", [CLIP])
    assert t.num_rows == 1
    assert t.schema.metadata[b"longreel.schema_version"] == SCHEMA_VERSION.encode()
    assert t.schema.metadata[b"longreel.record"] == b"clip"


@pytest.mark.parametrize("change, message", [
    ({"clip_id": None}, "required field 'clip_id'"),
    ({"start_s": "zero"}, "'start_s' must be double"),
    ({"index": 1.5}, "'index' must be int32"),
    ({"index": True}, "got bool"),
    ({"mode": "sideways"}, "not in"),
    ({"bogus": 1}, "unknown fields"),
    ({"end_s": float("nan")}, "not finite"),
    ({"clip_id": ""}, "empty key"),
])
def test_invalid_rows_name_the_problem(change, message):
    with pytest.raises(SchemaError, match=message):
        validate_row("clip", {**CLIP, **change})


def test_every_kind_has_its_key_and_required_fields_in_schema():
    for kind in KINDS.values():
        assert kind.key in kind.schema.names
        assert set(kind.required) <= set(kind.schema.names)
        for name in kind.allowed:
            assert name in kind.schema.names


def test_reject_helper_is_a_valid_reject():
    r = reject("ingest", "x.mp4", "not_found", "no such file")
    validate_row("reject", r)
    assert to_table("reject", [r]).column("reason").to_pylist() == ["not_found"]


def test_list_fields_are_checked():
    row = {"clip_id": "c", "video_id": "v", "start_s": 0.0, "end_s": 1.0, "frame_timestamps": [0.0, "x"],
           "motion": 0.0, "black_ratio": 0.0, "brightness": 0.0, "n_cuts": 0}
    with pytest.raises(SchemaError, match="frame_timestamps"):
        validate_row("clip_facts", row)
    row["frame_timestamps"] = [0.0, 0.5]
    assert to_table("clip_facts", [row]).schema.field("frame_timestamps").type == pa.list_(pa.float64())
