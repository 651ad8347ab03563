"""pyarrow schemas of every record that crosses a stage boundary, and their validation."""
from longreel.schemas.records import (CAPTION, CATEGORIES, CLIP, CLIP_FACTS, KINDS, PASS_RATE, PROBLEM_TYPES, QRA, REJECT,
                             SCHEMA_VERSION, VIDEO, RecordKind, reject)
from longreel.schemas.validate import SchemaError, to_table, validate_row

__all__ = ["CAPTION", "CATEGORIES", "CLIP", "CLIP_FACTS", "KINDS", "PASS_RATE", "PROBLEM_TYPES", "QRA", "REJECT",
           "SCHEMA_VERSION", "VIDEO", "RecordKind", "SchemaError", "reject", "to_table", "validate_row"]
