"""Frame cache: each video decoded once per parameter set, stored as uint8 frames ready for the processor.

An entry holds the frames a Qwen2-VL-family video processor would feed its vision tower *before*
rescale/normalize: sampled with the processor's own ``sample_frames`` (fps-based, capped at
``max_frames``, a multiple of ``temporal_patch_size``) and resized with the processor's own ``resize``
(smart-resize: both sides multiples of ``patch_size * merge_size``, pixel budget
``[min_pixels, max_pixels]``); for the default processor, the same rules through
:mod:`longreel.pipelines.media.qwen_vl_frames`, which spares a pipeline worker the import of transformers and
torchvision (:func:`frame_processor`). Later stages call the processor with
``do_sample_frames=False, do_resize=False`` and get the same ``pixel_values_videos`` and
``video_grid_thw`` as the on-the-fly path (``tests/test_pack_cache.py`` checks it exactly).

Layout under ``cache_dir`` (any Beam filesystem; local paths are memory-mappable)::

    <key[:2]>/<key>.npy    uint8 [T, H, W, 3] (np.save, allow_pickle=False)
    <key[:2]>/<key>.json   metadata: VideoMetadata fields, source frame indices, timestamps, sizes,
                           processor name/params, the .npy's bytes and sha256 (written last)

``key = sha256(video content sha256, sampling + processor params, versions)``: a parameter change
gives a new key, the same content under two names is decoded once. Both files are written under a
temporary name and renamed; the ``.json`` goes last, so an entry without it is incomplete. An entry
whose ``.npy`` does not match the recorded size/sha256 (truncated, a flipped byte) is rebuilt.
Nothing here unpickles: ``np.load(..., allow_pickle=False)`` and ``json``.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass

import numpy as np
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.media.qwen_vl_frames import Qwen2VLFrames, pixel_budget
from longreel.schemas.atomic import write_atomic

#: bump when what an entry holds changes for the same parameters (sampling, resize call, layout)
PREPROCESS_VERSION = "frames-v2"  # v2: display rotation applied (phone videos stored upright)
CACHE_KIND = "longreel-frame-cache-entry"
_RESIZE_CHUNK = 16  # frames resized at once (bounds the float buffer torchvision's bicubic uses)


class CacheError(Exception):
    """A video cannot be cached; ``reason`` is a reject code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _versions() -> dict:
    # from the installed distributions' metadata, the same strings as the modules' ``__version__`` (without the
    # local "+cu130" part): importing torch, torchvision and transformers only to read them cost seconds
    from importlib.metadata import version

    from longreel.pipelines.media.decode import DECODE_VERSION
    return {"preprocess": PREPROCESS_VERSION, "decode": DECODE_VERSION, "transformers": version("transformers"),
            "torchvision": version("torchvision").split("+")[0], "torch": version("torch").split("+")[0]}


