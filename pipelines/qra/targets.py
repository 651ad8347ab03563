"""Target strings, problem types, question normalization and ids of QRA records.

* :func:`make_target` builds the supervised target ``<think>{reasoning}</think><answer>{answer}</answer>``
  that CoT-SFT trains on and the trainer's rewards parse back.
* :func:`problem_type_of` maps what a model wrote (``"Multiple-Choice"``, ``"mcq"``, a missing field)
  to one canonical name of :data:`longreel.schemas.records.PROBLEM_TYPES`.
* :func:`normalize_question` is the key for near-duplicate detection *and* the input of :func:`qra_id`,
  so two questions that differ only in case, punctuation or spacing get the same id.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Any, Mapping

from longreel.schemas.records import PROBLEM_TYPES

#: The problem types the QRA generation stage produces (a subset of ``PROBLEM_TYPES``).
GENERATED_PROBLEM_TYPES = ("multiple_choice", "open_ended")

#: Letters of the four options of a multiple-choice item, in order.
OPTION_LETTERS = ("A", "B", "C", "D")

# Tags that delimit the target; text containing them would make the target ambiguous to parse.
TARGET_TAGS = ("<think>", "</think>", "<answer>", "</answer>")

_PROBLEM_TYPE_ALIASES = {
    "mc": "multiple_choice",
    "mcq": "multiple_choice",
    "multiplechoice": "multiple_choice",
    "multi_choice": "multiple_choice",
    "choice": "multiple_choice",
    "open": "open_ended",
    "openended": "open_ended",
    "open_answer": "open_ended",
    "free_form": "open_ended",
    "freeform": "open_ended",
}

_APOSTROPHES = "'\u2019\u2018\u02bc`\u00b4"
_SPACE_RE = re.compile(r"\s+")


def make_target(reasoning: str, answer: str) -> str:
    """Return ``<think>{reasoning}</think><answer>{answer}</answer>`` (both stripped).

    Raises ``ValueError`` if either part contains one of the target tags (it could not be parsed back
    unambiguously) or if the answer is empty. The reasoning may be empty.
    """
    reasoning, answer = reasoning.strip(), answer.strip()
    for part, name in ((reasoning, "reasoning"), (answer, "answer")):
        low = part.lower()
        for tag in TARGET_TAGS:
            if tag in low:
                raise ValueError(f"{name} contains the target tag {tag!r}")
    if not answer:
        raise ValueError("answer is empty")
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


def canonical_problem_type(value: str) -> str:
    """Map a spelling such as ``"Multiple-Choice"``, ``"open ended"`` or ``"MCQ"`` to its canonical name.

    Raises ``ValueError`` for a value that is not one of :data:`longreel.schemas.records.PROBLEM_TYPES` or a known alias.
    """
    key = re.sub(r"[\s\-]+", "_", unicodedata.normalize("NFKC", value).strip().casefold())
    key = _PROBLEM_TYPE_ALIASES.get(key, key)
    if key not in PROBLEM_TYPES:
        raise ValueError(f"unknown problem type {value!r}")
    return key


def problem_type_of(item: Mapping[str, Any]) -> str:
    """Return the canonical problem type of a (raw or normalized) QRA item.

    Uses ``item["problem_type"]`` when it is a non-empty string (aliases accepted, see
    :func:`canonical_problem_type`). When it is absent, null or empty the type is inferred: a non-empty
    ``options`` list or mapping means ``multiple_choice``, anything else ``open_ended``.
    Raises ``ValueError`` when the field is present but is not a string or not a known type.
    """
    value = item.get("problem_type")
    if value is None or (isinstance(value, str) and not value.strip()):
        options = item.get("options")
        if isinstance(options, (list, tuple, dict)) and len(options) > 0:
            return "multiple_choice"
        return "open_ended"
    if not isinstance(value, str):
        raise ValueError(f"problem_type must be a string, got {type(value).__name__}")
    return canonical_problem_type(value)


def normalize_question(text: str) -> str:
    """The near-duplicate key of a question.

    NFKC (full-width letters and digits become ASCII, composed and decomposed accents compare equal),
    casefold, apostrophes removed (``"What's"`` == ``"Whats"``), every other punctuation character
    (Unicode category P*) replaced by a space, whitespace collapsed, stripped. Symbols such as emoji
    and accents are kept: ``"café"`` and ``"cafe"`` stay different.
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    out = []
    for ch in text:
        if ch in _APOSTROPHES:
            continue
        out.append(" " if unicodedata.category(ch).startswith("P") else ch)
    return _SPACE_RE.sub(" ", "".join(out)).strip()


def qra_id(video_id: str, category: str, question: str) -> str:
    """Deterministic id of a QRA item: the first 16 hex digits of sha256 over video id, category and the
    normalized question (so near-duplicates collide on purpose). Hex only: no dots, safe as a WebDataset key."""
    payload = "\x1f".join((video_id, category, normalize_question(question)))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
