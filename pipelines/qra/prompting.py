"""Chat messages of the QRA generation and refinement calls, rendered from ``pipelines/prompts/qra_*.j2``.

Templates: ``qra_system`` (system message of every call), ``qra_<category>`` for the four categories,
``qra_refine``. A call's ``prompt_hash`` is the sha256 of ``"<system hash>:<template hash>"``, so it
changes exactly when the text of either template does (see :mod:`longreel.pipelines.prompts`).
"""
from __future__ import annotations

import hashlib
import json

from longreel.pipelines.prompts import render
from longreel.pipelines.qra.context import fmt_ts
from longreel.pipelines.qra.targets import OPTION_LETTERS

SYSTEM_TEMPLATE = "qra_system"
REFINE_TEMPLATE = "qra_refine"

_MC_EXAMPLE = {"question": "...", "problem_type": "multiple_choice", "options": ["...", "...", "...", "..."],
               "reasoning": "Checking the video at [MM:SS-MM:SS], ... So the answer is B.", "answer": "B"}
_OPEN_EXAMPLE = {"question": "...", "problem_type": "open_ended",
                 "reasoning": "Checking the video at [MM:SS-MM:SS], ...", "answer": "..."}


def category_template(category: str) -> str:
    return f"qra_{category}"


def combined_hash(*hashes: str) -> str:
    return hashlib.sha256(":".join(hashes).encode()).hexdigest()


def generation_example(problem_type: str) -> str:
    item = _MC_EXAMPLE if problem_type == "multiple_choice" else _OPEN_EXAMPLE
    return json.dumps({"questions": [item]}, ensure_ascii=False)


def generation_messages(category: str, *, n_questions: int, problem_type: str, duration_s: float, captions: str,
                        window: dict | None = None) -> tuple[list[dict], str]:
    """``(messages, prompt_hash)`` of one generation call. ``window``: ``{"start_s", "end_s"}`` when the
    captions are one window of a longer video, else None."""
    system, sys_hash = render(SYSTEM_TEMPLATE)
    win = None if window is None else {"start": fmt_ts(window["start_s"]), "end": fmt_ts(window["end_s"])}
    user, user_hash = render(category_template(category), n_questions=n_questions, problem_type=problem_type,
                             duration=fmt_ts(duration_s), captions=captions, window=win,
                             example=generation_example(problem_type))
    return ([{"role": "system", "content": system}, {"role": "user", "content": user}],
            combined_hash(sys_hash, user_hash))


def refine_messages(item: dict, *, duration_s: float, captions: str) -> tuple[list[dict], str]:
    """``(messages, prompt_hash)`` of the refinement call for one kept item."""
    system, sys_hash = render(SYSTEM_TEMPLATE)
    options = list(zip(OPTION_LETTERS, item["options"])) if item.get("options") else None
    example = json.dumps({"reasoning": "Checking the video at [MM:SS-MM:SS], ...", "answer": item["answer"]},
                         ensure_ascii=False)
    user, user_hash = render(REFINE_TEMPLATE, duration=fmt_ts(duration_s), captions=captions,
                             question=item["question"], options=options, answer=item["answer"],
                             reasoning=item["reasoning"], example=example)
    return ([{"role": "system", "content": system}, {"role": "user", "content": user}],
            combined_hash(sys_hash, user_hash))


def template_hashes(categories) -> dict[str, str]:
    """sha256 of every template the QRA stage may use (for provenance and data cards)."""
    from longreel.pipelines.prompts import load_template

    names = [SYSTEM_TEMPLATE, REFINE_TEMPLATE] + [category_template(c) for c in categories]
    return {n: load_template(n)[1] for n in names}
