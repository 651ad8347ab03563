"""Per-token log-probs of the sampled tokens from a model's logits, a block of positions at a time.

``log_softmax(logits.float() / T).gather(labels)`` is the textbook form. At a VLM's vocabulary the logits are the
largest tensors of a GRPO update: with Qwen2-VL's 151,936 tokens, 8 responses of 1,024 tokens are 2.5 GB of bf16
logits. The textbook form makes a float32 tensor of twice that size for the upcast, for the division by the
temperature and for the log-softmax; autograd keeps the log-softmax until the backward, which makes more of that
size. Measured at that vocabulary, its forward and backward raised the peak memory by 6.0 times the bf16 logits'
bytes, and this module's by 1.6 times (most of it the logits' gradient).

:func:`chunked_token_logprobs` gives the same numbers (to float32 rounding) with one block of positions in float32
at a time (``block_elements``, 64 Mi floats by default: 256 MB). For the backward it keeps the logits as they came,
in the model's dtype, and the log-sum-exp of each position. The backward recomputes each block's softmax from them,
writing the gradient into one tensor in the logits' dtype. The work is one more pass over the logits in the
backward. Fused linear-cross-entropy kernels (Liger's, for example) go further and never make the logits, but they
take the hidden states and the LM head instead of logits and need Triton on a GPU. The trainer gets its logits from
the model in several ways (a shared prompt cache, packed rows, sequence-parallel prefill), so this works on the
logits themselves, in plain torch, on any device.

Measured by ``benchmarks/logprob_memory.py`` (``benchmarks/results/logprob_memory.json``).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunked_token_logprobs", "DEFAULT_BLOCK_ELEMENTS"]

#: float32 elements of one block (rows x vocabulary): 256 MB
DEFAULT_BLOCK_ELEMENTS = 1 << 26


def _blocks(n: int, t: int, vocab: int, block_elements: int):
    """``(rows of dim 0, positions of dim 1)`` slices covering ``[n, t]`` with about ``block_elements`` logits each:
    whole rows of several sequences when a sequence is short, parts of one sequence when it is long. Views of a
    ``[n, t, V]`` tensor by these slices need no copy, whatever its strides."""
    positions = max(1, block_elements // max(vocab, 1))
    if positions >= t:
        per = max(1, positions // max(t, 1))
        for r in range(0, n, per):
            yield slice(r, min(r + per, n)), slice(0, t)
    else:
        for r in range(n):
            for s in range(0, t, positions):
                yield slice(r, r + 1), slice(s, min(s + positions, t))


def _scaled(block: Tensor, temperature: float) -> Tensor:
    x = block.float()
    return x / temperature if temperature != 1.0 else x


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, block_elements: int) -> Tensor:
        n, t, vocab = logits.shape
        out = torch.empty((n, t), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for rows, pos in _blocks(n, t, vocab, block_elements):
            x = _scaled(logits[rows, pos], temperature)
            lse[rows, pos] = torch.logsumexp(x, dim=-1)
            out[rows, pos] = x.gather(-1, labels[rows, pos].unsqueeze(-1)).squeeze(-1) - lse[rows, pos]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.block_elements = temperature, block_elements
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        temperature = ctx.temperature
        n, t, vocab = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_out = grad_out.float()
        for rows, pos in _blocks(n, t, vocab, ctx.block_elements):
            g = grad_out[rows, pos].unsqueeze(-1)
            # d log p(label) / d x = onehot(label) - softmax(x), times the incoming gradient
            block = torch.exp(_scaled(logits[rows, pos], temperature) - lse[rows, pos].unsqueeze(-1)).mul_(-g)
            block.scatter_add_(-1, labels[rows, pos].unsqueeze(-1), g)
            if temperature != 1.0:
                block.div_(temperature)
            grad[rows, pos] = block
        return grad, None, None, None


def chunked_token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0, *,
                           block_elements: int = DEFAULT_BLOCK_ELEMENTS) -> Tensor:
    """``log softmax(logits / temperature)`` at ``labels``, float32, differentiable in ``logits``.

    Args:
        logits: ``[N, T, V]``, any floating dtype and strides (an expanded or sliced view is read as it is).
        labels: ``[N, T]`` token ids.
        temperature: the sampling temperature (the logits are divided by it first).
        block_elements: float32 logits computed at once; the block size changes neither result nor gradient.
    Returns:
        ``[N, T]`` float32.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"need logits [N, T, V] and labels [N, T], got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    return _ChunkedLogprobs.apply(logits, labels.to(logits.device), float(temperature), int(block_elements))
