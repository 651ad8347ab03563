"""MR-SP benchmark: GRPO-step-like time without / with embedding reuse / with reuse + sequence parallelism, peak
prefill memory per rank (1 rank vs 2 ranks), and the length where the SP prefill starts paying off.

    python benchmarks/mrsp.py                       # writes benchmarks/results/mrsp.json
    python benchmarks/mrsp.py --quick --out /tmp/mrsp.json   # a few minutes: 1 repeat, 2 sweep points

Model: the offline tiny Qwen2-VL tokenizer/processor (longreel.testing.tiny_model) with a benchmark-sized random model:
text 4 layers / hidden 128 (8 heads, 4 KV heads), vision tower depth 4 / width 128 (4 heads). Video: frames of
``moviepy__bbb_full.mp4`` (``longreel.testing.sample_videos``: ../shared/videos, else fetched from moviepy's sdist;
real frames, processor-resized). Every process runs with one torch thread, so "2 ranks" means twice the cores of
"1 rank".

GRPO-step-like time = rollout prefill of the G prompts + old-policy log-probs + reference log-probs + the
update's forward/backward (vision tower trained in every variant), in one process (1 rank) or two.

Two text paths, measured separately (``text_path`` in the JSON):

* ``shared_prefix`` (primary; what the trainer runs): the G sequences of a group share one prompt, so every
  log-prob pass runs the prompt (video + question) once and only the G responses on top of its K/V cache
  (``share_prompt``), and the rollout prefill runs the prompt once (minus its last token), repeats its cache to
  G rows and runs the last token for the G rows (what ``generate_shared_prefix`` does before decoding). Every
  variant, the baseline included, uses it, so the stage-1 ratio isolates embedding reuse:

  * ``no_reuse_per_request`` (the baseline the issue names: "not G+2 times"): each of the G rollout requests
    encodes the video and prefills its own prompt, each log-prob pass (old, ref, update) encodes it once: G + 3
    vision-tower passes per step;
  * ``no_reuse_per_pass`` (a stronger baseline): as above, but the G rollouts are one request sharing one prompt
    prefill: 4 vision-tower passes per step (``policy.sequence_logprobs`` with no embeddings);
  * ``reuse`` (stage 1): StepEmbedCache(vision="deferred"): the policy encodes once, the reference (a separate
    model) once: 2 passes, gradients still reach the tower;
  * ``reuse_frozen``: stage 1 with a frozen vision tower shared by policy and reference: 1 pass;
  * (``--step-only``) ``no_reuse_per_pass_frozen``: the shared-prefill baseline with the tower frozen (the
    like-for-like baseline of ``reuse_frozen``); ``*_store_cold`` / ``*_store_steady``: a frozen tower's features
    (the reference's; the policy's when frozen) through the cross-step store ``frozen_cache.FrozenFeatureCache`` on a
    video's first sight / when it recurs (``reuse_dir_steady``: from the feature directory,
    ``feature_dir.FeatureDir``, instead of memory); ``*_store_prefix_*``: also the reference's video-prefix K/V through
    ``ref_prefix.PrefixKVStore``. Steady-state stores live across the role's steps and are filled by the warm-up;
    cold ones are new every step;
  * ``reuse_2ranks`` (2 gloo ranks): vision frames sharded across the ranks, rollouts split over the ranks
    (each rank prefills the prompt once for its rows), old/ref/update rows split over the ranks (each rank
    shares the prompt over its rows; sequence parallelism off);
  * ``reuse_sp2`` (stage 1+2, 2 gloo ranks): as ``reuse_2ranks``, but old/ref/update log-probs with the
    prompt sequence-parallel, run once, and the rows split (``sp_shared_prompt_logprobs``).

* ``per_sequence`` (secondary, the text path before the shared prefix): every pass runs G full sequences and
  every rollout request prefills its own prompt (G prefills); variants as before:

  * ``no_reuse_per_sequence``: every sequence carries its video's pixels in every pass: 4G tower passes;
  * ``no_reuse_per_pass``: each rollout request encodes, each log-prob pass encodes once: G + 3 passes;
  * ``reuse`` / ``reuse_frozen``: as above; ``reuse_sp2``: 2 ranks, old/ref/update sequence-parallel.

  By default only ``no_reuse_per_pass`` and ``reuse`` with one repeat (``--per-sequence-variants``,
  ``--per-sequence-repeats``): that path is ~4x slower and only there to show what the shared prefix changed.

Ceiling (``--step-only``): the policy's tower alone on the same video (role ``tower``: a forward without grad, a
forward keeping its graph, the backward), turned by :func:`tower_ceilings` into the stage-1 ratio a step would show
if the language model cost nothing. With the tower trained and one update micro-batch, the baseline's tower work is
3F + Fg + B and stage 1's F + Fg + B: when the backward costs about twice a forward the ceiling is about 1.5,
whatever the text model costs. With ``--grad-accum k`` the baseline encodes (and backpropagates through the tower)
in each of the k micro-batches, 3F + k(Fg + B), while stage 1 still does F + Fg + B: about 2.25 at k = 2.

Memory: peak resident memory of the prefill (forward + backward of one sequence's log-probs, video features
precomputed) measured per rank as VmHWM - VmRSS, after resetting VmHWM through /proc/self/clear_refs, one
fresh process (or torchrun pair) per point. The same runs time the prefill: the crossover is the first length at
which the 2-rank SP prefill of one sequence beats the 1-rank prefill of it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VIDEO = "moviepy__bbb_full.mp4"


# ---------------------------------------------------------------------------------------------- set-up
def build_model(work: Path) -> str:
    """The tiny tokenizer/processor + a benchmark-sized random Qwen2-VL (built offline, seed 0)."""
    import torch
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    base = build_tiny_qwen2vl(work / "tiny", seed=0, hidden_size=128, num_layers=4, vision_depth=4)
    cfg = AutoConfig.from_pretrained(base)
    cfg.vision_config.embed_dim = 128
    cfg.vision_config.num_heads = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32).eval()
    out = work / "model"
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(base).save_pretrained(out)
    return str(out)


def prepare_inputs(model_dir: str, frames: int, path: Path) -> dict:
    """Processor outputs for ``frames`` frames of the video (first 2 s per 16 frames), saved as safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    from longreel.testing.sample_videos import ensure_videos
    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    proc = AutoProcessor.from_pretrained(model_dir)
    dec = decode_frames(str(ensure_videos([VIDEO]) / VIDEO), sample_timestamps(30.0, 30.0 + frames / 8.0, frames))
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                               "text": "What does the rabbit do after the butterfly "
                                                                       "lands? Think step by step."}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = {"fps": dec.fps, "frames_indices": dec.indices, "total_num_frames": len(dec.indices)}
    enc = proc(text=[text], videos=[torch.from_numpy(dec.frames)], video_metadata=[meta], do_sample_frames=False,
               return_tensors="pt")
    keep = ("input_ids", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids")
    save_file({k: enc[k].contiguous() for k in keep}, str(path))
    return {"frames": frames, "prompt_tokens": int(enc["input_ids"].shape[1]),
            "video_tokens": int(enc["video_grid_thw"].prod()) // 4, "patches": int(enc["video_grid_thw"].prod()),
            "grid": enc["video_grid_thw"].tolist()[0]}


def load(model_dir: str, inputs: str):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return model, load_file(inputs)


def responses(g: int, t: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 300, (g, t), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(g):  # a spread of lengths, right-padded
        mask[i, t - (i * t) // (2 * g):] = 0
    adv = torch.randn(g, 1, generator=gen)
    return ids, mask, adv


def rss_kb() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status", encoding="ascii"))
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def reset_peak() -> int:
    """Return freed heap memory to the OS (glibc ``malloc_trim``), reset VmHWM, return the current RSS (kB).

    The memory processes also run with a fixed ``MALLOC_MMAP_THRESHOLD_`` so that large tensors are mmapped
    and unmapped on free instead of staying resident in the heap (which would hide a second run's peak)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
    return rss_kb()[0]


# -------------------------------------------------------------------------------------- GRPO-step variants
def _plain_logprobs(model, x, resp, mask, *, per_sequence: bool):
    """No reuse: the model encodes pixels itself (once per sequence, or once for the pass) and ropes itself."""
    import torch

    from longreel.trainer.mrsp.embed_cache import encode_video_features
    from longreel.trainer.mrsp.reuse import mm_encoder_outputs, token_logprobs

    n, t = resp.shape
    prompt = x["input_ids"]
    ids = torch.cat([prompt.expand(n, -1), resp], dim=1)
    attn = torch.cat([torch.ones_like(prompt).expand(n, -1), mask], dim=1)
    mmt = torch.cat([x["mm_token_type_ids"].expand(n, -1), torch.zeros_like(resp)], dim=1)
    grid = x["video_grid_thw"].repeat(n, 1)
    if per_sequence:
        out = model(input_ids=ids, attention_mask=attn, pixel_values_videos=x["pixel_values_videos"].repeat(n, 1),
                    video_grid_thw=grid, mm_token_type_ids=mmt, logits_to_keep=t + 1, use_cache=False)
    else:
        feats = encode_video_features(model, x["pixel_values_videos"], x["video_grid_thw"])
        out = model(input_ids=ids, attention_mask=attn, mm_encoder_outputs=mm_encoder_outputs(feats, n),
                    video_grid_thw=grid, mm_token_type_ids=mmt, logits_to_keep=t + 1, use_cache=False)
    return token_logprobs(out.logits[:, :-1], resp)


def _loss(lp, old, mask, adv, denominator=None):
    import torch

    ratio = torch.exp(lp - old)
    denominator = mask.sum() if denominator is None else denominator
    return -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * mask).sum() / denominator


def _rollout_prefill(model, **prompt_kw):
    """Rollout prefill of one prompt for its rollouts, as ``shared_prefix.sample_shared_prefix`` runs it: the
    whole prompt once (batch 1); every row's first token is drawn from the last position's logits and the decode
    steps attend to this one K/V copy (nothing repeated per row). Returns the model output (logits + cache)."""
    return model(**prompt_kw, use_cache=True, logits_to_keep=1)


def _rows_on_prompt_state(model, out, prompt_len: int, resp, mask, pos, rows=None):
    """Log-probs ``[n, T]`` of responses ``rows`` teacher-forced on a kept prompt state (``out``: the rollout
    prefill's output, its one K/V copy expanded by views): what the decode computes for its own tokens (the MR-SP
    trainer takes them from the decode as the old log-probs; here the responses are fixed, so they are run)."""
    import torch
    from transformers import DynamicCache

    from longreel.engines.kv_cache import cache_kwargs, output_cache
    from longreel.trainer.mrsp.reuse import token_logprobs

    if rows is not None:
        resp, mask = resp[rows], mask[rows]
    n, t = resp.shape
    first = out.logits[:, -1:].expand(n, -1, -1)
    cache = DynamicCache()
    for i, layer in enumerate(output_cache(out).layers):
        cache.update(layer.keys.expand(n, -1, -1, -1), layer.values.expand(n, -1, -1, -1), i)
    attn = torch.cat([mask.new_ones(n, prompt_len), mask[:, :-1]], dim=1)
    rest = model(input_ids=resp[:, :-1], attention_mask=attn, position_ids=pos.with_responses(n, t)[
        :, :, prompt_len:prompt_len + t - 1], use_cache=True, **cache_kwargs(cache)).logits
    return token_logprobs(torch.cat([first, rest], dim=1), resp)


def _prompt_inputs(x):
    import torch

    from longreel.trainer.policy import PromptInputs

    ids = x["input_ids"]
    return PromptInputs("bench", ids, torch.ones_like(ids), x["pixel_values_videos"], x["video_grid_thw"],
                        x["mm_token_type_ids"])


def _clock() -> tuple[float, float]:
    """(wall, CPU seconds of this process): every process runs one torch thread, so its CPU time is what it
    computed, far less sensitive than wall time to other processes sharing the cores."""
    return time.perf_counter(), time.process_time()


def _phases(*t) -> dict:
    names = ("rollout_prefill", "old_logp", "ref_logp", "update")
    out = {n: t[i + 1][0] - t[i][0] for i, n in enumerate(names)}
    out |= {f"cpu_{n}": t[i + 1][1] - t[i][1] for i, n in enumerate(names)}
    return out


def _micro_batches(g: int, grad_accum: int) -> list[slice]:
    size = -(-g // max(1, grad_accum))
    return [slice(a, min(g, a + size)) for a in range(0, g, size)]


def step_no_reuse(model, ref, x, resp, mask, adv, *, per_sequence: bool, text: str = "per_sequence",
                  rollout_per_request: bool = False, grad_accum: int = 1) -> dict:
    """No embedding reuse. ``rollout_per_request``: the G rollouts are G requests, each encoding the video and
    prefilling its prompt (nothing is shared between them), as with the pixels expanded G times by
    ``generate(num_return_sequences=G)``; otherwise (shared prefix) one request per group."""
    import torch

    from longreel.trainer.positions import prompt_positions
    from longreel.trainer.policy import sequence_logprobs

    g = resp.shape[0]
    ids, mmt = x["input_ids"], x["mm_token_type_ids"]
    shared = text == "shared_prefix"
    prompt = _prompt_inputs(x)
    t0 = _clock()
    with torch.no_grad():
        if shared and not rollout_per_request:  # one request per group: encode and ropes once, prefill once
            _rollout_prefill(model, input_ids=ids, pixel_values_videos=x["pixel_values_videos"],
                             video_grid_thw=x["video_grid_thw"], mm_token_type_ids=mmt)
        else:
            for _ in range(g):  # each rollout request prefills its prompt with its video
                model(input_ids=ids, pixel_values_videos=x["pixel_values_videos"], video_grid_thw=x["video_grid_thw"],
                      mm_token_type_ids=mmt, use_cache=True, logits_to_keep=1)
        t1 = _clock()
        if shared:
            old = sequence_logprobs(model, prompt, resp, mask)
        else:
            old = _plain_logprobs(model, x, resp, mask, per_sequence=per_sequence)
        t2 = _clock()
        if shared:
            sequence_logprobs(ref, prompt, resp, mask)
        else:
            _plain_logprobs(ref, x, resp, mask, per_sequence=per_sequence)
        t3 = _clock()
    for rows in _micro_batches(g, grad_accum):  # each micro-batch encodes and runs its prompt again
        if shared:
            lp = sequence_logprobs(model, prompt, resp[rows], mask[rows])
        else:
            lp = _plain_logprobs(model, x, resp[rows], mask[rows], per_sequence=per_sequence)
        _loss(lp, old[rows], mask[rows], adv[rows], mask.sum()).backward()
    t4 = _clock()
    return _phases(t0, t1, t2, t3, t4)


def step_reuse(model, ref, x, resp, mask, adv, *, vision: str, group=None, sp_min_tokens: int | None = None,
               text: str = "per_sequence", grad_accum: int = 1, store=None, prefix_store=None) -> dict:
    """Stage 1 (one process) or with a ``group`` of 2 (sharded vision, rollouts split, log-prob rows split or
    sequence-parallel above ``sp_min_tokens``). Shared-prefix text path: the old log-probs come from the rollout's
    kept prompt state (the trainer takes them from the decode), and in one process the update runs the prompt
    once with grad for all its micro-batches (``reuse.PromptGraph``). ``store``: a cross-step
    ``frozen_cache.FrozenFeatureCache`` (as the trainer's ``mrsp.frozen_cache_mb``) for the reference's features
    (tower trained) or the frozen policy tower's (``vision="frozen"``); its digest and lookup are timed in the
    phase that asks for the features. ``prefix_store``: a ``ref_prefix.PrefixKVStore`` (one process) for the
    reference's video-prefix K/V (``mrsp.ref_prefix_cache_mb``)."""
    import torch

    from longreel.trainer.mrsp.dist_ops import allreduce_grads_, gather_seq, world
    from longreel.trainer.mrsp.embed_cache import StepEmbedCache
    from longreel.trainer.mrsp.frozen_cache import pixel_digest
    from longreel.trainer.mrsp.reuse import PromptGraph, build_inputs_embeds
    from longreel.trainer.mrsp.sp_prefill import _split, prefill_logprobs
    from longreel.trainer.mrsp.vision_shard import make_sharded_encoder

    rank, size = world(group)
    enc = make_sharded_encoder(model, group=group) if size > 1 else None
    shared_ref = vision == "frozen"  # a frozen tower is the reference's tower too
    if shared_ref and store is not None:  # the frozen policy tower's features from the cross-step store
        enc = store.encode
    cache = StepEmbedCache(model, vision=vision, encoder=enc)
    if shared_ref:
        ref_cache = cache
    elif store is not None:  # the reference's features from the cross-step store
        ref_cache = store
    else:
        ref_cache = StepEmbedCache(ref, vision="frozen",
                                   encoder=make_sharded_encoder(ref, group=group) if size > 1 else None)
    g = resp.shape[0]
    prompt, pv, grid = x["input_ids"], x["pixel_values_videos"], x["video_grid_thw"]
    sp = sp_min_tokens if sp_min_tokens is not None else 1 << 60
    share = text == "shared_prefix"
    kw = dict(group=group, sp_min_tokens=sp, share_prompt=share)
    sizes = _split(g, size)  # the rollouts split over the ranks, contiguous (as the trainer's engine does)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    t0 = _clock()
    cache.begin_step()
    ref_cache.begin_step()
    with torch.no_grad():
        feats = cache.features("video", pv, grid)
        pos = cache.positions("prompt", prompt, grid, x["mm_token_type_ids"])
        embeds = build_inputs_embeds(model, prompt, feats)
        state = None
        if share and sizes[rank]:
            state = _rollout_prefill(model, inputs_embeds=embeds, position_ids=pos.prompt)
        elif not share:
            for _ in range(sizes[rank]):  # rollout prefill from cached features + positions
                model(inputs_embeds=embeds, position_ids=pos.prompt, use_cache=True, logits_to_keep=1)
        t1 = _clock()
        if share and (size == 1 or sp >= 1 << 60):  # this rank's rollouts' log-probs from its prompt state
            lp_mine = (_rows_on_prompt_state(model, state, prompt.shape[1], resp, mask, pos, mine) if state
                       is not None else feats.new_zeros(0, resp.shape[1]))
            old = gather_seq(lp_mine, dim=0, group=group, sizes=sizes) if size > 1 else lp_mine
        else:
            old = prefill_logprobs(model, prompt, resp, mask, features=feats, positions=pos, **kw)
        del state
        t2 = _clock()
        ref_feats = ref_cache.features("video", pv, grid)
        if prefix_store is not None:
            cid = (ref_cache.content_id("video", pv, grid) if hasattr(ref_cache, "content_id")
                   else pixel_digest(pv, grid))
            prefix_store.logprobs(cid, prompt, resp, mask, features=ref_feats, positions=pos)
        else:
            prefill_logprobs(ref, prompt, resp, mask, features=ref_feats, positions=pos, **kw)
        t3 = _clock()
    batches = _micro_batches(g, grad_accum) if size == 1 else [slice(0, g)]
    graph = (PromptGraph(model, prompt, cache.update_features("video"), pos)
             if share and size == 1 and len(batches) > 1 else None)
    for rows in batches:
        if graph is not None:
            lp = graph.logprobs(model, resp[rows], mask[rows])
        else:
            lp = prefill_logprobs(model, prompt, resp[rows], mask[rows], features=cache.update_features("video"),
                                  positions=pos, **kw)
        _loss(lp, old[rows], mask[rows], adv[rows], mask.sum()).backward()
    if graph is not None:
        graph.backward()
    cache.backward_vision()
    if size > 1:
        allreduce_grads_(model.parameters(), group)
    t4 = _clock()
    return _phases(t0, t1, t2, t3, t4)


def role_step(args) -> None:
    """One process: every 1-rank variant, ``repeats`` times each, interleaved; medians to JSON."""
    import copy

    import torch

    from longreel.trainer.mrsp.embed_cache import VisionCallCounter

    model, x = load(args.model, args.inputs)
    ref = copy.deepcopy(model).requires_grad_(False)
    resp, mask, adv = responses(args.G, args.resp)
    video_patches = int(x["video_grid_thw"].prod())
    text = args.text
    from longreel.trainer.mrsp.feature_dir import FeatureDir, tower_digest
    from longreel.trainer.mrsp.frozen_cache import FrozenFeatureCache
    from longreel.trainer.mrsp.ref_prefix import PrefixKVStore

    budget = 1 << 30  # far above one video's features or prefix K/V: the stores never evict here
    steady_ref = FrozenFeatureCache(ref, max_bytes=budget)       # these live across the steps: filled by the
    steady_frozen = FrozenFeatureCache(model, max_bytes=budget)  # warm-up round, every measured step is a hit
    steady_ref2 = FrozenFeatureCache(ref, max_bytes=budget)
    steady_frozen2 = FrozenFeatureCache(model, max_bytes=budget)
    steady_prefix = PrefixKVStore(ref, max_bytes=budget)
    steady_prefix_frozen = PrefixKVStore(ref, max_bytes=budget)
    # the reference's features on disk only (no memory store): filled by the warm-up, read in every measured step
    dir_ref = FrozenFeatureCache(ref, max_bytes=0, directory=FeatureDir(Path(args.out).parent / "features",
                                                                        tower_digest(ref)))
    every = {
        "no_reuse_per_sequence": lambda r, m, a: step_no_reuse(model, ref, x, r, m, a, per_sequence=True,
                                                               text=text),
        "no_reuse_per_pass": lambda r, m, a: step_no_reuse(model, ref, x, r, m, a, per_sequence=False, text=text,
                                                           grad_accum=args.grad_accum),
        "no_reuse_per_pass_frozen": lambda r, m, a: step_no_reuse(model, ref, x, r, m, a, per_sequence=False,
                                                                  text=text, grad_accum=args.grad_accum),
        # cold: a new store every step (the video's first sight: digest + encode + store)
        "reuse_store_cold": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="deferred", text=text,
                                                       grad_accum=args.grad_accum,
                                                       store=FrozenFeatureCache(ref, max_bytes=budget)),
        # steady state: the video recurs, its reference features are in the store (digest + lookup)
        "reuse_store_steady": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="deferred", text=text,
                                                         grad_accum=args.grad_accum, store=steady_ref),
        # the same from the feature directory (mrsp.frozen_feature_dir): a safetensors read instead of a lookup
        "reuse_dir_steady": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="deferred", text=text,
                                                       grad_accum=args.grad_accum, store=dir_ref),
        # + the reference's video-prefix K/V store: cold (a new one: prefix computed and stored) and steady
        "reuse_store_prefix_cold": lambda r, m, a: step_reuse(
            model, ref, x, r, m, a, vision="deferred", text=text, grad_accum=args.grad_accum,
            store=FrozenFeatureCache(ref, max_bytes=budget), prefix_store=PrefixKVStore(ref, max_bytes=budget)),
        "reuse_store_prefix_steady": lambda r, m, a: step_reuse(
            model, ref, x, r, m, a, vision="deferred", text=text, grad_accum=args.grad_accum, store=steady_ref2,
            prefix_store=steady_prefix),
        "reuse_frozen_store_prefix_steady": lambda r, m, a: step_reuse(
            model, ref, x, r, m, a, vision="frozen", text=text, grad_accum=args.grad_accum, store=steady_frozen2,
            prefix_store=steady_prefix_frozen),
        "reuse_frozen_store_cold": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="frozen", text=text,
                                                              grad_accum=args.grad_accum,
                                                              store=FrozenFeatureCache(model, max_bytes=budget)),
        "reuse_frozen_store_steady": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="frozen", text=text,
                                                                grad_accum=args.grad_accum, store=steady_frozen),
        "no_reuse_per_request": lambda r, m, a: step_no_reuse(model, ref, x, r, m, a, per_sequence=False, text=text,
                                                              rollout_per_request=True, grad_accum=args.grad_accum),
        "reuse": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="deferred", text=text,
                                            grad_accum=args.grad_accum),
        "reuse_frozen": lambda r, m, a: step_reuse(model, ref, x, r, m, a, vision="frozen", text=text,
                                                   grad_accum=args.grad_accum),
    }
    variants = {k: every[k] for k in args.variants.split(",")}
    results: dict = {k: [] for k in variants}
    calls: dict = {}
    for rep in range(args.repeats + 1):  # the first round (2 rollouts only) warms up and is dropped
        batch = (resp, mask, adv) if rep else (resp[:2], mask[:2], adv[:2])
        for name, fn in variants.items():
            model.zero_grad(set_to_none=True)
            model.model.visual.requires_grad_("frozen" not in name)
            with VisionCallCounter(model) as cp, VisionCallCounter(ref) as cr:
                parts = fn(*batch)
            # videos through the tower = patches seen / patches of the video (a batched call counts each copy)
            calls[name] = {"tower_calls": cp.calls + cr.calls,
                           "videos_encoded": (cp.patches + cr.patches) // video_patches}
            parts["cpu_total"] = sum(v for k, v in parts.items() if k.startswith("cpu_"))
            parts["total"] = sum(v for k, v in parts.items() if not k.startswith("cpu_"))
            if rep:
                results[name].append(parts)
            print(f"[step {text}] rep {rep} {name}: {parts['total']:.2f}s", file=sys.stderr, flush=True)
    out = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} | calls[name]
           | {"totals_all_repeats": [round(r["total"], 3) for r in runs]}
           for name, runs in results.items()}
    Path(args.out).write_text(json.dumps(out, indent=1))
    del torch


