"""Configs as pydantic models: loaded from YAML, validated, overridable from the command line, hashed.

Every field is made with ``cfg(default, help, choices=...)``: the help text is the field's description, which
``--help``, ``--show-config`` and the JSON schema show. A config class derives from :class:`ConfigModel`.
Unknown keys and wrong types are errors that name the key (``segment.clip_s: expected a number, got 'abc'``),
never silently ignored.

The accepted values are the command line's, not pydantic's lax mode: ``--set`` values arrive as YAML scalars, so
a bool field takes true/false/yes/no/1/0 (as bools or strings) and nothing else, an int or float field refuses
bools (``true`` is not 1), an int field refuses floats, a str field takes numbers (``--set model.path=7``).
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import types
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError, PydanticUndefined


def closest(name: str, candidates, cutoff: float = 0.75) -> str | None:
    """The candidate nearest to a misspelt ``name`` (difflib's ratio of at least ``cutoff``), or None."""
    near = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=cutoff)
    return near[0] if near else None


def unexpected_arguments(extra: list[str], options=(), positional_for: str | None = None) -> str:
    """One line on the arguments a command was given and does not take: each unknown option with the nearest of the
    command's ``options`` (``--sett`` -> ``--set``); the values after an unknown option are not named, since which
    ones belong to it cannot be told. A lone positional argument is what the user meant as an option's value: a
    YAML file is a ``--config`` (when the command has one), anything else the ``positional_for`` option's value
    (``longreel eval RUN/final`` -> ``--model RUN/final``)."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-") and a != "-"]
    if not flags:
        if len(extra) == 1:
            value = extra[0]
            option = "--config" if value.endswith((".yaml", ".yml")) and "--config" in options else positional_for
            hint = f" (did you mean {option} {value}?)" if option else ""
            return f"unexpected argument {value!r}{hint}"
        return f"unexpected arguments {extra}"
    named = [f + (f" (did you mean {near}?)" if (near := closest(f, options)) else "") for f in flags]
    return f"unknown option{'s' if len(named) > 1 else ''} {', '.join(named)}"


class ConfigError(ValueError):
    pass


def cfg(default: Any = PydanticUndefined, help: str = "", choices: tuple | None = None,
        default_factory: Any = None):
    """A model field with help text and optional allowed values.

    The allowed values go to the JSON schema as ``enum`` (so an exported schema states them) and are enforced by
    :class:`ConfigModel`; the annotation stays ``str`` rather than a ``Literal`` so that the value is coerced like
    any string first and the module-level tuples of names (``BACKENDS``) stay the one list."""
    extra = {"enum": list(choices)} if choices is not None else None
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra)
    return Field(default, description=help, json_schema_extra=extra)


# Validation context of a load (load_yaml): only then do the check hooks run. A section built in code or by a
# default factory (CurateConfig's FilterConfig has no model yet) is not checked, as with the dataclass configs.
_RUN_CHECKS = "longreel_run_checks"
_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


class ConfigModel(BaseModel):
    """Base of every config: unknown keys forbidden, the command line's coercion rules, per-class ``check``."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    def check(self) -> None:
        """This section's own rules beyond types (subclasses override); raise :class:`ConfigError` naming the key.
        Runs after a load has built the section (its nested sections are checked before it)."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        # Before the fields, like the dataclass loader: one message listing every unknown key and the known ones
        # (pydantic's extra="forbid" reports each unknown key alone, after the field errors).
        if isinstance(data, dict):
            unknown = set(data) - set(cls.model_fields)
            if unknown:
                # field names are short: a looser match than for options ('clip_len' is 0.71 of 'clip_s')
                near = {k: closest(str(k), cls.model_fields, cutoff=0.6) for k in sorted(unknown, key=str)}
                near = {k: v for k, v in near.items() if v}
                hint = ("" if not near else f" (did you mean {next(iter(near.values()))!r}?)" if len(unknown) == 1
                        else f" (did you mean {', '.join(f'{v!r} for {k!r}' for k, v in near.items())}?)")
                raise PydanticCustomError("unknown_keys", "unknown key(s) {unknown}{hint}; known: {known}",
                                          {"unknown": sorted(unknown, key=str), "known": sorted(cls.model_fields),
                                           "hint": hint})
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _coerce_like_the_command_line(cls, value: Any, info: ValidationInfo) -> Any:
        annotation, nullable = _strip_optional(cls.model_fields[info.field_name].annotation)
        if value is None and nullable:
            return value
        coerce = _COERCE.get(typing.get_origin(annotation) or annotation)
        return coerce(value) if coerce else value

    @field_validator("*", mode="after")
    @classmethod
    def _one_of_the_choices(cls, value: Any, info: ValidationInfo) -> Any:
        choices = _choices(cls.model_fields[info.field_name])
        if choices and value is not None and value not in choices:
            raise PydanticCustomError("not_a_choice", "{value} is not one of {choices}",
                                      {"value": repr(value), "choices": choices})
        return value

    @model_validator(mode="after")
    def _run_check(self, info: ValidationInfo) -> "ConfigModel":
        if info.context and info.context.get(_RUN_CHECKS):
            self.check()
        return self


def _strip_optional(annotation) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (itself, False)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return annotation, False


def _wrong(expected: str, value: Any) -> PydanticCustomError:
    return PydanticCustomError("config_type", "{expected}, got {got}", {"expected": expected, "got": repr(value)})


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    raise _wrong("expected true/false", value)


def _to_int(value: Any) -> int:
    # bool is an int subclass, and pydantic's lax int also takes 5.0 and "5.0": refused here.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _wrong("expected an integer", value)


def _to_float(value: Any) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise _wrong("expected a number", value)
    # YAML reads .nan, .inf and 1e400 as floats, and Python's float() "nan" and "inf": no setting means them, and
    # each passed every range check (nan compares false) to fail deep in a stage
    if not math.isfinite(number):
        raise _wrong("expected a finite number", value)
    return number


def _a_list(value: Any) -> Any:
    # pydantic would also take a set (YAML's !!set), whose order is not the file's; the items are pydantic's.
    if isinstance(value, (list, tuple)):
        return list(value)
    raise PydanticCustomError("config_type", "expected a list, got {got}", {"got": type(value).__name__})


# str, dict and nested sections are pydantic's own (coerce_numbers_to_str); their errors are reworded below.
_COERCE = {bool: _to_bool, int: _to_int, float: _to_float, list: _a_list}


def _choices(field) -> list | None:
    extra = field.json_schema_extra
    return extra.get("enum") if isinstance(extra, dict) else None


def _path(loc: tuple) -> str:
    """('qra', 'categories', 0) -> 'qra.categories[0]'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _pydantic_wording(err: dict) -> str:
    """The loader's words for the errors pydantic's own validators raise (str, dict and section fields)."""
    kind, value = err["type"], err.get("input")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping, got {type(value).__name__}"
    if kind == "string_type":
        return f"expected a string, got {value!r}"
    return err["msg"]


