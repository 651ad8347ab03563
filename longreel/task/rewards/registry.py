"""Registry of per-task scorers, keyed by ``problem_type``.

A scorer turns the text inside the final ``<answer>`` block (already known to be well formatted and non-empty) into
an accuracy in ``[0, 1]``. It has two steps, so that a bad reference answer is caught on every completion (and can be
checked up front by the data pipeline) rather than only on the well-formatted ones:

* ``parse_reference(answer, options, **params)``: parse the ground-truth answer once; raise :class:`InvalidReference`
  when it cannot be used (empty, not one of the options, an interval with ``start >= end``, ...).
* ``judge(prediction, reference, options, **params) -> Judgement``: score the model's answer text against the parsed
  reference. A prediction that cannot be read raises :class:`AnswerParseError` (reason ``"unparseable"`` or
  ``"ambiguous"``); the caller turns it into accuracy 0.

Register a new task with a class::

    @register("counting", params={"max_diff": 0})
    class CountingScorer(Scorer):
        def judge(self, prediction, reference, options, **params): ...

or, for the simple case, with a function ``fn(prediction, answer, options, **params) -> Judgement | float``
(the reference is then passed through unchanged as a string).

``params`` declares the keyword parameters the scorer understands, with their defaults. ``score(...)`` in
:mod:`longreel.task.rewards` rejects keyword parameters that no registered scorer declares (a typo is an error, not a
silent default) and passes each scorer only its own parameters, with defaults filled in.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "AnswerParseError",
    "InvalidReference",
    "Judgement",
    "Scorer",
    "UnknownProblemType",
    "get_scorer",
    "register",
    "registered_types",
    "reason_for_score",
]


class UnknownProblemType(KeyError):
    """Raised by :func:`get_scorer` for a ``problem_type`` that has no registered scorer."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown problem type"


class InvalidReference(ValueError):
    """The ground-truth answer (or its options) cannot be scored against: a data error, not a model error."""


class AnswerParseError(ValueError):
    """The model's answer text cannot be read as an answer of this type.

    ``reason`` is a machine code: ``"unparseable"`` (no answer of this type found) or ``"ambiguous"`` (several
    different candidate answers, e.g. ``"C or D"``), or ``"invalid"`` (well formed but impossible, e.g. a reversed
    interval or a zero-area box).
    """

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


@dataclass(frozen=True)
class Judgement:
    """What a scorer says about one prediction: accuracy in [0, 1], canonical extracted answer, reason code."""

    accuracy: float
    extracted: str | None
    reason: str


def reason_for_score(accuracy: float) -> str:
    """Reason code for a graded score: ``"ok"`` at 1, ``"wrong"`` at 0, ``"partial"`` in between."""
    if accuracy >= 1.0:
        return "ok"
    if accuracy <= 0.0:
        return "wrong"
    return "partial"


class Scorer(ABC):
    """Base class of a task scorer. Subclasses implement :meth:`judge` and usually :meth:`parse_reference`."""

    name: ClassVar[str] = ""
    params: ClassVar[Mapping[str, Any]] = {}

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> Any:
        """Parse the ground-truth answer; the default checks it is a non-empty string and returns it stripped."""
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidReference(f"{self.name}: reference answer must be a non-empty string, got {answer!r}")
        return answer.strip()

    @abstractmethod
    def judge(self, prediction: str, reference: Any, options: Sequence[str] | None, **params: Any) -> Judgement:
        """Score ``prediction`` (the stripped text of the final answer block) against the parsed reference."""


class _FunctionScorer(Scorer):
    """Adapter that lets a plain function be registered as a scorer."""

    def __init__(self, name: str, fn: Callable[..., Judgement | float], params: Mapping[str, Any]) -> None:
        self._fn = fn
        self.name = name  # type: ignore[misc]  # instance attribute shadows the ClassVar on purpose
        self.params = dict(params)  # type: ignore[misc]

    def judge(self, prediction: str, reference: Any, options: Sequence[str] | None, **params: Any) -> Judgement:
        out = self._fn(prediction, reference, options, **params)
        if isinstance(out, Judgement):
            return out
        acc = float(out)
        return Judgement(acc, prediction, reason_for_score(acc))


_REGISTRY: dict[str, Scorer] = {}

T = TypeVar("T")


def register(
    name: str, *, params: Mapping[str, Any] | None = None, overwrite: bool = False
) -> Callable[[T], T]:
    """Decorator registering a :class:`Scorer` subclass (instantiated with no arguments) or a function under ``name``.

    ``params`` (name -> default) overrides the class attribute ``Scorer.params``. Registering a name twice raises
    ``ValueError`` unless ``overwrite=True``.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"problem type name must be a non-empty string without surrounding spaces, got {name!r}")

    def deco(obj: T) -> T:
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"problem type {name!r} is already registered ({type(_REGISTRY[name]).__name__})")
        if inspect.isclass(obj) and issubclass(obj, Scorer):
            inst = obj()
            inst.name = name  # type: ignore[misc]
            if params is not None:
                inst.params = dict(params)  # type: ignore[misc]
            scorer: Scorer = inst
        elif callable(obj):
            scorer = _FunctionScorer(name, obj, params or {})
        else:
            raise TypeError(f"register({name!r}) expects a Scorer subclass or a function, got {obj!r}")
        _REGISTRY[name] = scorer
        return obj

    return deco


def unregister(name: str) -> None:
    """Remove a registered scorer (meant for tests and plugins that register temporary types)."""
    _REGISTRY.pop(name, None)


def get_scorer(name: str) -> Scorer:
    """The scorer registered for ``name``; raises :class:`UnknownProblemType` listing the known types."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        raise UnknownProblemType(f"unknown problem_type {name!r}; registered types: {known}") from None


def registered_types() -> tuple[str, ...]:
    """Names of all registered problem types, sorted."""
    return tuple(sorted(_REGISTRY))


def known_params() -> dict[str, set[str]]:
    """Parameter name -> the problem types that declare it."""
    out: dict[str, set[str]] = {}
    for tname, scorer in _REGISTRY.items():
        for p in scorer.params:
            out.setdefault(p, set()).add(tname)
    return out
