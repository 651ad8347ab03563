"""Qwen2-VL's video frame rules (which frames, what size, the resize) without importing transformers or torchvision.

The pipeline's CPU stages need three things from the Qwen2-VL video processor: the frames its ``sample_frames``
picks, the size its ``smart_resize`` gives, and its resize. Importing ``Qwen2VLVideoProcessor`` to get them costs
about 3.7 s of CPU (torchvision, torch's compiler stack that torchvision pulls in, most of transformers), paid by
every worker process before its first decode: on the local runner it was the longest step before any video was
read. Here the same rules use torch alone (1.2 s), with the calls the processor makes:

* indices: ``torch.arange(0, total, total / n).int()``, ``n`` from the fps rule, as ``sample_frames`` computes them
  (a float32 arange, which numpy does not reproduce bit for bit: hence torch rather than pure Python);
* size: ``smart_resize`` (pure arithmetic, below);
* resize: ``torch.nn.functional.interpolate(..., mode="bicubic", antialias=True)`` on the uint8 frames, which is the
  kernel torchvision's ``resize`` runs for bicubic on CPU tensors (no float round trip), skipped when the size does
  not change, as torchvision does.

``tests/test_qwen_vl_frames.py`` checks every one of them bitwise against the installed transformers processor, so
a transformers release that changes a rule fails the suite instead of drifting. Only the processor's *defaults*
(Qwen2-VL's, with the project's per-frame pixel cap) take this path; a processor directory is still loaded through
transformers (:func:`longreel.pipelines.pack.frame_cache.frame_processor`).
"""
from __future__ import annotations

import math

#: Qwen2VLVideoProcessor's defaults (transformers 5.x) with ``cap_pixels_per_frame=True``; the test compares them
#: with the class's own
DEFAULTS = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
            "size": {"shortest_edge": 100352, "longest_edge": 602112}, "resample": 3,  # PIL BICUBIC
            "cap_pixels_per_frame": True, "max_video_tokens": 128000, "do_convert_rgb": True}


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """``(height, width)`` after Qwen2-VL's rule: both multiples of ``factor``, ``min_pixels <= h * w <=
    max_pixels``, aspect ratio kept as well as the rounding allows. Raises ValueError past an aspect ratio of 200."""
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        shrink = math.sqrt((height * width) / max_pixels)
        h = max(factor, math.floor(height / shrink / factor) * factor)
        w = max(factor, math.floor(width / shrink / factor) * factor)
    elif h * w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * grow / factor) * factor
        w = math.ceil(width * grow / factor) * factor
    return h, w


def frame_count(total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                temporal_patch_size: int) -> int:
    """How many frames the fps rule samples: ``fps`` per second of video, within ``[min_frames, max_frames]`` and
    the video's own count, rounded down to a multiple of the temporal patch."""
    cap = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    n = total_frames / video_fps * fps
    n = min(max(n, min_frames), cap, total_frames)
    return math.floor(n / temporal_patch_size) * temporal_patch_size


def sample_indices(total_frames: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                   temporal_patch_size: int) -> list[int]:
    """Source frame indices, spread evenly from frame 0 (what ``sample_frames`` returns for the same arguments).
    A count of 0 raises ZeroDivisionError, as the processor does."""
    import torch

    n = frame_count(total_frames, video_fps, fps, min_frames, max_frames, temporal_patch_size)
    return torch.arange(0, total_frames, total_frames / n).int().tolist()


def resize_uint8(frames, height: int, width: int):
    """uint8 ``[T, 3, H, W]`` torch frames -> ``[T, 3, height, width]``, bicubic with antialias."""
    import torch

    if frames.dtype != torch.uint8 or frames.ndim != 4:
        raise ValueError(f"expected uint8 [T, 3, H, W], got {frames.dtype} {tuple(frames.shape)}")
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    return torch.nn.functional.interpolate(frames.contiguous(), size=[height, width], mode="bicubic",
                                           align_corners=False, antialias=True)


def pixel_budget(size: dict, min_pixels: int | None, max_pixels: int | None, factor: int) -> dict:
    """A processor's ``size`` (``shortest_edge``/``longest_edge``: per-frame minimum and maximum pixels) with the
    given ones put in. A maximum below the processor's own minimum drops that minimum to one ``factor`` x ``factor``
    cell: smart-resize scales a frame under the minimum up to it (and rounds up), so Qwen2-VL's default minimum
    (100,352) under a 50,176 budget made every small frame about twice the budget (the demo's 176x144 frames became
    364x308); with the floor at one cell, a frame is only rounded to the grid, and a frame over the budget scaled
    down, as the maximum means."""
    size = dict(size)
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
        if min_pixels is None and int(size.get("shortest_edge") or 0) > int(max_pixels):
            size["shortest_edge"] = int(factor) * int(factor)
    return size


class Qwen2VLFrames:
    """The default Qwen2-VL video processor's attributes and frame rules, for the frame cache (see the module
    docstring). It has the attributes :func:`~longreel.pipelines.pack.frame_cache.processor_params` reads, under the
    processor's class name, so a cache entry made through it has the same key as one made through transformers."""

    processor_class = "Qwen2VLVideoProcessor"

    def __init__(self, min_pixels: int | None = None, max_pixels: int | None = None):
        d = DEFAULTS
        self.patch_size, self.merge_size = d["patch_size"], d["merge_size"]
        self.temporal_patch_size = d["temporal_patch_size"]
        self.size = pixel_budget(d["size"], min_pixels, max_pixels, self.patch_size * self.merge_size)
        self.resample = d["resample"]
        self.cap_pixels_per_frame = d["cap_pixels_per_frame"]
        self.max_video_tokens = d["max_video_tokens"]
        self.do_convert_rgb = d["do_convert_rgb"]

    def sample_indices(self, total_frames: int, video_fps: float, fps: float, min_frames: int,
                       max_frames: int) -> list[int]:
        return sample_indices(total_frames, video_fps, fps, min_frames, max_frames, self.temporal_patch_size)

    def resize(self, frames, max_pixels: int):
        """uint8 ``[T, 3, H, W]`` torch frames resized as the processor resizes a video whose per-frame pixel cap is
        ``max_pixels``."""
        h, w = smart_resize(int(frames.shape[-2]), int(frames.shape[-1]), factor=self.patch_size * self.merge_size,
                            min_pixels=self.size["shortest_edge"], max_pixels=max_pixels)
        return resize_uint8(frames, h, w)
