"""The ``N`` responses of one prompt as ONE packed row on top of the prompt's single K/V cache (batch 1).

Repeating a prompt's K/V cache to ``N`` rows (``DynamicCache.batch_repeat_interleave``, or ``expand`` followed by
the cache's ``cat``) materialises ``N`` copies of the prompt's K/V per layer, and under grad every copy is held
for the backward. Here the responses are concatenated into one row of ``N * S`` tokens instead, and a 4D mask
lets each response token see every prompt position plus its own response's earlier (real) tokens, block-
diagonal over the responses, so the cache's ``cat`` appends the responses to the prompt's one copy:

    logits = packed_response_logits(model, cache, ids, mask, positions)   # cache: the prompt's K/V, batch 1

transformers (5.x, ``masking_utils._preprocess_mask_arguments``) passes a 4D ``attention_mask`` through
unchanged to the attention function; an additive float mask is what both the ``eager`` (``weights + mask``)
and the ``sdpa`` paths take. Other attention implementations (flash, flex) need another mask format, so
:func:`can_pack_responses` says no there and callers keep the repeated-cache path.

Cost: the attention scores are ``[N*S, Lp + N*S]`` instead of ``N x [S, Lp + S]`` (the off-diagonal response
blocks are computed and masked), and the mask itself is one ``[N*S, Lp + N*S]`` tensor shared by the layers;
both are small next to ``N - 1`` copies of a long prompt's K/V in every layer.
"""
from __future__ import annotations

import torch
from torch import Tensor

from longreel.engines.kv_cache import cache_kwargs
from longreel.trainer.packed_row_attention import PACKED_ROW_ATTENTION

__all__ = ["can_pack_responses", "packed_attention_mask", "packed_positions", "packed_response_logits", "packed_row_mask",
           "packed_row_positions", "packed_row_logits"]

PACKABLE_ATTENTION = ("eager", "sdpa", PACKED_ROW_ATTENTION)


def _text_config(model):
    inner = getattr(model, "model", model)
    text = getattr(inner, "language_model", None)
    return text.config if text is not None else getattr(model.config, "text_config", model.config)


def can_pack_responses(model) -> bool:
    """Whether the text decoder's attention takes the additive 4D mask the packed row needs."""
    return getattr(_text_config(model), "_attn_implementation", None) in PACKABLE_ATTENTION


