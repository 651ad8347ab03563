"""``boolean``: yes/no questions.

Reference: ``yes``/``no``/``true``/``false`` in any case (``true`` means ``yes``); anything else raises
``InvalidReference``.

Prediction (after :func:`~longreel.task.rewards.extract.clean_answer`: ``\\boxed{Yes}``, ``**No**``, "Answer: yes",
trailing ``.``/``!`` all fine), case-insensitive:

* exactly one of ``yes``, ``no``, ``true``, ``false``;
* or one of them followed by ``,``/``;``/``:``/``.``/``!`` and an explanation (``Yes, the man enters.``) that does
  not contain another standalone yes/no/true/false word (else ``"ambiguous"``).

``No one enters`` is not "no" (no punctuation after the word): ``"unparseable"``, as are ``y``, ``1``, ``maybe``.
``yes or no`` and ``yes/no`` are ``"ambiguous"``. Accuracy is 1.0 on a match, else 0.0; extracted is ``yes``/``no``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from longreel.task.rewards.extract import clean_answer
from longreel.task.rewards.registry import AnswerParseError, InvalidReference, Judgement, Scorer, register

__all__ = ["BooleanScorer", "parse_boolean"]

_VALUES = {"yes": "yes", "true": "yes", "no": "no", "false": "no"}
_LEAD_RE = re.compile(r"(yes|no|true|false)\s*(?:[,;:.!]\s*(.*))?", re.IGNORECASE | re.DOTALL)
_WORD_RE = re.compile(r"(?<![A-Za-z])(yes|no|true|false)(?![A-Za-z])", re.IGNORECASE)


def parse_boolean(text: str) -> str:
    """``"yes"`` or ``"no"`` for an answer text (module docstring), or :class:`AnswerParseError`."""
    s = clean_answer(text)
    m = _LEAD_RE.fullmatch(s)
    if m:
        value = _VALUES[m.group(1).lower()]
        others = {_VALUES[w.lower()] for w in _WORD_RE.findall(m.group(2) or "")}
        if others - {value}:  # "Yes, no": ambiguous; "Yes, yes" is fine
            raise AnswerParseError("ambiguous", "both yes and no")
        return value
    words = {_VALUES[w.lower()] for w in _WORD_RE.findall(s)}
    if len(words) > 1:
        raise AnswerParseError("ambiguous", "both yes and no")
    raise AnswerParseError("unparseable", f"not yes/no: {s[:40]!r}")


@register("boolean")
class BooleanScorer(Scorer):
    """Yes/no match; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> str:
        if not isinstance(answer, str) or answer.strip().lower().rstrip(".") not in _VALUES:
            raise InvalidReference(f"boolean: reference must be yes/no/true/false, got {answer!r}")
        return _VALUES[answer.strip().lower().rstrip(".")]

    def judge(self, prediction: str, reference: str, options: Sequence[str] | None, **params: Any) -> Judgement:
        value = parse_boolean(prediction)
        ok = value == reference
        return Judgement(1.0 if ok else 0.0, value, "ok" if ok else "wrong")