def frame_processor(processor: str | None = None, *, min_pixels: int | None = None, max_pixels: int | None = None):
    """What the pipeline's stages sample and resize with: for the default processor (``processor`` None), the
    rules of :mod:`longreel.pipelines.media.qwen_vl_frames`, which need torch but neither transformers nor
    torchvision (seconds of import per worker); for a processor directory, the transformers processor
    (:func:`load_video_processor`). Both give the same frames and cache keys for the same settings (tested)."""
    if processor:
        return load_video_processor(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return Qwen2VLFrames(min_pixels=min_pixels, max_pixels=max_pixels)


def load_video_processor(processor: str | None = None, *, min_pixels: int | None = None,
                         max_pixels: int | None = None):
    """The target video processor: from a local processor/checkpoint dir, or Qwen2-VL's defaults.

    ``min_pixels`` / ``max_pixels`` override the processor's per-frame pixel budget when given.
    Never downloads: ``processor`` must be a local directory.
    """
    from transformers import Qwen2VLVideoProcessor

    if processor:
        if not os.path.isdir(processor):
            raise FileNotFoundError(f"processor {processor!r} is not a local directory (no hub downloads here)")
        from transformers import AutoVideoProcessor
        vp = AutoVideoProcessor.from_pretrained(processor, local_files_only=True)
    else:
        vp = Qwen2VLVideoProcessor(cap_pixels_per_frame=True)
    for attr in ("patch_size", "merge_size", "temporal_patch_size"):
        if not getattr(vp, attr, None):
            raise ValueError(f"{type(vp).__name__} has no {attr}: not a Qwen2-VL-family video processor")
    vp.size = pixel_budget(dict(vp.size), min_pixels, max_pixels, vp.patch_size * vp.merge_size)
    return vp


def processor_params(vp) -> dict:
    """Everything about the processor that decides which frames are sampled and how they are resized."""
    size = {k: int(v) for k, v in dict(vp.size).items() if v is not None}
    resample = vp.resample
    return {"class": getattr(vp, "processor_class", None) or type(vp).__name__, "patch_size": int(vp.patch_size),
            "merge_size": int(vp.merge_size),
            "temporal_patch_size": int(vp.temporal_patch_size), "size": dict(sorted(size.items())),
            "resample": int(resample) if resample is not None else None,
            "cap_pixels_per_frame": bool(getattr(vp, "cap_pixels_per_frame", False)),
            "max_video_tokens": int(getattr(vp, "max_video_tokens", 0) or 0),
            "do_convert_rgb": bool(vp.do_convert_rgb)}


@dataclass(frozen=True)
class FrameParams:
    fps: float = 2.0
    max_frames: int = 64
    min_frames: int = 4

    def as_dict(self) -> dict:
        return {"fps": float(self.fps), "max_frames": int(self.max_frames), "min_frames": int(self.min_frames)}


def cache_key(video_sha256: str, params: FrameParams, proc: dict, versions: dict) -> str:
    blob = json.dumps({"sha256": video_sha256, "sampling": params.as_dict(), "processor": proc,
                       "versions": versions}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def sample_indices(vp, total_frames: int, video_fps: float, params: FrameParams) -> list[int]:
    """Source frame indices chosen by the processor's ``sample_frames`` rule (fps-based, capped, even)."""
    if total_frames < 1 or not video_fps or video_fps <= 0:
        raise CacheError("too_few_frames", f"cannot sample from {total_frames} frames at {video_fps} fps")
    try:
        if isinstance(vp, Qwen2VLFrames):  # the default processor's rules without transformers
            idx = vp.sample_indices(int(total_frames), float(video_fps), params.fps, params.min_frames,
                                    params.max_frames)
        else:
            from transformers.video_utils import VideoMetadata
            meta = VideoMetadata(total_num_frames=int(total_frames), fps=float(video_fps),
                                 duration=total_frames / video_fps)
            idx = vp.sample_frames(metadata=meta, fps=params.fps, num_frames=None, min_frames=params.min_frames,
                                   max_frames=params.max_frames, temporal_patch_size=vp.temporal_patch_size)
    except (ValueError, ZeroDivisionError) as e:
        raise CacheError("too_few_frames", f"{total_frames} frames at {video_fps:.3f} fps: {e}") from None
    out = [int(i) for i in (idx.tolist() if hasattr(idx, "tolist") else idx)]
    if not out:
        raise CacheError("too_few_frames", f"no frames sampled from {total_frames} frames at {video_fps} fps")
    return out


def effective_max_pixels(vp, num_frames: int) -> int:
    """The per-frame pixel cap the processor applies to a ``num_frames``-frame video (its
    ``cap_pixels_per_frame`` rule), so that frames can be resized in chunks with the same result."""
    size = dict(vp.size)
    max_pixels = int(size["longest_edge"])
    if getattr(vp, "cap_pixels_per_frame", False):
        factor = vp.patch_size * vp.merge_size
        total = int(vp.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total * vp.temporal_patch_size // num_frames),
                         int(size["shortest_edge"] * 1.05))
    return max_pixels


def processor_resize(vp, frames: np.ndarray, num_frames: int | None = None) -> np.ndarray:
    """Resize uint8 ``[T, H, W, 3]`` frames exactly as ``vp`` does inside its ``_preprocess``.

    The processor's ``resize`` (smart-resize + bicubic with antialias on uint8: the transformers processor's own
    method, or the same rule of :class:`~longreel.pipelines.media.qwen_vl_frames.Qwen2VLFrames`), ``_RESIZE_CHUNK``
    frames at a time with the pixel cap of the whole video: a video of ``num_frames`` frames (default: ``T``), so
    that the frames of one video can be resized in parts, each part as the whole.
    """
    import torch

    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    n = frames.shape[0]
    max_pixels = effective_max_pixels(vp, num_frames or n)
    light = isinstance(vp, Qwen2VLFrames)
    if not light:
        from transformers.image_utils import SizeDict
        size = SizeDict(**{**dict(vp.size), "longest_edge": max_pixels})
    factor = vp.patch_size * vp.merge_size
    out = None
    for s in range(0, n, _RESIZE_CHUNK):
        # a copy: the frames may be a read-only memory map of the decoder's output (torch wants writable memory)
        chunk = torch.from_numpy(np.array(frames[s:s + _RESIZE_CHUNK])).permute(0, 3, 1, 2).contiguous()
        if light:
            resized = vp.resize(chunk, max_pixels)
        else:
            resized = vp.resize(videos=chunk.unsqueeze(0), size=size, resample=vp.resample, factor=factor,
                                temporal_factor=vp.temporal_patch_size, cap_pixels_per_frame=False)[0]
        arr = resized.permute(0, 2, 3, 1).contiguous().numpy()
        if arr.dtype != np.uint8:
            raise RuntimeError(f"{type(vp).__name__}.resize returned {arr.dtype}, expected uint8")
        if out is None:
            out = np.empty((n,) + arr.shape[1:], dtype=np.uint8)
        out[s:s + arr.shape[0]] = arr
    return out


def grid_thw(vp, num_frames: int, height: int, width: int) -> list[int]:
    """``video_grid_thw`` the processor reports for already-resized frames (pads T to the temporal patch)."""
    tp = vp.temporal_patch_size
    return [int(math.ceil(num_frames / tp)), int(height // vp.patch_size), int(width // vp.patch_size)]


def npy_bytes(frames: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, frames, allow_pickle=False)
    return buf.getvalue()


def _read(path: str) -> bytes:
    if "://" not in path:
        with open(path, "rb") as fh:
            return fh.read()
    with FileSystems.open(path, compression_type="uncompressed") as fh:
        return fh.read()


@dataclass
class CacheEntry:
    key: str
    npy_path: str
    meta_path: str
    meta: dict

    @property
    def frames_bytes(self) -> int:
        return int(self.meta["frames_file"]["bytes"])

    @property
    def frames_sha256(self) -> str:
        return self.meta["frames_file"]["sha256"]

    def load(self, mmap: bool = True) -> np.ndarray:
        """uint8 ``[T, H, W, 3]``; memory-mapped when local and ``mmap``."""
        if mmap and "://" not in self.npy_path:
            return np.load(self.npy_path, mmap_mode="r", allow_pickle=False)
        return np.load(io.BytesIO(_read(self.npy_path)), allow_pickle=False)

    def ref(self) -> dict:
        """A small JSON-able reference that travels through a pipeline instead of the frames."""
        return {"key": self.key, "npy_path": self.npy_path, "meta_path": self.meta_path, "meta": self.meta}


class FrameCache:
    """Decode-once cache of processor-ready uint8 frames (see the module docstring)."""

    def __init__(self, cache_dir: str, params: FrameParams, vp):
        self.cache_dir = cache_dir
        self.params = params
        self.vp = vp
        self.proc = processor_params(vp)
        self.versions = _versions()

    def key(self, video_sha256: str) -> str:
        return cache_key(video_sha256, self.params, self.proc, self.versions)

    def paths(self, key: str) -> tuple[str, str]:
        d = FileSystems.join(self.cache_dir, key[:2])
        return FileSystems.join(d, f"{key}.npy"), FileSystems.join(d, f"{key}.json")

    def lookup(self, video_sha256: str, verify: str = "sha256") -> tuple[CacheEntry | None, str]:
        """``(entry, state)``; state is ``hit``, ``missing`` or ``corrupt:<why>`` (entry None unless hit)."""
        key = self.key(video_sha256)
        npy, meta_path = self.paths(key)
        if not FileSystems.exists(meta_path):
            return None, "missing"
        try:
            meta = json.loads(_read(meta_path))
        except (OSError, ValueError) as e:
            return None, f"corrupt:meta unreadable ({e})"
        if meta.get("__kind__") != CACHE_KIND or meta.get("cache_key") != key:
            return None, "corrupt:meta does not describe this key"
        if not FileSystems.exists(npy):
            return None, "corrupt:frames file missing"
        want = meta["frames_file"]
        size = os.path.getsize(npy) if "://" not in npy else FileSystems.match([npy])[0].metadata_list[0].size_in_bytes
        if size != want["bytes"]:
            return None, f"corrupt:frames file has {size} bytes, expected {want['bytes']}"
        if verify == "sha256":
            digest = hashlib.sha256(_read(npy)).hexdigest()
            if digest != want["sha256"]:
                return None, "corrupt:frames sha256 mismatch"
        return CacheEntry(key, npy, meta_path, meta), "hit"

    def plan(self, video: dict) -> tuple[list[int], list[float], float]:
        """``(source frame indices, their timestamps, fps)`` the processor samples from ``video`` (a VIDEO row)."""
        total = int(video["n_frames"])
        fps = float(video.get("fps_avg") or (total / video["duration_s"] if video.get("duration_s") else 0.0))
        indices = sample_indices(self.vp, total, fps, self.params)
        return indices, [round(i / fps, 6) for i in indices], fps

    def build(self, video: dict, local_path: str, decode) -> CacheEntry:
        """Decode, sample and resize ``video`` (a VIDEO row) from ``local_path`` and write the entry.

        ``decode(path, timestamps, rotation=) -> DecodedFrames`` (full resolution, as displayed); pass
        ``lambda p, ts, **kw: decode_in_worker(worker, p, ts, **kw)`` for untrusted files.
        """
        _indices, timestamps, _fps = self.plan(video)
        return self.store(video, decode(local_path, timestamps, rotation=int(video.get("rotation") or 0) % 360))

    def store(self, video: dict, decoded) -> CacheEntry:
        """Resize the frames decoded at :meth:`plan`'s timestamps (full resolution, upright: one decode pass may
        have served other stages too) and write the entry."""
        indices = self.plan(video)[0]
        frames = decoded.frames
        if frames.ndim != 4 or frames.shape[0] != len(indices):
            raise CacheError("decode_failed", f"decoder returned {frames.shape} for {len(indices)} timestamps")
        return self.store_resized(video, processor_resize(self.vp, frames), decoded.timestamps)

    def store_resized(self, video: dict, resized: np.ndarray, decoded_timestamps: list[float]) -> CacheEntry:
        """Write the entry from frames already resized by :func:`processor_resize` (with the whole video's frame
        count), e.g. put together from parts that several decode passes resized (the same bytes as :meth:`store`:
        the resize treats each frame alone)."""
        from longreel.pipelines.media.decode import displayed_size

        vp = self.vp
        total = int(video["n_frames"])
        indices, timestamps, fps = self.plan(video)
        if resized.ndim != 4 or resized.shape[0] != len(indices) or len(decoded_timestamps) != len(indices):
            raise CacheError("decode_failed", f"{resized.shape[0]} frames for {len(indices)} timestamps")
        rotation = int(video.get("rotation") or 0) % 360
        width, height = displayed_size(video)
        t, h, w, _ = resized.shape
        data = npy_bytes(resized)
        key = self.key(video["sha256"])
        npy, meta_path = self.paths(key)
        meta = {
            "__kind__": CACHE_KIND,
            "cache_key": key,
            "video_id": video["video_id"],
            "video_sha256": video["sha256"],
            # transformers.video_utils.VideoMetadata fields (of the source video) ...
            "total_num_frames": total,
            "fps": fps,
            "duration": float(video["duration_s"]),
            "width": width,    # as displayed
            "height": height,
            "frames_indices": indices,
            # ... and what was actually decoded and stored
            "timestamps": [float(x) for x in decoded_timestamps],
            "requested_timestamps": timestamps,
            "rotation_applied": rotation,
            "num_frames": int(t),
            "resized_height": int(h),
            "resized_width": int(w),
            "video_grid_thw": grid_thw(vp, t, h, w),
            "sampling": self.params.as_dict(),
            "processor": self.proc,
            "versions": self.versions,
            "frames_file": {"format": "npy", "dtype": "uint8", "layout": "THWC",
                            "shape": [int(x) for x in resized.shape], "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()},
        }
        write_atomic(npy, data)
        write_atomic(meta_path, (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode())
        return CacheEntry(key, npy, meta_path, meta)


# -- frames of one decode request, as decoded --------------------------------------------------------------------

DECODED_KIND = "longreel-decoded-frames-entry"


class DecodedFrameStore:
    """Frames one stage asked the shared decode pass for, stored as decoded (no processor resize), so that the
    stage reads them instead of decoding the video again: the pass-rate filter's ``uniform`` frames, decoded in the
    caption stage's pass. Entries sit beside the frame cache's (``<key[:2]>/<key>.frames.npy`` and
    ``.frames.json``, the JSON written last and holding the ``.npy``'s size and sha256); ``key`` covers the video's
    content, the request (timestamps, size), the rotation applied and the decoder's version, so an entry is only
    ever read by a request for the same frames. A missing or damaged entry reads as absent (the stage decodes)."""

    def __init__(self, cache_dir: str):
        self.cache_dir = cache_dir

    def key(self, video: dict, request) -> str:
        from longreel.pipelines.media.decode import DECODE_VERSION

        blob = json.dumps({"kind": DECODED_KIND, "sha256": video["sha256"], "request": request.as_dict(),
                           "rotation": int(video.get("rotation") or 0) % 360, "decode": DECODE_VERSION},
                          sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def paths(self, key: str) -> tuple[str, str]:
        d = FileSystems.join(self.cache_dir, key[:2])
        return FileSystems.join(d, f"{key}.frames.npy"), FileSystems.join(d, f"{key}.frames.json")

    def lookup(self, video: dict, request):
        """The stored :class:`~longreel.pipelines.media.decode.DecodedFrames` of ``request``, or None."""
        from longreel.pipelines.media.decode import DecodedFrames

        key = self.key(video, request)
        npy, meta_path = self.paths(key)
        try:
            if not FileSystems.exists(meta_path) or not FileSystems.exists(npy):
                return None
            meta = json.loads(_read(meta_path))
            if meta.get("__kind__") != DECODED_KIND or meta.get("key") != key:
                return None
            data = _read(npy)
            want = meta["frames_file"]
            if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
                return None
            frames = np.load(io.BytesIO(data), allow_pickle=False)
        except (OSError, ValueError, KeyError):
            return None
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != len(request.timestamps):
            return None
        return DecodedFrames(frames=frames, timestamps=[float(t) for t in meta["timestamps"]],
                             indices=[int(i) for i in meta["indices"]], fps=float(meta["fps"]))

    def store(self, video: dict, request, decoded) -> str:
        """Write ``decoded`` (the frames of ``request``) for ``video``; returns the key."""
        key = self.key(video, request)
        npy, meta_path = self.paths(key)
        data = npy_bytes(np.ascontiguousarray(decoded.frames))
        meta = {"__kind__": DECODED_KIND, "key": key, "video_id": video["video_id"], "video_sha256": video["sha256"],
                "request": request.as_dict(), "timestamps": [float(t) for t in decoded.timestamps],
                "indices": [int(i) for i in decoded.indices], "fps": float(decoded.fps),
                "frames_file": {"format": "npy", "dtype": "uint8", "layout": "THWC",
                                "shape": [int(x) for x in decoded.frames.shape], "bytes": len(data),
                                "sha256": hashlib.sha256(data).hexdigest()}}
        write_atomic(npy, data)
        write_atomic(meta_path, (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode())
        return key
