"""``multiple_choice``: letter match against the reference option.

Options. ``options`` is the ordered list of option texts; option ``i`` has letter ``"ABC..."[i]`` (2 to 26
options). An option may carry its own label (``"A. Paris"``, ``"(A) Paris"``, ``"A) Paris"``): a label whose letter
is the option's position letter is ignored when comparing texts. With ``options=None`` any letter A-Z is allowed and
only letters can be matched.

Reference. A letter (any case, also ``"(C)"``, ``"C."``) or, when options are given, the exact text of one option
(compared case-insensitively, whitespace collapsed, trailing full stop ignored). A letter wins over an option whose
text happens to be a letter. Anything else raises :class:`~longreel.task.rewards.registry.InvalidReference`.

Prediction (the final answer block, see :func:`~longreel.task.rewards.extract.clean_answer` for the wrappers removed
first: ``\\boxed{C}``, ``**C**``, ``$C$``, "Answer: C", "The answer is C", "Option C"). Accepted, in order:

1. a lone letter, optionally bracketed and/or followed by ``.``/``:``/``)``: ``C``, ``(C)``, ``[C]``, ``C.``,
   ``C)``. Lowercase (``c``, ``(c)``) is accepted in this form only, because a lone letter cannot be part of a word.
   If the lone letter is also the exact text of a *different* option (options ``["C", "D", "E", "F"]``), it is
   ``"ambiguous"``.
2. an UPPERCASE letter label followed by text: ``(C) text``, ``[C] text``, or ``C.``/``C)``/``C:`` then whitespace
   and text. The letter decides; the text only matters when it is exactly another option's text, or names another
   letter (``(C) or (D)``, ``C) or D``): then it is ``"ambiguous"``.
3. the exact text of exactly one option (two identical options: ``"ambiguous"``).

Nothing else is read: a letter inside a word (``Cat`` is not C, ``A cat`` is not A), ``C or D``, ``A, B``, prose.
Those are ``"ambiguous"`` when at least two different standalone option letters occur, else ``"unparseable"``. A
letter beyond the number of options (``E`` with four options) is ``"invalid"``. Accuracy is 1.0 for the reference
letter, else 0.0.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

from longreel.task.rewards.extract import clean_answer, normalize_text
from longreel.task.rewards.registry import AnswerParseError, InvalidReference, Judgement, Scorer, register

__all__ = ["MultipleChoiceScorer", "parse_choice"]

LETTERS = string.ascii_uppercase
MAX_OPTIONS = len(LETTERS)

_BARE_RE = re.compile(r"\(\s*([A-Za-z])\s*\)|\[\s*([A-Za-z])\s*\]|([A-Za-z])\s*[.:)]?")
_LABELLED_RE = re.compile(r"(?:\(\s*([A-Z])\s*\)|\[\s*([A-Z])\s*\]|([A-Z])\s*[.):](?=\s))\s*(\S.*)", re.DOTALL)
_OTHER_LABEL_RE = re.compile(
    r"\(\s*([A-Z])\s*\)|(?<![A-Za-z])([A-Z])[.)](?=\s|$)|\b(?:or|and)\s+([A-Z])(?![A-Za-z])"
)
_STANDALONE_RE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")
_OPTION_LABEL_RE = re.compile(r"^\s*(?:\(\s*([A-Za-z])\s*\)|([A-Za-z])\s*[.):])\s*")


def _first(groups: tuple[str | None, ...]) -> str:
    return next(g for g in groups if g)


def _norm(text: str) -> str:
    return " ".join(normalize_text(text).casefold().split()).rstrip(" .!。")


def _option_texts(options: Sequence[str] | None) -> list[str] | None:
    if options is None:
        return None
    if isinstance(options, str) or not isinstance(options, Sequence):
        raise InvalidReference(f"multiple_choice: options must be a list of strings, got {type(options).__name__}")
    if not 2 <= len(options) <= MAX_OPTIONS:
        raise InvalidReference(f"multiple_choice: need 2 to {MAX_OPTIONS} options, got {len(options)}")
    texts: list[str] = []
    for i, opt in enumerate(options):
        if not isinstance(opt, str):
            raise InvalidReference(f"multiple_choice: option {i} is not a string: {opt!r}")
        m = _OPTION_LABEL_RE.match(opt)
        if m and _first(m.groups()).upper() == LETTERS[i] and opt[m.end() :].strip():
            opt = opt[m.end() :]
        text = _norm(opt)
        if not text:
            raise InvalidReference(f"multiple_choice: option {LETTERS[i]} is empty")
        texts.append(text)
    return texts


def _match_option_text(text: str, texts: list[str] | None) -> int | None:
    if not texts:
        return None
    hits = [i for i, t in enumerate(texts) if t == _norm(text)]
    if len(hits) > 1:
        raise AnswerParseError("ambiguous", f"text matches several identical options {[LETTERS[i] for i in hits]}")
    return hits[0] if hits else None


def parse_choice(answer: str, options: Sequence[str] | None = None) -> int:
    """Index of the option chosen by ``answer`` (an answer block's text) under the rules of the module docstring.

    Raises :class:`AnswerParseError` with reason ``"unparseable"``, ``"ambiguous"`` or ``"invalid"``.
    """
    texts = _option_texts(options)
    n = len(texts) if texts is not None else MAX_OPTIONS
    s = clean_answer(answer)

    def checked(letter: str) -> int:
        idx = LETTERS.index(letter.upper())
        if idx >= n:
            raise AnswerParseError("invalid", f"letter {letter.upper()} is not among {n} options")
        return idx

    m = _BARE_RE.fullmatch(s)
    if m:
        idx = checked(_first(m.groups()))
        if texts is not None:
            other = _match_option_text(_first(m.groups()), texts)
            if other is not None and other != idx:
                raise AnswerParseError("ambiguous", f"{s!r} is letter {LETTERS[idx]} and the text of {LETTERS[other]}")
        return idx

    m = _LABELLED_RE.fullmatch(s)
    if m:
        letter, tail = _first(m.groups()[:3]), m.group(4)
        idx = checked(letter)
        if texts is not None and _norm(tail) == texts[idx]:
            return idx
        other = _match_option_text(tail, texts)
        if other is not None and other != idx:
            raise AnswerParseError("ambiguous", f"label {letter} but the text of option {LETTERS[other]}")
        named = {_first(g) for g in _OTHER_LABEL_RE.findall(tail)} - {letter}
        if any(LETTERS.index(x) < n for x in named):
            raise AnswerParseError("ambiguous", f"label {letter} and other labels {sorted(named)}")
        return idx

    idx_text = _match_option_text(s, texts)
    if idx_text is None and texts is not None:  # an option text may itself start with "Answer"/"Option"
        idx_text = _match_option_text(clean_answer(answer, strip_prefix=False), texts)
    if idx_text is not None:
        return idx_text

    standalone = {x for x in _STANDALONE_RE.findall(s) if LETTERS.index(x) < n}
    if len(standalone) >= 2:
        raise AnswerParseError("ambiguous", f"several option letters {sorted(standalone)}")
    raise AnswerParseError("unparseable", "no option letter or option text")


@register("multiple_choice")
class MultipleChoiceScorer(Scorer):
    """Letter match; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> int:
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidReference(f"multiple_choice: reference must be a non-empty string, got {answer!r}")
        texts = _option_texts(options)
        try:
            s = clean_answer(answer)
        except AnswerParseError as e:
            raise InvalidReference(f"multiple_choice: reference {answer!r}: {e}") from None
        n = len(texts) if texts is not None else MAX_OPTIONS
        m = _BARE_RE.fullmatch(s)
        if m:
            idx = LETTERS.index(_first(m.groups()).upper())
            if idx >= n:
                raise InvalidReference(f"multiple_choice: reference letter {LETTERS[idx]} but only {n} options")
            return idx
        try:
            idx_text = _match_option_text(s, texts)
        except AnswerParseError:
            raise InvalidReference(f"multiple_choice: reference {answer!r} matches several options") from None
        if idx_text is None:
            raise InvalidReference(f"multiple_choice: reference {answer!r} is neither a letter nor an option's text")
        return idx_text

    def judge(self, prediction: str, reference: int, options: Sequence[str] | None, **params: Any) -> Judgement:
        idx = parse_choice(prediction, options)
        ok = idx == reference
        return Judgement(1.0 if ok else 0.0, LETTERS[idx], "ok" if ok else "wrong")
