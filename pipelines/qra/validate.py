"""Validation of generated QRA items: one normalized item or one reject reason per item.

:func:`validate_item` checks one decoded item and :func:`validate_generation` one raw model output
(parse, then every item, with near-duplicates tracked inside the output). Both are pure: they never
mutate their inputs, ``seen_questions`` included. A caller that validates several outputs of the same
video adds ``normalize_question(item["question"])`` of every kept item to its own set.

Checks run in a fixed order and the first failure is the item's reason (:data:`REASONS` defines every
code): unparseable, missing_field, wrong_category, bad_problem_type, question_empty, reasoning_empty,
mc_wrong_option_count / mc_empty_option / mc_duplicate_options / mc_answer_not_in_options or
open_answer_empty, answer_leaked, reasoning_no_timespan, timespan_out_of_range,
reasoning_contradicts_answer, near_duplicate.

Normalizations applied to an accepted item (reported in the acceptance message; a well-formed item
passes unchanged):

* keys are matched case-insensitively, with aliases ``choices``->options, ``rationale``/``explanation``
  ->reasoning, ``type``/``question_type``->problem_type; unknown keys are dropped;
* ``problem_type`` spellings are canonicalized (``"Multiple-Choice"``, ``"mcq"``); when it is absent
  it is inferred from the presence of options (see :func:`longreel.pipelines.qra.targets.problem_type_of`);
* text fields are stripped; the target tags ``<think>``, ``</think>``, ``<answer>``, ``</answer>``
  are removed from them (they would break the training target);
* numbers given for the answer or an option become their text (``3`` -> ``"3"``, ``2.5`` -> ``"2.5"``);
  booleans, lists and objects are not text (``missing_field``, or ``mc_empty_option`` for an option);
* options given as an object ``{"A": ..., "D": ...}`` become the list in letter order; options all
  prefixed ``"A. "``, ``"(B) "``, ``"C) "``, ``"D: "`` in order lose the prefix;
* a multiple-choice answer is normalized to one letter A-D: ``"c"``, ``"(C)"``, ``"C."``,
  ``"Option C"``, full-width ``"Ｃ"`` (NFKC) all mean ``C``; ``"C. <text>"`` means C unless the text is
  exactly another option; an answer equal to one option's text (normalized as for duplicates) is
  mapped to that option's letter. Anything else, ``"E"`` included, is ``mc_answer_not_in_options``.
"""
from __future__ import annotations

import math
import re
import unicodedata
from typing import AbstractSet, Any, Mapping

from longreel.pipelines.qra.parse import UNPARSEABLE, ParseError, parse_generation
from longreel.pipelines.qra.targets import (GENERATED_PROBLEM_TYPES, OPTION_LETTERS, TARGET_TAGS, normalize_question,
                                   problem_type_of)
from longreel.schemas.records import CATEGORIES

#: Every reject reason of the QRA validation, with its definition.
REASONS: dict[str, str] = {
    "unparseable": "no JSON could be read from the output, or an item of it is not a JSON object",
    "missing_field": "question, answer or reasoning (or options of a multiple-choice item) is absent, null, "
                     "or not text (a number is accepted as text only for the answer and options); also an "
                     "item without problem_type and options whose answer is an option letter",
    "wrong_category": "the item declares a category other than the requested one, or an unknown one",
    "bad_problem_type": "problem_type is not multiple_choice/open_ended, or an open_ended item carries options",
    "question_empty": "the question is blank",
    "reasoning_empty": "the reasoning is blank",
    "mc_wrong_option_count": "a multiple-choice item does not have exactly 4 options",
    "mc_empty_option": "an option is blank, only punctuation, or not text",
    "mc_duplicate_options": "two options are equal after normalization (NFKC, casefold, strip, collapsed "
                            "spaces, trailing punctuation removed)",
    "mc_answer_not_in_options": "the answer is neither a letter A-D nor exactly one option's text",
    "open_answer_empty": "an open-ended item's answer is blank",
    "answer_leaked": "the correct answer appears verbatim (normalized) in the question",
    "reasoning_no_timespan": "the reasoning cites no time reference (see TIME_REF_RE)",
    "reasoning_prefix_mismatch": "the reasoning does not start with qra.reasoning_prefix (a regular expression; "
                                 "only when that option is set)",
    "timespan_out_of_range": "the question or reasoning cites a time beyond the video's span",
    "reasoning_contradicts_answer": "the reasoning's last conclusion names a different letter than the answer",
    "near_duplicate": "the normalized question was already kept for this video",
}

