"""Answer extraction and text normalisation shared by the scorers.

* :func:`extract_answer_text` returns the content of the LAST complete ``<answer>...</answer>`` block, or ``None``
  when there is none. It never falls back to the whole completion. Tags are matched exactly (lowercase, no spaces or
  attributes inside the angle brackets). "Last complete block" means: the last ``<answer>`` that has a ``</answer>``
  somewhere after it, up to the first ``</answer>`` that follows it. So ``<answer>A</answer><answer>B</answer>`` gives
  ``"B"``, the nested ``<answer>x<answer>B</answer></answer>`` gives ``"B"``, and a trailing unclosed ``<answer>C`` is
  ignored. (All three shapes fail the format check of ``format.py``, so under the gated reward they score 0; the
  extracted text is still reported for diagnostics.)
* :func:`normalize_text` maps every Unicode decimal digit (category ``Nd``: full-width ``１``, Arabic-Indic ``١``,
  Devanagari ``१``, mathematical bold ``𝟏``, ...) to its ASCII digit, full-width ASCII forms (``Ｃ``, ``（``) to
  ASCII, the Arabic decimal/thousands separators to ``.``/``,``, Unicode minus signs to ``-``, the ideographic
  space to a space, and deletes zero-width characters. It deliberately does NOT apply NFKC: NFKC would turn the
  superscript in ``10²`` into ``102``.
* :func:`clean_answer` strips the usual wrappers around a short answer: one ``\\boxed{...}`` (several boxes with
  different contents are ambiguous), markdown emphasis/backticks, ``$...$``, ``\\text{...}``, surrounding quotes,
  a leading "Answer:" / "The answer is" / "Final answer:" / "Option" phrase, and trailing ``.``/``!``/``。``.
"""

from __future__ import annotations

import re
import unicodedata

from longreel.task.rewards.registry import AnswerParseError

__all__ = [
    "ANSWER_CLOSE",
    "ANSWER_OPEN",
    "THINK_CLOSE",
    "THINK_OPEN",
    "boxed_contents",
    "clean_answer",
    "extract_answer_text",
    "normalize_text",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


def extract_answer_text(completion: str) -> str | None:
    """Stripped content of the last complete ``<answer>...</answer>`` block, or ``None`` if there is none.

    An empty block gives ``""`` (not ``None``). The whole completion is never used as a fallback.
    """
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    close = completion.rfind(ANSWER_CLOSE)
    if close < 0:
        return None
    opening = completion.rfind(ANSWER_OPEN, 0, close)
    if opening < 0:
        return None
    start = opening + len(ANSWER_OPEN)
    end = completion.find(ANSWER_CLOSE, start)  # first close after the last opening (<= close)
    return completion[start:end].strip()


_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)
_SPECIAL = {
    0x3000: " ",  # ideographic space
    0x066B: ".",  # Arabic decimal separator
    0x066C: ",",  # Arabic thousands separator
    0x2212: "-",  # minus sign
    0xFE63: "-",  # small hyphen-minus
    0x2012: "-",  # figure dash
    0x2013: "-",  # en dash (ranges "3–5")
    0x2014: "-",  # em dash
}


def normalize_text(text: str) -> str:
    """ASCII-fold digits, full-width forms, minus signs and zero-width characters (see module docstring)."""
    if text.isascii():
        return text
    out: list[str] = []
    for ch in text.translate(_ZERO_WIDTH):
        cp = ord(ch)
        if cp < 128:
            out.append(ch)
        elif cp in _SPECIAL:
            out.append(_SPECIAL[cp])
        elif 0xFF01 <= cp <= 0xFF5E:  # full-width ASCII block
            out.append(chr(cp - 0xFEE0))
        elif unicodedata.category(ch) == "Nd":
            out.append(str(unicodedata.decimal(ch)))
        else:
            out.append(ch)
    return "".join(out)


def _braced(text: str, open_idx: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[open_idx] == "{"`` and the index after it; None if unbalanced."""
    depth = 0
    for i in range(open_idx, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i], i + 1
    return None


_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, in order (nested boxes are inside)."""
    found: list[str] = []
    pos = 0
    while True:
        m = _BOXED_RE.search(text, pos)
        if not m:
            return found
        got = _braced(text, m.end() - 1)
        if got is None:
            return found
        found.append(got[0])
        pos = got[1]


_WRAPPER_CMD_RE = re.compile(r"^\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{")
_PREFIX_RE = re.compile(
    r"^(?:(?:so|thus|therefore|hence)\s*,?\s+)?(?:the\s+)?(?:final\s+|correct\s+|best\s+|right\s+)?"
    r"(?:answer|option|choice)\b(?:\s+is)?\s*(?::|=|-(?=\s))?\s*",
    re.IGNORECASE,
)
_TRAILING = " \t\r\n.!。"


def _strip_wrappers_once(s: str) -> str:
    s = s.strip()
    for a, b in (("**", "**"), ("__", "__"), ("`", "`"), ("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"),
                 ('"', '"'), ("'", "'"), ("\u201c", "\u201d"), ("\u2018", "\u2019")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            return s[len(a) : len(s) - len(b)].strip()
    m = _WRAPPER_CMD_RE.match(s)
    if m:
        got = _braced(s, m.end() - 1)
        if got is not None and got[1] == len(s):
            return got[0].strip()
    return s


def clean_answer(text: str, *, strip_prefix: bool = True) -> str:
    """Normalise a short answer and strip boxes, markup, answer phrases and trailing full stops.

    Raises :class:`AnswerParseError` ``("ambiguous")`` when several ``\\boxed{}`` hold different contents, and
    ``("unparseable")`` when nothing is left.
    """
    s = normalize_text(text).strip()
    boxes = boxed_contents(s)
    if boxes:
        distinct = {b.strip() for b in boxes}
        if len(distinct) > 1:
            raise AnswerParseError("ambiguous", f"several different \\boxed{{}} answers: {sorted(distinct)!r}")
        s = boxes[-1]
    for _ in range(8):  # bounded: each pass removes at least one wrapper or stops
        before = s
        s = _strip_wrappers_once(s).rstrip(_TRAILING).strip()
        if strip_prefix:
            s = _PREFIX_RE.sub("", s, count=1).strip()
        if s == before:
            break
    if not s:
        raise AnswerParseError("unparseable", "empty after removing wrappers")
    return s
