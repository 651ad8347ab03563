"""``numerical``: one number compared with relative / absolute tolerance.

Accepted (reference and prediction alike, after :func:`~longreel.task.rewards.extract.clean_answer`, so also inside
``\\boxed{}`` or after "Answer:"), the whole text being exactly one of:

* a decimal number: ``12``, ``-3.5``, ``+.5``, ``1e-3``, ``6.02E23``; Unicode digits are ASCII-folded first
  (``١٢`` and ``１２`` are ``12``: see :func:`~longreel.task.rewards.extract.normalize_text`);
* a number with comma thousands separators in strict groups of three: ``1,234,567.5`` (``1,5`` is unparseable);
* scientific notation spelled out: ``1.5 \\times 10^{3}``, ``1.5×10^3``, ``2*10^-4``;
* an integer fraction ``3/4`` or ``\\frac{3}{4}`` (``\\dfrac`` too); a zero denominator is unparseable;
* a number word from ``zero`` to ``twenty`` (case-insensitive);
* any of the above followed by ONE unit token, which is ignored: ``12 seconds``, ``3.5m``, ``45%``, ``30°``,
  ``5 km/h``. Percent is not converted: ``45%`` is 45.

Everything else is ``"unparseable"``: two numbers (``12 or 13``, ``3-5``), ``nan``, ``inf``, ``∞``, words. Values are
parsed exactly as :class:`decimal.Decimal`, so huge numbers (``1e400``, 400-digit integers) are compared exactly,
never overflowing to ``inf``. A reference that is not exactly one finite number raises ``InvalidReference``.

Parameters: ``rel_tol`` (default 1e-3) and ``abs_tol`` (default 1e-9), both finite and >= 0. The prediction is
correct (accuracy 1.0, else 0.0) iff ``|p - g| <= max(rel_tol * max(|p|, |g|), abs_tol)``, the rule of
:func:`math.isclose`; with both tolerances 0 it is exact equality.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal, InvalidOperation, localcontext
from numbers import Real
from typing import Any

from longreel.task.rewards.extract import clean_answer
from longreel.task.rewards.registry import AnswerParseError, InvalidReference, Judgement, Scorer, register

__all__ = ["NumericalScorer", "parse_number"]

DEFAULT_REL_TOL = 1e-3
DEFAULT_ABS_TOL = 1e-9

_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_GROUPED = r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?"
_UNIT = r"(?:\s*(?P<u>\\?%|°|\^\s*\{?\s*\\circ\s*\}?|[^\W\d_]+(?:/[^\W\d_]+)?))?"
_PLAIN_RE = re.compile(rf"(?P<n>{_GROUPED}|{_NUM}){_UNIT}")
_SCI_RE = re.compile(
    rf"(?P<m>{_NUM})\s*(?:\\times|\\cdot|×|·|\*|x)\s*10\s*\^\s*(?:\{{\s*(?P<e1>[+-]?\d+)\s*\}}|(?P<e2>[+-]?\d+))"
    rf"{_UNIT}"
)
_FRAC_RE = re.compile(rf"(?P<s>[+-]?)(?P<a>\d+)\s*/\s*(?P<b>\d+){_UNIT}")
_TEX_FRAC_RE = re.compile(rf"(?P<s>[+-]?)\s*\\[dt]?frac\s*\{{\s*(?P<a>[+-]?\d+)\s*\}}\s*\{{\s*(?P<b>\d+)\s*\}}{_UNIT}")
_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}


# 60 significant digits for the tolerance arithmetic, and no exponent limits (1e999999 stays finite). Parsing with
# Decimal(str) is exact whatever the context; equality is exact too.
_CTX = Context(prec=60, Emax=MAX_EMAX, Emin=MIN_EMIN)


def _context() -> Any:
    return localcontext(_CTX)


def parse_number(text: str) -> Decimal:
    """The single finite number written in ``text`` (module docstring), or :class:`AnswerParseError`."""
    s = clean_answer(text)
    value: Decimal | None = None
    m = _PLAIN_RE.fullmatch(s) or _SCI_RE.fullmatch(s) or _FRAC_RE.fullmatch(s) or _TEX_FRAC_RE.fullmatch(s)
    unit = m["u"] if m else None
    if unit and unit[0].isalnum() and not unit.replace("/", "").isalpha():  # "10²" is not 10 with a unit "²"
        raise AnswerParseError("unparseable", f"not a unit: {unit!r}")
    try:
        with _context():
            if m := _PLAIN_RE.fullmatch(s):
                value = Decimal(m["n"].replace(",", ""))
            elif m := _SCI_RE.fullmatch(s):
                value = Decimal(m["m"]).scaleb(int(m["e1"] or m["e2"]))
            elif (m := _FRAC_RE.fullmatch(s)) or (m := _TEX_FRAC_RE.fullmatch(s)):
                if int(m["b"]) == 0:
                    raise AnswerParseError("unparseable", "zero denominator")
                value = Decimal(m["a"]) / Decimal(m["b"])
                if m["s"] == "-":
                    value = -value
            elif s.casefold() in _WORDS:
                value = Decimal(_WORDS[s.casefold()])
    except (InvalidOperation, ValueError, OverflowError) as e:
        if isinstance(e, AnswerParseError):
            raise
        raise AnswerParseError("unparseable", f"bad number {s!r}") from None
    if value is None:
        raise AnswerParseError("unparseable", f"not a single number: {s[:60]!r}")
    if not value.is_finite():
        raise AnswerParseError("unparseable", "non-finite number")
    return value


def canonical(value: Decimal) -> str:
    """Exact, readable canonical text of a parsed number: ``12.5``, ``1500``, ``1E+400`` (never rounded)."""
    digits = len(value.as_tuple().digits)
    v = value.normalize(_CTX.copy() if digits <= _CTX.prec else Context(prec=digits, Emax=MAX_EMAX, Emin=MIN_EMIN))
    if v.is_zero():
        return "0"
    return format(v, "f") if -20 <= v.adjusted() <= 20 else str(v)


def _tolerance(name: str, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise ValueError(f"numerical: {name} must be a finite number >= 0, got {value!r}")
    return Decimal(repr(float(value)))


@register("numerical", params={"rel_tol": DEFAULT_REL_TOL, "abs_tol": DEFAULT_ABS_TOL})
class NumericalScorer(Scorer):
    """Tolerance match of one number; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> Decimal:
        _tolerance("rel_tol", params.get("rel_tol", DEFAULT_REL_TOL))
        _tolerance("abs_tol", params.get("abs_tol", DEFAULT_ABS_TOL))
        if not isinstance(answer, str):
            raise InvalidReference(f"numerical: reference must be a string, got {type(answer).__name__}")
        try:
            return parse_number(answer)
        except AnswerParseError as e:
            raise InvalidReference(f"numerical: reference {answer!r} is not one finite number ({e})") from None

    def judge(self, prediction: str, reference: Decimal, options: Sequence[str] | None, **params: Any) -> Judgement:
        rel = _tolerance("rel_tol", params.get("rel_tol", DEFAULT_REL_TOL))
        abs_ = _tolerance("abs_tol", params.get("abs_tol", DEFAULT_ABS_TOL))
        p = parse_number(prediction)
        with _context():
            ok = p == reference or abs(p - reference) <= max(rel * max(abs(p), abs(reference)), abs_)
        return Judgement(1.0 if ok else 0.0, canonical(p), "ok" if ok else "wrong")