#: Time references accepted as grounding in the reasoning (case-insensitive):
#: ``clock``: ``0:10``, ``00:10``, ``1:02:03``, ``00:10.5`` (so ranges ``00:10-00:20`` and caption stamps
#: ``[00:10-00:20]`` too; clock times need two digits after the colon, so ``16:9`` is no time);
#: ``secs``: a number of at most 3 digits followed by ``s`` (``10s``, ``at 10 s``, ``12.5s``; ``1990s`` is not);
#: ``num``+``unit``: a number followed by ``sec``/``secs``/``second(s)``/``min``/``mins``/``minute(s)``/
#: ``hr``/``hrs``/``hour(s)`` (``10 seconds``, ``3 minutes``); ``t``: ``t=10``.
#: Spelled-out numbers (``ten seconds``) are not recognized.
TIME_REF_RE = re.compile(
    r"""(?<![\w:.])(?P<clock>(?:\d{1,2}:)?\d{1,2}:\d{2}(?:\.\d+)?)(?![\w:])
      | \b(?P<secs>\d{1,3}(?:\.\d+)?)\s?s\b
      | \b(?P<num>\d{1,6}(?:\.\d+)?)\s*(?P<unit>secs?|seconds?|mins?|minutes?|hrs?|hours?)\b
      | \bt\s*=\s*(?P<t>\d+(?:\.\d+)?)""",
    re.X | re.I,
)

#: Slack, in seconds, allowed beyond the video's span before a time reference is out of range
#: (caption stamps are rounded to whole seconds).
SPAN_TOLERANCE_S = 1.0

#: Open-ended answers shorter than this (in words and characters) are not checked for leaks: a short
#: answer ("3", "red") appears in questions by chance.
LEAK_MIN_WORDS, LEAK_MIN_CHARS = 3, 12

_KEY_ALIASES = {"choices": "options", "rationale": "reasoning", "explanation": "reasoning",
                "type": "problem_type", "question_type": "problem_type"}
_FIELDS = ("question", "problem_type", "options", "answer", "reasoning", "category")
_TAG_RE = re.compile("|".join(re.escape(t) for t in TARGET_TAGS), re.I)
_SPACE_RE = re.compile(r"\s+")
_LETTER_ANSWER_RE = re.compile(r"^(?:(?:option|choice|answer)\s*[:\-]?\s*)?[(\[]?([A-Da-d])[)\]]?[.:)]?$", re.I)
# "C. text", "(C) text", "C) text", "C: text": a letter prefix on an answer or an option.
_LETTER_PREFIX_RE = re.compile(r"^[(\[]?([A-D])[)\].:]\s+(\S.*)$", re.S)
_UNIT_S = {"sec": 1, "second": 1, "min": 60, "minute": 60, "hr": 3600, "hour": 3600}

# Conclusions of a reasoning that name a letter. Words are case-insensitive, the letter must be a
# capital A-D standing alone; the conclusion that starts last in the text wins.
_L = r"[(\[]?([A-D])[)\]]?(?![\w'\u2019-])"
_CONCLUSION_RES = (
    re.compile(r"(?i:answer|option|choice)\s*(?i:is|would\s+be|should\s+be|must\s+be|=|:)\s*"
               r"(?i:option\s+|choice\s+)?" + _L),
    re.compile(r"(?<![\w'])" + _L + r"\s+(?i:is|was)\s+(?i:the\s+)?(?i:correct|right|best)\b"),
    re.compile(r"\b(?i:choose|select|pick|go\s+with)\s+(?i:option\s+|choice\s+)?" + _L),
    re.compile(r"\b(?i:therefore|thus|hence|so)\s*,?\s*(?i:option\s+|choice\s+)?" + _L + r"(?=\s*[.!]?\s*$)"),
)

_ARTICLE_AFTER_RE = re.compile(r"\s+[a-z]")

Result = tuple[dict | None, str | None, str]


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def option_key(text: str) -> str:
    """Comparison key of an option (duplicates, answer-text mapping): NFKC, casefold, whitespace
    collapsed, stripped, trailing punctuation (Unicode P*) removed."""
    key = _SPACE_RE.sub(" ", _nfkc(text).casefold()).strip()
    while key and (unicodedata.category(key[-1]).startswith("P") or key[-1].isspace()):
        key = key[:-1]
    return key


def _clean(text: str) -> str:
    return _TAG_RE.sub("", text).strip()


def _as_text(value: Any, *, numbers: bool) -> str | None:
    """Text of a field value, or None when it is not text (numbers count when ``numbers``)."""
    if isinstance(value, str):
        return _clean(value)
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float):
            if not math.isfinite(value):
                return None
            return str(int(value)) if value.is_integer() else repr(value)
        return str(value)
    return None


