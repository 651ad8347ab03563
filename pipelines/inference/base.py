"""What every inference client shares: requests, generations, sampling parameters, model identity.

A *client* turns a batch of :class:`Request` (a text prompt, optionally with the frames of a
video) into one :class:`Generation` per request, in order. Expected per-request failures (an
HTTP 500 after the last retry, a timeout) come back as a Generation with ``error_reason``
set, never as an exception, so one bad request does not fail its batch. Exceptions are for
the unexpected (a model bug); the Beam handler and ``RunInference.with_exception_handling``
turn those into rejects.

Clients are used by the caption stage (vision prompts) and are meant for the QRA stage too
(text-only prompts: ``frames=None``). Backends: ``transformers`` (:mod:`.hf_client`), ``openai``
(:mod:`.openai_client`), ``vllm`` (:mod:`.vllm_client`), ``facts`` (:mod:`.facts_captioner`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Request:
    key: str                                # identifies the item (clip id, video id...): per-item seeds, logs
    text: str                               # the user prompt
    frames: np.ndarray | None = None        # uint8 [N, H, W, 3] RGB, video frames in time order (None: text only)
    timestamps: list[float] | None = None   # seconds, one per frame
    fps: float | None = None                # the source's frame rate (video metadata for the processor)
    frame_indices: list[int] | None = None  # frame numbers in the source
    system: str | None = None               # optional system prompt
    meta: dict = field(default_factory=dict)  # carried through untouched (the caller's row data)

    def nbytes(self) -> int:
        return len(self.text) + (int(self.frames.nbytes) if self.frames is not None else 0)


@dataclass
class Generation:
    text: str | None
    latency_s: float
    error_reason: str | None = None         # a reject code when the request failed
    error_message: str | None = None
    finish_reason: str | None = None        # stop | length | ...
    attempts: int = 1                       # HTTP attempts (openai) or 1

    @property
    def ok(self) -> bool:
        return self.error_reason is None

    @classmethod
    def failed(cls, reason: str, message: str, latency_s: float = 0.0, attempts: int = 1) -> "Generation":
        return cls(text=None, latency_s=latency_s, error_reason=reason, error_message=message, attempts=attempts)


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 160
    temperature: float = 0.0                # 0: greedy
    top_p: float = 1.0
    seed: int = 0                           # base seed; item seed = item_seed(seed, request.key)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelInfo:
    backend: str
    model: str
    revision: str | None


def item_seed(base: int, key: str) -> int:
    """A per-item seed: the same for an item whatever batch it lands in."""
    return (int(base) + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)) % (2 ** 31 - 1)


def sampling_json(params: GenerationParams, **extra: Any) -> str:
    return json.dumps({**params.to_dict(), **extra}, sort_keys=True, separators=(",", ":"))


_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_WEIGHT_EXT = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_REV_CACHE: dict[tuple, str] = {}


def weights_revision(path: str, explicit: str | None = None) -> str | None:
    """The revision recorded with every output of a model.

    The one formula for every backend (captioners, QRA writers, pass-rate answerers), so that one checkpoint has
    one revision across tables: ``explicit`` wins; a directory inside a Hugging Face cache gives its snapshot
    commit; a local directory gives ``sha256:<hex>`` over the (name, bytes) of its weight files in name order; a
    single weights file (e.g. a ``.gguf``) the same over that one file; anything else (a hub id not on disk, a
    remote model name) gives None.
    """
    if explicit:
        return explicit
    if not path:
        return None
    m = _SNAPSHOT.search(os.path.abspath(path) if os.path.exists(path) else path)
    if m:
        return m.group(1)
    if os.path.isfile(path) and path.endswith(_WEIGHT_EXT):
        path, files = os.path.dirname(os.path.abspath(path)), [os.path.basename(path)]
    elif os.path.isdir(path):
        files = sorted(f for f in os.listdir(path)
                       if f.endswith(_WEIGHT_EXT) and os.path.isfile(os.path.join(path, f)))
    else:
        return None
    if not files:
        return None
    stamp = tuple((f, os.stat(os.path.join(path, f)).st_size, os.stat(os.path.join(path, f)).st_mtime_ns)
                  for f in files)
    key = (os.path.abspath(path), stamp)
    if key not in _REV_CACHE:
        h = hashlib.sha256()
        for f in files:
            h.update(f.encode() + b"\0")
            with open(os.path.join(path, f), "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        _REV_CACHE[key] = "sha256:" + h.hexdigest()
    return _REV_CACHE[key]


def fit_pixels(width: int, height: int, max_pixels: int, multiple: int = 2, min_pixels: int = 0) -> tuple[int, int]:
    """The output size for a ``width`` x ``height`` frame: aspect kept, ``w * h <= max_pixels`` (and
    ``>= min_pixels``), both sides multiples of ``multiple`` (28 for Qwen-VL: patch 14 x merge 2). It is the Qwen
    processors' own rule (transformers' ``smart_resize``), so frames resized here pass through them unchanged; the
    floor of one ``multiple`` per side keeps a tiny frame from rounding to nothing."""
    if width <= 0 or height <= 0:
        raise ValueError(f"bad frame size {width}x{height}")
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    m = max(1, int(multiple))
    h, w = smart_resize(height, width, factor=m, min_pixels=max(int(min_pixels), m * m), max_pixels=max_pixels)
    return w, h
