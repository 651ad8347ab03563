"""Validation of rows against their record kind; every stage uses it on its outputs."""
from __future__ import annotations

import math
from typing import Iterable

import pyarrow as pa

from longreel.schemas.records import KINDS, RecordKind


class SchemaError(ValueError):
    """A row does not match its record kind. The message names the kind, the key and the field."""


def _kind(kind: str | RecordKind) -> RecordKind:
    if isinstance(kind, RecordKind):
        return kind
    try:
        return KINDS[kind]
    except KeyError:
        raise SchemaError(f"unknown record kind {kind!r}; known: {sorted(KINDS)}") from None


_PY_TYPES = {
    pa.string(): (str,),
    pa.float64(): (float, int),
    pa.int64(): (int,),
    pa.int32(): (int,),
    pa.bool_(): (bool,),
}


def _check_value(kind: RecordKind, key: str, name: str, typ: pa.DataType, value) -> None:
    if pa.types.is_list(typ):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(f"{kind.name} {key!r}: field {name!r} must be a list, got {type(value).__name__}")
        for item in value:
            _check_value(kind, key, name, typ.value_type, item)
        return
    ok = _PY_TYPES.get(typ)
    if ok is None:
        return
    if isinstance(value, bool) and bool not in ok:
        raise SchemaError(f"{kind.name} {key!r}: field {name!r} must be {typ}, got bool")
    if not isinstance(value, ok):
        raise SchemaError(f"{kind.name} {key!r}: field {name!r} must be {typ}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(f"{kind.name} {key!r}: field {name!r} is not finite ({value})")


def validate_row(kind: str | RecordKind, row: dict) -> dict:
    """Return ``row`` unchanged if it matches ``kind``; raise :class:`SchemaError` naming what is wrong.

    Unknown fields are an error too: a typo must not silently vanish when the row is written.
    """
    k = _kind(kind)
    key = str(row.get(k.key, "?"))
    names = set(k.schema.names)
    extra = set(row) - names
    if extra:
        raise SchemaError(f"{k.name} {key!r}: unknown fields {sorted(extra)}")
    for f in k.schema:
        value = row.get(f.name)
        if value is None:
            if f.name in k.required or not f.nullable:
                raise SchemaError(f"{k.name} {key!r}: required field {f.name!r} is missing")
            continue
        _check_value(k, key, f.name, f.type, value)
        if f.name in k.allowed and value not in k.allowed[f.name]:
            raise SchemaError(
                f"{k.name} {key!r}: field {f.name!r} = {value!r} not in {sorted(k.allowed[f.name])}")
    if isinstance(row.get(k.key), str) and not row[k.key]:
        raise SchemaError(f"{k.name}: empty key field {k.key!r}")
    return row


def to_table(kind: str | RecordKind, rows: Iterable[dict], validate: bool = True) -> pa.Table:
    """Rows -> a pyarrow Table with the kind's schema (and its version in the metadata)."""
    k = _kind(kind)
    rows = list(rows)
    if validate:
        for r in rows:
            validate_row(k, r)
    full = [{n: r.get(n) for n in k.schema.names} for r in rows]
    return pa.Table.from_pylist(full, schema=k.arrow_schema())
