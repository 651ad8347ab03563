"""JSON schemas of the reasoning LLM's outputs, for guided (constrained) decoding and for checking.

Two outputs:

* generation: ``{"questions": [item, ...]}`` where an item is either
  ``{"question", "problem_type": "multiple_choice", "options": [4 strings], "reasoning", "answer": "A".."D"}``
  or ``{"question", "problem_type": "open_ended", "reasoning", "answer"}``;
* refinement: ``{"reasoning", "answer"}`` (the answer can be pinned to the existing one).

The schemas use only the keywords that every common constrained-decoding backend understands
(vLLM's ``guided_json`` through xgrammar, guidance/llguidance or outlines; lm-format-enforcer or outlines
on the transformers side): ``type``, ``properties``, ``required``, ``additionalProperties``, ``enum``,
``anyOf``, ``items``, ``minItems``, ``maxItems``, ``minLength``. No ``$ref``, ``oneOf``, ``if/then`` or
``format``; ``pattern`` appears only on the reasoning, only when ``qra.reasoning_prefix`` is set, and only in the
schemas sent to backends whose constrained decoding takes it (llguidance in the transformers backend, vLLM's
structured outputs, OpenAI-compatible servers). :data:`SCHEMA_KEYWORDS` lists them and a test enforces it.

Property order matters to grammar-based backends (they emit properties in schema order): ``reasoning``
comes before ``answer`` so the model writes its argument before committing to an answer.

Guided decoding guarantees the shape, not the content: the validator in :mod:`longreel.pipelines.qra.validate`
still runs on every output (and is the only check for backends without guided decoding).
:func:`check_instance` is a small checker for exactly this keyword subset, for tests and diagnostics.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from longreel.pipelines.qra.targets import GENERATED_PROBLEM_TYPES, OPTION_LETTERS

#: The only JSON-schema keywords used by the schemas of this module.
SCHEMA_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum", "anyOf",
                             "items", "minItems", "maxItems", "minLength", "title", "description", "pattern"})

_TEXT = {"type": "string", "minLength": 1}


def _reasoning(prefix: str | None) -> dict:
    """The reasoning's schema; with ``prefix`` (a regular expression) it must start with a match of it. JSON-schema
    patterns are searched, not anchored, hence the ``^``; the ``.*`` lets grammar backends that match the whole
    string go on after the prefix."""
    return dict(_TEXT) if not prefix else {**_TEXT, "pattern": f"^({prefix}).*"}


def _mc_item(reasoning_prefix: str | None = None) -> dict:
    return {
        "type": "object",
        "properties": {
            "question": dict(_TEXT),
            "problem_type": {"type": "string", "enum": ["multiple_choice"]},
            "options": {"type": "array", "items": dict(_TEXT), "minItems": 4, "maxItems": 4},
            "reasoning": _reasoning(reasoning_prefix),
            "answer": {"type": "string", "enum": list(OPTION_LETTERS)},
        },
        "required": ["question", "problem_type", "options", "reasoning", "answer"],
        "additionalProperties": False,
    }


def _open_item(reasoning_prefix: str | None = None) -> dict:
    return {
        "type": "object",
        "properties": {
            "question": dict(_TEXT),
            "problem_type": {"type": "string", "enum": ["open_ended"]},
            "reasoning": _reasoning(reasoning_prefix),
            "answer": dict(_TEXT),
        },
        "required": ["question", "problem_type", "reasoning", "answer"],
        "additionalProperties": False,
    }


def generation_schema(problem_types: Sequence[str] = GENERATED_PROBLEM_TYPES, *, min_questions: int = 1,
                      max_questions: int | None = None, reasoning_prefix: str | None = None) -> dict:
    """The schema of one generation output.

    ``problem_types``: which item shapes are allowed (``multiple_choice``, ``open_ended`` or both; with
    both, items are an ``anyOf`` of the two shapes). ``min_questions``/``max_questions`` bound the list.
    ``reasoning_prefix``: a regular expression every reasoning must start with (a ``pattern``; see above).
    Returns a fresh dict (callers may mutate it).
    """
    shapes = {"multiple_choice": _mc_item, "open_ended": _open_item}
    types = list(dict.fromkeys(problem_types))
    if not types:
        raise ValueError("problem_types is empty")
    unknown = [t for t in types if t not in shapes]
    if unknown:
        raise ValueError(f"unsupported problem types {unknown}; supported: {list(shapes)}")
    if min_questions < 0 or (max_questions is not None and max_questions < max(min_questions, 1)):
        raise ValueError(f"bad bounds min_questions={min_questions} max_questions={max_questions}")
    item = (shapes[types[0]](reasoning_prefix) if len(types) == 1
            else {"anyOf": [shapes[t](reasoning_prefix) for t in types]})
    questions: dict[str, Any] = {"type": "array", "items": item, "minItems": min_questions}
    if max_questions is not None:
        questions["maxItems"] = max_questions
    return {
        "title": "qra_generation",
        "type": "object",
        "properties": {"questions": questions},
        "required": ["questions"],
        "additionalProperties": False,
    }


def refinement_schema(answer: str | None = None, reasoning_prefix: str | None = None) -> dict:
    """The schema of one refinement output ``{"reasoning": str, "answer": str}``.

    With ``answer`` given, the answer is pinned to that exact string (``enum`` of one value): refinement
    rewrites the reasoning and must keep the answer unchanged.
    """
    answer_schema: dict[str, Any] = dict(_TEXT) if answer is None else {"type": "string", "enum": [answer]}
    return {
        "title": "qra_refinement",
        "type": "object",
        "properties": {"reasoning": _reasoning(reasoning_prefix), "answer": answer_schema},
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }


#: Generation schema allowing both item shapes and any number (>= 1) of questions.
GENERATION_SCHEMA: dict = generation_schema()
#: Refinement schema with a free answer.
REFINEMENT_SCHEMA: dict = refinement_schema()


def schema_json(schema: dict) -> str:
    """The schema as a compact, key-order-preserving JSON string (what vLLM's ``guided_json`` and
    OpenAI-compatible ``response_format`` accept; hashing it gives a stable prompt/config hash)."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def schema_keywords(schema: Any) -> set[str]:
    """Every JSON-schema keyword used anywhere in ``schema`` (property names are not keywords)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                found.add(key)
                if key == "properties":
                    for sub in value.values():
                        walk(sub)
                elif key in ("items", "additionalProperties"):
                    walk(value)
                elif key == "anyOf":
                    for sub in value:
                        walk(sub)

    walk(schema)
    return found


def check_instance(instance: Any, schema: dict, path: str = "$") -> list[str]:
    """Check ``instance`` against a schema written with :data:`SCHEMA_KEYWORDS`; return error strings
    (empty when it conforms). Not a general JSON-schema validator."""
    if "anyOf" in schema:
        branches = [check_instance(instance, sub, path) for sub in schema["anyOf"]]
        if any(not b for b in branches):
            return []
        return [f"{path}: matches no anyOf branch ({'; '.join(b[0] for b in branches)})"]
    errors: list[str] = []
    typ = schema.get("type")
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str)}
    if typ is not None and typ in checks and not checks[typ](instance):
        return [f"{path}: expected {typ}, got {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r} not in {schema['enum']}")
    if isinstance(instance, str) and len(instance) < schema.get("minLength", 0):
        errors.append(f"{path}: shorter than {schema['minLength']}")
    if isinstance(instance, str) and "pattern" in schema and not re.search(schema["pattern"], instance):
        errors.append(f"{path}: does not match /{schema['pattern']}/")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, value in enumerate(instance):
                errors += check_instance(value, schema["items"], f"{path}[{i}]")
    if isinstance(instance, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing {key!r}")
        for key, value in instance.items():
            if key in props:
                errors += check_instance(value, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected property {key!r}")
    return errors
