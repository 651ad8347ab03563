"""``math``: symbolic equivalence with the ``math-verify`` library (``from math_verify import parse, verify``).

(The module is named ``math_expr`` so that it can never be confused with the standard library's ``math``.)

Reference and prediction are ASCII-folded (:func:`~longreel.task.rewards.extract.normalize_text`). Text that has no LaTeX
math delimiter of its own (``$``, ``\\(``, ``\\[``, ``\\boxed``) is wrapped in ``$...$`` before ``parse``, because
math-verify reads bare LaTeX only partly (bare ``2\\sqrt{2}`` parses as ``2``). So ``\\frac{1}{2}``, ``0.5``,
``1/2``, ``$x = 0.5$`` and ``\\boxed{\\tfrac12}`` all match a reference ``1/2``; ``(x+1)^2`` matches ``x^2+2x+1``;
sets, intervals and percentages follow math-verify's rules. ``verify(gold, prediction)`` decides: accuracy 1.0 or
0.0. A prediction math-verify extracts nothing from is ``"unparseable"``; a reference it extracts nothing from raises
``InvalidReference``.

Safety. Sympy evaluates integer powers eagerly, so ``9^{9^{9^9}}`` would run for ever. Predictions longer than
``MAX_CHARS`` characters, with nested exponents, with an integer exponent of 5 or more digits, or a factorial of an
integer of 4 or more digits are rejected as ``"unparseable"`` before parsing (deterministically, in every thread).
math-verify's own timeouts use ``signal.alarm`` and only work in the main thread; they are applied there (parameter
``math_timeout_s``, default 5 s, ``None`` to disable) and switched off in other threads, where the guard above is
the protection. A timeout counts as wrong.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from functools import lru_cache
from numbers import Real
from typing import Any

from longreel.task.rewards.extract import normalize_text
from longreel.task.rewards.registry import AnswerParseError, InvalidReference, Judgement, Scorer, register

__all__ = ["MathScorer", "MAX_CHARS"]

MAX_CHARS = 1000
_DELIMITED_RE = re.compile(r"\$|\\\(|\\\[|\\boxed|\\fbox")
# an exponent whose own body contains another exponent: 9^{9^9}, 9^9^9, 2**3**4
_NESTED_POW_RE = re.compile(r"(?:\^|\*\*)\s*(?:\{[^{}]*(?:\^|\*\*)|\(?[\w.]*\s*(?:\^|\*\*))")
_BIG_EXP_RE = re.compile(r"(?:\^|\*\*)\s*[{(]?\s*[+-]?\d{5,}")
_BIG_FACT_RE = re.compile(r"\d{4,}\s*\}?\s*!")


def _prepare(text: str) -> str:
    s = normalize_text(text).strip()
    return s if _DELIMITED_RE.search(s) else f"${s}$"


def _timeout(params: dict[str, Any]) -> int | None:
    t = params.get("math_timeout_s", 5)
    if t is not None and (isinstance(t, bool) or not isinstance(t, Real) or t <= 0):
        raise ValueError(f"math: math_timeout_s must be a positive number or None, got {t!r}")
    if t is None or threading.current_thread() is not threading.main_thread():
        return None
    return max(1, int(round(t)))


@lru_cache(maxsize=4096)
def _parse_reference(text: str, timeout: int | None) -> tuple[Any, ...]:
    from math_verify import parse

    return tuple(parse(_prepare(text), parsing_timeout=timeout))


@register("math", params={"math_timeout_s": 5})
class MathScorer(Scorer):
    """math-verify equivalence; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> list[Any]:
        timeout = _timeout(params)
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidReference(f"math: reference must be a non-empty string, got {answer!r}")
        try:
            gold = list(_parse_reference(answer, timeout))
        except Exception as e:  # noqa: BLE001 - math-verify/sympy can raise anything on odd input
            raise InvalidReference(f"math: reference {answer!r} failed to parse: {e}") from None
        if not gold:
            raise InvalidReference(f"math: math-verify extracts nothing from the reference {answer!r}")
        return gold

    def judge(self, prediction: str, reference: list[Any], options: Sequence[str] | None,
              **params: Any) -> Judgement:
        from math_verify import parse, verify

        timeout = _timeout(params)
        s = normalize_text(prediction).strip()
        if len(s) > MAX_CHARS or _NESTED_POW_RE.search(s) or _BIG_EXP_RE.search(s) or _BIG_FACT_RE.search(s):
            raise AnswerParseError("unparseable", "expression too large to evaluate safely")
        try:
            pred = parse(_prepare(s), parsing_timeout=timeout)
        except Exception:  # noqa: BLE001
            pred = []
        if not pred:
            raise AnswerParseError("unparseable", "math-verify extracts nothing")
        try:
            ok = bool(verify(reference, pred, timeout_seconds=timeout))
        except Exception:  # noqa: BLE001
            ok = False
        extracted = str(pred[-1]) if isinstance(pred[-1], str) else str(pred[0])
        return Judgement(1.0 if ok else 0.0, extracted, "ok" if ok else "wrong")