def packed_attention_mask(key_mask: Tensor, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive mask ``[1, 1, N*S, prefix_len + N*S]`` (0 = attend, ``finfo(dtype).min`` = masked) for ``N``
    responses of ``S`` tokens packed in one row after a ``prefix_len``-token prompt.

    ``key_mask`` ``[N, S]``: 1 on real tokens. Query ``(b, i)`` attends every prompt position and key ``(b, j)``
    with ``j <= i`` and ``key_mask[b, j] == 1``; never another response. Every query sees the prompt, so no row
    is fully masked (a padding query's output is meaningless but finite).
    """
    n, s = key_mask.shape
    dev = key_mask.device
    block = torch.arange(n, device=dev).repeat_interleave(s)
    step = torch.arange(s, device=dev).repeat(n)
    allowed = (block[:, None] == block[None, :]) & (step[None, :] <= step[:, None]) & key_mask.reshape(1, -1).bool()
    allowed = torch.cat([allowed.new_ones(n * s, prefix_len), allowed], dim=1)
    out = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill_(~allowed, torch.finfo(dtype).min)
    return out[None, None]


def packed_positions(position_ids: Tensor) -> Tensor:
    """Per-response position ids ``[3, N, S]`` (M-RoPE) or ``[N, S]`` -> the packed row's ``[3, 1, N*S]`` /
    ``[1, N*S]`` (responses in order)."""
    if position_ids.dim() == 3:
        return position_ids.reshape(position_ids.shape[0], 1, -1)
    return position_ids.reshape(1, -1)


def packed_response_logits(model, cache, response_ids: Tensor, key_mask: Tensor, position_ids: Tensor) -> Tensor:
    """Logits ``[N, S, V]`` of ``N`` right-padded token rows ``response_ids`` ``[N, S]`` run as one packed row on
    ``cache`` (a transformers cache holding one prompt's K/V, batch 1; the responses are appended to it).

    ``key_mask`` ``[N, S]``: 1 on real tokens; ``position_ids``: the rows' own positions (``[3, N, S]`` or ``[N, S]``,
    as for the repeated-cache forward). Gradients flow to the cache's tensors and the model like the batched path.
    """
    n, s = response_ids.shape
    prefix_len = cache.get_seq_length()
    dtype = model.get_input_embeddings().weight.dtype
    mask = packed_attention_mask(key_mask, prefix_len, dtype)
    logits = model(input_ids=response_ids.reshape(1, -1), attention_mask=mask,
                   position_ids=packed_positions(position_ids), use_cache=True, **cache_kwargs(cache)).logits
    return logits.view(n, s, -1)


# ---- the prompt and its packed responses as ONE row, no cache: the shared prompt under gradient checkpointing ----
#
# transformers' checkpointed decoder layers keep no K/V cache in training mode, so the cache-based paths above
# cannot run there and every response used to carry its own copy of the prompt (N x the prompt's compute in the
# update: the text decoder was 12.5-13.5 s of an 18 s GRPO step at 1,024 frames on an H100,
# benchmarks/results/grpo_gpu.md). Here the prompt and the N packed responses form one row of Lp + N*S tokens
# with a 4D mask (prompt causal; each response sees the whole prompt and its own earlier tokens), so the prompt
# runs once and the layers checkpoint as usual. On a decoder switched to packed_row_attention (load_policy's
# default for Qwen2-VL-family models on SDPA) the prompt's rows run as plain causal attention and only the
# responses' rows take a mask, [N*S, L]; elsewhere (eager) the row takes one [L, L] additive mask that the layers
# share: 2 bytes x L^2 in bf16 (1.9 GB at L = 31k), and the full L x L scores.


def packed_row_mask(prefix_len: int, key_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive mask ``[1, 1, L, L]`` (``L = prefix_len + N*S``) for a ``prefix_len``-token prompt followed by the
    ``N`` responses of :func:`packed_attention_mask` (``key_mask`` ``[N, S]``): the prompt's rows are causal and see
    no response; the responses' rows are :func:`packed_attention_mask`'s."""
    n, s = key_mask.shape
    dev = key_mask.device
    top = torch.full((prefix_len, prefix_len + n * s), torch.finfo(dtype).min, dtype=dtype, device=dev)
    top[:, :prefix_len].triu_(1)  # 0 on and below the diagonal: causal within the prompt
    return torch.cat([top[None, None], packed_attention_mask(key_mask, prefix_len, dtype)], dim=2)


def packed_row_positions(prompt_positions: Tensor, response_positions: Tensor) -> Tensor:
    """The row's position ids: the prompt's (``[3, 1, Lp]`` or ``[1, Lp]``) followed by the packed responses'
    (``[3, N, S]`` or ``[N, S]``, see :func:`packed_positions`)."""
    return torch.cat([prompt_positions, packed_positions(response_positions).to(prompt_positions.device)], dim=-1)


def packed_row_logits(model, row_inputs: dict, prefix_len: int, response_mask: Tensor, prompt_positions: Tensor,
                      response_positions: Tensor) -> Tensor:
    """Per-response logits ``[N, T, V]`` from ONE forward of the prompt followed by the ``N`` responses' first
    ``T - 1`` tokens, packed (:func:`packed_row_mask`, :func:`packed_row_positions`).

    ``row_inputs``: the row's own model inputs (``input_ids`` or ``inputs_embeds`` of length
    ``prefix_len + N*(T-1)``, plus e.g. the prompt's video inputs); ``response_mask`` ``[N, T]``;
    ``prompt_positions`` ``[3, 1, Lp]`` / ``[1, Lp]``; ``response_positions`` ``[3, N, T]`` / ``[N, T]``. The
    prompt's last position predicts every response's first token, then each response its next ones.
    """
    n, t = response_mask.shape
    dtype = model.get_input_embeddings().weight.dtype
    dev = prompt_positions.device
    key_mask = response_mask[:, :-1].to(dev)
    if t > 1 and getattr(_text_config(model), "_attn_implementation", None) == PACKED_ROW_ATTENTION:
        mask = dict(attention_mask=packed_attention_mask(key_mask, prefix_len, dtype), packed_prompt_len=prefix_len)
    else:
        mask = dict(attention_mask=packed_row_mask(prefix_len, key_mask, dtype))
    logits = model(**row_inputs, **mask,
                   position_ids=packed_row_positions(prompt_positions, response_positions[..., :-1]),
                   logits_to_keep=1 + n * (t - 1), use_cache=False).logits
    first = logits[:, :1].expand(n, -1, -1)
    if t == 1:
        return first
    return torch.cat([first, logits[0, 1:].reshape(n, t - 1, -1)], dim=1)
