"""torchrun worker for tests/test_mrsp_dist.py (not collected by pytest: no test_ prefix).

Usage: torchrun --nproc_per_node N tests/mrsp_dist_worker.py MODEL_DIR INPUTS.safetensors OUT.json

Every rank computes the single-process reference itself (same weights, same inputs), then the distributed
version, and writes the max abs differences (rank 0 writes OUT.json; every rank's figures are gathered).
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from longreel.trainer.mrsp.dist_ops import allreduce_grads_, world  # noqa: E402
from longreel.trainer.mrsp.embed_cache import StepEmbedCache, VisionCallCounter, encode_video_features  # noqa: E402
from longreel.trainer.positions import prompt_positions  # noqa: E402
from longreel.trainer.mrsp.reuse import token_logprobs  # noqa: E402
from longreel.trainer.mrsp.sp_prefill import prefill_logprobs, sp_response_logprobs, sp_shared_prompt_logprobs  # noqa: E402
from longreel.trainer.mrsp.vision_shard import make_sharded_encoder, plan_temporal_shards, sharded_video_features  # noqa: E402


def grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def maxdiff(a: dict, b: dict, prefix: str = "") -> float:
    return max((float((a[k] - b[k]).abs().max()) for k in a if k.startswith(prefix)), default=0.0)


def scale(g: dict) -> float:
    return max(float(v.abs().max()) for v in g.values())


def sp_checks(model, prompt, pv, grid, mmt, resp, rmask, weights) -> dict:
    res: dict = {}
    n, t = resp.shape
    lp_len = prompt.shape[1]
    weights = weights / rmask.sum()  # a token-mean loss, as GRPO's: gradients at their real scale
    rank, size = world()
    length = lp_len + t
    chunk = -(-length // size)
    res["response_rows_per_rank"] = [max(0, min((r + 1) * chunk, length - 1) - max(r * chunk, lp_len - 1))
                                     for r in range(size)]
    # ---- 2. SP prefill vs the plain single-process pixel path (no reuse): log-probs + all grads
    ids = torch.cat([prompt.expand(n, -1), resp], dim=1)
    attn = torch.cat([torch.ones_like(prompt).expand(n, -1), rmask], dim=1)
    mmt_full = torch.cat([mmt.expand(n, -1), torch.zeros_like(resp)], dim=1)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=attn, pixel_values_videos=pv.repeat(n, 1),
                video_grid_thw=grid.repeat(n, 1), mm_token_type_ids=mmt_full, use_cache=False)
    lp_plain = token_logprobs(out.logits[:, lp_len - 1:-1], resp)
    ((lp_plain * weights * rmask).sum()).backward()
    g_plain = grads(model)
    res["grad_scale"] = scale(g_plain)

    pos = prompt_positions(model, prompt, grid, mmt)
    for label, shard_vision in (("sp", False), ("sp_shardvision", True)):
        model.zero_grad(set_to_none=True)
        with VisionCallCounter(model) as counter:
            if shard_vision:
                feats = sharded_video_features(model, pv, grid, grad="sum")
            else:
                feats = encode_video_features(model, pv, grid)
            lp = sp_response_logprobs(model, ids, pos.with_responses(n, t), lp_len, features=feats,
                                      attention_mask=attn)
        res[f"{label}_vision_calls"] = counter.calls
        res[f"{label}_logp_diff"] = float(((lp - lp_plain) * rmask).abs().max())
        ((lp * weights * rmask).sum()).backward()
        allreduce_grads_(model.parameters())
        g = grads(model)
        res[f"{label}_grad_diff"] = maxdiff(g, g_plain)
        res[f"{label}_grad_diff_visual"] = maxdiff(g, g_plain, "model.visual.")

    # ---- 2b. the prompt sequence-parallel once, the rows split over the ranks (prefill_logprobs' default)
    model.zero_grad(set_to_none=True)
    feats = sharded_video_features(model, pv, grid, grad="sum")
    lp = sp_shared_prompt_logprobs(model, prompt, resp, features=feats, positions=pos)
    res["shared_logp_diff"] = float(((lp - lp_plain) * rmask).abs().max())
    ((lp * weights * rmask).sum()).backward()
    allreduce_grads_(model.parameters())
    g = grads(model)
    res["shared_grad_diff"] = maxdiff(g, g_plain)
    res["shared_grad_diff_visual"] = maxdiff(g, g_plain, "model.visual.")

    # ---- 3. the trainer-facing path: StepEmbedCache(deferred, sharded encoder) + prefill_logprobs(SP)
    model.zero_grad(set_to_none=True)
    cache = StepEmbedCache(model, vision="deferred", encoder=make_sharded_encoder(model, grad="sum"))
    cache.begin_step()
    with VisionCallCounter(model) as counter:
        with torch.no_grad():  # old-policy log-probs (and, in a real step, rollouts and reference)
            f = cache.features("video", pv, grid)
            p = cache.positions("prompt", prompt, grid, mmt)
            old = prefill_logprobs(model, prompt, resp, rmask, features=f, positions=p, sp_min_tokens=1)
        lp = prefill_logprobs(model, prompt, resp, rmask, features=cache.update_features("video"), positions=p,
                              sp_min_tokens=1)
        ((lp * weights * rmask).sum()).backward()
        pushed = cache.backward_vision()
    allreduce_grads_(model.parameters())
    g = grads(model)
    res["step_vision_calls"] = counter.calls
    res["step_pushed"] = pushed
    res["step_old_diff"] = float(((old - lp_plain) * rmask).abs().max())
    res["step_logp_diff"] = float(((lp.detach() - lp_plain) * rmask).abs().max())
    res["step_grad_diff"] = maxdiff(g, g_plain)

    # ---- 4. the same step below the SP threshold: the group splits the rows instead (3 rows over 2 ranks)
    model.zero_grad(set_to_none=True)
    cache.begin_step()
    with torch.no_grad():
        f = cache.features("video", pv, grid)
        old_rows = prefill_logprobs(model, prompt, resp, rmask, features=f, positions=p, sp_min_tokens=1 << 30)
    lp_rows = prefill_logprobs(model, prompt, resp, rmask, features=cache.update_features("video"), positions=p,
                               sp_min_tokens=1 << 30)
    ((lp_rows * weights * rmask).sum()).backward()
    cache.backward_vision()
    allreduce_grads_(model.parameters())
    res["rows_old_diff"] = float(((old_rows - lp_plain) * rmask).abs().max())
    res["rows_grad_diff"] = maxdiff(grads(model), g_plain)

    return res


def fsdp_checks(model_dir: str, prompt, pv, grid, mmt, resp, rmask, weights) -> dict:
    """The same computations on an FSDP2-sharded copy (``runtime.shard_fsdp``, the tower, embeddings and root held
    gathered as ``TrainSession.hold_resident`` does): the gradients, reduce-scattered by FSDP (an average, so the loss
    is scaled by the world size) and gathered back, equal the single-process ones. Cases where a rank has nothing
    of its own: ``resp`` puts every response row on the last rank (the others never reach the LM head but for the
    zero anchor), and a video of one temporal group leaves a rank without frames."""
    from transformers import AutoModelForImageTextToText

    from longreel.trainer.runtime import shard_fsdp

    _, size = world()
    plain = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    resident = shard_fsdp(model)["resident"]

    def hold():
        for m in resident:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()

    def full_grads() -> dict:
        for m in resident:
            m.reshard()
        out = {}
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
            out[n] = g.detach().clone()
        model.zero_grad(set_to_none=True)
        return out

    res: dict = {}
    n, t = resp.shape
    lp_len = prompt.shape[1]
    weights = weights / rmask.sum()
    ids = torch.cat([prompt.expand(n, -1), resp], dim=1)
    attn = torch.cat([torch.ones_like(prompt).expand(n, -1), rmask], dim=1)
    pos = prompt_positions(plain, prompt, grid, mmt)
    out = plain(input_ids=ids, attention_mask=attn, pixel_values_videos=pv.repeat(n, 1),
                video_grid_thw=grid.repeat(n, 1),
                mm_token_type_ids=torch.cat([mmt.expand(n, -1), torch.zeros_like(resp)], dim=1), use_cache=False)
    (token_logprobs(out.logits[:, lp_len - 1:-1], resp) * weights * rmask).sum().backward()
    g_plain = grads(plain)
    res["fsdp_grad_scale"] = scale(g_plain)
    for label in ("sp", "shared"):
        hold()
        feats = sharded_video_features(model, pv, grid, grad="sum")
        if label == "sp":
            lp = sp_response_logprobs(model, ids, pos.with_responses(n, t), lp_len, features=feats,
                                      attention_mask=attn)
        else:
            lp = sp_shared_prompt_logprobs(model, prompt, resp, features=feats, positions=pos)
        ((lp * weights * rmask).sum() * size).backward()
        g = full_grads()
        res[f"fsdp_{label}_grad_diff"] = maxdiff(g, g_plain)
        res[f"fsdp_{label}_lm_head_grad"] = float(g["lm_head.weight"].abs().sum())

    # a one-group video: the shard plan gives a rank no frames
    _, h, w = (int(v) for v in grid[0])
    pv1, grid1 = pv[:h * w], grid.new_tensor([[1, h, w]])
    res["fsdp_one_group_plan"] = list(plan_temporal_shards(grid1, size, 2).patches)
    w_feat = torch.randn(h * w // 4, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(2))
    plain.zero_grad(set_to_none=True)
    (encode_video_features(plain, pv1, grid1) * w_feat).sum().backward()
    g_ref = grads(plain)
    hold()
    ((sharded_video_features(model, pv1, grid1, grad="own") * w_feat).sum() * size).backward()
    res["fsdp_one_group_grad_diff"] = maxdiff(full_grads(), g_ref, "model.visual.")
    res["fsdp_one_group_grad_scale"] = scale({k: v for k, v in g_ref.items() if k.startswith("model.visual.")})
    return res


def main() -> None:
    # a collective mismatch would hang both ranks: dump the stacks and exit instead
    faulthandler.dump_traceback_later(float(os.environ.get("MRSP_WORKER_TIMEOUT", "420")), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        _checks(*sys.argv[1:4])
    finally:
        # on every path, an exception's included: a gloo group left to the interpreter's teardown can abort the
        # process (SIGABRT, "terminate called without an active exception") and bury the exception's traceback
        dist.destroy_process_group()


def _checks(model_dir: str, inputs_path: str, out_path: str) -> None:
    rank, size = world()
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()  # dropout is 0 in these configs; train mode exercises the grad paths
    x = load_file(inputs_path)
    prompt, pv, grid, mmt = x["input_ids"], x["pixel_values_videos"], x["video_grid_thw"], x["mm_token_type_ids"]
    res: dict = {"rank": rank, "world": size}

    # ---- 1. sharded vision encoding vs single process (forward + vision grads), both grad modes
    plan = plan_temporal_shards(grid, size, 2)
    res["plan_patches"] = list(plan.patches)
    w_feat = torch.randn(int(grid.prod()) // 4, model.config.text_config.hidden_size,
                         generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    ref = encode_video_features(model, pv, grid)
    (ref * w_feat).sum().backward()
    g_ref = grads(model)
    for mode in ("own", "sum"):
        model.zero_grad(set_to_none=True)
        with VisionCallCounter(model) as counter:
            feats = sharded_video_features(model, pv, grid, grad=mode)
        res[f"shard_{mode}_calls"] = counter.calls
        res[f"shard_{mode}_patches"] = counter.patches
        res[f"shard_{mode}_fwd_diff"] = float((feats.detach() - ref.detach()).abs().max())
        if mode == "own":  # every rank computes the same full loss
            loss = (feats * w_feat).sum()
        else:  # ranks consume disjoint halves of the rows: sum over ranks == the full loss
            rows = torch.arange(feats.shape[0]) % size == rank
            loss = (feats[rows] * w_feat[rows]).sum()
        loss.backward()
        allreduce_grads_(model.parameters())
        g = grads(model)
        res[f"shard_{mode}_grad_diff"] = maxdiff(g, g_ref)
        res[f"shard_{mode}_grad_scale"] = scale(g_ref)

    for tag in sorted({k.split('.')[0] for k in x if k.endswith('.response_ids')}):
        resp, rmask, weights = x[f'{tag}.response_ids'], x[f'{tag}.response_mask'], x[f'{tag}.weights']
        n, t = resp.shape
        res[tag] = sp_checks(model, prompt, pv, grid, mmt, resp, rmask, weights)

    res["fsdp"] = fsdp_checks(model_dir, prompt, pv, grid, mmt, x["short.response_ids"], x["short.response_mask"],
                              x["short.weights"])

    gathered = [None] * size
    dist.all_gather_object(gathered, res)
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(gathered, fh, indent=1, sort_keys=True)
    dist.barrier()


if __name__ == "__main__":
    main()
