"""Prefilling a prompt once for its ``n`` sampled continuations (transformers ``generate``).

Used by the transformers engine's prepared-inputs path (GRPO rollouts: the G responses of a prompt) and by
MR-SP's embedding reuse. Generic over Hugging Face models whose forward takes the prompt's keywords and returns a
``DynamicCache``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_PER_TOKEN = ("input_ids", "attention_mask", "mm_token_type_ids")


def prefill_prompt_once(model, prompt_inputs: dict[str, Any], n: int):
    """The K/V cache (transformers ``DynamicCache``) of ``input_ids[:, :-1]`` of one prompt, repeated to ``n``
    rows, for ``model.generate(input_ids=input_ids.expand(n, -1), past_key_values=cache)``.

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
        cache = model(**head, use_cache=True, logits_to_keep=1).past_key_values
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
                          past_key_values=cache, **generate_kwargs)