def role_step_sp(args) -> None:
    import copy

    import torch
    import torch.distributed as dist

    from longreel.trainer.mrsp.embed_cache import VisionCallCounter

    dist.init_process_group("gloo")
    model, x = load(args.model, args.inputs)
    ref = copy.deepcopy(model).requires_grad_(False)
    resp, mask, adv = responses(args.G, args.resp)
    runs = []
    for rep in range(args.repeats + 1):  # the first round (2 rollouts only) warms up and is dropped
        batch = (resp, mask, adv) if rep else (resp[:2], mask[:2], adv[:2])
        model.zero_grad(set_to_none=True)
        dist.barrier()
        with VisionCallCounter(model) as cp, VisionCallCounter(ref) as cr:
            # per-sequence text: log-probs sequence-parallel (SP on from 0 tokens); shared prefix: rows split,
            # or with --sp-min-tokens 0 the prompt sequence-parallel once and the rows split
            sp_min = args.sp_min_tokens if args.sp_min_tokens >= 0 else (0 if args.text == "per_sequence" else None)
            parts = step_reuse(model, ref, x, *batch, vision="deferred", text=args.text, sp_min_tokens=sp_min)
        dist.barrier()
        parts["cpu_total"] = sum(v for k, v in parts.items() if k.startswith("cpu_"))
        parts["total"] = sum(v for k, v in parts.items() if not k.startswith("cpu_"))
        if rep:
            runs.append(parts)
        print(f"[step-2ranks {args.text}] rank {dist.get_rank()} rep {rep}: {parts['total']:.2f}s", file=sys.stderr,
              flush=True)
    # the step ends when the slowest rank ends: take the max over ranks of each median
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    allmed = [None] * dist.get_world_size()
    dist.all_gather_object(allmed, med)
    if dist.get_rank() == 0:
        out = {k: max(m[k] for m in allmed) for k in med}
        out["tower_calls_per_rank"] = cp.calls + cr.calls
        out["videos_encoded_per_rank"] = (cp.patches + cr.patches) / int(x["video_grid_thw"].prod())
        out["totals_all_repeats_rank0"] = [round(r["total"], 3) for r in runs]
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    del torch


