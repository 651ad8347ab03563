"""A pass-rate answerer of known correctness, for tests of the filter stage (not a config choice: tests hand it to
the stage, ``run_filter(out, cfg, handler=ScriptedAnswerer(cfg, {qra_id: n}))``).

For each question ``correct[qra_id]`` (else ``default``) of the k samples answer right; the rest answer a wrong
option or, for non-multiple-choice types, give no answer block. Which of the k are right is drawn from the
question's seed. The completions go through the reward library like a model's, so the pass counts the stage
computes must equal the script.
"""
from __future__ import annotations

import random

from longreel.pipelines.filter_config import FilterConfig
from longreel.pipelines.passrate.answerers import AnswererHandler, Loaded
from longreel.task.prompting import OPTION_LETTERS
from longreel.task.rewards import score

SCRIPTED_REVISION = "scripted-v1"


class ScriptedAnswerer(AnswererHandler):
    backend = "scripted"

    def __init__(self, cfg: FilterConfig, correct: dict[str, int] | None = None, default: int = 0):
        super().__init__(cfg)
        self.correct, self.default = dict(correct or {}), int(default)
        bad = {q: n for q, n in self.correct.items() if isinstance(n, bool) or not isinstance(n, int)
               or not 0 <= n <= cfg.k}
        if bad or not 0 <= self.default <= cfg.k:
            raise ValueError(f"scripted counts must be integers in [0, k={cfg.k}]: {bad or self.default}")

    def answerer_name(self) -> str:
        return "scripted"

    def answerer_revision(self) -> str | None:
        return SCRIPTED_REVISION

    def processor_dir(self) -> str | None:
        return None  # no model: Qwen2-VL's default video processor

    def load_model(self):
        return Loaded()

    def answer(self, model, example: dict) -> list[str]:
        frames = example.get("frames")
        if frames is None or getattr(frames, "ndim", 0) != 4 or frames.shape[0] < 1:
            raise ValueError("scripted answerer got no frames")  # the stage must always pass the video
        q = example["qra"]
        k = self.cfg.k
        right = set(random.Random(example["seed"]).sample(range(k), int(self.correct.get(q["qra_id"], self.default))))
        think = f"<think>I looked at {frames.shape[0]} frames of the video.</think>"
        wrong = self._wrong_letters(q, think) if q["problem_type"] == "multiple_choice" else []
        out = []
        for i in range(k):
            if i in right:
                out.append(f"{think}<answer>{q['answer']}</answer>")
            elif wrong:
                out.append(f"{think}<answer>{wrong[i % len(wrong)]}</answer>")
            else:
                out.append(think)  # no answer block: scores 0 whatever the type
        return out

    def _wrong_letters(self, q: dict, think: str) -> list[str]:
        """Option letters that the reward library scores below 1 for this question (the answer may be stored as
        a letter or as an option's text, so "wrong" is decided by the scorer, not by comparing strings)."""
        letters = OPTION_LETTERS[:len(q.get("options") or OPTION_LETTERS)]
        return [x for x in letters
                if score(f"{think}<answer>{x}</answer>", q["problem_type"], q["answer"], q.get("options"),
                         **self.cfg.reward_params).accuracy < 1.0]
