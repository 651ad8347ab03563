"""torchrun worker for tests/test_sp_rollouts.py (not collected by pytest: no test_ prefix).

Usage: torchrun --nproc_per_node 2 tests/sp_rollouts_worker.py MODEL_DIR INPUTS.safetensors OUT.json

Every rank samples the prompts' rollouts twice: alone (no group: every rollout, as one process does) and as an
SP group of the whole world (each rank its share of every prompt's rollouts, then all-gathered). Rank 0 writes
both, with the rows each rank really sampled.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longreel.trainer.policy import PromptInputs, encode_video  # noqa: E402
from longreel.trainer.rollout import SamplingConfig, TransformersEngine  # noqa: E402


def _record_rows(engine) -> list:
    """The ``rows`` sampled for each prompt of ``engine``'s ``generate_prepared_many`` calls."""
    rows: list = []
    inner = engine.engine.generate_prepared_many

    def record(inputs, *a, **k):
        rows.extend(list(k["rows"]) for _ in inputs)
        return inner(inputs, *a, **k)

    engine.engine.generate_prepared_many = record
    return rows


def main(model_dir: str, inputs: str, out: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model_dir)
    x = load_file(inputs)
    prompt = PromptInputs("p", x["input_ids"], torch.ones_like(x["input_ids"]), x["pixel_values_videos"],
                          x["video_grid_thw"], x["mm_token_type_ids"])
    with torch.no_grad():
        emb = encode_video(model, prompt)
    prompts, embeds, seeds = [prompt, prompt], [emb, emb], [11, 12]
    res = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    for label, sampling in (("sample", SamplingConfig(n=5, temperature=1.0, top_p=0.95, max_new_tokens=10)),
                            ("greedy", SamplingConfig(n=3, greedy=True, max_new_tokens=6))):
        # no group under torchrun (data-parallel ranks hold different prompts): every rollout sampled here
        solo = TransformersEngine(model, proc)
        solo_rows = _record_rows(solo)
        alone = solo.generate(prompts, sampling, seeds, video_embeds=embeds)
        split = TransformersEngine(model, proc, group=dist.group.WORLD)
        sampled = _record_rows(split)
        groups = split.generate(prompts, sampling, seeds, video_embeds=embeds)
        res[label] = {"alone": [g.response_ids.tolist() for g in alone],
                      "alone_texts": [g.texts for g in alone], "alone_finished": [g.finished.tolist() for g in alone],
                      "split": [g.response_ids.tolist() for g in groups],
                      "split_texts": [g.texts for g in groups], "split_finished": [g.finished.tolist() for g in groups],
                      "rows_sampled": sampled, "rows_sampled_without_group": solo_rows}
    allres: list = [None] * dist.get_world_size()
    dist.all_gather_object(allres, res)
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(allres, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
