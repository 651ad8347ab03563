"""The one prompt format for video questions: used by the trainer (SFT, GRPO rollouts) and the pass-rate filter.

A question is asked as a chat with two messages::

    [{"role": "system", "content": SYSTEM_PROMPT},
     {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question_text(...)}]}]

* the system prompt asks for the reasoning inside ``<think>...</think>`` followed by the final answer inside
  ``<answer>...</answer>`` (the format :mod:`longreel.task.rewards` gates accuracy on);
* the video is one ``{"type": "video"}`` content item before the text (the processor expands it to the video's
  visual tokens; the frames themselves travel beside the messages, never inside them);
* the text is the question, then, for multiple choice, the options lettered ``A.`` .. ``D.`` one per line (options
  are stored without their letters in QRA rows), then a one-line instruction for the answer's form that depends on
  the problem type (:data:`ANSWER_INSTRUCTIONS`).

:func:`build_messages` returns the chat; :func:`render_prompt` renders it with a processor's (or tokenizer's) own
chat template and the generation prompt, which is the exact string a backend tokenizes. :func:`prompt_hash` identifies
the format (system prompt, layout and instructions, with :data:`PROMPT_VERSION`): it is recorded next to every sample
generated with it, so that a pass-rate table and a training run can be checked to use the same prompt.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ANSWER_INSTRUCTIONS",
    "OPTION_LETTERS",
    "PROMPT_VERSION",
    "SYSTEM_PROMPT",
    "build_messages",
    "format_options",
    "messages_for_qra",
    "prompt_hash",
    "question_text",
    "render_prompt",
]

#: Bump when anything below changes what the model sees.
PROMPT_VERSION = "video-qa-v1"

SYSTEM_PROMPT = (
    "You are a helpful assistant that answers questions about videos. "
    "First think about the question step by step, using what you see in the video, and put this reasoning "
    "inside <think> and </think>. Then give only the final answer inside <answer> and </answer>. "
    "Write nothing outside these two blocks."
)

#: Multiple choice has at most four options in QRA rows; their letters, in order.
OPTION_LETTERS = ("A", "B", "C", "D")

#: The last line of the user text, per problem type: how the final answer should be written.
ANSWER_INSTRUCTIONS: dict[str, str] = {
    "multiple_choice": "Answer with the letter of the correct option (A, B, C or D) inside <answer></answer>.",
    "numerical": "Answer with a single number inside <answer></answer>.",
    "open_ended": "Answer with a short phrase or sentence inside <answer></answer>.",
    "boolean": "Answer with yes or no inside <answer></answer>.",
    "temporal_grounding": "Answer with the start and end time in seconds as [start, end] inside <answer></answer>.",
    "spatial_grounding": "Answer with the bounding box as [x1, y1, x2, y2] inside <answer></answer>.",
    "math": "Answer with the final mathematical expression or number inside <answer></answer>.",
}


def format_options(options: Sequence[str]) -> str:
    """``"A. first\\nB. second ..."``. Raises ``ValueError`` for 0 or more than 4 options or an empty option."""
    opts = list(options)
    if not 1 <= len(opts) <= len(OPTION_LETTERS):
        raise ValueError(f"multiple choice needs 1 to {len(OPTION_LETTERS)} options, got {len(opts)}")
    lines = []
    for letter, text in zip(OPTION_LETTERS, opts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"option {letter} is empty or not text: {text!r}")
        lines.append(f"{letter}. {' '.join(text.split())}")
    return "\n".join(lines)


def question_text(question: str, options: Sequence[str] | None = None,
                  problem_type: str = "multiple_choice") -> str:
    """The user message's text: question, lettered options (multiple choice only), answer instruction."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty")
    if problem_type not in ANSWER_INSTRUCTIONS:
        raise ValueError(f"unknown problem_type {problem_type!r}; known: {sorted(ANSWER_INSTRUCTIONS)}")
    parts = [f"Question: {question.strip()}"]
    if problem_type == "multiple_choice":
        if not options:
            raise ValueError("a multiple-choice question needs options")
        parts.append("Options:\n" + format_options(options))
    parts.append(ANSWER_INSTRUCTIONS[problem_type])
    return "\n".join(parts)


def build_messages(question: str, options: Sequence[str] | None = None, problem_type: str = "multiple_choice",
                   *, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The chat for one question about one video (see the module docstring for the layout)."""
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": [
            {"type": "video"},
            {"type": "text", "text": question_text(question, options, problem_type)},
        ]},
    ]


def messages_for_qra(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """:func:`build_messages` for a ``qra`` record (``question``, ``options``, ``problem_type``; a row without a
    problem type is multiple choice when it has options, else open-ended)."""
    options = row.get("options")
    options = list(options) if options is not None else None
    return build_messages(row["question"], options, row.get("problem_type") or
                          ("multiple_choice" if options else "open_ended"))


def render_prompt(processor_or_tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt string a backend tokenizes: the model's own chat template, with the assistant turn opened."""
    return processor_or_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def prompt_hash() -> str:
    """sha256 (hex) of the prompt format: version, system prompt, option layout and answer instructions."""
    blob = json.dumps({"version": PROMPT_VERSION, "system": SYSTEM_PROMPT, "letters": OPTION_LETTERS,
                       "layout": question_text("{question}", ["{a}", "{b}", "{c}", "{d}"]),
                       "instructions": ANSWER_INSTRUCTIONS}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()