def role_mem(args) -> None:
    """Peak memory + time of one sequence's log-prob prefill (forward + backward), 1 rank or SP over torchrun."""
    import torch
    import torch.distributed as dist

    from longreel.trainer.mrsp.dist_ops import allreduce_grads_, world
    from longreel.trainer.mrsp.embed_cache import encode_video_features
    from longreel.trainer.positions import prompt_positions
    from longreel.trainer.mrsp.sp_prefill import prefill_logprobs

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank, size = world()
    model, x = load(args.model, args.inputs)
    model.model.visual.requires_grad_(False)
    with torch.no_grad():
        feats = encode_video_features(model, x["pixel_values_videos"], x["video_grid_thw"])
    pos = prompt_positions(model, x["input_ids"], x["video_grid_thw"], x["mm_token_type_ids"])
    resp, mask, adv = responses(1, args.resp)
    del x["pixel_values_videos"]
    times, peaks = [], []
    for rep in range(2):  # the second run is the measured one (the first warms up allocator and kernels)
        model.zero_grad(set_to_none=True)
        if size > 1:
            dist.barrier()
        base = reset_peak()
        t0 = time.perf_counter()
        # one sequence: no prompt to share; the 1-rank point is the same single forward that SP splits
        lp = prefill_logprobs(model, x["input_ids"], resp, mask, features=feats, positions=pos, sp_min_tokens=0,
                              share_prompt=False)
        (lp * mask).sum().backward()
        t1 = time.perf_counter()
        peak = rss_kb()[1]
        if size > 1:
            allreduce_grads_(model.parameters())
        times.append(t1 - t0)
        peaks.append((peak - base) / 1024.0)
        del lp
    res = {"rank": rank, "world": size, "seconds": times[-1], "peak_mb": peaks[-1]}
    if size > 1:
        allres = [None] * size
        dist.all_gather_object(allres, res)
        if rank == 0:
            Path(args.out).write_text(json.dumps(allres))
        dist.barrier()
        dist.destroy_process_group()
    else:
        Path(args.out).write_text(json.dumps([res]))
    del torch


