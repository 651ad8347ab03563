"""The packed row's text attention as two SDPA calls instead of one call with an ``[L, L]`` mask.

Under gradient checkpointing the update runs a prompt and its ``N`` responses as ONE row of ``L = Lp + N*S``
tokens (:func:`longreel.trainer.packed_responses.packed_row_logits`). Given to SDPA as one call with an additive
``[L, L]`` mask, that row costs the full ``L x L`` score matrix in every layer (a mask rules out the kernels that
skip the causal upper triangle, and on CUDA the flash kernel altogether) and one ``2 * L^2``-byte mask in bf16
(1.9 GB at L = 31k). Yet the mask's structure is known: the prompt's ``Lp`` rows are plain causal attention over
the prompt, and only the ``N*S`` response rows need a mask. So the prompt's rows go through SDPA with
``is_causal=True`` over the prompt's keys (flash on CUDA, the blocked causal kernel on CPU) and the response rows
through SDPA with the ``[N*S, L]`` mask over all keys; the two outputs are concatenated along the rows. Each query
row sees exactly the keys and weights it saw before, so the result is the same attention up to float rounding
(tests/test_packed_row_attention.py).

transformers picks a decoder's attention function by ``config._attn_implementation``; the function is registered
under its own name (with SDPA's mask builder, so every other call builds its usual masks) and switched on the
text sub-config only. It splits only when the caller says so with the ``packed_prompt_len`` keyword, which
transformers forwards from ``model(...)`` to every attention call (and gradient checkpointing keeps for the
recompute); without it the function is transformers' own SDPA path, so generation, the cached log-prob passes
and everything else run as before.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PACKED_ROW_ATTENTION", "PACKED_ROW_MODES", "packed_row_sdpa", "use_packed_row_attention"]

log = logging.getLogger("longreel.trainer")

#: the name the function is registered under in transformers' AttentionInterface and AttentionMaskInterface (no
#: "flash" in it: transformers would then hand it varlen arguments instead of masks)
PACKED_ROW_ATTENTION = "sdpa_packed_row_longreel"
#: ``model.packed_row_attention`` choices: ``split`` (this module) or ``mask`` (one SDPA call with the [L, L] mask)
PACKED_ROW_MODES = ("split", "mask")
#: decoders whose attention calls go through transformers' AttentionInterface with the forwarded keywords
_SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def packed_row_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    packed_prompt_len: int | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' SDPA attention, or, with ``packed_prompt_len=P``, a packed row's attention in two calls.

    ``query`` ``[B, H, L, D]``, ``key``/``value`` ``[B, Hkv, L, D]`` (no cache: the row is the whole sequence);
    with ``P``, ``attention_mask`` is the response rows' additive mask ``[1, 1, L - P, L]``
    (:func:`longreel.trainer.packed_responses.packed_attention_mask`) and the first ``P`` rows are causal over the
    first ``P`` keys. Returns ``([B, L, H, D], None)``, the layout of transformers' attention functions.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_prompt_len is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    p, length = int(packed_prompt_len), query.shape[2]
    if key.shape[2] != length or not 0 < p < length:
        raise ValueError(f"packed row: {length} queries, {key.shape[2]} keys, prompt of {p} (expects one uncached "
                         "row whose first packed_prompt_len tokens are the prompt)")
    if attention_mask is None or tuple(attention_mask.shape[-2:]) != (length - p, length):
        got = None if attention_mask is None else tuple(attention_mask.shape)
        raise ValueError(f"packed row: the mask must cover the {length - p} response rows over {length} keys, "
                         f"got {got}")
    kwargs.pop("is_causal", None)
    head = _causal_prompt(query[:, :, :p], key[:, :, :p], value[:, :, :p], dropout, scaling,
                          repeat_kv=query.is_cuda and query.dtype == torch.float32)
    tail, _ = sdpa_attention_forward(module, query[:, :, p:], key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, is_causal=False, **kwargs)
    return torch.cat([head, tail], dim=1), None


def _causal_prompt(query: Tensor, key: Tensor, value: Tensor, dropout: float, scaling: float | None, *,
                   repeat_kv: bool = False) -> Tensor:
    """Causal SDPA of the prompt's rows, ``[B, H, P, D]`` x ``[B, Hkv, P, D]`` -> ``[B, P, H, D]``.

    Called directly rather than through transformers' SDPA function, which asks for grouped-query attention
    whenever there is no mask: on CUDA only the flash kernel takes that, and flash needs fp16/bf16, so an fp32
    model would fall to the math kernel and materialise the ``[H, P, P]`` scores (measured on an H200 at 7.9k
    prompt tokens: +10 GiB and slower than the one masked call). There (``repeat_kv``) the K/V heads are repeated
    instead, which the memory-efficient kernel takes with ``is_causal``."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and repeat_kv:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                         enable_gqa=groups > 1 and not repeat_kv)
    return out.transpose(1, 2).contiguous()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ROW_ATTENTION, packed_row_sdpa)
    AttentionMaskInterface.register(PACKED_ROW_ATTENTION, sdpa_mask)


def use_packed_row_attention(model: torch.nn.Module) -> bool:
    """Switch ``model``'s text decoder (a Qwen2-VL-family model loaded with SDPA) to :func:`packed_row_sdpa`.

    Returns whether it switched: other model types and decoders on another implementation are left as they are
    (the packed row then takes its full mask). Only the in-memory config changes: ``save_pretrained`` does not
    record it."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "model_type", None) not in _SUPPORTED_MODEL_TYPES:
        return False
    if getattr(text, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    text._attn_implementation = PACKED_ROW_ATTENTION
    log.debug("text decoder attention: %s (a packed row's prompt and responses in two SDPA calls)",
              PACKED_ROW_ATTENTION)
    return True
