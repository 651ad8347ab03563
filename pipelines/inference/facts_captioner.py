"""The weight-free ``facts`` captioner: the clip facts and time span rendered into a plain sentence.

No model and no vision: it reads ``request.meta["facts"]`` (a ``clip_facts`` row) and renders the
``caption_facts`` prompt template. It is the embedded default on CPU so that the demo yields
real, if plain, captions; its provenance says what it is (backend ``facts``, model
``longreel-facts-captioner``, revision = the facts rules version, prompt hash = the template's).
"""
from __future__ import annotations

import time

from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request
from longreel.pipelines.media.facts import FACTS_VERSION
from longreel.pipelines.prompts import load_template

MODEL_NAME = "longreel-facts-captioner"
TEMPLATE = "caption_facts"


class FactsCaptioner:
    def __init__(self, template: str = TEMPLATE):
        self.template, self.prompt_hash = load_template(template)
        self.info = ModelInfo("facts", MODEL_NAME, FACTS_VERSION)

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        out = []
        for r in requests:
            t0 = time.monotonic()
            f = r.meta["facts"]
            text = self.template.render(start_s=f["start_s"], end_s=f["end_s"], motion=f["motion"],
                                        black_ratio=f["black_ratio"], brightness=f["brightness"],
                                        n_cuts=f["n_cuts"], dominant_color=f.get("dominant_color") or "mixed",
                                        n_frames=len(f["frame_timestamps"])).strip()
            out.append(Generation(text=text, latency_s=time.monotonic() - t0, finish_reason="stop"))
        return out

    def close(self) -> None:
        pass