# ---------------------------------------------------------------------------- the tower's own share: a ceiling
def tower_ceilings(forward_s: float, forward_graph_s: float, backward_s: float, micro_batches: int = 1) -> dict:
    """Upper bounds on stage 1's step speed-up over the shared-prefill baseline from the vision tower's own costs:
    the ratio a step would show if the language model cost nothing. It bounds the measured ratio because the text
    passes gain less from reuse: of the baseline's ~6 prompt-length passes (rollout, old, reference, the update's
    forward and its backward counted as 2) stage 1 saves only the old pass's, ~1.2x.

    Tower work in one step on one video, F a forward without grad, Fg a forward that keeps its graph, B the backward
    through the tower:

    * baseline, tower trained: ``3F + k (Fg + B)`` (the rollout, old and reference passes each encode; each of
      the update's ``k = micro_batches`` micro-batches (``optim.grad_accum``) encodes with its graph and
      backpropagates, as a trainer without reuse runs the whole sequence per micro-batch);
    * stage 1, tower trained: ``F + Fg + B`` (the policy encodes once keeping its graph for every micro-batch, the
      reference once);
    * stage 1 with the reference's features from the cross-step store (a video seen before): ``Fg + B``;
    * tower frozen: baseline ``(3 + k) F``, stage 1 ``F`` (one pass serves policy and reference): ``3 + k``
      whatever F is.
    """
    if min(forward_s, forward_graph_s, backward_s) <= 0:
        raise ValueError(f"tower times must be positive, got {forward_s}, {forward_graph_s}, {backward_s}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    f, fg, b, k = forward_s, forward_graph_s, backward_s, micro_batches
    baseline = 3 * f + k * (fg + b)
    return {"tower_trained": round(baseline / (f + fg + b), 3),
            "tower_trained_reference_from_store": round(baseline / (fg + b), 3),
            "tower_frozen": float(3 + k)}


def role_tower(args) -> None:
    """The policy's vision tower alone on the step's video: a forward without grad, a forward keeping its graph,
    the backward through it; medians over ``repeats`` after one warm-up round, wall and CPU seconds."""
    import torch

    from longreel.trainer.mrsp.embed_cache import encode_video_features

    model, x = load(args.model, args.inputs)
    pv, grid = x["pixel_values_videos"], x["video_grid_thw"]
    runs = []
    for rep in range(args.repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = _clock()
        with torch.no_grad():
            encode_video_features(model, pv, grid)
        t1 = _clock()
        feats = encode_video_features(model, pv, grid)
        t2 = _clock()
        feats.backward(torch.ones_like(feats))  # the upstream gradient's values do not change the backward's cost
        t3 = _clock()
        if rep:
            runs.append({"forward_s": t1[0] - t0[0], "forward_graph_s": t2[0] - t1[0], "backward_s": t3[0] - t2[0],
                         "cpu_forward_s": t1[1] - t0[1], "cpu_forward_graph_s": t2[1] - t1[1],
                         "cpu_backward_s": t3[1] - t2[1]})
        del feats
    Path(args.out).write_text(json.dumps({k: statistics.median(r[k] for r in runs) for k in runs[0]}, indent=1))
    del torch


# ------------------------------------------------------------------------------------- --step-only report
STEP_ONLY_VARIANTS = ",".join([
    "no_reuse_per_request", "no_reuse_per_pass", "reuse", "reuse_store_cold", "reuse_store_steady", "reuse_dir_steady",
    "reuse_store_prefix_cold", "reuse_store_prefix_steady", "no_reuse_per_pass_frozen", "reuse_frozen",
    "reuse_frozen_store_cold", "reuse_frozen_store_steady", "reuse_frozen_store_prefix_steady"])

LONG_RL_NOTE = (
    "Long-RL (Chen et al., 'Scaling RL to Long Videos', arXiv 2507.07966; github.com/NVlabs/Long-RL) reports MR-SP "
    "up to 2.1x on long-video RL; the stage-1 figure the issue quotes (1.8x, 439 -> 245 s/step at 512 frames) is "
    "from the paper's efficiency comparison. Whether the vision tower was trained in that measurement is not stated "
    "in the paper or README text available here. Long-RL is built on EasyR1 (its README defers multi-node runs and "
    "checkpoint merging to EasyR1), whose actor config defaults freeze_vision_tower to false (per a derived "
    "project's notes; Long-RL's own examples/config.yaml was not available), and its example scripts (e.g. "
    "examples/new_supports/longvila_7b_video_grpo.sh, read in a fork) do not set it; but its 'cached video "
    "embeddings' feature (README, Supported Features: embeddings precomputed to a directory and read in training) "
    "is exact only with a frozen tower. Nor does the paper say which of our baselines its no-reuse run matches "
    "(per request or per pass). So the 1.8x is not established as a tower-trained, like-for-like figure.")


CEILING_NOTE = (
    "the stage-1 speed-up over the shared-prefill baseline if the language model cost nothing, from the tower's own "
    "forward (F, no grad), forward keeping its graph (Fg) and backward (B) on this video, measured in this run (role "
    "tower), k the update's micro-batches (config.grad_accum_1rank; the baseline re-encodes in each): tower trained "
    "(3F + k(Fg + B)) / (F + Fg + B); with the reference's features from the store (3F + k(Fg + B)) / (Fg + B); "
    "tower frozen (3 + k)F / F. The text passes gain less from reuse (at k = 1, of the baseline's ~6 prompt-length "
    "passes, counting the update's backward as 2, stage 1 saves only the old pass's: ~1.2x; each further "
    "micro-batch adds a prompt forward and backward to the baseline only), so they pull a measured ratio below its "
    "ceiling")


def step_only_result(steps: dict, args, step_inputs: dict, command: str, tower: dict) -> dict:
    """The --step-only JSON: stage 1 against the shared-prefill baseline both ways (tower trained: the baseline
    and every reuse variant train the policy's tower; tower frozen: none does), cold and steady state; ``tower``:
    :func:`role_tower`'s times, from which :func:`tower_ceilings` bounds what stage 1 can reach."""
    def r(a: str, b: str, key: str = "total") -> float:
        return round(steps[a][key] / steps[b][key], 3)

    base, base_f = "no_reuse_per_pass", "no_reuse_per_pass_frozen"

    def six(cold: str, steady: str, key: str) -> float:  # 6 questions on one video: 1 cold step, 5 steady
        return round(steps[base][key] / ((steps[cold][key] + 5 * steps[steady][key]) / 6), 3)

    def table(key: str) -> tuple[dict, dict]:
        trained = {f"{v}_vs_{base}": r(base, v, key) for v in (
            "reuse", "reuse_store_cold", "reuse_store_steady", "reuse_dir_steady", "reuse_store_prefix_cold",
            "reuse_store_prefix_steady")}
        trained["six_questions_per_video_store_vs_" + base] = six("reuse_store_cold", "reuse_store_steady", key)
        trained["six_questions_per_video_store_prefix_vs_" + base] = six("reuse_store_prefix_cold",
                                                                          "reuse_store_prefix_steady", key)
        frozen = {f"{v}_vs_{base_f}": r(base_f, v, key) for v in (
            "reuse_frozen", "reuse_frozen_store_cold", "reuse_frozen_store_steady", "reuse_frozen_store_prefix_steady")}
        return trained, frozen

    trained, frozen = table("total")
    trained_cpu, frozen_cpu = table("cpu_total")
    k = max(1, args.grad_accum)
    ceilings = {"wall": tower_ceilings(tower["forward_s"], tower["forward_graph_s"], tower["backward_s"], k),
                "cpu": tower_ceilings(tower["cpu_forward_s"], tower["cpu_forward_graph_s"], tower["cpu_backward_s"], k)}
    return {
        "benchmark": "mrsp (--step-only: the shared-prefix GRPO-step variants)",
        "command": command,
        "config": {"frames": args.frames, "G": args.G, "response_tokens": args.resp,
                   "grad_accum_1rank": args.grad_accum, "repeats": args.repeats, "video": VIDEO,
                   "step_inputs": step_inputs, "threads_per_process": 1,
                   "warm_up": "one round with 2 rollouts per variant, dropped (it fills the steady-state stores)",
                   "statistic": "median over repeats of each phase; total = median of the per-repeat totals "
                                "(2 ranks: max over ranks of each median)"},
        "variants": {
            "no_reuse_per_request": "tower trained; every rollout request and every pass encodes (G + 3)",
            "no_reuse_per_pass": "tower trained; the shared-prefill baseline: one rollout request per group, every "
                                 "pass (rollout, old, ref, update) encodes: 4 tower passes (3 + k with k update "
                                 "micro-batches: each encodes)",
            "reuse": "tower trained; MR-SP stage 1 with per-step caches: policy encodes once (graph kept for the "
                     "update), reference once: 2 passes",
            "reuse_store_cold": "as reuse, the reference's features through the cross-step store on a video's "
                                "first sight (pixel digest + encode + store): 2 passes",
            "reuse_store_steady": "as reuse, in a step where the video recurs: the reference's features come from "
                                  "the cross-step store (pixel digest + lookup): 1 pass",
            "reuse_dir_steady": "as reuse_store_steady, the reference's features read from the feature directory "
                                "(mrsp.frozen_feature_dir; pixel digest + safetensors read) instead of memory: 1 pass",
            "reuse_store_prefix_cold": "as reuse_store_cold, and the reference's prompt run as video prefix (K/V "
                                       "stored) + the rest, on a video's first sight: 2 passes",
            "reuse_store_prefix_steady": "as reuse_store_steady, and the reference's video-prefix K/V from the "
                                         "cross-step store (ref_prefix.PrefixKVStore): the reference runs only the "
                                         "question, the generation prompt and the responses: 1 pass",
            "reuse_frozen_store_prefix_steady": "as reuse_frozen_store_steady, and the reference's video-prefix K/V "
                                                "from the store: 0 passes",
            "no_reuse_per_pass_frozen": "tower frozen; the shared-prefill baseline: 4 tower passes (3 + k with k "
                                        "update micro-batches), no tower backward",
            "reuse_frozen": "tower frozen; stage 1: one pass serves policy and reference",
            "reuse_frozen_store_cold": "tower frozen; the policy's features through the cross-step store on first "
                                       "sight: 1 pass",
            "reuse_frozen_store_steady": "tower frozen; the video recurs, its features come from the store: "
                                         "0 passes",
            "reuse_2ranks / reuse_sp2": "tower trained; 2 gloo ranks (see the module docstring)"},
        "step_seconds": steps,
        "speedup": {
            "tower_trained": trained, "tower_frozen": frozen,
            "reuse_vs_no_reuse_per_request": r("no_reuse_per_request", "reuse"),
            "reuse_frozen_vs_no_reuse_per_pass_not_like_for_like": r(base, "reuse_frozen"),
            "reuse_2ranks_vs_no_reuse_per_pass": r(base, "reuse_2ranks"),
            "reuse_2ranks_vs_reuse": r("reuse", "reuse_2ranks"), "reuse_sp2_vs_reuse": r("reuse", "reuse_sp2")},
        "speedup_cpu_1rank": {"tower_trained": trained_cpu, "tower_frozen": frozen_cpu},
        "tower_alone": tower,
        "stage1_ceiling": ceilings | {"what": CEILING_NOTE},
        "six_questions_per_video": "derived, not measured: one cold step and five steady steps per video "
                                   "((cold + 5 steady) / 6), LongVideo-Reason's ~6 questions per video, when the "
                                   "store still holds the video at its later questions (store size vs. the "
                                   "sampler's reuse distance; with a shuffled sampler over thousands of videos a "
                                   "bounded store rarely does)",
        "targets": {f"{k}_ge_1_5{suffix}": v >= 1.5 for suffix, tables in (("", (trained, frozen)),
                                                                         ("_cpu", (trained_cpu, frozen_cpu)))
                    for t in tables for k, v in t.items()}
                   | {f"stage1_ceiling_tower_trained_ge_1_5_{k}": c["tower_trained"] >= 1.5
                      for k, c in ceilings.items()},
        "long_rl_note": LONG_RL_NOTE,
    }


# ------------------------------------------------------------------------------------------ orchestration
def _run(cmd: list[str], timeout: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), timeout=timeout, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "".join(
        line + "\n" for line in proc.stderr.splitlines() if line.startswith("[")))
    if proc.returncode:
        raise RuntimeError(f"{cmd[:6]}... failed with {proc.returncode}")


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="main", choices=["main", "step", "step_sp", "mem", "tower"])
    ap.add_argument("--model", default="")
    ap.add_argument("--inputs", default="")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "mrsp.json"))
    ap.add_argument("--frames", type=int, default=64, help="frames per video for the step timing")
    ap.add_argument("--G", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--resp", type=int, default=32, help="response tokens")
    ap.add_argument("--repeats", type=int, default=3, help="measured repeats per step variant (after a small warm-up)")
    ap.add_argument("--mem-frames", default="16,64,128,256,512", help="frame counts for the memory/crossover sweep")
    ap.add_argument("--budget-mb", type=float, default=256.0, help="per-rank prefill memory budget")
    ap.add_argument("--per-sequence-variants", default="no_reuse_per_pass,reuse",
                    help="variants also timed with the per-sequence text path (secondary figure; add "
                         "no_reuse_per_sequence, reuse_frozen, reuse_sp2 for the full old table; empty: none)")
    ap.add_argument("--per-sequence-repeats", type=int, default=1, help="measured repeats of the per-sequence path")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="update micro-batches per group in the 1-rank variants (the trainer's optim.grad_accum; "
                         "grpo_step.py runs 2); 2-rank variants run one")
    ap.add_argument("--step-only", action="store_true",
                    help="only the shared-prefix step variants (1 rank, 2 ranks), written to --out; no per-sequence "
                         "path, no memory sweep")
    ap.add_argument("--quick", action="store_true",
                    help="a check run of a few minutes: --repeats 1, --mem-frames 16,64 (same step config)")
    # internal (the per-process roles)
    ap.add_argument("--text", default="shared_prefix", choices=["shared_prefix", "per_sequence"])
    ap.add_argument("--variants", default="no_reuse_per_pass,reuse,reuse_frozen")
    ap.add_argument("--sp-min-tokens", type=int, default=-1, help="(step_sp role) SP threshold; -1: the role's default")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.mem_frames = 1, "16,64"
    if args.role == "step":
        role_step(args)
        return 0
    if args.role == "step_sp":
        role_step_sp(args)
        return 0
    if args.role == "mem":
        role_mem(args)
        return 0
    if args.role == "tower":
        role_tower(args)
        return 0

    me = str(Path(__file__).resolve())
    work = Path(tempfile.mkdtemp(prefix="mrsp-bench-"))
    t_start = time.time()
    load_start = os.getloadavg()
    command = "python " + " ".join(["benchmarks/mrsp.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        model_dir = build_model(work)
        mem_frames = [] if args.step_only else sorted({int(f) for f in args.mem_frames.split(",")})
        inputs = {}
        for f in sorted(set(mem_frames) | {args.frames}):
            inputs[f] = (work / f"inputs{f}.safetensors", prepare_inputs(model_dir, f, work / f"inputs{f}.safetensors"))
            print(f"[prep] {f} frames: {inputs[f][1]}", file=sys.stderr, flush=True)

        common = ["--model", model_dir, "--G", str(args.G), "--resp", str(args.resp), "--grad-accum",
                  str(args.grad_accum)]
        step_in = str(inputs[args.frames][0])

        def one_rank(text: str, variants: str, repeats: int) -> dict:
            out = work / f"step_{text}.json"
            _run([sys.executable, me, "--role", "step", "--inputs", step_in, "--out", str(out), "--text", text,
                  "--variants", variants, "--repeats", str(repeats), *common], 3000)
            return json.loads(out.read_text())

        def two_ranks(text: str, repeats: int, sp_min_tokens: int = -1) -> dict:
            out = work / f"step_sp_{text}_{sp_min_tokens}.json"
            _run([*_torchrun(2), me, "--role", "step_sp", "--inputs", step_in, "--out", str(out), "--text", text,
                  "--repeats", str(repeats), "--sp-min-tokens", str(sp_min_tokens), *common], 3000)
            return json.loads(out.read_text())

        one = STEP_ONLY_VARIANTS if args.step_only else "no_reuse_per_request,no_reuse_per_pass,reuse,reuse_frozen"
        steps = one_rank("shared_prefix", one, args.repeats)
        steps["reuse_2ranks"] = two_ranks("shared_prefix", args.repeats)
        steps["reuse_sp2"] = two_ranks("shared_prefix", args.repeats, sp_min_tokens=0)
        if args.step_only:
            tower_out = work / "tower.json"
            _run([sys.executable, me, "--role", "tower", "--inputs", step_in, "--out", str(tower_out), "--repeats",
                  str(args.repeats), *common], 3000)
            result = step_only_result(steps, args, inputs[args.frames][1], command, json.loads(tower_out.read_text()))
            result["host"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                              "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()}
            result["wall_seconds"] = round(time.time() - t_start, 1)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result["speedup"]), json.dumps(result["targets"]), file=sys.stderr)
            return 0
        legacy_names = [v for v in args.per_sequence_variants.split(",") if v]
        legacy: dict = {}
        if [v for v in legacy_names if v != "reuse_sp2"]:
            legacy = one_rank("per_sequence", ",".join(v for v in legacy_names if v != "reuse_sp2"),
                              args.per_sequence_repeats)
        if "reuse_sp2" in legacy_names:
            legacy["reuse_sp2"] = two_ranks("per_sequence", args.per_sequence_repeats)

        sweep = []
        for f in mem_frames:
            point = {"frames": f, "tokens": inputs[f][1]["prompt_tokens"] + args.resp}
            for n in (1, 2):
                out = work / f"mem{f}_{n}.json"
                launcher = [sys.executable] if n == 1 else _torchrun(2)
                _run([*launcher, me, "--role", "mem", "--inputs", str(inputs[f][0]), "--out", str(out), *common,
                      "--repeats", "1"], 3000)
                per_rank = json.loads(out.read_text())
                point[f"ranks{n}"] = {"peak_mb_per_rank": [round(r["peak_mb"], 1) for r in per_rank],
                                      "seconds": round(max(r["seconds"] for r in per_rank), 3)}
                print(f"[mem] {f} frames, {n} rank(s): {point[f'ranks{n}']}", file=sys.stderr, flush=True)
            p1 = max(point["ranks1"]["peak_mb_per_rank"])
            p2 = max(point["ranks2"]["peak_mb_per_rank"])
            point["peak_ratio_2_over_1"] = round(p2 / p1, 3) if p1 > 0 else None
            point["sp_speedup"] = round(point["ranks1"]["seconds"] / point["ranks2"]["seconds"], 3)
            sweep.append(point)

        base = steps["no_reuse_per_pass"]["total"]
        base_req = steps["no_reuse_per_request"]["total"]
        ratio = lambda a, b: round(a / b, 3)  # noqa: E731
        legacy_speedup = {}
        if "no_reuse_per_pass" in legacy:
            lb = legacy["no_reuse_per_pass"]["total"]
            legacy_speedup = {f"{k}_vs_no_reuse_per_pass": ratio(lb, v["total"]) for k, v in legacy.items()
                              if k != "no_reuse_per_pass"}
        if "no_reuse_per_sequence" in legacy:
            legacy_speedup |= {f"{k}_vs_no_reuse_per_sequence": ratio(legacy["no_reuse_per_sequence"]["total"],
                                                                       v["total"])
                               for k, v in legacy.items() if k != "no_reuse_per_sequence"}
        fits1 = [p["tokens"] for p in sweep if max(p["ranks1"]["peak_mb_per_rank"]) <= args.budget_mb]
        fits2 = [p["tokens"] for p in sweep if max(p["ranks2"]["peak_mb_per_rank"]) <= args.budget_mb]
        crossover = next((p["tokens"] for p in sweep if p["sp_speedup"] > 1.0
                          and all(q["sp_speedup"] > 1.0 for q in sweep if q["tokens"] >= p["tokens"])), None)
        result = {
            "benchmark": "mrsp",
            "config": {"frames": args.frames, "G": args.G, "response_tokens": args.resp,
                       "grad_accum_1rank": args.grad_accum, "video": VIDEO, "step_inputs": inputs[args.frames][1],
                       "model": "Qwen2-VL random: text 4 layers, hidden 128, 8 heads / 4 KV heads; vision depth 4, "
                                "width 128, 4 heads; tiny BPE tokenizer",
                       "threads_per_process": 1, "quick": args.quick,
                       "repeats": args.repeats, "per_sequence_repeats": args.per_sequence_repeats,
                       "per_sequence_variants": legacy_names, "mem_frames": mem_frames,
                       "warm_up": "one round with 2 rollouts per variant, dropped",
                       "statistic": "median over repeats of each phase; total = median of the per-repeat totals "
                                    "(2 ranks: max over ranks of each median)",
                       "memory_method": "per rank: VmHWM - VmRSS around one forward+backward of one sequence's "
                                        "log-prob prefill (video features precomputed), VmHWM reset via "
                                        "/proc/self/clear_refs=5 after glibc malloc_trim(0), "
                                        "MALLOC_MMAP_THRESHOLD_=65536 (large tensors mmapped, unmapped on free), "
                                        "fresh process per point, second of two runs",
                       "budget_mb_per_rank": args.budget_mb},
            "text_path": "shared_prefix: each pass runs the prompt once and the G responses on its K/V cache; the "
                         "rollout prefill runs the prompt once for the G rows (see the module docstring)",
            "step_seconds": steps,
            "speedup": {
                # the baseline: the video re-encoded by every rollout request and every pass (G + 3)
                "reuse_vs_no_reuse_per_request": ratio(base_req, steps["reuse"]["total"]),
                "reuse_frozen_vs_no_reuse_per_request": ratio(base_req, steps["reuse_frozen"]["total"]),
                # a stronger baseline: no embedding reuse, but the G rollouts share one prompt prefill (4 passes)
                "reuse_vs_no_reuse_per_pass": ratio(base, steps["reuse"]["total"]),
                "reuse_frozen_vs_no_reuse_per_pass": ratio(base, steps["reuse_frozen"]["total"]),
                "reuse_2ranks_vs_no_reuse_per_pass": ratio(base, steps["reuse_2ranks"]["total"]),
                "reuse_2ranks_vs_reuse": ratio(steps["reuse"]["total"], steps["reuse_2ranks"]["total"]),
                "reuse_sp2_vs_reuse": ratio(steps["reuse"]["total"], steps["reuse_sp2"]["total"]),
            },
            "per_sequence_text_path": {
                "note": "secondary: the text path before the shared prefix (G full sequences per pass, G rollout "
                        "prefills); reuse_sp2 = old/ref/update sequence-parallel over 2 ranks",
                "step_seconds": legacy, "speedup": legacy_speedup,
                "shared_prefix_speedup": {k: ratio(legacy[k]["total"], steps[k]["total"])
                                          for k in legacy if k in steps},
                # both changes together against the old baseline (the comparison the issue first made)
                "reuse_shared_prefix_vs_no_reuse_per_pass_per_sequence": ratio(
                    legacy["no_reuse_per_pass"]["total"], steps["reuse"]["total"]) if "no_reuse_per_pass" in legacy
                else None,
            },
            "prefill_sweep": sweep,
            "longest_tokens_within_budget": {"ranks1": max(fits1) if fits1 else None,
                                             "ranks2": max(fits2) if fits2 else None},
            "sp_prefill_crossover_tokens": crossover,
            "peak_ratio_at_longest": sweep[-1]["peak_ratio_2_over_1"],
            "targets": {"stage1_speedup_ge_1_5_vs_per_request": base_req / steps["reuse"]["total"] >= 1.5,
                        "stage1_speedup_ge_1_5_vs_per_pass": base / steps["reuse"]["total"] >= 1.5,
                        "sp_peak_ratio_le_0_65_at_longest": sweep[-1]["peak_ratio_2_over_1"] <= 0.65},
            "host": {"python": platform.python_version(), "machine": platform.machine(),
                     "cpus": os.cpu_count(), "load_avg_at_start": load_start,
                     "load_avg_at_end": os.getloadavg()},
            "command": command,
            "wall_seconds": round(time.time() - t_start, 1),
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, out)
        print(json.dumps(result["speedup"]), json.dumps(result["targets"]), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