def _first_problem(cls, exc: ValidationError, section: str | None = None) -> str:
    """The first error of a ValidationError as one line naming the key, e.g. ``segment.clip_s: expected a number,
    got 'abc'``, under ``section`` when the config is one section of a larger file (``pack.fps``, not ``fps``). A
    check hook's ConfigError keeps its own message (it names its key already)."""
    err = exc.errors()[0]
    if err["type"] == "value_error":
        return str(err["ctx"]["error"])
    where = ".".join(p for p in (section, _path(err["loc"])) if p) or cls.__name__
    return f"{where}: {_pydantic_wording(err)}"


def from_dict(cls, data: dict, section: str | None = None):
    """Build config ``cls`` from a (possibly partial) mapping and run the check hooks of every section given.
    ``section``: the name the user knows this config by, for the error messages."""
    try:
        return cls.model_validate(data, context={_RUN_CHECKS: True})
    except ValidationError as e:
        raise ConfigError(_first_problem(cls, e, section)) from None


def to_dict(obj) -> dict:
    # The values as they are, like dataclasses.asdict: a field set in code (cfg.stages = ("caption",)) is dumped
    # without pydantic's serializer warnings.
    return obj.model_dump(warnings=False)


def _read_yaml(path: str, section: str | None) -> dict:
    """A config file's mapping (under ``section`` when the file has that top-level key)."""
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
    return data


def _merge(under: dict, over: dict) -> dict:
    """``over`` on top of ``under``: sections merged key by key, any other value (lists too) replaced."""
    out = dict(under)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(cls, path: str | None, overrides: list[str] | tuple[str, ...] = (), *, section: str | None = None,
              base: str | dict | None = None):
    """Defaults <- ``base`` file <- YAML file <- ``key.sub=value`` overrides (values parsed as YAML scalars).

    ``section``: the name of this config inside a larger one (e.g. ``caption`` of a ``curate`` file), so that a
    stage run alone takes the whole pipeline's file and its ``section.key=value`` overrides: a file with that
    top-level key is read from under it, and the ``section.`` prefix is dropped from overrides. ``base``: a file
    (``curate --demo``'s settings) or a mapping (a run's recorded section) under the user's file, whose keys the
    user's file overrides one by one."""
    if isinstance(base, dict):
        data: dict = copy.deepcopy(base)  # the overrides below write into nested sections
    else:
        data = _read_yaml(base, section) if base else {}
    if path:
        data = _merge(data, _read_yaml(path, section))
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
    return from_dict(cls, data, section)


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


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, ConfigModel)


def describe(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, nested sections flattened with dots; for --help."""
    out = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}{name}"
        if _is_section(field.annotation):
            out.extend(describe(field.annotation, key + "."))
            continue
        if field.default_factory is not None:
            default = repr(field.default_factory())  # type: ignore[call-arg]
        elif field.is_required():
            default = "(required)"
        else:
            default = repr(field.default)
        help_text = field.description or ""
        if _choices(field):
            help_text += f" One of {_choices(field)}."
        out.append((key, default, help_text))
    return out
