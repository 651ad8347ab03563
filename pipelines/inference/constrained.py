"""JSON-schema-constrained decoding for local models: a character-level matcher and a token mask.

Only the keyword subset of :mod:`longreel.pipelines.qra.json_schema` is supported (``type`` object/array/string,
``properties`` with every property ``required``, ``additionalProperties``, ``enum``, ``anyOf``, ``items``,
``minItems``, ``maxItems``, ``minLength``); anything else raises :class:`UnsupportedSchema`, it is never
silently ignored. The accepted language is *compact* JSON (no whitespace outside strings), properties in
schema order, and strings without escapes or control characters (a model cannot write ``"`` or ``\\``
inside a string), so every accepted text is valid JSON that satisfies the schema. Each string is closed
after ``max_string_chars`` characters (the decoder then only allows the closing quote).

How it works: the schema compiles to a small grammar of literals, string bodies, sequences,
alternatives and bounded repetitions. A parser state is an immutable stack of frames; a set of states
(several only under ``anyOf``) advances character by character (:meth:`Matcher.advance`). The token
mask (:class:`TokenMasker`) is computed per step:

* inside a string body, from precomputed token classes: tokens made only of string-safe characters
  that still fit, plus the (few) tokens holding a quote, each simulated through the matcher;
* elsewhere, by walking a character trie of the vocabulary with the state set, pruning dead branches
  (only a handful of tokens can follow a literal), cached per state.

End of sequence is allowed exactly when a state has accepted the whole value.
"""
from __future__ import annotations

import json
from typing import Sequence

# Grammar nodes: ("lit", text) | ("str", min_len) | ("seq", (nodes...)) | ("alt", (nodes...))
#                | ("arr", item_node, min_items, max_items_or_None)
# Stack frames: ("L", text, pos) | ("S", min_len, count) | ("N", node) | ("A", item, min, max, count)
# A stack is a linked list (frame, rest) or None (the value is complete: accept).

_SUPPORTED = frozenset({"type", "properties", "required", "additionalProperties", "enum", "anyOf", "items",
                        "minItems", "maxItems", "minLength", "title", "description"})


class UnsupportedSchema(ValueError):
    """The schema uses a keyword or shape the constrained decoder does not implement."""


def _lit(text: str) -> tuple:
    return ("lit", text)


def _seq(nodes: list) -> tuple:
    merged: list = []
    for n in nodes:
        if n[0] == "seq":
            for m in n[1]:
                _append(merged, m)
        else:
            _append(merged, n)
    return merged[0] if len(merged) == 1 else ("seq", tuple(merged))


def _append(out: list, node: tuple) -> None:
    if out and out[-1][0] == "lit" and node[0] == "lit":
        out[-1] = ("lit", out[-1][1] + node[1])
    else:
        out.append(node)


