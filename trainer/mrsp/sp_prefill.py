"""Sequence-parallel prefill (MR-SP stage 2): one long sequence's log-probs computed by ``N`` ranks.

The (gathered) input sequence is padded to a multiple of ``N``; rank ``r`` owns the contiguous slice
``[r*C, (r+1)*C)`` (``C = L_pad / N``) and runs the text decoder on it only. Everything in a Qwen2 decoder layer
except attention is per token (RMSNorm, q/k/v/o projections, M-RoPE rotation from the slice's own position
ids, the MLP), so the rank computes it on its rows with the HF modules' own weights and functions. Attention
is made exact by an **all-gather of K and V** along the sequence (after the rotary, before GQA expansion):
each local query row attends over the key range ``j <= global_row``. The all-gather's backward sums every rank's gradient for each K/V slice
and hands it to the rank that produced it (:func:`longreel.trainer.mrsp.dist_ops.gather_seq`, ``grad="sum"``).

Attention without an ``L x L`` mask: rank ``r``'s queries see the keys of earlier ranks in full and their own
keys causally. On CPU the two parts are two calls of PyTorch's fused flash-attention kernel (the same kernel
the model's ``sdpa`` path runs), merged exactly with their log-sum-exps; the backward calls the kernel's
backward for each part with the *merged* output and log-sum-exp, which is exactly the gradient of the joint
softmax (the ring-attention identity). Nothing quadratic in the sequence length is stored, so the per-rank
memory really falls with ``N``. Elsewhere (CUDA) a boolean lower-right causal mask over ``[C, L]`` is used.

Why K/V all-gather and not Ulysses all-to-all or a hook in transformers' ``ALL_ATTENTION_FUNCTIONS``:
all-gather is exact for any head count (Ulysses needs heads and KV heads divisible by ``N``; the tiny model's
2 KV heads with N=4 would not be), keeps GQA's small K/V as the only thing communicated (KV heads x head_dim
per token, half the query width here), and running the layers ourselves avoids mutating the shared model's
``config._attn_implementation`` or smuggling an offset mask through transformers' mask creation. The cost is
that each rank holds the full K/V of a layer while computing it (``2 * kv_width`` floats per token), which
is small next to the per-token activations that SP divides by ``N``.

Each rank computes the LM head only on its own rows that predict response tokens; the per-rank log-probs
are all-gathered to ``[B, T]`` (identical on every rank) with ``grad="own"``: every rank must then compute the
*same* loss from them, and parameter gradients are summed across the group afterwards
(:func:`longreel.trainer.mrsp.dist_ops.allreduce_grads_`).

Right padding only (the trainer's layout): with every row's real tokens first, causal masking alone excludes
the padding keys from every real query, so no per-row key mask is needed.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from longreel.trainer.mrsp.dist_ops import gather_seq, world
from longreel.trainer.mrsp.fsdp_calls import is_fsdp, run_as_forward
from longreel.trainer.positions import PromptPositions, base_model
from longreel.trainer.mrsp.reuse import response_logprobs, token_logprobs

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fold(x: Tensor) -> Tensor:
    """``[B, H, C, ...]`` -> ``[1, H, B*C, ...]``: ``B`` rows of queries as one row, for keys the rows share."""
    return x.transpose(0, 1).reshape(1, x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _unfold(x: Tensor, rows: int) -> Tensor:
    """The inverse of :func:`_fold` for ``rows`` rows."""
    return x.reshape(x.shape[1], rows, x.shape[2] // rows, *x.shape[3:]).transpose(0, 1)


class _PrefixCausalAttention(torch.autograd.Function):
    """softmax attention of queries over ``[prefix keys (all visible); own keys (causal, aligned square)]``.

    A prefix of batch 1 under queries of batch ``B`` is one prefix every row shares (the prompt under ``B``
    responses): the ``B`` rows' queries attend to it folded into one row, so its keys and values are neither
    copied per row nor saved per row for the backward."""

    @staticmethod
    def forward(ctx, q, kp, vp, kd, vd, scale):
        o, lse = _FLASH_CPU(q, kd, vd, 0.0, True, scale=scale)
        rows = q.shape[0]
        shared = kp.shape[0] == 1 and rows > 1
        if kp.shape[2]:
            qp = _fold(q) if shared else q
            o1, l1 = _FLASH_CPU(qp, kp, vp, 0.0, False, scale=scale)
            if shared:
                o1, l1 = _unfold(o1, rows), _unfold(l1, rows)
            merged = torch.logaddexp(l1, lse)
            o = torch.exp(l1 - merged).unsqueeze(-1) * o1 + torch.exp(lse - merged).unsqueeze(-1) * o
            lse = merged
        ctx.save_for_backward(q, kp, vp, kd, vd, o, lse)
        ctx.scale, ctx.shared = scale, shared
        return o

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, kd, vd, o, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dkd, dvd = _FLASH_CPU_BWD(grad, q, kd, vd, o, lse, 0.0, True, scale=ctx.scale)
        if kp.shape[2]:
            if ctx.shared:  # the prefix part's backward on the folded rows, as its forward ran
                f = [_fold(x).contiguous() for x in (grad, q, o, lse)]
                dq1, dkp, dvp = _FLASH_CPU_BWD(f[0], f[1], kp, vp, f[2], f[3], 0.0, False, scale=ctx.scale)
                dq1 = _unfold(dq1, q.shape[0])
            else:
                dq1, dkp, dvp = _FLASH_CPU_BWD(grad, q, kp, vp, o, lse, 0.0, False, scale=ctx.scale)
            dq = dq + dq1
        else:
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        return dq, dkp, dvp, dkd, dvd, None


def prefix_causal_attention(q: Tensor, k: Tensor, v: Tensor, lo: int, scale: float) -> Tensor:
    """Attention of the local queries ``q`` ``[B, H, C, D]`` (global rows ``lo .. lo+C-1``) over the gathered
    keys/values ``k``/``v`` ``[B, H, L, D]`` with causal masking: row ``lo+i`` sees keys ``0 .. lo+i``."""
    c = q.shape[2]
    kp, vp, kd, vd = k[:, :, :lo], v[:, :, :lo], k[:, :, lo:lo + c], v[:, :, lo:lo + c]
    if q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BWD is not None:
        return _PrefixCausalAttention.apply(q, kp, vp, kd, vd, float(scale))
    keys = lo + c
    mask = torch.arange(keys, device=q.device).view(1, -1) <= torch.arange(lo, keys, device=q.device).view(-1, 1)
    return F.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], attn_mask=mask, scale=scale)


def shared_prefix_attention(q: Tensor, kp: Tensor, vp: Tensor, kd: Tensor, vd: Tensor, scale: float) -> Tensor:
    """Attention of ``B`` rows of queries ``q`` ``[B, H, C, D]`` over one prefix all of them share (``kp``/``vp``
    ``[1, H, P, D]``, all visible) and then each row's own keys ``kd``/``vd`` ``[B, H, C, D]`` (causal).

    On CPU the prefix is never copied per row (:class:`_PrefixCausalAttention` folds the rows); elsewhere the keys
    are concatenated per row, ``B`` copies of the prefix, for the masked SDPA of :func:`prefix_causal_attention`."""
    if q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BWD is not None:
        return _PrefixCausalAttention.apply(q, kp, vp, kd, vd, float(scale))
    rows = q.shape[0]
    keys = torch.cat([kp.expand(rows, -1, -1, -1), kd], dim=2)
    vals = torch.cat([vp.expand(rows, -1, -1, -1), vd], dim=2)
    return prefix_causal_attention(q, keys, vals, kp.shape[2], scale)


__all__ = ["SPConfig", "sp_enabled", "sp_response_logprobs", "sp_shared_prompt_logprobs", "prefill_logprobs",
           "local_inputs_embeds", "prefix_causal_attention", "shared_prefix_attention"]


@dataclass
class SPConfig:
    """``min_tokens``: sequence parallelism switches on for sequences of at least this many tokens (prompt +
    response); below it each rank runs the plain stage-1 path. The default is the crossover measured by
    benchmarks/mrsp.py on CPU (2 gloo ranks, 1 thread each): the SP prefill of one sequence was slower than
    one rank at ~2k tokens and faster from ~3.9k tokens on; re-measure on other hardware."""

    min_tokens: int = 3072


def sp_enabled(seq_len: int, group=None, min_tokens: int = 3072) -> bool:
    return world(group)[1] > 1 and seq_len >= min_tokens


def _check_supported(lm) -> None:
    cfg = lm.config
    if getattr(cfg, "use_sliding_window", False):
        raise NotImplementedError("sequence-parallel prefill supports full attention only (use_sliding_window)")
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", ["full_attention"])):
        raise NotImplementedError(f"sequence-parallel prefill supports full attention only: {cfg.layer_types}")


def _right_padded(attention_mask: Tensor) -> bool:
    m = attention_mask.to(torch.long)
    return bool((m[:, 1:] <= m[:, :-1]).all()) and bool((m[:, 0] == 1).all())


def local_inputs_embeds(model, input_ids: Tensor, features: Tensor, lo: int, hi: int) -> Tensor:
    """``[B, hi-lo, H]``: rows ``lo:hi`` of the input embeddings (token embeddings with one prompt's video
    ``features`` in every row's placeholders) without building the full ``[B, L, H]`` tensor."""
    vid = input_ids == int(model.config.video_token_id)
    count = vid.sum(-1)
    if bool((count != features.shape[0]).any()):
        raise ValueError(f"video placeholders per row {count.tolist()} != {features.shape[0]} video features")
    idx = (vid.cumsum(-1) - 1)[:, lo:hi]
    local_ids, local_vid = input_ids[:, lo:hi], vid[:, lo:hi]
    emb = model.get_input_embeddings()(local_ids)
    feats = features.to(emb.dtype)[idx.clamp(min=0)]
    return torch.where(local_vid.unsqueeze(-1), feats, emb)


def sp_response_logprobs(model, input_ids: Tensor, position_ids: Tensor, response_start: int, *,
                         features: Tensor | None = None, inputs_embeds: Tensor | None = None,
                         attention_mask: Tensor | None = None, temperature: float = 1.0, group=None) -> Tensor:
    """Log-probs ``[B, T]`` (``T = L - response_start``) of tokens ``input_ids[:, response_start:]``,
    computed sequence-parallel over ``group``; identical on every rank and differentiable.

    Args:
        input_ids: ``[B, L]`` prompt + responses (every rank passes the same).
        position_ids: ``[3, B, L]`` M-RoPE positions (``PromptPositions.with_responses``).
        features: one prompt's video features ``[n, H]`` (shared by every row), or ``inputs_embeds`` ``[B, L, H]``.
        attention_mask: ``[B, L]``, right-padded; ``None`` = no padding.
    Gradient convention: compute the same loss on every rank from the result, ``backward``, then sum parameter
    gradients across ``group`` (``dist_ops.allreduce_grads_``). With one rank it is the plain computation.
    """
    if (features is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of features / inputs_embeds")
    if attention_mask is not None and not _right_padded(attention_mask):
        raise ValueError("sp_response_logprobs needs right-padded sequences (real tokens first in every row)")
    rank, size = world(group)
    b, length = input_ids.shape
    if not 0 < response_start < length:
        raise ValueError(f"response_start {response_start} outside (0, {length})")
    lm = base_model(model).language_model
    _check_supported(lm)
    attn0 = lm.layers[0].self_attn
    rotary_fn = sys.modules[type(attn0).__module__].apply_rotary_pos_emb

    chunk = -(-length // size)
    lo, hi = rank * chunk, (rank + 1) * chunk
    real_hi = min(hi, length)
    if inputs_embeds is not None:
        h = inputs_embeds[:, lo:real_hi]
    else:
        h = local_inputs_embeds(model, input_ids, features, lo, real_hi)
    pos = position_ids[:, :, lo:real_hi]
    if real_hi < hi:  # padding rows at the end of the last slice(s)
        pad = hi - max(lo, real_hi)
        h = torch.cat([h, h.new_zeros(b, pad, h.shape[-1])], dim=1)
        pos = torch.cat([pos, pos.new_zeros(3, b, pad)], dim=2)
    cos, sin = lm.rotary_emb(h, pos)
    sizes = [chunk] * size

    def layer_step(layer, h, cos, sin):
        attn = layer.self_attn
        residual = h
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(b, chunk, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, chunk, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, chunk, -1, attn.head_dim).transpose(1, 2)
        q, k = rotary_fn(q, k, cos, sin)
        # one collective per layer for K and V together (a fixed collective order in the backward, too)
        k, v = gather_seq(torch.stack([k, v]), dim=3, grad="sum", group=group, sizes=sizes).unbind(0)
        if attn.num_key_value_groups > 1:
            k = k.repeat_interleave(attn.num_key_value_groups, dim=1)
            v = v.repeat_interleave(attn.num_key_value_groups, dim=1)
        o = prefix_causal_attention(q, k, v, lo, attn.scaling)
        o = attn.o_proj(o.transpose(1, 2).reshape(b, chunk, -1))
        h = residual + o
        return h + layer.mlp(layer.post_attention_layernorm(h))

    for layer in lm.layers:  # under FSDP each layer's weights are gathered (and its gradient reduced) around it
        h = run_as_forward(layer, functools.partial(layer_step, layer), h, cos, sin)
    h = lm.norm(h)

    # rows predicting a response token: global positions [response_start - 1, length - 1)
    a, z = max(lo, response_start - 1), min(hi, length - 1)
    counts = [max(0, min((r + 1) * chunk, length - 1) - max(r * chunk, response_start - 1)) for r in range(size)]
    if z > a:
        logits = model.lm_head(h[:, a - lo:z - lo])
        lp = token_logprobs(logits, input_ids[:, a + 1:z + 1], temperature)
    else:
        # no response rows here; under grad keep this rank's graph connected so its K/V collectives run
        # in the backward like everyone else's
        lp = h.new_zeros(b, 0, dtype=torch.float32)
        if h.requires_grad:
            lp = lp + _anchor(model, h)
    return gather_seq(lp, dim=1, grad="own", group=group, sizes=counts)


def _anchor(model, h: Tensor) -> Tensor:
    """A zero that depends on the final hidden states ``h``, so that a rank with nothing to return still runs its
    backward collectives. Under FSDP it goes through the LM head too: the root unit reduce-scatters the gradients
    its parameters have, so every rank must give the head one (zero here) even without rows of its own."""
    if is_fsdp(model):
        return 0.0 * model.lm_head(h[:, -1:]).float().sum()
    return 0.0 * h.sum()


def _split(n: int, size: int) -> list[int]:
    """Contiguous chunk lengths of ``n`` items over ``size`` ranks (``ceil(n / size)`` each, the last ones short)."""
    per = -(-n // size)
    return [max(0, min(n, (r + 1) * per) - r * per) for r in range(size)]


def sp_shared_prompt_logprobs(model, prompt_ids: Tensor, response_ids: Tensor, *, features: Tensor,
                              positions: PromptPositions, temperature: float = 1.0, group=None) -> Tensor:
    """Log-probs ``[N, T]`` of ``N`` right-padded responses to one prompt, the prompt sequence-parallel over
    ``group`` and run **once** for the ``N`` rows; identical on every rank and differentiable.

    The prompt ``[1, Lp]`` is split along the sequence as in :func:`sp_response_logprobs` (K/V all-gathered per
    layer). The ``N`` responses are split by rows over the ranks; a rank runs its rows' response tokens layer by
    layer beside its prompt slice, attending over the layer's gathered prompt K/V (all visible) and their own
    keys (causal), so nothing of the long prompt is computed ``N`` times, nor (on CPU) copied or saved per row
    (:func:`shared_prefix_attention`). The first response token is predicted from the prompt's last position, on
    the rank that owns it. Same gradient convention as :func:`sp_response_logprobs`: the same loss on every rank,
    then parameter gradients summed over ``group``.
    """
    rank, size = world(group)
    lp_len = int(prompt_ids.shape[1])
    n, t = response_ids.shape
    lm = base_model(model).language_model
    _check_supported(lm)
    rotary_fn = sys.modules[type(lm.layers[0].self_attn).__module__].apply_rotary_pos_emb

    chunk = -(-lp_len // size)
    lo, hi = rank * chunk, (rank + 1) * chunk
    real_hi = min(hi, lp_len)
    h = local_inputs_embeds(model, prompt_ids, features, lo, real_hi)
    pos = positions.prompt[:, :, lo:real_hi]
    if real_hi < hi:  # padding rows at the end of the last slice(s); causal masking hides them from real rows
        pad = hi - max(lo, real_hi)
        h = torch.cat([h, h.new_zeros(1, pad, h.shape[-1])], dim=1)
        pos = torch.cat([pos, pos.new_zeros(3, 1, pad)], dim=2)
    cos, sin = lm.rotary_emb(h, pos)

    row_sizes = _split(n, size)
    r_lo = sum(row_sizes[:rank])
    rows = slice(r_lo, r_lo + row_sizes[rank])
    g, tr = row_sizes[rank], t - 1  # response tokens run as inputs: all but the last
    hr = cos_r = sin_r = None
    if g and tr:
        hr = model.get_input_embeddings()(response_ids[rows, :tr])
        pos_r = positions.with_responses(g, t)[:, :, lp_len:lp_len + tr]
        cos_r, sin_r = lm.rotary_emb(hr, pos_r)

    def qkv(attn, x, c, s):
        bsz, length = x.shape[:2]
        q = attn.q_proj(x).view(bsz, length, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(bsz, length, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(bsz, length, -1, attn.head_dim).transpose(1, 2)
        q, k = rotary_fn(q, k, c, s)
        return q, k, v

    def expand(attn, x):
        return x.repeat_interleave(attn.num_key_value_groups, dim=1) if attn.num_key_value_groups > 1 else x

    def layer_step(layer, h, hr, cos, sin, cos_r, sin_r):
        attn = layer.self_attn
        q, k, v = qkv(attn, layer.input_layernorm(h), cos, sin)
        k, v = gather_seq(torch.stack([k, v]), dim=3, grad="sum", group=group, sizes=[chunk] * size).unbind(0)
        k, v = expand(attn, k), expand(attn, v)  # once: the prompt's rows and the responses read the same copy
        o = prefix_causal_attention(q, k, v, lo, attn.scaling)
        o = attn.o_proj(o.transpose(1, 2).reshape(1, chunk, -1))
        if hr is not None:  # this rank's response rows over the prompt's keys (padding trimmed) + their own
            qr, kr, vr = qkv(attn, layer.input_layernorm(hr), cos_r, sin_r)
            orr = shared_prefix_attention(qr, k[:, :, :lp_len], v[:, :, :lp_len], expand(attn, kr),
                                          expand(attn, vr), attn.scaling)
            hr = hr + attn.o_proj(orr.transpose(1, 2).reshape(g, tr, -1))
            hr = hr + layer.mlp(layer.post_attention_layernorm(hr))
        h = h + o
        return h + layer.mlp(layer.post_attention_layernorm(h)), hr

    for layer in lm.layers:  # under FSDP each layer's weights are gathered (and its gradient reduced) around it
        h, hr = run_as_forward(layer, functools.partial(layer_step, layer), h, hr, cos, sin, cos_r, sin_r)
    h = lm.norm(h)

    # under grad, every rank's graph must reach its K/V collectives in the backward, whatever it returns
    anchor = _anchor(model, h) if h.requires_grad else None
    owner = (lp_len - 1) // chunk
    if rank == owner:  # the first response token, from the prompt's last position (one row of logits)
        logits0 = model.lm_head(h[:, lp_len - 1 - lo])  # [1, V]
        first = token_logprobs(logits0.unsqueeze(1).expand(n, 1, -1), response_ids[:, :1], temperature)
    else:
        first = h.new_zeros(n, 0, dtype=torch.float32)
    if anchor is not None:
        first = first + anchor
    first = gather_seq(first, dim=1, grad="own", group=group, sizes=[1 if r == owner else 0 for r in range(size)])
    if not tr:
        return first
    if hr is not None:
        rest = token_logprobs(model.lm_head(lm.norm(hr)), response_ids[rows, 1:], temperature)
    else:
        rest = h.new_zeros(0, tr, dtype=torch.float32)
    if anchor is not None:
        rest = rest + anchor
    rest = gather_seq(rest, dim=0, grad="own", group=group, sizes=row_sizes)
    return torch.cat([first, rest], dim=1)


def prefill_logprobs(model, prompt_ids: Tensor, response_ids: Tensor, response_mask: Tensor, *, features: Tensor,
                     positions: PromptPositions, temperature: float = 1.0, group=None,
                     sp_min_tokens: int = 3072, share_prompt: bool = True) -> Tensor:
    """Per-token log-probs ``[N, T]`` of ``N`` responses to one prompt from cached features and positions,
    identical on every rank of ``group``.

    * one rank (``group`` ``None`` or of size 1): the plain stage-1 forward
      (:func:`longreel.trainer.mrsp.reuse.response_logprobs`; with ``share_prompt`` the prompt runs once for the ``N``
      rows);
    * ``Lp + T >= sp_min_tokens``: sequence-parallel over ``group``; with ``share_prompt`` the prompt runs once
      sequence-parallel and the rows are split over the ranks (:func:`sp_shared_prompt_logprobs`), else every
      row's whole sequence is split (:func:`sp_response_logprobs`);
    * shorter sequences on a group of several ranks: the ``N`` rows are split in contiguous chunks over the
      ranks (each runs the plain forward on its rows, its prompt once with ``share_prompt``) and the log-probs
      are all-gathered, so the gradient convention is the same as under SP.

    Every rank of ``group`` must call this with the same arguments and compute the same loss from the result;
    then sum parameter gradients over ``group`` (``dist_ops.allreduce_grads_``).
    """
    n, t = response_ids.shape
    total = prompt_ids.shape[1] + t
    rank, size = world(group)
    if size == 1:
        return response_logprobs(model, prompt_ids, response_ids, response_mask, features=features,
                                 positions=positions, temperature=temperature, share_prompt=share_prompt)
    if not sp_enabled(total, group, sp_min_tokens):
        sizes = _split(n, size)
        lo = sum(sizes[:rank])
        rows = slice(lo, lo + sizes[rank])
        if sizes[rank]:
            lp = response_logprobs(model, prompt_ids, response_ids[rows], response_mask[rows], features=features,
                                   positions=positions, temperature=temperature, share_prompt=share_prompt)
        elif torch.is_grad_enabled() and is_fsdp(model):
            # no rows here, but under FSDP every rank must run the model's units (each runs collectives): one row
            # at weight zero
            one = response_logprobs(model, prompt_ids, response_ids[:1], response_mask[:1], features=features,
                                    positions=positions, temperature=temperature, share_prompt=share_prompt)
            lp = features.new_zeros(0, t, dtype=torch.float32) + 0.0 * one.sum()
        else:  # no rows here; keep the features' graph connected so the ranks' backward collectives match
            lp = features.new_zeros(0, t, dtype=torch.float32)
            if torch.is_grad_enabled() and features.requires_grad:
                lp = lp + 0.0 * features.sum()
        if torch.is_grad_enabled() and features.requires_grad and not lp.requires_grad:
            lp = lp + 0.0 * features.sum()
        return gather_seq(lp, dim=0, grad="own", group=group, sizes=sizes)
    if share_prompt:
        return sp_shared_prompt_logprobs(model, prompt_ids, response_ids, features=features, positions=positions,
                                         temperature=temperature, group=group)
    ids = torch.cat([prompt_ids.expand(n, -1), response_ids], dim=1)
    attn = torch.cat([torch.ones_like(prompt_ids).expand(n, -1), response_mask.to(prompt_ids.dtype)], dim=1)
    return sp_response_logprobs(model, ids, positions.with_responses(n, t), prompt_ids.shape[1], features=features,
                                attention_mask=attn, temperature=temperature, group=group)
