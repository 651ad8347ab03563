"""The engine interface: a batch of chat requests in, one :class:`Completion` per request out, in order.

An :class:`EngineRequest` is chat ``messages`` (a ``{"type": "video"}`` content part marks where the video goes),
an optional :class:`Video` (frames already sampled and sized by the caller), its :class:`Sampling` (``n`` samples
under the request's own ``seed``, so a request's output does not depend on its batch) and an optional JSON schema
for constrained decoding. Expected per-request failures (a server error after the last retry, a timeout, a model
error on one request) come back as a Completion with ``error_reason`` set, never as an exception: one bad request
does not sink its neighbours. A model that cannot be loaded raises (a configuration error stops the run).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Video:
    """Frames of one video as the model will see them. ``frames``: uint8 ``[T, H, W, 3]`` RGB in time order;
    ``frame_indices``: their frame numbers in the source; ``total_frames``/``duration_s``: the processor's video
    metadata (what the caller's frames stand for); ``embeds``: precomputed vision-tower outputs an engine may use
    instead of the frames (vLLM's ``video_embeds``/``video_grid_thw``)."""

    frames: np.ndarray | None
    fps: float
    frame_indices: list[int]
    total_frames: int
    duration_s: float
    embeds: dict | None = None


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy. ``top_k``/``repetition_penalty`` None leave the model's own defaults (its
    generation config), a number sets them (``top_k`` 0: off)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float | None = None
    n: int = 1
    seed: int = 0
    min_new_tokens: int = 0                   # e.g. equal-length samples for a benchmark

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class EngineRequest:
    key: str                                  # the item (clip, video, question): logs and errors
    messages: list[dict]                      # chat messages; content a string or a list of typed parts
    video: Video | None = None
    sampling: Sampling = field(default_factory=Sampling)
    schema: dict | None = None                # JSON schema to constrain the output to, or None
    max_string_chars: int | None = None       # constrained decoding: longest JSON string (maxLength)
    logit_bias: dict[int, float] | None = None  # token id -> bias (e.g. never sample a vision placeholder)
    extra: dict = field(default_factory=dict)  # engine-specific request fields (an OpenAI server's extra body)


@dataclass
class Completion:
    """The ``n`` samples of one request: ``texts`` (special tokens skipped), ``token_ids`` (the sampled ids, up
    to and including the end-of-sequence token when it stopped there) and ``logprobs`` (per sampled token, when
    the engine reports them), ``finish`` per sample (``stop``, ``length``, ``dead_end`` when the schema allowed
    no token). A failed request has ``error_reason`` (a reject code) and no samples."""

    texts: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    prompt_tokens: int = 0                    # the prompt as the model saw it, vision placeholders included
    vision_tokens: int | None = 0             # of which video/image tokens (None: the engine cannot tell)
    new_tokens: int = 0                       # generated tokens over all samples, end-of-sequence tokens excluded
    latency_s: float = 0.0
    attempts: int = 1
    guided: bool = False
    error_reason: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_reason is None

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""

    @classmethod
    def failed(cls, reason: str, message: str, latency_s: float = 0.0, attempts: int = 1) -> "Completion":
        return cls(error_reason=reason, error_message=message, latency_s=latency_s, attempts=attempts)


class Engine:
    """One model behind one engine. ``backend``/``model``/``revision`` name what wrote an output (provenance);
    ``setup`` loads the model or opens the client (once per worker; ``generate`` calls it when needed)."""

    backend = "none"
    supports_schema = False    # constrained decoding to a JSON schema
    supports_pattern = False   # ... including JSON-schema ``pattern`` keywords

    def __init__(self, model: str, revision: str | None = None):
        self.model = model
        self.revision = revision

    def setup(self) -> None:
        pass

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        raise NotImplementedError

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt tokens of ``messages`` under the model's own tokenizer and chat template, when known."""
        return None

    def close(self) -> None:
        pass


def video_metadata(video: Video) -> dict[str, Any]:
    """The processor's video metadata for already-sampled frames (transformers ``VideoMetadata`` fields; vLLM
    takes the same dict): the processor must neither re-sample nor re-time them."""
    return {"total_num_frames": int(video.total_frames), "fps": float(video.fps),
            "frames_indices": [int(i) for i in video.frame_indices], "duration": float(video.duration_s),
            "width": int(video.frames.shape[2]), "height": int(video.frames.shape[1])}


def item_seed(base: int, key: str) -> int:
    """A per-item seed: the same for an item whatever batch it lands in."""
    return (int(base) + int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)) % (2 ** 31 - 1)



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
