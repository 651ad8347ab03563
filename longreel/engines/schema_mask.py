"""JSON-schema constrained decoding for transformers' ``generate``: llguidance's grammar as a logits processor.

Chosen by ``benchmarks/constrained_libs.py``: as fast and as valid as xgrammar on SmolLM2 here, and a single wheel
without dependencies. :class:`SchemaMask` must be the *first* logits processor (before repetition penalty,
temperature and top-p), so that a sampling warper can never remove every token the grammar allows.
"""
from __future__ import annotations

import json


def with_max_length(schema, limit: int):
    """``schema`` with ``maxLength: limit`` on every free string (what ``max_string_chars`` promises)."""
    if isinstance(schema, dict):
        out = {k: with_max_length(v, limit) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = min(limit, out.get("maxLength", limit))
        return out
    if isinstance(schema, list):
        return [with_max_length(v, limit) for v in schema]
    return schema


class SchemaMask:
    """A logits processor holding one llguidance matcher per row (None: that row is free text). At each step it
    first feeds every matcher the token its row chose last, then masks each row's logits to what its grammar
    allows; a finished row is pinned to end of sequence."""

    def __init__(self, schemas: list, max_chars: list[int], lltok):
        import llguidance
        import llguidance.torch

        self.lltok = lltok
        self.matchers = []
        for schema, limit in zip(schemas, max_chars):
            if schema is None:
                self.matchers.append(None)
                continue
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(with_max_length(schema, limit)), overrides={"whitespace_flexible": False})
            self.matchers.append(llguidance.LLMatcher(lltok, grammar))
        self.bitmask = llguidance.torch.allocate_token_bitmask(len(schemas), lltok.vocab_size)
        self.started = False

    def dead_end(self, row: int) -> bool:
        m = self.matchers[row]
        return m is not None and m.is_error()

    def __call__(self, input_ids, scores):
        import llguidance.torch

        if not any(self.matchers):
            return scores
        for row, m in enumerate(self.matchers):
            if m is None:
                continue
            if self.started and not m.is_stopped() and not m.is_error():
                m.consume_token(int(input_ids[row, -1]))
            llguidance.torch.fill_next_token_bitmask(m, self.bitmask, row)
        self.started = True
        rows = [row for row, m in enumerate(self.matchers) if m is not None]
        if len(rows) == len(self.matchers):
            llguidance.torch.apply_token_bitmask_inplace(scores, self.bitmask)
        else:  # free-text rows keep their logits
            sub = scores[rows]
            llguidance.torch.apply_token_bitmask_inplace(sub, self.bitmask[rows])
            scores[rows] = sub
        return scores
