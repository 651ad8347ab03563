"""Rollouts with one copy of the prompt's K/V and per-rollout seeds (longreel.engines.shared_prefix), and a
group's rollouts split over the ranks of an SP group (2 gloo ranks): the same samples as one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.engines.base import Sampling  # noqa: E402
from longreel.engines.shared_prefix import rollout_row_seed, supports_shared_decode  # noqa: E402
from longreel.trainer.policy import PromptInputs, encode_video, sequence_logprobs  # noqa: E402
from longreel.trainer.rollout import SamplingConfig, TransformersEngine, pad_responses  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "sp_rollouts_worker.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, shared_videos):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from conftest import vtest_prompt

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2vl(tmp_path_factory.mktemp("sprollouts") / "tiny", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model_dir)
    prompt = vtest_prompt(proc, shared_videos)
    return model_dir, model, proc, prompt


def _prepared(model, proc, prompt, sampling: Sampling, rows=None, share=True):
    engine = TransformersEngine(model, proc, share_prompt=share)
    with torch.no_grad():
        emb = encode_video(model, prompt)
    return engine, engine.engine.generate_prepared(engine._inputs(prompt, emb), sampling, share_prompt=share,
                                                   eos_ids=engine.eos, pad_id=engine.pad_id,
                                                   suppress_tokens=engine.suppress, rows=rows)


def _decode_vs_trainer_logprobs(model, engine, prompt, c) -> float:
    """Largest gap between the log-probs the decode reported for completion ``c`` and the trainer's log-prob pass
    over the same responses."""
    ids, mask = pad_responses(c.token_ids, engine.pad_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, prompt, ids, mask)
    beh = torch.zeros_like(lp)
    for i, row in enumerate(c.logprobs):
        beh[i, :len(row)] = torch.tensor(row)
    return float(((lp - beh) * mask).abs().max())


def test_row_seeds_depend_on_seed_and_row_only():
    assert rollout_row_seed(3, 1) == rollout_row_seed(3, 1)
    seeds = {rollout_row_seed(s, r) for s in range(4) for r in range(8)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 for s in seeds)


def test_decode_keeps_one_prompt_copy_and_matches_the_trainers_logprobs(tiny):
    """The shared decoder runs the text model's forward once, on the one prompt (batch 1); every later step is
    its own layer loop over that one K/V copy. The log-probs it reports for the sampled tokens equal the
    trainer's log-prob pass over the same responses (fp32, 1e-5), so the decode's attention and positions are
    the model's."""
    _, model, proc, prompt = tiny
    assert supports_shared_decode(model)
    shapes = []
    lm = model.model.language_model
    handle = lm.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["inputs_embeds"].shape[:2])),
                                          with_kwargs=True)
    try:
        engine, c = _prepared(model, proc, prompt, Sampling(max_new_tokens=12, n=6, seed=7, temperature=1.0,
                                                            top_p=0.9, top_k=0))
    finally:
        handle.remove()
    assert shapes == [(1, prompt.length)]
    assert sum(len(row) for row in c.token_ids) > 6  # more than one token per row was decoded
    assert _decode_vs_trainer_logprobs(model, engine, prompt, c) <= 1e-5


def test_shared_decode_samples_what_generate_samples(tiny):
    """Same per-rollout seeds through transformers ``generate`` (each row's prompt prefilled by generate, no
    shared K/V): the same tokens."""
    _, model, proc, prompt = tiny
    s = Sampling(max_new_tokens=10, n=5, seed=3, temperature=1.0, top_p=1.0, top_k=0)
    _, shared = _prepared(model, proc, prompt, s)
    _, plain = _prepared(model, proc, prompt, s, share=False)
    assert shared.token_ids == plain.token_ids and shared.texts == plain.texts and shared.finish == plain.finish
    assert len({tuple(t) for t in shared.token_ids}) == 5  # the rows' seeds differ


def test_any_subset_of_rows_samples_the_same_rollouts(tiny):
    _, model, proc, prompt = tiny
    s = Sampling(max_new_tokens=10, n=6, seed=5, temperature=1.0, top_p=0.95, top_k=0)
    _, full = _prepared(model, proc, prompt, s)
    _, low = _prepared(model, proc, prompt, s, rows=[0, 1, 2])
    _, high = _prepared(model, proc, prompt, s, rows=[3, 4, 5])
    _, one = _prepared(model, proc, prompt, s, rows=[4])
    assert low.token_ids + high.token_ids == full.token_ids
    assert one.token_ids == [full.token_ids[4]]


