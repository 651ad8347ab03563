"""The vision tower's attention as one batched SDPA call per run of equal-length frames.

Qwen2-VL-family towers attend within each temporal patch (two frames) only: a video of ``T`` patches is ``T``
independent blocks along one packed sequence, described by ``cu_seqlens``. With ``attn_implementation="sdpa"``,
transformers' ``VisionAttention`` splits the packed sequence and calls SDPA once per block, in Python: at 1,024
frames that is 512 calls in each of the tower's 32 blocks, and with grad on each call also records its own
autograd nodes. The tower is then bound by launch and bookkeeping overhead rather than by arithmetic (on an H100,
a 2B-class tower's encode with grad under checkpointing took 3x its no-grad time: benchmarks/results/grpo_gpu.md).

Every block of one video has the same length, so consecutive blocks of equal length are reshaped into a batch and
go through a single SDPA call. Each (batch, head) slice is the same attention as before; on this machine's CPU the
features are bitwise equal to the per-block path (tests/test_vision_attention.py).

transformers hands ``cu_seqlens`` to the attention function only on its variable-length (flash) path, which it
selects when the implementation's name contains ``flash``: hence the registered name. Only the vision sub-config
is switched; the text decoder keeps plain SDPA and its masks.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BATCHED_VISION_ATTENTION", "batched_varlen_sdpa", "use_batched_vision_attention", "VISION_ATTENTION"]

log = logging.getLogger("longreel.trainer")

#: the name the function is registered under in transformers' AttentionInterface (see the module docstring)
BATCHED_VISION_ATTENTION = "flash_varlen_sdpa_longreel"
#: ``model.vision_attention`` choices: ``batched`` (this module) or ``native`` (transformers' own per-block loop)
VISION_ATTENTION = ("batched", "native")
#: towers whose VisionAttention takes the varlen path with ``cu_seq_lens_q`` and no mask (checked by the tests for
#: qwen2_vl; Qwen2.5-VL's window attention passes its window ``cu_seqlens`` the same way)
_SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``[(length, count)]``: consecutive equal lengths grouped, in order."""
    runs: list[tuple[int, int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1] = (n, runs[-1][1] + 1)
        else:
            runs.append((n, 1))
    return runs


def batched_varlen_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                        cu_seq_lens_q: Tensor | None = None, cu_seq_lens_k: Tensor | None = None,
                        is_causal: bool = False, **kwargs) -> tuple[Tensor, None]:
    """Block-diagonal attention over a packed sequence.

    ``query``/``key``/``value``: ``[1, H, N, D]`` (``N`` packed tokens); ``cu_seq_lens_q``: ``LongTensor[B + 1]``
    block boundaries (the same for keys). Returns ``([1, N, H, D], None)``, the layout of transformers' attention
    functions. Runs of equal-length blocks become one ``[count, H, length, D]`` SDPA call each.
    """
    if attention_mask is not None or is_causal:
        raise ValueError("batched_varlen_sdpa is for the vision tower's unmasked, non-causal attention")
    if cu_seq_lens_q is None:
        raise ValueError("batched_varlen_sdpa needs cu_seq_lens_q (the packed sequence's block boundaries)")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k,
                                                                                           cu_seq_lens_q):
        raise ValueError("batched_varlen_sdpa: query and key blocks differ")
    _, heads, total, dim = query.shape
    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()  # one host sync per layer, not one per block
    if sum(lengths) != total:
        raise ValueError(f"cu_seq_lens_q covers {sum(lengths)} tokens, the sequence has {total}")
    p = dropout if module.training else 0.0
    outs, start = [], 0
    for length, count in _runs(lengths):
        stop = start + length * count
        q, k, v = (t[0, :, start:stop].reshape(heads, count, length, dim).transpose(0, 1)
                   for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=scaling)  # [count, H, length, D]
        outs.append(o.transpose(1, 2).reshape(count * length, heads, dim))
        start = stop
    return torch.cat(outs, 0).unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(BATCHED_VISION_ATTENTION, batched_varlen_sdpa)


def use_batched_vision_attention(model: torch.nn.Module) -> bool:
    """Switch ``model``'s vision tower (a Qwen2-VL-family model loaded with SDPA) to :func:`batched_varlen_sdpa`.

    Returns whether it switched: other model types, and towers on another implementation (eager, flash), are
    left as they are. Only the in-memory config changes: ``save_pretrained`` does not record it.
    """
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "model_type", None) not in _SUPPORTED_MODEL_TYPES:
        return False
    if getattr(vision, "_attn_implementation", None) != "sdpa":
        return False
    _register()
    vision._attn_implementation = BATCHED_VISION_ATTENTION
    log.debug("vision tower attention: %s (one SDPA call per run of equal-length frames)", BATCHED_VISION_ATTENTION)
    return True
