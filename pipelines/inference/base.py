"""What the caption stage's clients share: requests, generations, sampling parameters, model identity, frame sizes.

A *client* turns a batch of :class:`Request` (a prompt with the frames of a clip) into one :class:`Generation` per
request, in order. Expected per-request failures (an HTTP 500 after the last retry, a timeout) come back as a
Generation with ``error_reason`` set, never as an exception, so one bad request does not fail its batch. Exceptions
are for the unexpected (a model bug); the Beam handler and ``RunInference.with_exception_handling`` turn those into
rejects. Clients: :class:`longreel.pipelines.inference.captioner.EngineCaptioner` over any engine of
:mod:`longreel.engines` (transformers, openai, vllm), and the weight-free :mod:`.facts_captioner`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from longreel.engines.base import item_seed, weights_revision  # noqa: F401  (re-exported: the caption stage's names)


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
    prompt_tokens: int | None = None        # the compute bill (None: no model, e.g. the facts captioner)
    vision_tokens: int | None = None        # of the prompt's tokens, the video's (None: not known)
    output_tokens: int | None = None

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


def sampling_json(params: GenerationParams, **extra: Any) -> str:
    return json.dumps({**params.to_dict(), **extra}, sort_keys=True, separators=(",", ":"))


def fit_pixels(width: int, height: int, max_pixels: int, multiple: int = 2, min_pixels: int = 0) -> tuple[int, int]:
    """The output size for a ``width`` x ``height`` frame: aspect kept, ``w * h <= max_pixels`` (and
    ``>= min_pixels``), both sides multiples of ``multiple`` (28 for Qwen-VL: patch 14 x merge 2). It is the Qwen
    processors' own rule (``smart_resize``, :mod:`longreel.pipelines.media.qwen_vl_frames`), so frames resized here
    pass through them unchanged; the floor of one ``multiple`` per side keeps a tiny frame from rounding to
    nothing."""
    if width <= 0 or height <= 0:
        raise ValueError(f"bad frame size {width}x{height}")
    from longreel.pipelines.media.qwen_vl_frames import smart_resize

    m = max(1, int(multiple))
    h, w = smart_resize(height, width, factor=m, min_pixels=max(int(min_pixels), m * m), max_pixels=max_pixels)
    return w, h


DEFAULT_MAX_PIXELS = 448 * 448
DEFAULT_MULTIPLE = 28


def processor_pixel_budget(path: str) -> tuple[int, int, int]:
    """``(max_pixels, multiple, min_pixels)`` per frame from a checkpoint's processor files, without loading it.

    Reads the video processor's (else the image processor's) ``size.longest_edge`` / ``max_pixels`` and
    ``patch_size * merge_size``; falls back to 448*448 pixels in multiples of 28 when the files say nothing.
    """
    sections = []
    for name in ("video_preprocessor_config.json", "processor_config.json", "preprocessor_config.json"):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            continue
        try:
            with open(p, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        sections += [doc.get("video_processor"), doc.get("image_processor"), doc]
    for sec in sections:
        if not isinstance(sec, dict):
            continue
        size = sec.get("size") or {}
        max_px = sec.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
        if max_px:
            min_px = sec.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or 0
            multiple = int(sec.get("patch_size") or 14) * int(sec.get("merge_size") or 2)
            return int(max_px), multiple, int(min_px)
    return DEFAULT_MAX_PIXELS, DEFAULT_MULTIPLE, 0