def _canonical_fields(item: Mapping[Any, Any]) -> dict[str, Any]:
    """The known fields of ``item`` under their canonical names (exact names win over variants)."""
    out: dict[str, Any] = {k: item[k] for k in _FIELDS if k in item}
    for key, value in item.items():
        if not isinstance(key, str):
            continue
        name = re.sub(r"[\s\-]+", "_", key.strip().casefold())
        name = _KEY_ALIASES.get(name, name)
        if name in _FIELDS and name not in out:
            out[name] = value
    return out


def time_refs_s(text: str) -> list[float]:
    """The times, in seconds, of every time reference in ``text`` (see :data:`TIME_REF_RE`)."""
    values = []
    for m in TIME_REF_RE.finditer(_nfkc(text)):
        if m.group("clock"):
            seconds = 0.0
            for part in m.group("clock").split(":"):
                seconds = seconds * 60 + float(part)
            values.append(seconds)
        elif m.group("secs"):
            values.append(float(m.group("secs")))
        elif m.group("num"):
            unit = m.group("unit").casefold().rstrip("s")
            values.append(float(m.group("num")) * _UNIT_S[unit])
        else:
            values.append(float(m.group("t")))
    return values


def has_time_ref(text: str) -> bool:
    """Whether ``text`` holds at least one time reference (see :data:`TIME_REF_RE`)."""
    return TIME_REF_RE.search(_nfkc(text)) is not None


def concluded_letter(reasoning: str) -> str | None:
    """The option letter named by the reasoning's last conclusion ("so the answer is B", "C is correct",
    "I choose D", "Therefore, A." at the end), or None when it names none."""
    text = _nfkc(reasoning)
    best: tuple[int, str] | None = None
    for pattern in _CONCLUSION_RES:
        for m in pattern.finditer(text):
            if m.group(1) == "A" and _ARTICLE_AFTER_RE.match(text, m.end(1)):
                continue  # "the answer is A man ...": the article, not option A
            if best is None or m.start() > best[0]:
                best = (m.start(), m.group(1))
    return best[1] if best else None


def _leak_key(text: str) -> str:
    # Time references are removed first so that "at 00:10" does not leak an answer "10".
    return f" {normalize_question(TIME_REF_RE.sub(' ', _nfkc(text)))} "


def _normalize_options(raw: Any) -> tuple[list[str] | None, str | None, str]:
    """Options as 4 clean strings, or (None, reason, message)."""
    if isinstance(raw, dict):
        letters = {re.sub(r"[\s().\[\]:]", "", _nfkc(str(k))).upper(): v for k, v in raw.items()}
        if sorted(letters) == list(OPTION_LETTERS[:len(letters)]) and len(letters) == len(raw):
            raw = [letters[k] for k in sorted(letters)]
        else:
            raw = list(raw.values())
    if not isinstance(raw, list):
        return None, "missing_field", f"options must be a list of 4 texts, got {type(raw).__name__}"
    if len(raw) != len(OPTION_LETTERS):
        return None, "mc_wrong_option_count", f"{len(raw)} options instead of {len(OPTION_LETTERS)}"
    options = []
    for letter, value in zip(OPTION_LETTERS, raw):
        text = _as_text(value, numbers=True)
        if text is None or not option_key(text):
            return None, "mc_empty_option", f"option {letter} is empty or not text: {value!r}"
        options.append(text)
    prefixed = [_LETTER_PREFIX_RE.match(_nfkc(o)) for o in options]
    if all(m and m.group(1) == letter for m, letter in zip(prefixed, OPTION_LETTERS)):
        options = [m.group(2).strip() for m in prefixed]  # type: ignore[union-attr]
    keys = [option_key(o) for o in options]
    for i, key in enumerate(keys):
        if not key:
            return None, "mc_empty_option", f"option {OPTION_LETTERS[i]} is empty"
        if key in keys[:i]:
            j = keys.index(key)
            return None, "mc_duplicate_options", (f"options {OPTION_LETTERS[j]} and {OPTION_LETTERS[i]} are the "
                                                  f"same: {options[j]!r} / {options[i]!r}")
    return options, None, ""


