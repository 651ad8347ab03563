"""The judge: an LLM checks a question against the timestamped captions it was written from.

Checks, in the order a reject names the first failed one (``details`` lists all):

* ``judge_answer_unsupported``: the verdict says the answer does not follow from the captions;
* ``judge_answer_not_unique`` (multiple choice): the verdict says another option is as right;
* ``judge_timestamp_missing``: a time the reasoning cites lies in no caption's span (checked here, not asked of
  the model: a small judge misreads clock times, the captions' spans are data);
* ``judge_single_clip`` (categories of ``multi_clip_categories``): the verdict says one clip is enough.

The verdict is decoded under :func:`verdict_schema` (greedy); output that does not parse is ``judge_unparseable``.
"""
from __future__ import annotations

import hashlib
import json

from longreel.engines.base import EngineRequest, Sampling, item_seed
from longreel.pipelines.judge_config import JudgeConfig
from longreel.pipelines.qra.context import caption_line
from longreel.pipelines.qra.validate import time_refs_s
from longreel.task.prompting import OPTION_LETTERS

STAGE = "judge"
UNSUPPORTED, NOT_UNIQUE = "judge_answer_unsupported", "judge_answer_not_unique"
TIMESTAMP_MISSING, SINGLE_CLIP, UNPARSEABLE = "judge_timestamp_missing", "judge_single_clip", "judge_unparseable"
CHECKS = (UNSUPPORTED, NOT_UNIQUE, TIMESTAMP_MISSING, SINGLE_CLIP)
JUDGE_PROMPT_VERSION = "judge-v1"
SYSTEM = ("You check questions written about a video from its timestamped captions. Judge only from the captions. "
          "Answer with a JSON object: answer_follows (the given answer follows from the captions), unique_answer "
          "(no other option is as right; true for questions without options), needs_multiple_clips (answering "
          "needs more than one caption's time span), and a short explanation.")


def verdict_schema(cfg: JudgeConfig) -> dict:
    return {"title": "judge_verdict", "type": "object", "additionalProperties": False,
            "required": ["answer_follows", "unique_answer", "needs_multiple_clips", "explanation"],
            "properties": {"answer_follows": {"type": "boolean"}, "unique_answer": {"type": "boolean"},
                           "needs_multiple_clips": {"type": "boolean"},
                           "explanation": {"type": "string", "maxLength": cfg.explanation_chars}}}


def judge_messages(q: dict, captions: list[dict]) -> list[dict]:
    lines = "\n".join(caption_line(c) for c in sorted(captions, key=lambda c: c["start_s"]))
    options = q.get("options")
    listed = "\n".join(f"{letter}. {o}" for letter, o in zip(OPTION_LETTERS, options)) if options else "(none)"
    user = (f"Captions:\n{lines}\n\nQuestion: {q['question']}\nOptions:\n{listed}\nGiven answer: {q['answer']}\n"
            f"Reasoning: {q['reasoning']}")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def request_for(q: dict, captions: list[dict], cfg: JudgeConfig) -> EngineRequest:
    return EngineRequest(key=f"judge:{q['qra_id']}", messages=judge_messages(q, captions),
                         sampling=Sampling(max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                                           seed=item_seed(cfg.seed, q["qra_id"])),
                         schema=verdict_schema(cfg), max_string_chars=cfg.explanation_chars)


def parse_verdict(text: str) -> dict | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    keys = ("answer_follows", "unique_answer", "needs_multiple_clips")
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), bool) for k in keys):
        return None
    return {**{k: doc[k] for k in keys}, "explanation": str(doc.get("explanation", ""))}


def missing_times(reasoning: str, captions: list[dict], tolerance_s: float) -> list[float]:
    """The times the reasoning cites that lie in no caption's span (widened by ``tolerance_s``)."""
    spans = [(float(c["start_s"]) - tolerance_s, float(c["end_s"]) + tolerance_s) for c in captions]
    return [t for t in time_refs_s(reasoning) if not any(lo <= t <= hi for lo, hi in spans)]


def failed_checks(q: dict, verdict: dict, captions: list[dict], cfg: JudgeConfig) -> list[str]:
    failed = []
    if not verdict["answer_follows"]:
        failed.append(UNSUPPORTED)
    if q.get("options") and not verdict["unique_answer"]:
        failed.append(NOT_UNIQUE)
    if missing_times(q["reasoning"], captions, cfg.timestamp_tolerance_s):
        failed.append(TIMESTAMP_MISSING)
    if q["category"] in cfg.multi_clip_categories and not verdict["needs_multiple_clips"]:
        failed.append(SINGLE_CLIP)
    return failed


def prompt_hash(cfg: JudgeConfig) -> str:
    blob = json.dumps({"version": JUDGE_PROMPT_VERSION, "system": SYSTEM, "schema": verdict_schema(cfg),
                       "layout": judge_messages({"question": "{q}", "options": ["{a}"], "answer": "{x}",
                                                 "reasoning": "{r}"}, [])[1]["content"]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()
