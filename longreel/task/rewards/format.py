"""Format check for ``<think>...</think><answer>...</answer>`` completions.

The rule, exactly. Let ``s`` be the completion with leading and trailing whitespace removed (``str.strip``). The
completion is well formatted iff

1. ``s`` contains exactly one each of ``<think>``, ``</think>``, ``<answer>`` and ``</answer>`` (tags are matched
   case-sensitively, with no spaces or attributes inside the brackets);
2. ``s`` starts with ``<think>`` and ends with ``</answer>``;
3. ``</think>`` comes before ``<answer>`` and only whitespace lies between them;
4. the think content has at least one non-whitespace character;
5. the answer content has at least one non-whitespace character.

Consequences: any text before ``<think>`` or after ``</answer>`` (including a chat template's end token such as
``<|im_end|>``: decode with ``skip_special_tokens=True``, and include a ``<think>`` prefilled by the prompt in the text
you pass), a missing think block, two answer blocks, nested or unclosed tags, and an empty think block all fail.

Reason codes of a failure, checked in this order:

* ``"no_answer_tag"``: there is no complete ``<answer>...</answer>`` pair anywhere;
* ``"bad_format"``: rules 1-4 fail;
* ``"empty_answer"``: the layout is right but the answer block is blank.

``format_reward`` is 1.0 for a well formatted completion, else 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass

from longreel.task.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, extract_answer_text

__all__ = ["FormatCheck", "check_format", "format_reward"]


@dataclass(frozen=True)
class FormatCheck:
    """Result of :func:`check_format`: ``answer`` is the stripped answer content when ``ok``, else ``None``."""

    ok: bool
    reason: str
    answer: str | None = None


def check_format(completion: str) -> FormatCheck:
    """Apply the rule in the module docstring."""
    if not isinstance(completion, str):
        raise TypeError(f"completion must be str, got {type(completion).__name__}")
    if extract_answer_text(completion) is None:
        return FormatCheck(False, "no_answer_tag")
    s = completion.strip()
    if any(s.count(tag) != 1 for tag in (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)):
        return FormatCheck(False, "bad_format")
    if not (s.startswith(THINK_OPEN) and s.endswith(ANSWER_CLOSE)):
        return FormatCheck(False, "bad_format")
    think_close = s.index(THINK_CLOSE)
    answer_open = s.index(ANSWER_OPEN)
    if answer_open < think_close or s[think_close + len(THINK_CLOSE) : answer_open].strip():
        return FormatCheck(False, "bad_format")
    if not s[len(THINK_OPEN) : think_close].strip():
        return FormatCheck(False, "bad_format")
    answer = s[answer_open + len(ANSWER_OPEN) : len(s) - len(ANSWER_CLOSE)].strip()
    if not answer:
        return FormatCheck(False, "empty_answer")
    return FormatCheck(True, "ok", answer)


def format_reward(completion: str) -> float:
    """1.0 if ``completion`` is well formatted (module docstring), else 0.0."""
    return 1.0 if check_format(completion).ok else 0.0
