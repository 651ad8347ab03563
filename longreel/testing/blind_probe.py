"""A text-only answerer that reads answers off time references, for measuring answer leaks with the blind filter.

:class:`TimestampReader` is an :class:`longreel.engines.base.Engine` that sees only the blind prompt, like any blind
answerer, and answers by one rule: a multiple-choice question whose options hold time references is answered with
the option of the earliest time ("which scene happens first"); one whose question lists numbered scenes with time
references is answered with the option that orders them by time ("in which order"); anything else gets option A
(no reading possible: under the blind filter's rotation that passes 1 sample in 4). It is an upper bound of what a
strong LLM gets from the timestamps alone, not a model of one.
"""
from __future__ import annotations

import json
import re

from longreel.engines.base import Completion, Engine

_OPTION_RE = re.compile(r"^([A-D])\. (.*)$", re.M)
_SCENE_RE = re.compile(r"\((\d)\) (.*?)(?= \(\d\) |\nOptions:|$)", re.S)


def _first_time(text: str) -> float | None:
    """The first time the text names (a caption's leading span starts with its clip's start)."""
    from longreel.pipelines.qra.validate import time_refs_s

    times = time_refs_s(text)
    return times[0] if times else None


def read_answer(prompt: str) -> str:
    """The letter the timestamps give away, or "A"."""
    options = dict(_OPTION_RE.findall(prompt))
    timed = {k: _first_time(v) for k, v in options.items()}
    if options and all(t is not None for t in timed.values()):
        return min(timed, key=timed.get)
    question = prompt.split("\nOptions:", 1)[0]
    scenes = {n: _first_time(t) for n, t in _SCENE_RE.findall(question)}
    if scenes and all(t is not None for t in scenes.values()):
        order = ", ".join(sorted(scenes, key=scenes.get))
        return next((k for k, v in options.items() if v.strip() == order), "A")
    return "A"


class TimestampReader(Engine):
    backend = "probe"
    supports_schema = True

    def __init__(self):
        super().__init__("timestamp-reader", "rule-v1")

    def generate(self, requests):
        out = []
        for r in requests:
            prompt = r.messages[-1]["content"]
            text = json.dumps({"reasoning": "read from the time references", "answer": read_answer(prompt)})
            n = r.sampling.n
            out.append(Completion(texts=[text] * n, finish=["stop"] * n, vision_tokens=0))
        return out