def _answer_letter(answer: str, options: list[str]) -> tuple[str | None, str]:
    """The letter an MC answer means, with a note when it was not a plain letter; (None, why) if none."""
    text = _nfkc(answer).strip()
    keys = [option_key(o) for o in options]
    m = _LETTER_ANSWER_RE.match(text)
    if m:
        letter = m.group(1).upper()
        return letter, "" if answer.strip() == letter else f"answer {answer!r} read as {letter}"
    m = _LETTER_PREFIX_RE.match(text)
    if m:
        letter, rest = m.group(1), option_key(m.group(2))
        own = keys[OPTION_LETTERS.index(letter)]
        if rest != own and rest in keys:
            return None, f"answer {answer!r} names letter {letter} but the text of option " \
                         f"{OPTION_LETTERS[keys.index(rest)]}"
        return letter, f"answer {answer!r} read as {letter}"
    key = option_key(text)
    matches = [letter for letter, k in zip(OPTION_LETTERS, keys) if key and k == key]
    if len(matches) == 1:
        return matches[0], f"answer {answer!r} is the text of option {matches[0]}"
    return None, f"answer {answer!r} is not a letter A-D nor the text of one option"


def validate_item(item: dict, *, category: str, video_span_s: float | None,
                  seen_questions: AbstractSet[str], reasoning_prefix: str = "") -> Result:
    """Check one decoded item generated for ``category``.

    Returns ``(normalized_item, None, note)`` when it is kept, where ``normalized_item`` has exactly the
    keys question, problem_type, options (4 texts, or None for open-ended), answer (a letter for
    multiple choice), reasoning and category, and ``note`` lists the normalizations applied ("" if
    none); or ``(None, reason, message)`` with a code of :data:`REASONS`.
    ``video_span_s``: the video's duration; None (or <= 0) skips the range check. ``seen_questions``:
    :func:`~longreel.pipelines.qra.targets.normalize_question` keys of the questions already kept for this video.
    ``reasoning_prefix``: a regular expression the reasoning must start with (``re.match``); "" checks nothing.
    Raises ``ValueError`` only for a ``category`` that is not one of ``CATEGORIES`` (a caller bug).
    """
    if category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; known: {CATEGORIES}")
    if not isinstance(item, Mapping):
        return None, UNPARSEABLE, f"item is not a JSON object but {type(item).__name__}"
    fields = _canonical_fields(item)
    notes: list[str] = []
    try:
        ptype = _problem_type(fields, category, notes)
        question, reasoning, answer = _texts(fields)
        if ptype == "multiple_choice":
            options, answer = _multiple_choice(fields, question, answer, notes)
        else:
            options = None
            _open_ended(fields, question, answer)
        _grounding(question, reasoning, video_span_s, reasoning_prefix)
    except _Reject as r:
        return None, r.reason, r.message
    if ptype == "multiple_choice":
        concluded = concluded_letter(reasoning)
        if concluded is not None and concluded != answer:
            return None, "reasoning_contradicts_answer", f"the reasoning concludes {concluded}, the answer is {answer}"
    if normalize_question(question) in seen_questions:
        return None, "near_duplicate", "the same question (normalized) was already kept for this video"
    kept = {"question": question, "problem_type": ptype, "options": options, "answer": answer,
            "reasoning": reasoning, "category": category}
    return kept, None, "; ".join(notes)


