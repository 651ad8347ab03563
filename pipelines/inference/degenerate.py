"""Degenerate generations: empty text, repeated-token loops, the prompt echoed back (pure functions).

:func:`degenerate_reason` returns ``None`` for a usable text, else ``(reason, message)`` with reason
``empty_caption``, ``repetitive_caption`` or ``prompt_echo`` (``kind`` replaces ``caption`` for other
stages, e.g. ``empty_answer``).
"""
from __future__ import annotations

import re

_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def longest_repeat(toks: list[str], max_n: int = 8) -> tuple[int, int]:
    """``(n, repeats)``: the n-gram (n <= max_n) repeated back to back the most times, by tokens covered."""
    best = (1, 1 if toks else 0)
    for n in range(1, max_n + 1):
        i = 0
        while i + 2 * n <= len(toks):
            r = 1
            while toks[i + r * n:i + (r + 1) * n] == toks[i:i + n]:
                r += 1
            if r > 1 and r * n > best[0] * best[1]:
                best = (n, r)
            i += max(1, (r - 1) * n) if r > 1 else 1
    return best


def periodic_run(text: str, max_period: int = 80) -> tuple[int, int, int]:
    """``(period, start, length)`` of the longest stretch of ``text`` that repeats itself with a period of at most
    ``max_period`` characters (at least two full periods; a loop cut off by the token limit ends mid-period)."""
    best = (0, 0, 0)
    n = len(text)
    for period in range(1, min(max_period, n // 2) + 1):
        run = 0
        for j in range(period, n):
            if text[j] == text[j - period]:
                run += 1
                length = run + period
                if length >= 2 * period and length > best[2]:
                    best = (period, j - length + 1, length)
            else:
                run = 0
    return best


def _shingles(toks: list[str], k: int) -> set:
    return {tuple(toks[i:i + k]) for i in range(len(toks) - k + 1)}


def degenerate_reason(text: str | None, prompt: str | None = None, *, min_chars: int = 8,
                      max_repeat_share: float = 0.5, echo_share: float = 0.6,
                      kind: str = "caption") -> tuple[str, str] | None:
    t = (text or "").strip()
    alnum = sum(ch.isalnum() for ch in t)
    if alnum < min_chars:
        return (f"empty_{kind}", f"{alnum} letters/digits (< {min_chars}): {t[:80]!r}")
    period, start, length = periodic_run(t)
    if length >= max(24, max_repeat_share * len(t)):
        unit = t[start:start + period]
        return (f"repetitive_{kind}", f"{unit!r} repeated {length / period:.1f} times covers {length} of {len(t)} "
                                      f"characters: {t[:80]!r}")
    toks = tokens(t)
    n, r = longest_repeat(toks)
    if r >= 3 and n * r >= max(6, max_repeat_share * len(toks)):
        return (f"repetitive_{kind}", f"a {n}-token phrase repeated {r} times covers {n * r} of {len(toks)} "
                                      f"tokens: {t[:80]!r}")
    if prompt:
        p = " ".join(tokens(prompt))
        joined = " ".join(toks)
        if len(joined) >= 12 and joined in p:
            return ("prompt_echo", f"the text is part of the prompt: {t[:80]!r}")
        k = 4
        mine = _shingles(toks, k)
        if len(mine) >= 3:
            share = len(mine & _shingles(tokens(prompt), k)) / len(mine)
            if share >= echo_share:
                return ("prompt_echo", f"{share:.0%} of the text's word 4-grams come from the prompt: {t[:80]!r}")
    return None
