"""Sharded vision encoding: the frames of the step's videos split across ranks in temporal-patch groups.

Qwen2-VL-family vision towers attend within one temporal patch group (``temporal_patch_size`` frames; the
``cu_seqlens`` of the tower are per group, Qwen2.5-VL's windows too) and their rotary positions depend only on
(h, w). A contiguous run of groups of a video is therefore encoded exactly by running the tower on its rows of
``pixel_values_videos`` with the sub-grid ``[t', h, w]``. So:

1. :func:`plan_temporal_shards` cuts the sequence of groups (all videos, in order) into ``N`` contiguous ranges
   balanced by patch count (the tower's cost is linear in patches within a group);
2. each rank encodes its range (``model.get_video_features`` on a slice: one tower pass);
3. the merged features are all-gathered in rank order (= the model's order) by
   :func:`longreel.trainer.mrsp.dist_ops.gather_seq`, whose backward returns each rank the gradient of its own slice
   (``grad="sum"``: summed over the ranks that consumed it; ``"own"``: every rank computed the same loss).

Vision parameter gradients then live on the rank that encoded the frames: sum them across the group
(:func:`longreel.trainer.mrsp.dist_ops.allreduce_grads_`), as for every MR-SP parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longreel.trainer.mrsp.dist_ops import gather_seq, world
from longreel.trainer.mrsp.embed_cache import encode_video_features
from longreel.trainer.mrsp.fsdp_calls import is_fsdp
from longreel.trainer.positions import base_model

__all__ = ["ShardPlan", "plan_temporal_shards", "sharded_video_features", "make_sharded_encoder"]


@dataclass(frozen=True)
class ShardPlan:
    """Per rank: ``rows[r] = (lo, hi)`` rows of ``pixel_values_videos``; ``grids[r]``: the sub-grid ``[k, 3]``;
    ``out_sizes[r]``: merged feature rows it produces; ``patches[r]``: its patch count."""

    rows: tuple
    grids: tuple
    out_sizes: tuple
    patches: tuple


def plan_temporal_shards(video_grid_thw: Tensor, world_size: int, merge_size: int = 2) -> ShardPlan:
    """Contiguous, patch-balanced split of all temporal patch groups of ``video_grid_thw`` (``[V, 3]``).

    Cut ``k`` goes to the group boundary whose patch prefix sum is nearest ``k * total / N`` (never before the
    previous cut); if that leaves a rank above the smallest achievable maximum (found by a binary search over
    the capacity), the groups are instead filled greedily up to that capacity. The busiest rank thus always
    carries the least possible patches. A rank may get nothing when there are fewer groups than ranks.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    grid = [tuple(int(x) for x in row) for row in video_grid_thw.reshape(-1, 3).tolist()]
    units = []  # (video, t, patches)
    for v, (t, h, w) in enumerate(grid):
        units.extend((v, j, h * w) for j in range(t))
    prefix = [0]
    for _, _, p in units:
        prefix.append(prefix[-1] + p)
    total = prefix[-1]

    def fill(cap: int) -> list[int] | None:  # greedy cuts with at most ``cap`` patches per rank
        cuts, load = [0], 0
        for j, (_, _, p) in enumerate(units):
            if load + p > cap:
                cuts.append(j)
                load = 0
            load += p
        if len(cuts) > world_size:
            return None
        return cuts + [len(units)] * (world_size + 1 - len(cuts))

    lo_cap, hi_cap = max((p for _, _, p in units), default=0), max(total, 1)
    while lo_cap < hi_cap:
        mid = (lo_cap + hi_cap) // 2
        if fill(mid) is None:
            lo_cap = mid + 1
        else:
            hi_cap = mid
    cuts = [0]
    for k in range(1, world_size):
        target = k * total / world_size
        cuts.append(min(range(cuts[-1], len(units) + 1), key=lambda j: (abs(prefix[j] - target), j)))
    cuts.append(len(units))
    if max(prefix[cuts[r + 1]] - prefix[cuts[r]] for r in range(world_size)) > lo_cap:
        cuts = fill(lo_cap)
    merge2 = merge_size * merge_size
    rows, grids, outs, patches = [], [], [], []
    for r in range(world_size):
        a, b = cuts[r], cuts[r + 1]
        rows.append((prefix[a], prefix[b]))
        patches.append(prefix[b] - prefix[a])
        sub: list[list[int]] = []
        last_v = None
        for v, _, _ in units[a:b]:
            if v == last_v:
                sub[-1][0] += 1
            else:
                sub.append([1, grid[v][1], grid[v][2]])
                last_v = v
        grids.append(tuple(tuple(s) for s in sub))
        outs.append((prefix[b] - prefix[a]) // merge2)
    return ShardPlan(tuple(rows), tuple(grids), tuple(outs), tuple(patches))


def _out_width(model) -> int:
    cfg = model.config.vision_config
    return int(getattr(cfg, "out_hidden_size", None) or model.config.get_text_config().hidden_size)


def sharded_video_features(model, pixel_values_videos: Tensor, video_grid_thw: Tensor, *, group=None,
                           grad: str = "sum", plan: ShardPlan | None = None) -> Tensor:
    """``[n_tokens, hidden]`` video features of all videos, each rank encoding only its share of the frames.

    Equal to ``model.get_video_features`` on the whole input (forward and, after summing vision gradients
    across ranks, backward). Without a process group it is the plain single-process encode.
    Every rank must pass the same ``pixel_values_videos`` / ``video_grid_thw``.
    """
    rank, size = world(group)
    if size == 1:
        return encode_video_features(model, pixel_values_videos, video_grid_thw)
    visual = base_model(model).visual
    plan = plan or plan_temporal_shards(video_grid_thw, size, int(visual.spatial_merge_size))
    lo, hi = plan.rows[rank]
    if hi > lo:
        local_grid = torch.tensor(plan.grids[rank], dtype=video_grid_thw.dtype, device=video_grid_thw.device)
        local = encode_video_features(model, pixel_values_videos[lo:hi], local_grid)
    else:
        # nothing to encode here; keep the autograd graph shape equal on every rank so that the collective
        # in the backward runs everywhere
        wants_grad = torch.is_grad_enabled() and any(p.requires_grad for p in visual.parameters())
        local = torch.zeros(0, _out_width(model), dtype=pixel_values_videos.dtype,
                            device=pixel_values_videos.device, requires_grad=wants_grad)
        if wants_grad and is_fsdp(visual):
            # under FSDP the tower's gradient is reduce-scattered by every rank together, over the parameters that
            # have one: encode the first temporal group at weight zero so this rank's tower gets a (zero) gradient
            t, h, w = (int(x) for x in video_grid_thw.reshape(-1, 3)[0])
            one = encode_video_features(model, pixel_values_videos[:h * w], video_grid_thw.new_tensor([[1, h, w]]))
            local = local + 0.0 * one.sum()
    return gather_seq(local, dim=0, grad=grad, group=group, sizes=plan.out_sizes)


def make_sharded_encoder(model, *, group=None, grad: str = "sum"):
    """An ``encoder`` for :class:`longreel.trainer.mrsp.embed_cache.StepEmbedCache` that shards across ``group``."""
    def encoder(pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
        return sharded_video_features(model, pixel_values_videos, video_grid_thw, group=group, grad=grad)
    return encoder