def compile_schema(schema: dict) -> tuple:
    """Compile ``schema`` to a grammar node; raises :class:`UnsupportedSchema`."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"a schema must be an object, got {type(schema).__name__}")
    unknown = set(schema) - _SUPPORTED
    if unknown:
        raise UnsupportedSchema(f"unsupported keywords {sorted(unknown)}")
    if "anyOf" in schema:
        rest = {k: v for k, v in schema.items() if k not in ("anyOf", "title", "description")}
        if rest:
            raise UnsupportedSchema(f"anyOf beside other keywords {sorted(rest)}")
        branches = schema["anyOf"]
        if not branches:
            raise UnsupportedSchema("empty anyOf")
        return ("alt", tuple(compile_schema(b) for b in branches))
    if "enum" in schema:
        values = schema["enum"]
        if not values:
            raise UnsupportedSchema("empty enum")
        for v in values:
            if schema.get("type") == "string" and not isinstance(v, str):
                raise UnsupportedSchema(f"enum value {v!r} is not a string")
            if isinstance(v, str) and any(c in v for c in '"\\') or isinstance(v, str) and any(ord(c) < 32 for c in v):
                raise UnsupportedSchema(f"enum value {v!r} needs escapes")
        alts = tuple(_lit(json.dumps(v, ensure_ascii=False, separators=(",", ":"))) for v in values)
        return alts[0] if len(alts) == 1 else ("alt", alts)
    typ = schema.get("type")
    if typ == "string":
        return _seq([_lit('"'), ("str", int(schema.get("minLength", 0)))])
    if typ == "array":
        if "items" not in schema:
            raise UnsupportedSchema("an array needs items")
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        if hi is not None and int(hi) < lo:
            raise UnsupportedSchema(f"maxItems {hi} < minItems {lo}")
        return ("arr", compile_schema(schema["items"]), lo, None if hi is None else int(hi))
    if typ == "object":
        props = schema.get("properties", {})
        required = list(schema.get("required", []))
        if set(required) != set(props):
            raise UnsupportedSchema("every property must be required (optional properties are not supported)")
        if schema.get("additionalProperties", False) is not False:
            raise UnsupportedSchema("additionalProperties must be false")
        if not props:
            return _lit("{}")
        parts: list = []
        for i, (name, sub) in enumerate(props.items()):
            parts.append(_lit(("{" if i == 0 else ",") + json.dumps(name, ensure_ascii=False) + ":"))
            parts.append(compile_schema(sub))
        parts.append(_lit("}"))
        return _seq(parts)
    raise UnsupportedSchema(f"unsupported type {typ!r}")


def is_string_char(ch: str) -> bool:
    """Characters allowed inside a string body (no quote, backslash or control character)."""
    return ch != '"' and ch != "\\" and ord(ch) >= 0x20


class Matcher:
    """A set of parser states over a compiled schema. Immutable: :meth:`advance` returns a new matcher."""

    __slots__ = ("states", "max_chars")

    def __init__(self, states: tuple, max_chars: int):
        self.states = states
        self.max_chars = max_chars

    @classmethod
    def start(cls, schema: dict, max_string_chars: int = 360) -> "Matcher":
        node = compile_schema(schema)
        return cls(tuple(_dedupe(_expand((("N", node), None)))), max_string_chars)

    @property
    def dead(self) -> bool:
        return not self.states

    @property
    def accepted(self) -> bool:
        """Whether the text so far is a complete value (end of sequence allowed)."""
        return any(s is None for s in self.states)

    def in_string(self) -> list:
        return [s for s in self.states if s is not None and s[0][0] == "S"]

    def advance(self, text: str) -> "Matcher":
        states = self.states
        for ch in text:
            nxt: list = []
            for s in states:
                nxt.extend(_step(s, ch, self.max_chars))
            states = tuple(_dedupe(nxt))
            if not states:
                break
        return Matcher(states, self.max_chars)

    def accepts_text(self, text: str) -> bool:
        m = self.advance(text)
        return m.accepted


def _dedupe(states: list) -> list:
    out, seen = [], set()
    for s in states:
        key = _key(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _key(stack) -> tuple:
    frames = []
    while stack is not None:
        frame, stack = stack
        if frame[0] == "N":
            frame = ("N", id(frame[1]))
        elif frame[0] == "A":
            frame = ("A", id(frame[1]), frame[2], frame[3], frame[4])
        frames.append(frame)
    return tuple(frames) if frames else ()


def _expand(stack) -> list:
    """States reachable from ``stack`` without consuming a character, each with a terminal frame on top."""
    if stack is None:
        return [None]
    frame, rest = stack
    kind = frame[0]
    if kind in ("L", "S"):
        return [stack]
    if kind == "A":
        _, item, lo, hi, count = frame
        out: list = []
        if count >= lo:
            out.extend(_expand((("L", "]", 0), rest)))
        if hi is None or count < hi:
            nxt = (("A", item, lo, hi, count + 1), rest)
            nxt = (("N", item), nxt)
            if count > 0:
                nxt = (("L", ",", 0), nxt)
            out.extend(_expand(nxt))
        return out
    node = frame[1]
    nk = node[0]
    if nk == "lit":
        return [(("L", node[1], 0), rest)]
    if nk == "str":
        return [(("S", node[1], 0), rest)]
    if nk == "seq":
        st = rest
        for child in reversed(node[1]):
            st = (("N", child), st)
        return _expand(st)
    if nk == "alt":
        out = []
        for child in node[1]:
            out.extend(_expand((("N", child), rest)))
        return out
    if nk == "arr":
        return [(("L", "[", 0), (("A", node[1], node[2], node[3], 0), rest))]
    raise AssertionError(nk)


def _step(stack, ch: str, max_chars: int) -> list:
    if stack is None:
        return []
    frame, rest = stack
    if frame[0] == "L":
        text, pos = frame[1], frame[2]
        if text[pos] != ch:
            return []
        if pos + 1 < len(text):
            return [(("L", text, pos + 1), rest)]
        return _expand(rest)
    # string body
    min_len, count = frame[1], frame[2]
    if ch == '"':
        return _expand(rest) if count >= min_len else []
    if is_string_char(ch) and count < max_chars:
        return [(("S", min_len, count + 1), rest)]
    return []


class _Trie:
    __slots__ = ("children", "ids")

    def __init__(self):
        self.children: dict[str, _Trie] = {}
        self.ids: list[int] = []


class TokenMasker:
    """Which tokens a :class:`Matcher` allows next. Built once per tokenizer (vocabulary texts)."""

    def __init__(self, token_texts: Sequence[str | None], eos_ids: Sequence[int]):
        import torch

        self.n = len(token_texts)
        self.texts = list(token_texts)
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        safe_len = [-1] * self.n
        self.quote_ids: list[int] = []
        self.root = _Trie()
        for i, text in enumerate(token_texts):
            if not text or i in self.eos_ids:
                continue
            node = self.root
            for ch in text:
                node = node.children.setdefault(ch, _Trie())
            node.ids.append(i)
            if all(is_string_char(c) for c in text):
                safe_len[i] = len(text)
            else:
                head = text.split('"', 1)[0]
                if '"' in text and all(is_string_char(c) for c in head):
                    self.quote_ids.append(i)
        self.safe_len = torch.tensor(safe_len, dtype=torch.int64)
        self._cache: dict = {}

    def allowed(self, matcher: Matcher):
        """A boolean tensor over the vocabulary (True: the token may come next)."""
        import torch

        mask = torch.zeros(self.n, dtype=torch.bool)
        if matcher.accepted:
            for i in self.eos_ids:
                if i < self.n:
                    mask[i] = True
        for state in matcher.states:
            if state is None:
                continue
            frame = state[0]
            if frame[0] == "S":
                room = matcher.max_chars - frame[2]
                if room > 0:
                    mask |= (self.safe_len >= 1) & (self.safe_len <= room)
                single = Matcher((state,), matcher.max_chars)
                for i in self.quote_ids:
                    if not single.advance(self.texts[i]).dead:
                        mask[i] = True
            else:
                key = _key(state)
                ids = self._cache.get(key)
                if ids is None:
                    ids = []
                    self._walk(self.root, (state,), matcher.max_chars, ids)
                    if len(self._cache) < 4096:
                        self._cache[key] = ids
                if ids:
                    mask[ids] = True
        return mask

    def _walk(self, node: _Trie, states: tuple, max_chars: int, out: list) -> None:
        for ch, child in node.children.items():
            nxt: list = []
            for s in states:
                nxt.extend(_step(s, ch, max_chars))
            if not nxt:
                continue
            out.extend(child.ids)
            if child.children:
                self._walk(child, tuple(_dedupe(nxt)), max_chars, out)


def token_texts(tokenizer) -> list[str | None]:
    """The text each token id adds when decoded after other text (None for special tokens and for byte
    pieces that are not valid text on their own)."""
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    anchor = tokenizer.encode("a", add_special_tokens=False)
    out: list[str | None] = []
    base = tokenizer.decode(anchor) if anchor else ""
    for i in range(vocab_size):
        if i in special:
            out.append(None)
            continue
        if anchor:
            text = tokenizer.decode(anchor + [i])
            text = text[len(base):] if text.startswith(base) else None
        else:
            text = tokenizer.decode([i])
        if not text or "\ufffd" in text:
            out.append(None)
        else:
            out.append(text)
    return out
