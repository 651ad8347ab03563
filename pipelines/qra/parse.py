"""Turning a reasoning LLM's raw text into JSON items.

Reasoning models wrap or pad their JSON: a ``<think>...</think>`` preamble (DeepSeek-R1's chat template
puts the opening ``<think>`` in the prompt, so often only ``</think>`` appears), Markdown code fences,
prose before and after, trailing commas. The functions here are tolerant of that padding and strict
about the JSON itself:

* :func:`strip_think` removes reasoning blocks;
* :func:`extract_json` finds the outermost JSON object or array in the text;
* :func:`parse_generation` combines both and returns the list of raw question items.

Every failure raises :class:`ParseError`, whose ``reason`` is always the reject code ``unparseable``
and whose ``detail`` says why: ``empty``, ``unclosed_think`` (a ``<think>`` block cut off by the
token limit, so no answer was written), ``no_json``, ``truncated_json`` (brackets or a string left
open: output cut off), ``invalid_json``, ``bad_shape`` (``"questions"`` is not a list),
``no_questions`` (an empty list: recorded as a reject so that nothing disappears silently).

Decisions: a truncated JSON output is rejected whole (no salvage of the complete items before the
cut); JSON's non-standard constants ``NaN``/``Infinity`` are invalid; a top-level scalar is not JSON
output; when several JSON values stand in the text, the one with the longest source text wins
(fenced blocks are tried first).
"""
from __future__ import annotations

import json
import re
from typing import Any

#: The reject reason of every parse failure.
UNPARSEABLE = "unparseable"

_THINK_BLOCK_RE = re.compile(r"<think>.*?</think>", re.S | re.I)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_FENCE_RE = re.compile(r"```[ \t]*(?:json5?|jsonc|javascript|js)?[ \t]*\r?\n?(.*?)(?:```|\Z)", re.S | re.I)
_OPEN_RE = re.compile(r"[\[{]")
_TRAILING_COMMA_RE = re.compile(r",(\s*[}\]])")


class ParseError(ValueError):
    """The text holds no usable JSON. ``reason`` is ``"unparseable"``; ``detail`` a finer code."""

    def __init__(self, detail: str, message: str):
        super().__init__(f"{detail}: {message}")
        self.reason = UNPARSEABLE
        self.detail = detail
        self.message = message


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _split_think(text: str) -> tuple[str, bool]:
    """Return (text without reasoning blocks, whether an unclosed ``<think>`` was cut off)."""
    body = _THINK_BLOCK_RE.sub("", text)
    low = body.lower()
    close = low.find(_THINK_CLOSE)
    if close >= 0:  # an orphan closer: the opener was part of the prompt; everything before it is thought
        body = body[close + len(_THINK_CLOSE):]
        low = body.lower()
    opened = low.find(_THINK_OPEN)
    if opened >= 0:  # an opener never closed: thinking ran into the token limit
        return body[:opened].strip(), True
    return body.strip(), False


def strip_think(text: str) -> str:
    """Remove a reasoning model's thinking from ``text`` and strip the rest.

    Removes every closed ``<think>...</think>`` block (case-insensitive); then, if a ``</think>`` without
    an opener remains, everything up to and including the first such closer; then an unclosed ``<think>``
    and everything after it (thinking cut off by max tokens: there is no answer after it, so the result is
    usually empty). Text that merely mentions these tags inside a JSON string is altered too; that is
    accepted: no output of ours should contain them.
    """
    return _split_think(text)[0]


def _region_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes the one at ``start`` (strings respected), or None when
    it is never closed (a cut-off output). Bracket kinds are not matched against each other."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _scan(text: str) -> tuple[tuple[Any, int] | None, bool]:
    """The longest *outermost* JSON object/array of ``text`` as (value, source length), or None; and
    whether a bracket was left unclosed.

    Values nested in a bracketed region that does not decode are never candidates: the options list
    of a cut-off output is not "the JSON of the output".
    """
    best: tuple[Any, int] | None = None
    pos = 0
    while True:
        match = _OPEN_RE.search(text, pos)
        if match is None:
            return best, False
        start = match.start()
        try:
            value, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            region_end = _region_end(text, start)
            if region_end is None:
                return best, True
            pos = region_end  # a closed but invalid region: skip it, inner values included
            continue
        if best is None or end - start > best[1]:
            best = (value, end - start)
        pos = end  # values nested in this one are not outermost


def extract_json(text: str) -> Any:
    """Return the outermost JSON object or array in ``text`` (a ``dict`` or ``list``).

    Tolerates a byte-order mark, Markdown code fences (```` ```json ````, also an unclosed one), prose
    before and after, and trailing commas before ``}``/``]`` (retried only when nothing else decodes).
    Raises :class:`ParseError` with detail ``empty``, ``no_json``, ``truncated_json`` or ``invalid_json``.
    """
    if not isinstance(text, str):
        raise ParseError("empty", f"expected text, got {type(text).__name__}")
    body = text.strip().lstrip("\ufeff").strip()
    if not body:
        raise ParseError("empty", "the output is empty")
    try:
        value = _DECODER.decode(body)
        if isinstance(value, (dict, list)):
            return value
    except (ValueError, RecursionError):
        pass
    truncated = False
    candidates = []
    for block in _FENCE_RE.findall(body):
        found, cut = _scan(block)
        truncated |= cut
        if found is not None:
            candidates.append(found)
    if not candidates:
        found, cut = _scan(body)
        truncated |= cut
        if found is None:
            repaired = _TRAILING_COMMA_RE.sub(r"\1", body)
            if repaired != body:
                found, _ = _scan(repaired)
        if found is not None:
            candidates.append(found)
    if candidates:
        return max(candidates, key=lambda c: c[1])[0]
    if _OPEN_RE.search(body) is None:
        raise ParseError("no_json", "no JSON object or array in the output")
    if truncated:
        raise ParseError("truncated_json", "the JSON is cut off (unclosed bracket or string)")
    raise ParseError("invalid_json", "the output's JSON does not decode")


def parse_generation(text: str) -> list[Any]:
    """Return the raw question items of one generation output.

    Accepts ``{"questions": [...]}`` (key matched case-insensitively; a single object instead of the
    list is wrapped), a bare list of items, or a single item object (any object without a
    ``questions`` key: its fields are checked by the validator). Items are returned as decoded, possibly
    not even dicts; :func:`longreel.pipelines.qra.validate.validate_item` judges each one.
    Raises :class:`ParseError` (see the module docstring for the details).
    """
    if not isinstance(text, str):
        raise ParseError("empty", f"expected text, got {type(text).__name__}")
    body, cut_off = _split_think(text)
    try:
        value = extract_json(body)
    except ParseError as err:
        if cut_off:
            raise ParseError("unclosed_think", "a <think> block was never closed (token limit?); "
                             f"no JSON after it ({err.detail})") from err
        raise
    if isinstance(value, dict):
        key = next((k for k in value if isinstance(k, str) and k.strip().casefold() == "questions"), None)
        if key is None:
            items: list[Any] = [value]
        elif isinstance(value[key], list):
            items = list(value[key])
        elif isinstance(value[key], dict):
            items = [value[key]]
        else:
            raise ParseError("bad_shape", f'"questions" must be a list, got {type(value[key]).__name__}')
    else:
        items = list(value)
    if not items:
        raise ParseError("no_questions", "the output holds no question items")
    return items
