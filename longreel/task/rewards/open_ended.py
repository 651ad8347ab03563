"""``open_ended``: free-text answers scored by ROUGE F-measure (``rouge-score`` library), ROUGE-L by default.

Reference: any text with at least one token (else ``InvalidReference``). Prediction: the answer block with outer
markup removed by :func:`~longreel.task.rewards.extract.clean_answer` (``\\boxed{}``, quotes, ``**``, trailing full stop;
the "Answer:" phrase is kept, it is just one more token). A prediction with no token at all (``"!!!"``) is
``"unparseable"``.

Tokenisation. For ASCII text it is exactly the library's default (lowercase, split on anything not ``[a-z0-9]``,
Porter-stem tokens longer than 3 characters). Unlike the default, which deletes every non-ASCII character (so two
Chinese answers would score 0 against each other), letters and digits of any script are kept: text is
ASCII-folded with :func:`~longreel.task.rewards.extract.normalize_text`, case-folded, split on non-alphanumerics, and each
CJK ideograph or kana is its own token. Stemming applies to ASCII tokens only.

Parameters: ``rouge_type`` (``"rougeL"`` default, or ``"rouge1"``, ``"rouge2"``, ``"rougeLsum"``) and
``use_stemmer`` (default ``True``). Accuracy is the F-measure in [0, 1]; reason ``"ok"`` at 1, ``"partial"`` in
between, ``"wrong"`` at 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from longreel.task.rewards.extract import clean_answer, normalize_text
from longreel.task.rewards.registry import AnswerParseError, InvalidReference, Judgement, Scorer, reason_for_score, register

__all__ = ["OpenEndedScorer", "UnicodeTokenizer", "rouge_f"]

ROUGE_TYPES = ("rougeL", "rouge1", "rouge2", "rougeLsum")
_WORD_RE = re.compile(r"[^\W_]+")
_CJK_RE = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")
_ASCII_ALPHA_RE = re.compile(r"[a-z]+")


class UnicodeTokenizer:
    """ROUGE tokenizer: the library default for ASCII, plus letters/digits of other scripts (module docstring).

    ``rouge_score`` wants an object with a ``tokenize`` method. ``rouge_score`` and nltk are imported when a scorer
    is first made, not with this module: nltk pulls in scipy.stats (about 1.4 s of CPU), which every process that
    imports the reward library (a pass-rate filter's, a multiple-choice run's) paid whether or not it scored an
    open-ended answer."""

    def __init__(self, use_stemmer: bool = True) -> None:
        if use_stemmer:
            from nltk.stem import porter
            self._stemmer = porter.PorterStemmer()
        else:
            self._stemmer = None

    def tokenize(self, text: str) -> list[str]:
        tokens: list[str] = []
        for word in _WORD_RE.findall(normalize_text(text).casefold()):
            for piece in _CJK_RE.split(word):
                if not piece:
                    continue
                if self._stemmer is not None and len(piece) > 3 and _ASCII_ALPHA_RE.fullmatch(piece):
                    piece = self._stemmer.stem(piece)
                tokens.append(piece)
        return tokens


@lru_cache(maxsize=16)
def _scorer(rouge_type: str, use_stemmer: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([rouge_type], tokenizer=UnicodeTokenizer(use_stemmer))


def _check_params(params: dict[str, Any]) -> tuple[str, bool]:
    rouge_type = params.get("rouge_type", "rougeL")
    use_stemmer = params.get("use_stemmer", True)
    if rouge_type not in ROUGE_TYPES:
        raise ValueError(f"open_ended: rouge_type must be one of {ROUGE_TYPES}, got {rouge_type!r}")
    if not isinstance(use_stemmer, bool):
        raise ValueError(f"open_ended: use_stemmer must be a bool, got {use_stemmer!r}")
    return rouge_type, use_stemmer


def rouge_f(prediction: str, reference: str, rouge_type: str = "rougeL", use_stemmer: bool = True) -> float:
    """ROUGE F-measure of ``prediction`` against ``reference`` with :class:`UnicodeTokenizer`, in [0, 1]."""
    f = _scorer(rouge_type, use_stemmer).score(reference, prediction)[rouge_type].fmeasure
    return min(1.0, max(0.0, float(f))) if f == f else 0.0


@register("open_ended", params={"rouge_type": "rougeL", "use_stemmer": True})
class OpenEndedScorer(Scorer):
    """ROUGE F-measure; see the module docstring."""

    def parse_reference(self, answer: str, options: Sequence[str] | None, **params: Any) -> str:
        _check_params(params)
        if not isinstance(answer, str) or not UnicodeTokenizer(False).tokenize(answer):
            raise InvalidReference(f"open_ended: reference must be text with at least one word, got {answer!r}")
        return answer

    def judge(self, prediction: str, reference: str, options: Sequence[str] | None, **params: Any) -> Judgement:
        rouge_type, use_stemmer = _check_params(params)
        text = clean_answer(prediction, strip_prefix=False)
        if not UnicodeTokenizer(False).tokenize(text):
            raise AnswerParseError("unparseable", "no word in the answer")
        acc = rouge_f(text, reference, rouge_type, use_stemmer)
        return Judgement(acc, text, reason_for_score(acc))
