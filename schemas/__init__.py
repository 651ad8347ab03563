"""pyarrow schemas of every record that crosses a stage boundary, and their validation.

The names below load on first use (PEP 562): the trainer and the CLI import ``longreel.schemas.config`` and
``longreel.schemas.atomic`` only, and should not pay for, or need, pyarrow (a GPU trainer image carries no pyarrow).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "records": ("CAPTION", "CATEGORIES", "CLIP", "CLIP_FACTS", "KINDS", "PASS_RATE", "PROBLEM_TYPES", "QRA", "REJECT",
                "SCHEMA_VERSION", "VIDEO", "RecordKind", "reject"),
    "validate": ("SchemaError", "to_table", "validate_row"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