class _Reject(Exception):
    """An item's first failed rule (a code of :data:`REASONS` and a message), raised by the phases below."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def _problem_type(fields: dict, category: str, notes: list[str]) -> str:
    """The required fields are there, the declared category (if any) is the requested one, and the problem type
    is one generated here (read from the fields when it is not declared)."""
    for name in ("question", "answer", "reasoning"):
        if fields.get(name) is None:
            raise _Reject("missing_field", f"{name!r} is missing or null")
    declared = fields.get("category")
    if declared is not None and not (isinstance(declared, str) and not declared.strip()):
        norm = re.sub(r"[\s\-/]+", "_", _nfkc(declared).strip().casefold()) if isinstance(declared, str) else None
        if norm != category:
            raise _Reject("wrong_category", f"item declares category {declared!r}, requested {category!r}")
    try:
        ptype = problem_type_of(fields)
    except ValueError as err:
        raise _Reject("bad_problem_type", str(err)) from None
    if ptype not in GENERATED_PROBLEM_TYPES:
        raise _Reject("bad_problem_type", f"problem type {ptype!r} is not generated here ({GENERATED_PROBLEM_TYPES})")
    if fields.get("problem_type") != ptype:
        notes.append(f"problem_type {fields.get('problem_type')!r} read as {ptype!r}")
    if ptype == "open_ended" and fields.get("options") not in (None, [], {}):
        raise _Reject("bad_problem_type", "an open_ended item carries options")
    return ptype


def _texts(fields: dict) -> tuple[str, str, str]:
    """(question, reasoning, answer) as text (a number is text only for the answer); question and reasoning
    not blank."""
    question = _as_text(fields["question"], numbers=False)
    reasoning = _as_text(fields["reasoning"], numbers=False)
    answer = _as_text(fields["answer"], numbers=True)
    for name, value in (("question", question), ("reasoning", reasoning), ("answer", answer)):
        if value is None:
            raise _Reject("missing_field", f"{name!r} is not text: {type(fields[name]).__name__}")
    assert question is not None and reasoning is not None and answer is not None
    if not question:
        raise _Reject("question_empty", "the question is blank")
    if not reasoning:
        raise _Reject("reasoning_empty", "the reasoning is blank")
    return question, reasoning, answer


def _multiple_choice(fields: dict, question: str, answer: str, notes: list[str]) -> tuple[list[str], str]:
    """(normalized options, the answer's letter); the correct option must not be readable in the question."""
    raw_options = fields.get("options")
    if raw_options is None:
        raise _Reject("missing_field", "a multiple-choice item has no options")
    options, reason, message = _normalize_options(raw_options)
    if options is None:
        raise _Reject(reason, message)
    if options != raw_options:
        notes.append("options normalized")
    letter, note = _answer_letter(answer, options)
    if letter is None:
        raise _Reject("mc_answer_not_in_options", note)
    if note:
        notes.append(note)
    others = [_leak_key(o) for i, o in enumerate(options) if OPTION_LETTERS[i] != letter]
    correct = _leak_key(options[OPTION_LETTERS.index(letter)])
    qkey = _leak_key(question)
    if correct.strip() and correct in qkey and not any(o.strip() and o in qkey for o in others):
        raise _Reject("answer_leaked", f"the correct option {letter} appears in the question")
    return options, letter


def _open_ended(fields: dict, question: str, answer: str) -> None:
    """An open-ended answer: not blank, not a bare option letter, not in the question."""
    if not answer:
        raise _Reject("open_answer_empty", "the open-ended answer is blank")
    if fields.get("problem_type") in (None, "") and _LETTER_ANSWER_RE.match(_nfkc(answer)):
        # No problem_type, no options, and a letter for an answer: a multiple-choice item that lost
        # its options, not an open-ended one.
        raise _Reject("missing_field", f"answer {answer!r} is an option letter but the item has no options")
    akey = _leak_key(answer)
    if (len(akey.split()) >= LEAK_MIN_WORDS or len(akey.strip()) >= LEAK_MIN_CHARS) and akey in _leak_key(question):
        raise _Reject("answer_leaked", "the answer appears in the question")


def _grounding(question: str, reasoning: str, video_span_s: float | None, reasoning_prefix: str) -> None:
    """The reasoning opens as required, cites a time, and no cited time lies beyond the video."""
    if reasoning_prefix and not re.match(reasoning_prefix, reasoning):
        raise _Reject("reasoning_prefix_mismatch", f"the reasoning does not start with /{reasoning_prefix}/")
    if not has_time_ref(reasoning):
        raise _Reject("reasoning_no_timespan", "the reasoning cites no time reference (e.g. 00:10-00:20)")
    if video_span_s is not None and video_span_s > 0:
        limit = video_span_s + SPAN_TOLERANCE_S
        for name, text in (("question", question), ("reasoning", reasoning)):
            beyond = [t for t in time_refs_s(text) if t > limit]
            if beyond:
                raise _Reject("timespan_out_of_range", (f"the {name} cites {max(beyond):g} s; the video lasts "
                                                        f"{video_span_s:g} s"))


def validate_generation(text: str, *, category: str, video_span_s: float | None,
                        seen_questions: AbstractSet[str]) -> tuple[list[dict], list[tuple[str, str, Any]]]:
    """Parse and validate one raw model output generated for ``category``.

    Returns ``(kept, rejects)``: the normalized kept items in output order, and one
    ``(reason, message, raw)`` per rejected item (``raw`` is the decoded item) or a single
    ``("unparseable", message, text)`` when the output cannot be parsed. Every item of a parsed output
    is either kept or rejected. Questions repeated within the output are ``near_duplicate`` (the first
    kept one wins); ``seen_questions`` itself is not modified.
    """
    try:
        items = parse_generation(text)
    except ParseError as err:
        return [], [(err.reason, str(err), text)]
    seen = set(seen_questions)
    kept: list[dict] = []
    rejects: list[tuple[str, str, Any]] = []
    for raw in items:
        item, reason, message = validate_item(raw, category=category, video_span_s=video_span_s,
                                              seen_questions=seen)
        if item is None:
            rejects.append((reason or UNPARSEABLE, message, raw))
        else:
            kept.append(item)
            seen.add(normalize_question(item["question"]))
    return kept, rejects
