"""A frozen vision tower's video features on disk, shared by later epochs, ranks, restarts and runs.

A frozen tower (the GRPO reference's; the policy's under ``mrsp.vision=frozen``) maps a video to the same features
in every step of every run that starts from the same checkpoint. The memory store (``frozen_cache``) keeps them
within one run while they fit; a feature directory keeps them for good: the first sight of a video writes its
features, every later sight, in this run or the next one of a sweep from the same base model, reads them instead of
a tower pass. Long-RL's cached video embeddings do this for a frozen policy tower; here the reference uses it too,
which stays exact while the policy's tower trains.

Layout: ``<root>/<tower digest>/<pixel digest[:2]>/<pixel digest>.safetensors``, one tensor ``features``
``[n_tokens, hidden]`` in the dtype the tower computed, its metadata naming both digests. The tower digest covers
every parameter and buffer of the vision tower (names, dtypes, shapes, bytes) and what else decides the features'
bits (the trainer passes device type, compute dtypes, attention kernels and the torch / transformers versions), so
another checkpoint, fine-tune, precision, kernel or library version never gets these features. safetensors, not
pickle: loading a file runs no code. A write goes to a temporary file in the same folder and is renamed into place,
so ranks or runs sharing the directory never read a half-written file; a file that cannot be read or does not hold
what its name says is logged, counted and replaced by a fresh encode.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from longreel.trainer.positions import base_model

__all__ = ["FeatureDir", "host_bytes", "tower_digest"]

log = logging.getLogger(__name__)


def host_bytes(t: Tensor):
    """Every byte of ``t`` as a buffer in host memory, for a hash (copied off the device; viewed as uint8, so bf16 and
    fp16 go too: numpy has no bfloat16)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data


def tower_digest(model, context: str = "") -> str:
    """blake2b over the vision tower's state (every parameter and buffer: name, dtype, shape, bytes) and ``context``
    (what else decides the features' bits: device, compute dtype, attention kernels, library versions), hex.

    Read once when a run opens its feature directory: a copy of the tower to host memory and one pass over its
    bytes (a 7B Qwen2-VL's 675M-parameter tower in bf16: 1.35 GB). A tower sharded by FSDP is gathered tensor by
    tensor (``full_tensor``, a collective: every rank opens the directory at the same point of start-up), so every
    rank gets the digest of the whole tower."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"context|{context}|".encode())
    for name, t in sorted(base_model(model).visual.state_dict().items()):
        t = t.detach()
        if hasattr(t, "full_tensor"):  # a DTensor shard
            t = t.full_tensor()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(host_bytes(t))
    return h.hexdigest()


class FeatureDir:
    """Features of one frozen tower (``tower``: its :func:`tower_digest`) under ``root``.

    Counters: ``reads`` (files served), ``writes``, ``bad_files`` (unreadable or not what their name says; each
    re-encoded by the caller and overwritten), ``write_errors`` (a directory that cannot be written, say a
    read-only copy of precomputed features: reads go on, new features are not kept; logged once)."""

    def __init__(self, root: str | os.PathLike, tower: str):
        self.root = Path(root) / tower
        self.tower = tower
        self.reads = self.writes = self.bad_files = self.write_errors = 0

    def path(self, digest: str) -> Path:
        return self.root / digest[:2] / f"{digest}.safetensors"

    def get(self, digest: str) -> Tensor | None:
        """The stored features of the video ``digest`` (CPU), or None when there are none to trust."""
        from safetensors import SafetensorError, safe_open

        path = self.path(digest)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                feats = fh.get_tensor("features")
        except (SafetensorError, OSError, KeyError, ValueError) as err:
            return self._bad(path, f"unreadable ({type(err).__name__}: {err})")
        if meta.get("pixel_digest") != digest or meta.get("tower") != self.tower:
            return self._bad(path, "its metadata names another video or tower")
        if feats.dim() != 2 or feats.shape[0] == 0:
            return self._bad(path, f"features of shape {tuple(feats.shape)}, expected [n_tokens, hidden]")
        self.reads += 1
        return feats

    def put(self, digest: str, feats: Tensor) -> None:
        """Store ``feats`` ``[n_tokens, hidden]`` for the video ``digest`` (atomically: temp file + rename)."""
        from safetensors.torch import save_file

        path = self.path(digest)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{digest}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            save_file({"features": feats.detach().to("cpu").contiguous()}, tmp,
                      metadata={"pixel_digest": digest, "tower": self.tower})
            os.replace(tmp, path)
        except OSError as err:
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("feature directory: cannot write %s (%s); reading what is there, keeping nothing new",
                            path, err)
            return
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
        self.writes += 1

    def _bad(self, path: Path, why: str) -> None:
        self.bad_files += 1
        log.warning("feature directory: %s is %s; encoding the video again and replacing it", path, why)
        return None
