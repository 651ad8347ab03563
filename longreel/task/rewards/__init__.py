"""Rewards: one scoring function for the GRPO trainer and the pass-rate filter.

    score(completion, problem_type, answer, options=None, **params) -> RewardResult

Steps:

1. ``problem_type`` selects a registered scorer (:mod:`longreel.task.rewards.registry`); an unknown type raises
   :class:`UnknownProblemType`. Keyword parameters that no registered scorer declares raise ``TypeError``; bad values
   raise ``ValueError``. The reference ``answer`` (and ``options``) is parsed on every call, so a bad reference raises
   :class:`InvalidReference` whatever the completion (use :func:`validate_reference` up front in data pipelines).
2. The format check of :mod:`longreel.task.rewards.format`: exactly one non-empty ``<think>`` block, then (whitespace
   only) one non-empty ``<answer>`` block, nothing else outside them.
3. Only a well-formatted completion is scored: the scorer reads the answer block's text. When there is no
   ``<answer>`` block the answer is missing; the whole completion is never scored instead.

Combination rule (gated, never additive). With ``f = 1`` if the format is ok else ``0``, ``a`` the scorer's accuracy
in [0, 1] and ``w = format_weight`` in [0, 1] (default 0):

    accuracy = a * f
    reward   = f * ((1 - w) * a + w)

so with the default ``w = 0``, ``reward = accuracy if format ok else 0``. A badly formatted completion gets 0 for
both, whatever its answer; with ``w > 0`` a well-formatted wrong answer gets ``w``. Every value is a finite float in
[0, 1].

``RewardResult.reason``: ``"ok"`` (fully correct), ``"partial"`` (graded score strictly between 0 and 1),
``"wrong"``; the answer-reading failures ``"unparseable"``, ``"ambiguous"`` (e.g. ``C or D``), ``"invalid"`` (e.g. a
reversed interval, a zero-area box, an option letter beyond the options); the format failures ``"no_answer_tag"``,
``"bad_format"``, ``"empty_answer"``. ``extracted`` is the canonical parsed answer (``"C"``, ``"12.5"``, ``"yes"``,
``"[3.0, 7.5]"``) when the scorer read one, else the raw text of the last answer block, or ``None`` when there is
no answer block.

Problem types registered here: ``multiple_choice``, ``numerical``, ``open_ended``, ``temporal_grounding``,
``spatial_grounding``, ``boolean``, ``math`` (each module's docstring says what it accepts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from longreel.task.rewards import boolean as _boolean  # noqa: F401  (registers "boolean")
from longreel.task.rewards import grounding as _grounding  # noqa: F401  ("temporal_grounding", "spatial_grounding")
from longreel.task.rewards import math_expr as _math_expr  # noqa: F401  ("math")
from longreel.task.rewards import multiple_choice as _multiple_choice  # noqa: F401  ("multiple_choice")
from longreel.task.rewards import numerical as _numerical  # noqa: F401  ("numerical")
from longreel.task.rewards import open_ended as _open_ended  # noqa: F401  ("open_ended")
from longreel.task.rewards.extract import extract_answer_text, normalize_text
from longreel.task.rewards.format import FormatCheck, check_format, format_reward
from longreel.task.rewards.registry import (
    AnswerParseError,
    InvalidReference,
    Judgement,
    Scorer,
    UnknownProblemType,
    get_scorer,
    known_params,
    register,
    registered_types,
)

__all__ = [
    "AnswerParseError",
    "FormatCheck",
    "InvalidReference",
    "Judgement",
    "RewardResult",
    "Scorer",
    "UnknownProblemType",
    "check_format",
    "extract_answer_text",
    "format_reward",
    "get_scorer",
    "normalize_text",
    "register",
    "registered_types",
    "score",
    "score_batch",
    "validate_reference",
]

GLOBAL_PARAMS = {"format_weight": 0.0}


@dataclass(frozen=True)
class RewardResult:
    """Outcome of :func:`score`. ``format``, ``accuracy`` and ``reward`` are finite floats in [0, 1]."""

    format: float
    accuracy: float
    reward: float
    extracted: str | None
    reason: str

    def __post_init__(self) -> None:
        for name in ("format", "accuracy", "reward"):
            v = getattr(self, name)
            if not isinstance(v, float) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
                raise ValueError(f"RewardResult.{name} must be a float in [0, 1], got {v!r}")


def _split_params(scorer: Scorer, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    known = known_params()
    unknown = sorted(k for k in params if k not in known and k not in GLOBAL_PARAMS)
    if unknown:
        raise TypeError(f"unknown reward parameter(s) {unknown}; known: {sorted(set(known) | set(GLOBAL_PARAMS))}")
    w = params.get("format_weight", GLOBAL_PARAMS["format_weight"])
    if isinstance(w, bool) or not isinstance(w, Real) or not 0.0 <= float(w) <= 1.0:
        raise ValueError(f"format_weight must be a number in [0, 1], got {w!r}")
    own = {k: params.get(k, default) for k, default in scorer.params.items()}
    return float(w), own


def _unit(x: float) -> float:
    x = float(x)
    return min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0


def validate_reference(
    problem_type: str, answer: str, options: Sequence[str] | None = None, **params: Any
) -> None:
    """Raise (``UnknownProblemType``, ``InvalidReference``, ``TypeError``/``ValueError`` for parameters) unless
    ``answer`` can be scored as ``problem_type``; for data pipelines, to reject a question before sampling."""
    scorer = get_scorer(problem_type)
    _, own = _split_params(scorer, params)
    scorer.parse_reference(answer, options, **own)


def score(
    completion: str, problem_type: str, answer: str, options: Sequence[str] | None = None, **params: Any
) -> RewardResult:
    """Score one completion (see the module docstring for the rule). Pure: no state is kept between calls."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    scorer = get_scorer(problem_type)
    w, own = _split_params(scorer, params)
    reference = scorer.parse_reference(answer, options, **own)

    fmt = check_format(completion)
    if not fmt.ok:
        return RewardResult(0.0, 0.0, 0.0, extract_answer_text(completion), fmt.reason)
    assert fmt.answer is not None
    try:
        j = scorer.judge(fmt.answer, reference, options, **own)
    except AnswerParseError as e:
        j = Judgement(0.0, fmt.answer, e.reason)
    acc = _unit(j.accuracy)
    return RewardResult(1.0, acc, _unit((1.0 - w) * acc + w), j.extracted, j.reason)


def score_batch(
    completions: Sequence[str],
    problem_types: Sequence[str] | str,
    answers: Sequence[str],
    options_list: Sequence[Sequence[str] | None] | None = None,
    **params: Any,
) -> list[RewardResult]:
    """:func:`score` over aligned sequences. ``problem_types`` may be one string for all; ``options_list`` may be
    ``None`` (no options anywhere). Lengths must match (``ValueError``)."""
    n = len(completions)
    types = [problem_types] * n if isinstance(problem_types, str) else list(problem_types)
    opts: list[Sequence[str] | None] = [None] * n if options_list is None else list(options_list)
    lengths = {"completions": n, "problem_types": len(types), "answers": len(answers), "options_list": len(opts)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"score_batch: length mismatch {lengths}")
    return [score(c, t, a, o, **params) for c, t, a, o in zip(completions, types, answers, opts)]