def _longer(prompt: PromptInputs, extra: int) -> PromptInputs:
    """``prompt`` with ``extra`` more text tokens in front (a prompt of another length, same video)."""
    head = prompt.input_ids[:, :1].expand(1, extra)
    types = prompt.mm_token_type_ids
    if types is not None:
        types = torch.cat([torch.zeros_like(types[:, :1]).expand(1, extra), types], 1)
    return PromptInputs(f"{prompt.key}+{extra}", torch.cat([head, prompt.input_ids], 1),
                        torch.ones(1, prompt.input_ids.shape[1] + extra, dtype=prompt.attention_mask.dtype),
                        prompt.pixel_values_videos, prompt.video_grid_thw, types)


def test_prompts_decoded_together_sample_what_each_samples_alone(tiny):
    """Three prompts of two lengths (the shorter's K/V padded and masked) decoded in one batch, in batches of two,
    and one at a time: the same tokens, and log-probs within fp32 rounding of each other and of the trainer's
    log-prob pass (so the padding gets no attention and each row keeps its own prompt's positions)."""
    _, model, proc, prompt = tiny
    prompts = [prompt, _longer(prompt, 5), prompt]
    engine = TransformersEngine(model, proc)
    with torch.no_grad():
        emb = encode_video(model, prompt)
    inputs = [engine._inputs(p, emb) for p in prompts]
    samplings = [Sampling(max_new_tokens=10, n=4, seed=seed, temperature=1.0, top_p=0.95, top_k=0)
                 for seed in (1, 2, 3)]
    kw = dict(eos_ids=engine.eos, pad_id=engine.pad_id, suppress_tokens=engine.suppress)
    batches: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: batches.append(int(a[0].shape[0])))
    try:
        together = engine.engine.generate_prepared_many(inputs, samplings, **kw)
    finally:
        hook.remove()
    assert 12 in batches  # the decode steps ran the three prompts' 4 rows each as one batch
    pairs = engine.engine.generate_prepared_many(inputs, samplings, prompts_per_decode=2, **kw)
    alone = [engine.engine.generate_prepared(x, s, **kw) for x, s in zip(inputs, samplings)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone] == [c.token_ids for c in pairs]
    assert together[0].token_ids != together[2].token_ids  # the seeds, not the prompt, set the samples
    for c, a, p in zip(together, alone, prompts):
        assert max(abs(x - y) for r, q in zip(c.logprobs, a.logprobs) for x, y in zip(r, q)) <= 1e-5
        assert _decode_vs_trainer_logprobs(model, engine, p, c) <= 1e-5


@pytest.fixture(scope="module")
def dist_results(tiny, tmp_path_factory):
    from safetensors.torch import save_file

    model_dir, _, _, prompt = tiny
    tmp = tmp_path_factory.mktemp("sprollouts_dist")
    save_file({"input_ids": prompt.input_ids.contiguous(), "pixel_values_videos": prompt.pixel_values_videos,
               "video_grid_thw": prompt.video_grid_thw, "mm_token_type_ids": prompt.mm_token_type_ids.contiguous()},
              str(tmp / "inputs.safetensors"))
    out = tmp / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), model_dir, str(tmp / "inputs.safetensors"), str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("label", ["sample", "greedy"])
def test_sp_group_splits_rollouts_and_gathers_one_process_samples(dist_results, label):
    n = 5 if label == "sample" else 3
    per = -(-n // 2)
    assert [r["rank"] for r in dist_results] == [0, 1]
    for r in dist_results:
        x = r[label]
        # each rank sampled only its contiguous share of every prompt's rollouts...
        lo = r["rank"] * per
        assert x["rows_sampled"] == [list(range(lo, min(n, lo + per)))] * 2
        assert x["rows_sampled_without_group"] == [list(range(n))] * 2  # no SP group: no split
        # ...and after the gather holds every rollout, equal to what one process samples alone
        assert x["split"] == x["alone"] and x["split_texts"] == x["alone_texts"]
        assert x["split_finished"] == x["alone_finished"]
        assert all(len(g) == n for g in x["split"])
    assert dist_results[0]["sample"]["split"] == dist_results[1]["sample"]["split"]
    assert dist_results[0]["sample"]["split"][0] != dist_results[0]["sample"]["split"][1]  # per-prompt seeds
