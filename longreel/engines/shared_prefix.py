"""Prefilling a prompt once for its ``n`` sampled continuations.

* :func:`generate_shared_prefix`: transformers ``generate`` on the prompt's cache repeated to ``n`` rows.
  Generic over Hugging Face models whose forward takes the prompt's keywords and returns a ``DynamicCache``.
* :func:`sample_shared_prefixes` (:func:`sample_shared_prefix` for one prompt): Qwen2-VL-family decoders
  (:func:`supports_shared_decode`): each prompt's K/V kept as one copy that its rows attend to (no ``n`` copies),
  several prompts' rows decoded in one batch, and every row sampled from its own seed (:func:`rollout_row_seed`),
  so any subset of a group's rows can be sampled anywhere (an SP group splits them), with any other prompts.

Used by the transformers engine's prepared-inputs path (GRPO rollouts: the G responses of a prompt) and by
MR-SP's embedding reuse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longreel.engines.kv_cache import cache_kwargs, output_cache

_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids")


def prefill_prompt_once(model, prompt_inputs: dict[str, Any], n: int):
    """The K/V cache (transformers ``DynamicCache``) of ``input_ids[:, :-1]`` of one prompt, repeated to ``n``
    rows, for ``model.generate(input_ids=input_ids.expand(n, -1), **cache_kwargs(cache))``.

    ``prompt_inputs``: the prompt's ``model(...)`` keywords (batch 1: ``input_ids`` ``[1, Lp]``, vision inputs,
    per-token tensors such as ``mm_token_type_ids`` ``[1, Lp]``). The last prompt token is left for
    ``generate`` (it needs the logits of one uncached token to start). The forward computes the prompt's M-RoPE
    positions itself and stores the model's ``rope_deltas``, which ``generate`` then uses for the new tokens,
    as it does after its own prefill. Returns ``None`` when the prompt cannot be split so (a vision placeholder
    in last position, or a one-token prompt): the caller then lets ``generate`` prefill every row.
    """
    ids = prompt_inputs["input_ids"]
    types = prompt_inputs.get("mm_token_type_ids")
    if ids.shape[1] < 2 or (types is not None and bool(types[:, -1].any())):
        return None
    head = {k: v[:, :-1] if k in _PER_TOKEN and v is not None else v for k, v in prompt_inputs.items()}
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        # a prompt without vision inputs sets no rope_deltas: generate must not reuse the previous prompt's
        inner.rope_deltas = None
    with torch.no_grad():
        cache = output_cache(model(**head, use_cache=True, logits_to_keep=1))
    cache.batch_repeat_interleave(n)
    return cache


def generate_shared_prefix(model, prompt_inputs: dict[str, Any], n: int, **generate_kwargs: Any) -> Tensor:
    """``n`` continuations of one prompt with the prompt prefilled once (:func:`prefill_prompt_once`) instead
    of once per row. Returns ``[n, Lp + new]`` like ``model.generate(**prompt_inputs, num_return_sequences=n)``.

    Same seed, same tokens: ``generate`` then samples every step from an ``[n, V]`` distribution, exactly as
    with ``num_return_sequences=n`` (the same random draws), and its logits equal the per-row prefill's within
    fp32 rounding (tests/test_shared_prefix.py compares both, tokens and per-step logits). A draw can only
    differ where a uniform sample falls within that rounding of a CDF boundary (or, greedy, on an exact tie).
    """
    cache = prefill_prompt_once(model, prompt_inputs, n)
    if cache is None:
        return model.generate(**prompt_inputs, num_return_sequences=n, **generate_kwargs)
    ids = prompt_inputs["input_ids"]
    return model.generate(input_ids=ids.expand(n, -1), attention_mask=torch.ones_like(ids).expand(n, -1),
                          **cache_kwargs(cache), **generate_kwargs)


# ------------------------------------------------------------------------------------------------------------------
# Per-rollout seeds and a decoder that keeps one copy of the prompt's K/V
# ------------------------------------------------------------------------------------------------------------------


def rollout_row_seed(seed: int, row: int) -> int:
    """Seed of rollout ``row`` of a group sampled under ``seed``: a function of the two only, so a rollout is the
    same whichever process samples it and whichever other rows it is batched with (an SP group's ranks split a
    group's rows; one process samples them all)."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed) & (2**63 - 1), int(row)]).generate_state(1, np.uint64)[0] >> 1)


class RowSampler:
    """Samples one token per row, row ``r`` from its own ``torch.Generator`` (seeded ``seeds[r]``), after the
    suppressed tokens, the temperature, top-k and top-p. Returns the tokens ``[g]`` and their log-probs under
    ``log_softmax(logits / temperature)`` (no suppression or truncation: what the trainer computes)."""

    def __init__(self, seeds, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0,
                 greedy: bool = False, suppress_tokens=None, device="cpu"):
        self.greedy = bool(greedy) or temperature <= 0
        self.temperature = 1.0 if self.greedy else float(temperature)
        self.top_p, self.top_k = float(top_p), int(top_k or 0)
        self.suppress = list(suppress_tokens or [])
        self.gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    def __call__(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        scaled = logits.float() / self.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        if self.suppress:
            scaled = scaled.index_fill(-1, torch.as_tensor(self.suppress, device=scaled.device), float("-inf"))
        if self.greedy:
            tok = scaled.argmax(-1)
        else:
            if 0 < self.top_k < scaled.shape[-1]:
                kth = scaled.topk(self.top_k, dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if self.top_p < 1.0:  # keep the smallest set whose mass reaches top_p (the top token always)
                srt, idx = scaled.sort(-1, descending=True)
                mass = srt.softmax(-1).cumsum(-1)
                drop = (mass - srt.softmax(-1)) >= self.top_p
                scaled = scaled.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
            probs = scaled.softmax(-1)
            tok = torch.stack([torch.multinomial(probs[r], 1, generator=gen)[0] for r, gen in enumerate(self.gens)])
        return tok, logp.gather(-1, tok[:, None])[:, 0]


def _language_model(model):
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None)
    return inner, lm


def supports_shared_decode(model) -> bool:
    """Whether :func:`sample_shared_prefix` can run ``model``'s decoder: a Qwen2-VL-family model (M-RoPE through
    ``rope_deltas``) whose text layers are plain full-attention Qwen2 layers (q/k/v/o projections, no q/k norm)."""
    import sys

    inner, lm = _language_model(model)
    if lm is None or not hasattr(inner, "rope_deltas") or not hasattr(lm, "layers") or not len(lm.layers):
        return False
    cfg = lm.config
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention"
                                                         for t in getattr(cfg, "layer_types", None) or []):
        return False
    attn = lm.layers[0].self_attn
    mod = sys.modules[type(attn).__module__]
    return (all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            and not hasattr(attn, "q_norm") and hasattr(mod, "apply_rotary_pos_emb") and hasattr(lm, "rotary_emb"))


def _two_part_attention(q: Tensor, kp: Tensor, vp: Tensor, kr: Tensor, vr: Tensor, scale: float,
                        prompt_valid: Tensor | None = None) -> Tensor:
    """One new token per row attending over its prompt's keys (one copy per prompt, ``[P, Hkv, Lp, D]``, seen by
    every row of that prompt) and its own response keys (``[P * g, Hkv, t, D]``); the two softmaxes merged exactly
    by their log-sum-exps.

    ``q``: ``[P * g, H, 1, D]``, prompt ``p``'s ``g`` rows contiguous, with ``H = Hkv * grp`` (query head ``h``
    reads KV head ``h // grp``). The prompt part is one batched product per prompt and KV head of all its
    ``g * grp`` queries with that head's prompt keys, so a prompt's K/V are read once per step for its whole group
    and never copied per row. ``prompt_valid``: ``BoolTensor[P, Lp]``, False on the right padding of prompts
    shorter than the longest (those keys get no weight). Returns ``[P * g, 1, H * D]``."""
    rows, h, _, d = q.shape
    n_prompts, hkv = kp.shape[0], kp.shape[1]
    g, grp = rows // n_prompts, h // hkv
    qg = q.reshape(n_prompts, g, hkv, grp, d)
    qp = qg.permute(0, 2, 1, 3, 4).reshape(n_prompts, hkv, g * grp, d)
    s1 = torch.matmul(qp, kp.transpose(-1, -2)) * scale                       # [P, Hkv, g*grp, Lp]
    if prompt_valid is not None:
        s1 = s1.masked_fill(~prompt_valid[:, None, None, :], float("-inf"))
    l1 = torch.logsumexp(s1, -1, keepdim=True)
    o1 = torch.matmul(torch.exp(s1 - l1), vp)                                 # [P, Hkv, g*grp, D]
    o1 = o1.reshape(n_prompts, hkv, g, grp, d).permute(0, 2, 1, 3, 4).reshape(rows, hkv, grp, d)
    l1 = l1.reshape(n_prompts, hkv, g, grp, 1).permute(0, 2, 1, 3, 4).reshape(rows, hkv, grp, 1)
    qr = qg.reshape(rows, hkv, grp, d)
    s2 = torch.matmul(qr, kr.transpose(-1, -2)) * scale                       # [P*g, Hkv, grp, t]
    l2 = torch.logsumexp(s2, -1, keepdim=True)
    o2 = torch.matmul(torch.exp(s2 - l2), vr)
    lse = torch.logaddexp(l1, l2)
    o = torch.exp(l1 - lse) * o1 + torch.exp(l2 - lse) * o2                   # [P*g, Hkv, grp, D]
    return o.reshape(rows, 1, h * d)


@dataclass
class SharedDecode:
    """``tokens[r]``: row ``r``'s sampled ids up to and including the first end-of-sequence token (or
    ``max_new_tokens`` of them); ``logprobs[r]``: their log-probs (temperature applied); ``finished[r]``: it
    stopped at an end of sequence."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finished: list[bool]


@dataclass
class _Prefilled:
    """One prompt after its prefill: the logits of its last token ``[1, V]``, its K/V per text layer (one copy,
    ``[1, Hkv, Lp, D]`` each), its length and its M-RoPE offset for the tokens that follow."""

    logits: Tensor
    kv: list[tuple[Tensor, Tensor]]
    length: int
    delta: int


def _prefill(model, inner, prompt_inputs: dict[str, Any]) -> _Prefilled:
    inner.rope_deltas = None  # the prefill computes this prompt's own
    out = model(**prompt_inputs, use_cache=True, logits_to_keep=1)
    delta = inner.rope_deltas
    return _Prefilled(out.logits[:, -1], [(layer.keys, layer.values) for layer in output_cache(out).layers],
                      int(prompt_inputs["input_ids"].shape[1]), int(delta.reshape(-1)[0]) if delta is not None else 0)


def _stack_prompts(prefilled: list[_Prefilled], layer: int) -> tuple[Tensor, Tensor]:
    """Layer ``layer``'s prompt keys and values of every prompt, right-padded to the longest: ``[P, Hkv, Lp, D]``
    each (one prompt: its own tensors, no copy). The prompts' own copies of the layer are dropped as it is
    stacked, so the K/V are held about once, not twice, while the layers are stacked."""
    if len(prefilled) == 1:
        return prefilled[0].kv[layer]
    width = max(p.length for p in prefilled)
    ks, vs = [], []
    for p in prefilled:
        k, v = p.kv[layer]
        p.kv[layer] = None
        ks.append(torch.nn.functional.pad(k, (0, 0, 0, width - p.length)))
        vs.append(torch.nn.functional.pad(v, (0, 0, 0, width - p.length)))
    return torch.cat(ks), torch.cat(vs)


@torch.no_grad()
def sample_shared_prefix(model, prompt_inputs: dict[str, Any], seeds, *, max_new_tokens: int, eos_ids,
                         temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0, greedy: bool = False,
                         suppress_tokens=None) -> SharedDecode:
    """``len(seeds)`` continuations of one prompt, row ``r`` sampled from its own generator seeded ``seeds[r]``:
    :func:`sample_shared_prefixes` for one prompt."""
    return sample_shared_prefixes(model, [prompt_inputs], [seeds], max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                  temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy,
                                  suppress_tokens=suppress_tokens)[0]


@torch.no_grad()
def sample_shared_prefixes(model, prompts_inputs: list[dict[str, Any]], seeds: list, *, max_new_tokens: int,
                           eos_ids, temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0,
                           greedy: bool = False, suppress_tokens=None) -> list[SharedDecode]:
    """``len(seeds[p])`` continuations of each prompt ``p`` (the same count for every prompt), row ``r`` of prompt
    ``p`` sampled from its own generator seeded ``seeds[p][r]``, all prompts' rows decoded together.

    Each prompt (``prompts_inputs[p]``: the model's keywords for batch 1, no padding) is prefilled once; its K/V
    stay one ``[1, Hkv, Lp, D]`` copy per layer (right-padded to the longest prompt and masked), and each decode
    step runs every prompt's rows' new tokens through the text layers in one batch (the HF modules' own
    projections, rotary, norms and MLPs), each row attending over its prompt's one copy and its own keys
    (:func:`_two_part_attention`). Decoding the prompts together rather than one after another turns ``P``
    small decode batches into one: on a GPU the per-step launch cost, on a CPU the per-call overhead of a small
    model, is paid once per step instead of once per prompt. Response positions follow each prompt's
    ``rope_deltas`` as in ``generate``. A row's tokens depend only on its seed, its prompt and the weights (not on
    the other rows or prompts), up to fp32 rounding of batched products: an SP group that splits the rows, or a
    caller that decodes the prompts one at a time, samples what one batched call samples.
    Needs :func:`supports_shared_decode`.
    """
    import sys

    inner, lm = _language_model(model)
    rotary = sys.modules[type(lm.layers[0].self_attn).__module__].apply_rotary_pos_emb
    g = len(seeds[0])
    if any(len(s) != g for s in seeds) or len(seeds) != len(prompts_inputs):
        raise ValueError("sample_shared_prefixes needs one seed list per prompt, all of one length")
    prefilled = [_prefill(model, inner, x) for x in prompts_inputs]
    device = prefilled[0].logits.device
    n_prompts, rows = len(prefilled), len(prefilled) * g
    sampler = RowSampler([s for row_seeds in seeds for s in row_seeds], temperature=temperature, top_p=top_p,
                         top_k=top_k, greedy=greedy, suppress_tokens=suppress_tokens, device=device)
    stops = torch.as_tensor(sorted({int(e) for e in eos_ids}), device=device)
    first = torch.cat([p.logits.expand(g, -1) for p in prefilled])
    tok, lp = sampler(first)
    prompt_kv = [_stack_prompts(prefilled, i) for i in range(len(lm.layers))]
    lengths = torch.as_tensor([p.length for p in prefilled], device=device)
    valid = None
    if n_prompts > 1 and bool((lengths != lengths.max()).any()):
        valid = torch.arange(int(lengths.max()), device=device)[None, :] < lengths[:, None]
    # each row's position of its first new token (its prompt's length plus its M-RoPE offset)
    start = torch.as_tensor([p.length + p.delta for p in prefilled], device=device).repeat_interleave(g)
    del prefilled, first
    kv_heads, head_dim = prompt_kv[0][0].shape[1], prompt_kv[0][0].shape[3]
    dtype = prompt_kv[0][0].dtype
    resp_k = [torch.empty(rows, kv_heads, max_new_tokens, head_dim, dtype=dtype, device=device) for _ in lm.layers]
    resp_v = [torch.empty_like(k) for k in resp_k]
    toks, lps = [tok], [lp]
    done = torch.isin(tok, stops)
    embed = model.get_input_embeddings()
    for t in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        h = embed(tok[:, None])
        pos = (start + t)[None, :, None].expand(3, rows, 1)
        cos, sin = lm.rotary_emb(h, pos)
        for i, layer in enumerate(lm.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
            q, k = rotary(q, k, cos, sin)
            resp_k[i][:, :, t] = k[:, :, 0]
            resp_v[i][:, :, t] = v[:, :, 0]
            o = _two_part_attention(q, *prompt_kv[i], resp_k[i][:, :, :t + 1], resp_v[i][:, :, :t + 1], attn.scaling,
                                    valid)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(lm.norm(h[:, -1]))
        tok, lp = sampler(logits)
        toks.append(tok)
        lps.append(lp)
        done |= torch.isin(tok, stops)
    return _cut_rows(torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist(), {int(s) for s in stops.tolist()},
                     n_prompts, g)


def _cut_rows(all_toks: list, all_lps: list, stop_set: set, n_prompts: int, g: int) -> list[SharedDecode]:
    """Each row cut after its first end-of-sequence token, rows grouped back by prompt."""
    out = []
    for p in range(n_prompts):
        res = SharedDecode([], [], [])
        for row_t, row_l in zip(all_toks[p * g:(p + 1) * g], all_lps[p * g:(p + 1) * g]):
            stop = next((j for j, x in enumerate(row_t) if x in stop_set), None)
            keep = len(row_t) if stop is None else stop + 1
            res.tokens.append(row_t[:keep])
            res.logprobs.append(row_l[:keep])
            res.finished.append(stop is not None)
        out.append(res)
    return out
