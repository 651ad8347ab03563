"""Balanced multiple-choice options: a seeded, recorded permutation per question, and the answer moved with it.

LLM writers put the right answer at one letter far more often than at the others (about 60 % "B" in several
public reports), a free shortcut for a policy trained with RL. Every multiple-choice row's options are permuted
with a permutation drawn from its ``qra_id`` (so the same question always gets the same order, whatever the run
or the worker), recorded as ``option_permutation`` (the option shown at position ``i`` was at position
``perm[i]``); the answer letter and the letters the reasoning names ("option B", "so the answer is C") are
remapped. The card tests the released answer letters against uniform (:func:`chi_square_uniform`).

Options whose meaning depends on their position ("all of the above", "none of these", "both A and B") are
rejected ``position_dependent_option`` rather than kept in place: kept in place they would keep the writer's
letter (and "all of the above" is itself a known answer cue), and one could not be moved without rewriting it.
The template writer never writes them; only LLM-written items are lost.
"""
from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence

from longreel.pipelines.qra.targets import OPTION_LETTERS, make_target
from longreel.pipelines.qra.validate import concluded_letter

STAGE = "qra_balance"
POSITION_DEPENDENT = "position_dependent_option"
REMAP_FAILED = "letter_remap_failed"
BAD_ANSWER = "answer_not_a_letter"
SALT = "options-v1"

_LETTER = r"\(?(?-i:[A-D])\)?"
_POSITIONAL_RE = re.compile(
    r"\b(?:all|none|both|neither|any)\s+(?:of\s+)?(?:the\s+)?(?:above|below|previous|preceding|these|those|"
    r"other\s+options|options|answers|choices)\b"
    r"|\b(?:both|either|neither|only)?\s*(?:options?\s+)?" + _LETTER + r"\s*(?:,\s*" + _LETTER + r"\s*)*(?:and|or|nor|&)\s+"
    + _LETTER + r"(?![\w'])", re.I)
# A standalone capital A-D; "A" is the article unless a letter word precedes it or no lowercase word follows it.
_LETTER_REF_RE = re.compile(r"(?<![\w'\u2019-])([A-D])(?![\w'\u2019-])")
_LETTER_WORD_BEFORE_RE = re.compile(r"(?:options?|choices?|answer(?:\s+is)?|letter|and|or|,)\s*[:(\[]?\s*$", re.I)
_LOWER_WORD_AFTER_RE = re.compile(r"\s+[a-z]")


def permutation(qra_id: str, n: int) -> list[int]:
    """The order of ``qra_id``'s ``n`` options: a shuffle under a seed from sha256(salt, qra_id)."""
    seed = int(hashlib.sha256(f"{SALT}:{qra_id}".encode()).hexdigest()[:16], 16)
    perm = list(range(n))
    random.Random(seed).shuffle(perm)
    return perm


def position_dependent(options: Sequence[str]) -> str | None:
    """The first option whose meaning depends on the others' positions, or None."""
    return next((o for o in options if _POSITIONAL_RE.search(o)), None)


def _is_letter_ref(text: str, m: re.Match) -> bool:
    if m.group(1) != "A":
        return True
    if _LETTER_WORD_BEFORE_RE.search(text[:m.start()]) or text[m.start() - 1:m.start()] == "(":
        return True
    return not _LOWER_WORD_AFTER_RE.match(text, m.end())


def remap_letters(text: str, perm: Sequence[int]) -> str:
    """``text`` with every option letter it names moved to that option's new letter (see :func:`permutation`)."""
    new_letter = {OPTION_LETTERS[old]: OPTION_LETTERS[new] for new, old in enumerate(perm)}
    return _LETTER_REF_RE.sub(lambda m: new_letter.get(m.group(1), m.group(1)) if _is_letter_ref(text, m)
                              else m.group(1), text)


def balance(row: dict) -> tuple[dict | None, str | None, str]:
    """(the row with permuted options, None, "") or (None, reject reason, message). Rows without options pass
    unchanged (``option_permutation`` stays null)."""
    options = row.get("options")
    if row.get("problem_type") != "multiple_choice" or not options:
        return row, None, ""
    options = list(options)
    fixed = position_dependent(options)
    if fixed is not None:
        return None, POSITION_DEPENDENT, f"option {fixed!r} refers to the other options' positions"
    if row.get("answer") not in OPTION_LETTERS[:len(options)]:  # the QRA validator writes letters; a table from
        return None, BAD_ANSWER, f"answer {row.get('answer')!r} is not an option letter"  # elsewhere may not
    perm = permutation(row["qra_id"], len(options))
    answer = OPTION_LETTERS[perm.index(OPTION_LETTERS.index(row["answer"]))]
    reasoning = remap_letters(row["reasoning"], perm)
    concluded = concluded_letter(reasoning)
    if concluded not in (None, answer):
        return None, REMAP_FAILED, f"the remapped reasoning concludes {concluded}, the answer is now {answer}"
    out = dict(row, options=[options[i] for i in perm], answer=answer, reasoning=reasoning,
               target=make_target(reasoning, answer), option_permutation=perm)
    if row.get("draft_reasoning"):
        out["draft_reasoning"] = remap_letters(row["draft_reasoning"], perm)
    return out, None, ""


def chi_square_uniform(counts: Sequence[int]) -> dict:
    """Pearson's chi-square test of ``counts`` (one per letter) against the uniform distribution:
    X^2 = sum((o - e)^2 / e) with e = n / m, df = m - 1, p = Q(df / 2, X^2 / 2) (the chi-square survival
    function) in closed form for integer df: even df = 2j: p = exp(-x/2) * sum_{i<j} (x/2)^i / i!; odd
    df = 2j + 1: p = erfc(sqrt(x/2)) + exp(-x/2) * sum_{i=1..j} (x/2)^(i - 1/2) / Gamma(i + 1/2).
    With no observations the statistic is 0 and p is 1."""
    m, n = len(counts), sum(counts)
    if m < 2:
        raise ValueError("the test needs at least two categories")
    if n == 0:
        return {"n": 0, "chi2": 0.0, "df": m - 1, "p_value": 1.0}
    e = n / m
    x = sum((o - e) ** 2 / e for o in counts)
    df, h = m - 1, x / 2
    if df % 2 == 0:
        p = math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(df // 2))
    else:
        p = math.erfc(math.sqrt(h)) + math.exp(-h) * sum(h ** (i - 0.5) / math.gamma(i + 0.5)
                                                          for i in range(1, df // 2 + 1))
    return {"n": n, "chi2": round(x, 6), "df": df, "p_value": round(min(1.0, max(0.0, p)), 6)}
