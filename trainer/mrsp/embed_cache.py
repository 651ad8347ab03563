"""Per-step video embedding cache: each unique video goes through the vision tower once per GRPO step.

Without reuse a GRPO step runs the vision tower G + 3 times per prompt (each of the G rollouts, the old-policy
and reference log-probs, and the policy forward in the update). With :class:`StepEmbedCache` the video is
encoded once, at its first use in the step, and the detached features are handed to every consumer.

Vision-tower training modes (``vision=``):

``"frozen"``    the update reuses the cached (detached) features: no gradient reaches the vision tower;
                one tower pass per video per step.
``"recompute"`` the cached no-grad features serve rollouts and the old/ref log-probs; the update re-runs the
                tower with grad once per video (at its first ``update_features``), hands out a leaf tensor
                whose ``.grad`` accumulates over micro-batches, and :meth:`backward_vision` pushes it
                through: two tower passes per video per step, whatever the number of micro-batches; the
                tower's activations are held only from the update's first micro-batch on.
``"deferred"``  one tower pass per video per step *and* a trained vision tower: the first encode keeps its
                autograd graph; every consumer gets detached features, the update gets a leaf tensor
                (``requires_grad``) whose ``.grad`` accumulates over micro-batches; :meth:`backward_vision`
                then pushes that accumulated gradient through the kept graph once. Exact because the tower's
                weights do not change between the encode and the update of one step (checked); costs the
                tower's activation memory from the first encode until the update.

:class:`VisionCallCounter` counts passes through the tower (a forward hook), so a test can prove "once per
step". The encoder is pluggable (``encoder=``), e.g. :func:`longreel.trainer.mrsp.vision_shard.make_sharded_encoder`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from longreel.trainer.activation_checkpointing import checkpointing_on
from longreel.trainer.positions import PromptPositions, base_model, prompt_positions

__all__ = ["VisionCallCounter", "CachedVideo", "StepEmbedCache", "encode_video_features", "VISION_MODES"]

VISION_MODES = ("frozen", "recompute", "deferred")
Encoder = Callable[[Tensor, Tensor], Tensor]


def encode_video_features(model, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
    """The model's own ``get_video_features``; returns ``[n_tokens, hidden]`` (all videos of the grid, in order).

    Grad follows the caller's grad mode.
    """
    out = model.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True)
    pooled = out.pooler_output
    return torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled


class VisionCallCounter:
    """Counts forward passes through a model's vision tower (``calls``) and the patches they saw (``patches``).

    Use as a context manager or call :meth:`close`; :meth:`reset` zeroes the counts.
    """

    def __init__(self, model):
        self.tower = base_model(model).visual
        self.calls = 0
        self.patches = 0
        self.grad_calls = 0
        self._handle = self.tower.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.calls += 1
        self.patches += int(hidden.shape[0]) if hidden is not None else 0
        if torch.is_grad_enabled():
            self.grad_calls += 1

    def reset(self) -> None:
        self.calls = self.patches = self.grad_calls = 0

    def close(self) -> None:
        self._handle.remove()

    def __enter__(self) -> "VisionCallCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class CachedVideo:
    """One video's encoder output for the current step.

    ``features``: ``[n_tokens, hidden]`` detached. ``grid_thw``: ``[1, 3]`` (or ``[V, 3]``).
    ``graph``: the non-detached encoder output kept for the update (``deferred``/``recompute``).
    ``leaf``: the update's input, a detached copy with ``requires_grad`` whose ``.grad`` accumulates.
    """

    key: str
    features: Tensor
    grid_thw: Tensor
    fingerprint: tuple
    pixel_values_videos: Tensor | None = None
    graph: Tensor | None = None
    leaf: Tensor | None = None


def video_fingerprint(pixel_values_videos: Tensor, video_grid_thw: Tensor) -> tuple:
    """A cheap identity check for a video's pixels (shape, grid, the float64 sum and the float64 sum of the patches'
    sums weighted by position), not a content hash: it catches a key reused for different videos within a step on
    the pixels' own device, where a content hash would copy every pixel to the host. The weighted sum tells apart the
    same patches in another order (frames permuted, say), which the plain sum cannot."""
    pv = pixel_values_videos.detach()
    rows = pv.reshape(pv.shape[0], -1).sum(dim=1, dtype=torch.float64)  # one sum per patch: no float64 copy
    weights = torch.arange(1, rows.numel() + 1, device=rows.device, dtype=torch.float64)
    return (tuple(pv.shape), tuple(video_grid_thw.reshape(-1).tolist()), float(rows.sum()),
            float(torch.dot(rows, weights)))


class StepEmbedCache:
    """Video features (and prompt M-RoPE positions) computed once per step, keyed by video / prompt key.

    Args:
        model: a Qwen2-VL-family ``...ForConditionalGeneration``.
        vision: one of ``VISION_MODES`` (see the module docstring).
        encoder: ``(pixel_values_videos, video_grid_thw) -> [n_tokens, hidden]``; default the model's own
            ``get_video_features``. A sharded encoder (``vision_shard.make_sharded_encoder``) plugs in here.

    Per step: :meth:`begin_step`; then :meth:`video` (no-grad consumers: rollouts, old/ref log-probs) and
    :meth:`update_features` (the policy forward in the update); :meth:`backward_vision` after the last
    micro-batch's ``backward`` (a no-op when frozen). A key seen again with other pixels raises ``ValueError``.
    """

    def __init__(self, model, *, vision: str = "frozen", encoder: Encoder | None = None):
        if vision not in VISION_MODES:
            raise ValueError(f"vision must be one of {VISION_MODES}, got {vision!r}")
        self.model = model
        self.vision = vision
        self.encoder: Encoder = encoder or (lambda pv, grid: encode_video_features(model, pv, grid))
        self._videos: dict[str, CachedVideo] = {}
        self._positions: dict[str, PromptPositions] = {}
        self._param_versions: dict[str, int] = {}
        self.encodes = 0          # first-time encodes this step (== unique videos)
        self.update_encodes = 0   # extra grad encodes this step (``recompute`` mode)
        self.hits = 0

    # ---------------------------------------------------------------------------------------- step control
    def begin_step(self) -> None:
        """Forget the previous step's features (the weights changed). Raises if deferred grads were not pushed."""
        pending = [k for k, v in self._videos.items() if v.leaf is not None and v.leaf.grad is not None]
        if pending:
            raise RuntimeError(f"begin_step with un-pushed vision gradients for {pending}: call backward_vision()")
        self._videos.clear()
        self._positions.clear()
        self._param_versions.clear()
        self.encodes = self.update_encodes = self.hits = 0

    def __len__(self) -> int:
        return len(self._videos)

    # ------------------------------------------------------------------------------------------ features
    def video(self, key: str, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> CachedVideo:
        """The cached entry for ``key``, encoding the video now if it is the first use this step."""
        fp = video_fingerprint(pixel_values_videos, video_grid_thw)
        hit = self._videos.get(key)
        if hit is not None:
            if hit.fingerprint != fp:
                raise ValueError(f"video key {key!r} was cached this step with other pixels or grid "
                                 f"({hit.fingerprint[:2]} vs {fp[:2]}): keys must identify the video content")
            self.hits += 1
            return hit
        if self.vision == "deferred":
            graph = self._grad_encode(pixel_values_videos, video_grid_thw)
            self._param_versions = {n: p._version for n, p in base_model(self.model).visual.named_parameters()}
            feats = graph.detach()
            entry = CachedVideo(key, feats, video_grid_thw, fp, graph=graph,
                                leaf=feats.clone().requires_grad_(graph.requires_grad))
        else:
            with torch.no_grad():
                feats = self.encoder(pixel_values_videos, video_grid_thw)
            keep = pixel_values_videos if self.vision == "recompute" else None
            entry = CachedVideo(key, feats, video_grid_thw, fp, pixel_values_videos=keep)
        self._videos[key] = entry
        self.encodes += 1
        return entry

    def _grad_encode(self, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
        """The encoder with grad, under the tower's activation checkpointing when the model has it enabled.

        transformers checkpoints a block only in training mode, and the deferred encode runs during rollouts,
        in eval mode: without switching the tower to training mode here, the graph kept until the update
        holds every block's activations (a 2B-class tower ran out of 80 GB at 256 frames:
        benchmarks/results/grpo_gpu.json). The Qwen2-VL-family towers have no dropout or batch statistics, so
        training mode changes nothing else.
        """
        tower = base_model(self.model).visual
        was_training = tower.training
        if checkpointing_on(self.model):
            tower.train()
        try:
            with torch.enable_grad():
                return self.encoder(pixel_values_videos, video_grid_thw)
        finally:
            tower.train(was_training)

    def features(self, key: str, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
        """Detached features ``[n_tokens, hidden]`` for rollouts and old/ref log-probs."""
        return self.video(key, pixel_values_videos, video_grid_thw).features

    def update_features(self, key: str, pixel_values_videos: Tensor | None = None,
                        video_grid_thw: Tensor | None = None) -> Tensor:
        """Features for the policy forward in the update: the detached cached features (``frozen``), or a
        leaf tensor with ``requires_grad`` whose ``.grad`` accumulates over micro-batches (``deferred``: from
        the step's one encode; ``recompute``: from one grad encode at the first call of the update). Call
        :meth:`backward_vision` after the last micro-batch. The video must have been cached this step unless
        pixels are given."""
        entry = self._videos.get(key)
        if entry is None:
            if pixel_values_videos is None or video_grid_thw is None:
                raise KeyError(f"video {key!r} is not cached this step and no pixels were given")
            entry = self.video(key, pixel_values_videos, video_grid_thw)
        if self.vision == "frozen":
            return entry.features
        if self.vision == "recompute" and entry.leaf is None:
            self.update_encodes += 1
            graph = self._grad_encode(entry.pixel_values_videos, entry.grid_thw)
            self._param_versions = {n: p._version for n, p in base_model(self.model).visual.named_parameters()}
            entry.graph = graph
            entry.leaf = graph.detach().clone().requires_grad_(graph.requires_grad)
        return entry.leaf

    def backward_vision(self) -> int:
        """``deferred`` / ``recompute``: push the gradients accumulated on the update leaves through the vision
        tower (once per video), after the last micro-batch's ``backward`` and before ``optimizer.step()``.
        Returns the number of videos pushed. A no-op in ``frozen`` mode."""
        if self.vision == "frozen":
            return 0
        now = {n: p._version for n, p in base_model(self.model).visual.named_parameters()}
        if self._param_versions and now != self._param_versions:
            raise RuntimeError("the vision tower's weights changed between the encode and backward_vision(): "
                               "call backward_vision() before optimizer.step(), or use vision='recompute'")
        outs, grads = [], []
        for entry in self._videos.values():
            if entry.leaf is not None and entry.leaf.grad is not None and entry.graph is not None \
                    and entry.graph.requires_grad:
                outs.append(entry.graph)
                grads.append(entry.leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)
        for entry in self._videos.values():  # graphs are freed; the step's features stay usable detached
            entry.graph = None
            if entry.leaf is not None:
                entry.leaf.grad = None
            if self.vision == "recompute":
                entry.leaf = None
        return len(outs)

    # ----------------------------------------------------------------------------------------- positions
    def positions(self, prompt_key: str, input_ids: Tensor, video_grid_thw: Tensor | None,
                  mm_token_type_ids: Tensor | None = None, extra: dict | None = None) -> PromptPositions:
        """M-RoPE positions of a prompt, computed once per step (see :mod:`longreel.trainer.positions`)."""
        hit = self._positions.get(prompt_key)
        if hit is not None:
            if hit.length != input_ids.shape[-1]:
                raise ValueError(f"prompt key {prompt_key!r} was cached with length {hit.length}, "
                                 f"now {input_ids.shape[-1]}")
            return hit
        pos = prompt_positions(self.model, input_ids, video_grid_thw, mm_token_type_ids, extra=extra)
        self._positions[prompt_key] = pos
        return pos
