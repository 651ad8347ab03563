"""Autograd-aware collectives for MR-SP (torch.distributed; gloo on CPU, NCCL on GPU).

Gradient convention, used by every MR-SP collective: each rank ``r`` computes a partial loss ``L_r`` and the
training loss is ``L = sum_r L_r``; after ``backward`` each rank holds the gradient of ``L`` w.r.t. *its own*
inputs, so parameter gradients must be **summed** across the group (:func:`allreduce_grads_`).

* :func:`gather_seq` - concatenation of per-rank chunks of different lengths along ``dim``.
  ``grad="sum"``: rank ``r``'s chunk gets ``sum_k dL_k/dchunk_r`` (use when ranks consume different parts of the
  gathered tensor, e.g. the vision features feeding a sequence-parallel prefill, or K/V).
  ``grad="own"``: rank ``r``'s chunk gets its own rank's ``dL_r/dchunk_r`` (use when every rank computes the
  *same* loss from the gathered tensor, e.g. the GRPO loss over gathered log-probs; then ``L_r`` is "rank
  ``r``'s share" of one replicated loss and the sum over ranks is the loss once).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["world", "gather_sizes", "gather_seq", "allreduce_grads_"]


def world(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather_sizes(n: int, group=None) -> list[int]:
    """Every rank's ``n`` (a small all-gather)."""
    rank, size = world(group)
    if size == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.long)
    out = [torch.zeros_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return [int(x) for x in out]


def _all_gather_varlen(x: Tensor, sizes: Sequence[int], dim: int, group) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (sizes may differ): pad to the max, all-gather, trim."""
    x = x.movedim(dim, 0).contiguous()
    m = max(sizes)
    if x.shape[0] < m:
        x = torch.cat([x, x.new_zeros((m - x.shape[0],) + tuple(x.shape[1:]))], dim=0)
    bufs = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(bufs, x, group=group)
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)], dim=0).movedim(0, dim)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, sizes: tuple, grad_mode: str, group):
        ctx.dim, ctx.sizes, ctx.grad_mode, ctx.group = dim, sizes, grad_mode, group
        return _all_gather_varlen(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        rank, _ = world(ctx.group)
        grad = grad.contiguous()
        if ctx.grad_mode == "sum":
            grad = grad.clone()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[:rank])
        return grad.narrow(ctx.dim, start, ctx.sizes[rank]), None, None, None, None


def gather_seq(x: Tensor, *, dim: int = 0, grad: str = "sum", group=None, sizes: Sequence[int] | None = None) -> Tensor:
    """All ranks' ``x`` concatenated along ``dim`` in rank order (differentiable, see the module docstring).

    ``sizes``: every rank's length along ``dim`` when the caller knows them (saves one all-gather).
    Every rank of ``group`` must call this (and, under grad, run the backward) the same number of times.
    """
    if grad not in ("sum", "own"):
        raise ValueError(f"grad must be 'sum' or 'own', got {grad!r}")
    rank, size = world(group)
    if size == 1:
        return x
    dim = dim % x.dim()
    sizes = tuple(int(s) for s in (sizes if sizes is not None else gather_sizes(int(x.shape[dim]), group)))
    if sizes[rank] != x.shape[dim]:
        raise ValueError(f"rank {rank}: sizes[{rank}]={sizes[rank]} but x has {x.shape[dim]} along dim {dim}")
    if not torch.is_grad_enabled() or not x.requires_grad:
        return _all_gather_varlen(x, sizes, dim, group)
    return _GatherSeq.apply(x, dim, sizes, grad, group)


def allreduce_grads_(params, group=None) -> None:
    """Sum ``.grad`` of ``params`` across ``group`` in place (parameters without a grad count as zero)."""
    rank, size = world(group)
    if size == 1:
        return
    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    off = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[off:off + n].view_as(g).clone()
        off += n
