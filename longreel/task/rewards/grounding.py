"""``temporal_grounding`` (1D IoU of ``[start, end]`` seconds) and ``spatial_grounding`` (box IoU of
``[x1, y1, x2, y2]``).

Temporal. The text (after :func:`~longreel.task.rewards.extract.clean_answer`) must hold exactly two times and, besides
whitespace, the words ``from``/``to``/``and``/``between`` and second units (``s``, ``sec``, ``secs``, ``second``,
``seconds``), nothing else but: opening ``[``/``(`` before the first time, at most one separator ``,``/``;``/
``-``/``–``/``~`` between the times, closing ``]``/``)`` after the second. A time is a non-negative decimal
(``12.5``) or a clock time ``m:ss``/``h:mm:ss`` (``1:05.5`` is 65.5 s). So ``[3.5, 7.2]``, ``3.5-7.2``,
``from 3.5s to 7.2s`` and ``00:03 - 00:07`` all parse. A minus sign before the first time is rejected (negative
times do not exist). Unicode digits are ASCII-folded.

Spatial. Exactly four numbers (signs, decimals and exponents allowed) with only brackets, parentheses, commas,
semicolons and whitespace around them (``[10, 20, 110, 220]``, ``(10,20),(110,220)``), or JSON: a list of four
numbers, an object with one of the keys ``bbox_2d``/``bbox``/``box`` holding such a list, or a one-element list of
such an object (the Qwen2.5-VL grounding output). Several boxes are ``"ambiguous"``. Coordinates are taken as they
come (pixels or normalised), in the same frame as the reference.

Degenerate and reversed shapes. A prediction with ``start > end`` (reversed) or ``start == end`` (zero length), or a
box with ``x1 >= x2`` or ``y1 >= y2`` (reversed or zero area), is NOT reordered: it is ``"invalid"`` with accuracy
0. The model must emit ordered, non-degenerate shapes. The same shapes in a reference raise ``InvalidReference``;
non-finite values (``1e999``) are unparseable.

Accuracy is the IoU in [0, 1] (reason ``"ok"`` at 1, ``"partial"`` in between, ``"wrong"`` at 0). The parameter
``iou_threshold`` (default ``None``, shared by both types), when set to a number in [0, 1], makes it binary:
1.0 iff IoU >= threshold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from fractions import Fraction
from numbers import Real
from typing import Any

from longreel.task.rewards.extract import clean_answer
from longreel.task.rewards.registry import (
    AnswerParseError,
    InvalidReference,
    Judgement,
    Scorer,
    reason_for_score,
    register,
)

__all__ = ["SpatialGroundingScorer", "TemporalGroundingScorer", "box_iou", "interval_iou", "parse_box",
           "parse_interval"]

_TIME_RE = re.compile(r"(?<![\d.])(?:(?:(\d+):)?(\d+):(\d{1,2}(?:\.\d+)?)|(\d+(?:\.\d+)?|\.\d+))(?![\d.:])")
_TIME_FILLER_RE = re.compile(r"\b(?:from|to|and|between|s|sec|secs|second|seconds)\b", re.IGNORECASE)
_BOX_NUM_RE = re.compile(r"(?<![\w.])[+-]?(?:\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d+)?(?![\w.])")
_BOX_PUNCT = set("[](),; \t\r\n")


def _finite(x: float, what: str) -> float:
    if not math.isfinite(x):
        raise AnswerParseError("unparseable", f"non-finite {what}")
    return x


def parse_interval(text: str) -> tuple[float, float]:
    """``(start, end)`` seconds written in ``text``, in the order written (not reordered)."""
    s = clean_answer(text, strip_prefix=True)
    times: list[float] = []
    for m in _TIME_RE.finditer(s):
        h, mnt, sec, plain = m.groups()
        if plain is not None:
            t = float(plain)
        else:
            if float(sec) >= 60 or (h is not None and int(mnt) >= 60):
                raise AnswerParseError("unparseable", f"bad clock time {m.group(0)!r}")
            t = int(h or 0) * 3600 + int(mnt) * 60 + float(sec)
        times.append(_finite(t, "time"))
    if len(times) != 2:
        raise AnswerParseError("ambiguous" if len(times) > 2 else "unparseable", f"{len(times)} times, need 2")
    spans = [m.span() for m in _TIME_RE.finditer(s)]
    pre, mid, post = (
        "".join(_TIME_FILLER_RE.sub(" ", part).split())
        for part in (s[: spans[0][0]], s[spans[0][1] : spans[1][0]], s[spans[1][1] :])
    )
    if any(c in "-~" for c in pre):
        raise AnswerParseError("unparseable", "negative time")
    if not (set(pre) <= set("[(") and mid in ("", ",", ";", "-", "~") and set(post) <= set(")]")):
        raise AnswerParseError("unparseable", f"unexpected text around the times: {s[:60]!r}")
    return times[0], times[1]


def _box_from_json(obj: Any) -> list[float] | None:
    if isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], dict):
        obj = obj[0]
    if isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj):
        raise AnswerParseError("ambiguous", f"{len(obj)} boxes")
    if isinstance(obj, dict):
        keys = [k for k in ("bbox_2d", "bbox", "box") if k in obj]
        if len(keys) != 1:
            return None
        obj = obj[keys[0]]
    if (
        isinstance(obj, list)
        and len(obj) == 4
        and all(isinstance(v, Real) and not isinstance(v, bool) for v in obj)
    ):
        return [_finite(float(v), "coordinate") for v in obj]
    return None


def parse_box(text: str) -> tuple[float, float, float, float]:
    """``(x1, y1, x2, y2)`` written in ``text``, in the order written (not reordered)."""
    s = clean_answer(text, strip_prefix=True)
    if s[:1] in "[{":
        try:
            obj = json.loads(s)
        except (ValueError, RecursionError):
            obj = None
        if obj is not None:
            box = _box_from_json(obj)
            if box is not None:
                return box[0], box[1], box[2], box[3]
    nums = _BOX_NUM_RE.findall(s)
    if len(nums) != 4:
        raise AnswerParseError("ambiguous" if len(nums) > 4 and len(nums) % 4 == 0 else "unparseable",
                               f"{len(nums)} numbers, need 4")
    rest = _BOX_NUM_RE.sub(" ", s)
    if not set(rest) <= _BOX_PUNCT:
        raise AnswerParseError("unparseable", f"unexpected text around the box: {rest.strip()[:40]!r}")
    x1, y1, x2, y2 = (_finite(float(n), "coordinate") for n in nums)
    return x1, y1, x2, y2


def interval_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    """IoU of two ordered intervals of positive length, in [0, 1]; computed exactly (no overflow for huge values)."""
    a0, a1, b0, b1 = (Fraction(v) for v in (*a, *b))
    inter = max(Fraction(0), min(a1, b1) - max(a0, b0))
    union = (a1 - a0) + (b1 - b0) - inter
    return _clip(float(inter / union)) if union > 0 else 0.0


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """IoU of two ordered boxes of positive area, in [0, 1]; computed exactly (no overflow for huge values)."""
    ax1, ay1, ax2, ay2, bx1, by1, bx2, by2 = (Fraction(v) for v in (*a, *b))
    iw = max(Fraction(0), min(ax2, bx2) - max(ax1, bx1))
    ih = max(Fraction(0), min(ay2, by2) - max(ay1, by1))
    inter = iw * ih
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return _clip(float(inter / union)) if union > 0 else 0.0


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0


def _threshold(params: dict[str, Any]) -> float | None:
    thr = params.get("iou_threshold")
    if thr is None:
        return None
    if isinstance(thr, bool) or not isinstance(thr, Real) or not 0.0 <= float(thr) <= 1.0:
        raise ValueError(f"iou_threshold must be None or a number in [0, 1], got {thr!r}")
    return float(thr)


def _judge(iou: float, thr: float | None, extracted: str) -> Judgement:
    acc = iou if thr is None else (1.0 if iou >= thr else 0.0)
    return Judgement(acc, extracted, reason_for_score(acc))


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(repr(float(v)) for v in values) + "]"


@register("temporal_grounding", params={"iou_threshold": None})
class TemporalGroundingScorer(Scorer):
    """1D IoU of ``[start, end]``; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> tuple[float, float]:
        _threshold(params)
        if not isinstance(answer, str):
            raise InvalidReference(f"temporal_grounding: reference must be a string, got {type(answer).__name__}")
        try:
            start, end = parse_interval(answer)
        except AnswerParseError as e:
            raise InvalidReference(f"temporal_grounding: reference {answer!r}: {e}") from None
        if not start < end:
            raise InvalidReference(f"temporal_grounding: reference {answer!r} needs start < end")
        return start, end

    def judge(self, prediction: str, reference: tuple[float, float], options: Sequence[str] | None,
              **params: Any) -> Judgement:
        thr = _threshold(params)
        start, end = parse_interval(prediction)
        if not start < end:
            raise AnswerParseError("invalid", f"interval [{start}, {end}] is reversed or empty")
        return _judge(interval_iou((start, end), reference), thr, _fmt((start, end)))


@register("spatial_grounding", params={"iou_threshold": None})
class SpatialGroundingScorer(Scorer):
    """Box IoU of ``[x1, y1, x2, y2]``; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None,
                        **params: Any) -> tuple[float, float, float, float]:
        _threshold(params)
        if not isinstance(answer, str):
            raise InvalidReference(f"spatial_grounding: reference must be a string, got {type(answer).__name__}")
        try:
            box = parse_box(answer)
        except AnswerParseError as e:
            raise InvalidReference(f"spatial_grounding: reference {answer!r}: {e}") from None
        if not (box[0] < box[2] and box[1] < box[3]):
            raise InvalidReference(f"spatial_grounding: reference {answer!r} needs x1 < x2 and y1 < y2")
        return box

    def judge(self, prediction: str, reference: tuple[float, float, float, float],
              options: Sequence[str] | None, **params: Any) -> Judgement:
        thr = _threshold(params)
        box = parse_box(prediction)
        if not (box[0] < box[2] and box[1] < box[3]):
            raise AnswerParseError("invalid", f"box {list(box)} is reversed or has zero area")
        return _judge(box_iou(box, reference), thr, _fmt(box))
