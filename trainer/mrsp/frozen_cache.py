"""Video features of a frozen vision tower, kept across GRPO steps: the reference model's, and the policy's when
its tower is frozen.

The reference model never trains, so its vision tower maps a video to the same features at every step (so does a
frozen policy tower). A step cache (:class:`~longreel.trainer.mrsp.embed_cache.StepEmbedCache`) forgets them at
``begin_step``: with the policy's tower trained that is one reference tower pass per unique video per step (over
half the reference phase: 0.75 s -> 0.33 s per step from the store, benchmarks/results/mrsp_stage1_v2.json).
Data sets ask several questions about one video (LongVideo-Reason: ~6 per video), so a video can recur in a later
step and its features be reused as they are: the values the tower would compute again, bitwise
(tests/test_mrsp_frozen_cache.py).

:class:`FrozenFeatureCache` keys entries by a digest of the pixels themselves (the video's content id), not by the
item's name: two clips under one ``video_id`` never share an entry, and a video seen under two names does. The
store is bounded (``max_bytes``, least recently used evicted first) and can sit in host memory (``offload``)
so the accelerator holds only the current step's features. ``max_bytes=0`` keeps nothing across steps: the
step cache's behaviour (one encode per unique video per step). Under sequence parallelism the encoder is a
collective (``vision_shard``): every rank of a group sees the same videos in the same order, so their stores hit
and miss together.

Behind the memory store a feature directory (``feature_dir.FeatureDir``, ``mrsp.frozen_feature_dir``) can keep
the features on disk for later runs and restarts: read on a store miss, written after an encode.

Only for a model whose tower does not change: the reference, or a policy with a frozen tower (for the latter,
:meth:`FrozenFeatureCache.encode` is the ``encoder=`` of its ``StepEmbedCache(vision="frozen")``).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor

from longreel.trainer.mrsp.embed_cache import encode_video_features, video_fingerprint
from longreel.trainer.mrsp.feature_dir import FeatureDir, host_bytes

__all__ = ["FrozenFeatureCache", "pixel_digest"]

Encoder = Callable[[Tensor, Tensor], Tensor]


def pixel_digest(pixel_values_videos: Tensor, video_grid_thw: Tensor) -> str:
    """A content id of one prompt's video input: blake2b over dtype, shape, grid and every pixel byte.

    Exact (no sampling): equal digests mean equal tensors up to a hash collision. Tensors off the CPU are copied
    to host memory to be hashed (one copy per video per step, far cheaper than a tower pass)."""
    h = hashlib.blake2b(digest_size=16)
    pv = pixel_values_videos.detach()
    h.update(f"{pv.dtype}|{tuple(pv.shape)}|{video_grid_thw.reshape(-1).tolist()}".encode())
    h.update(host_bytes(pv))
    return h.hexdigest()


class FrozenFeatureCache:
    """Features of a frozen vision tower, computed once per unique video *for the run* (within ``max_bytes``).

    Args:
        model: the frozen model (e.g. the GRPO reference); its tower must not change while entries live.
        max_bytes: bytes of features kept across steps (0: nothing; entries larger than this are not kept).
        offload: keep the cross-step store in host memory (entries move back to the model's device on a hit).
        encoder: ``(pixel_values_videos, video_grid_thw) -> [n_tokens, hidden]``; default the model's own
            ``get_video_features`` (a sharded encoder from ``vision_shard.make_sharded_encoder`` plugs in here).
        directory: a :class:`~longreel.trainer.mrsp.feature_dir.FeatureDir` of this tower behind the memory store:
            read on a store miss before encoding, written after an encode (features kept across runs).

    Same call shape as ``StepEmbedCache(..., vision="frozen")``: :meth:`begin_step`, :meth:`features`; or
    :meth:`encode` as a step cache's encoder (the step cache then does the per-step bookkeeping).
    Counters: ``encodes`` / ``hits`` / ``store_hits`` / ``dir_hits`` (this step), ``total_encodes``,
    ``total_store_hits``, ``total_dir_hits``, ``evictions``, ``nbytes`` (bytes in the store).
    """

    def __init__(self, model, *, max_bytes: int, offload: bool = True, encoder: Encoder | None = None,
                 directory: FeatureDir | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.model = model
        self.max_bytes = int(max_bytes)
        self.offload = offload
        self.directory = directory
        self.encoder: Encoder = encoder or (lambda pv, grid: encode_video_features(model, pv, grid))
        self._step: dict[str, tuple] = {}  # name key -> (cheap fingerprint, features, pixel digest or None)
        self._store: OrderedDict[str, Tensor] = OrderedDict()  # pixel digest -> features (LRU order)
        self.nbytes = 0
        self.encodes = self.hits = self.store_hits = self.dir_hits = 0
        self.total_encodes = self.total_store_hits = self.total_dir_hits = self.evictions = 0

    def begin_step(self) -> None:
        """Forget this step's name keys (names may point to other videos next step); the store stays."""
        self._step.clear()
        self.encodes = self.hits = self.store_hits = self.dir_hits = 0

    def __len__(self) -> int:
        return len(self._store)

    def features(self, key: str, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
        """Detached features ``[n_tokens, hidden]`` of the video, on the pixels' device.

        Within a step a name key seen again with the same (cheap) fingerprint is a hit without hashing; across
        steps the pixel digest decides. A name key reused this step for other pixels is looked up afresh."""
        fp = video_fingerprint(pixel_values_videos, video_grid_thw)
        seen = self._step.get(key)
        if seen is not None and seen[0] == fp:
            self.hits += 1
            return seen[1]
        feats, digest = self._lookup(pixel_values_videos, video_grid_thw)
        self._step[key] = (fp, feats, digest)
        return feats

    def content_id(self, key: str, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> str:
        """The pixel digest of the video cached under ``key`` this step (hashed now if the store is off)."""
        seen = self._step.get(key)
        if seen is not None and seen[2] is not None and seen[0] == video_fingerprint(pixel_values_videos, video_grid_thw):
            return seen[2]
        return pixel_digest(pixel_values_videos, video_grid_thw)

    def encode(self, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> Tensor:
        """``encoder``-shaped lookup by pixel digest alone (for a ``StepEmbedCache`` in ``frozen`` mode, which
        already encodes each video once per step): the stored features, or the tower's (then stored)."""
        return self._lookup(pixel_values_videos, video_grid_thw)[0]

    def _lookup(self, pixel_values_videos: Tensor, video_grid_thw: Tensor) -> tuple[Tensor, str | None]:
        keep = self.max_bytes > 0 or self.directory is not None
        digest = pixel_digest(pixel_values_videos, video_grid_thw) if keep else None
        stored = self._store.get(digest) if digest is not None else None
        if stored is not None:
            self._store.move_to_end(digest)
            self.store_hits += 1
            self.total_store_hits += 1
            return stored.to(pixel_values_videos.device), digest
        if self.directory is not None:
            stored = self.directory.get(digest)
            if stored is not None:
                self.dir_hits += 1
                self.total_dir_hits += 1
                feats = stored.to(pixel_values_videos.device)
                self._put(digest, feats)
                return feats, digest
        with torch.no_grad():
            feats = self.encoder(pixel_values_videos, video_grid_thw).detach()
        self.encodes += 1
        self.total_encodes += 1
        if digest is not None:
            self._put(digest, feats)
            if self.directory is not None:
                self.directory.put(digest, feats)
        return feats, digest

    def _put(self, digest: str, feats: Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.max_bytes:
            return
        while self._store and self.nbytes + size > self.max_bytes:
            _, old = self._store.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
            self.evictions += 1
        # host copy when offloading (a CPU tensor stays as it is: nothing writes to cached features in place)
        self._store[digest] = feats.to("cpu") if self.offload else feats
        self.nbytes += size
