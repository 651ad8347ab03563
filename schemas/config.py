"""Configs as dataclasses: loaded from YAML, validated, overridable from the command line, hashed.

Every field carries help text in its metadata (``field(default=..., metadata={"help": ...})``),
which ``--help`` and the docs show. Unknown keys and wrong types are errors that name the
key, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


def cfg(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None,
        default_factory: Any = dataclasses.MISSING):
    """A dataclass field with help text and optional allowed values."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _is_dataclass_type(t) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _coerce(path: str, typ, value):
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, a, value)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if _is_dataclass_type(typ):
        if isinstance(value, typ):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return from_dict(typ, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        (item_t, *_) = typing.get_args(typ) or (Any,)
        items = [_coerce(f"{path}[{i}]", item_t, v) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if typ is Any:
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def from_dict(cls, data: dict, path: str = ""):
    """Build dataclass ``cls`` from a (possibly partial) mapping; unknown keys are an error."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        where = path or cls.__name__
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        p = f"{path}.{name}" if path else name
        v = _coerce(p, hints[name], value)
        choices = f.metadata.get("choices")
        if choices and v not in choices:
            raise ConfigError(f"{p}: {v!r} is not one of {list(choices)}")
        kwargs[name] = v
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check()
    return obj


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def load_yaml(cls, path: str | None, overrides: list[str] | tuple[str, ...] = (), *, section: str | None = None):
    """Defaults <- YAML file <- ``key.sub=value`` overrides (values parsed as YAML scalars).

    ``section``: the name of this config inside a larger one (e.g. ``caption`` of a ``curate`` file), so that a
    stage run alone takes the whole pipeline's file and its ``section.key=value`` overrides: a file with that
    top-level key is read from under it, and the ``section.`` prefix is dropped from overrides."""
    data: dict = {}
    if path:
        with open(path, encoding="utf-8") as fh:
            try:
                loaded = yaml.safe_load(fh) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded.get(section, loaded) if section else loaded
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: {section!r} must be a mapping")
    if section:
        overrides = [o[len(section) + 1:] if o.startswith(section + ".") else o for o in overrides]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key.strip()}: the value {raw!r} is not valid YAML ({_yaml_problem(e)}); "
                              "quote the strings in it, e.g. --set '" + key.strip() + "=[\"dir/ds-{000..009}.tar\"]'") from None
    return from_dict(cls, data)


def _yaml_problem(e: "yaml.YAMLError") -> str:
    """One line: what PyYAML found wrong and where (1-based line and column)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "")


def dump_yaml(obj) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


def config_hash(obj) -> str:
    """sha256 of the canonical JSON of a config: the identity of a run's parameters."""
    blob = json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, nested sections flattened with dots; for --help."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if _is_dataclass_type(hints[f.name]):
            out.extend(describe(hints[f.name], key + "."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "(required)"
        help_text = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_text += f" One of {list(f.metadata['choices'])}."
        out.append((key, default, help_text))
    return out
