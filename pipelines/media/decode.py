"""Decoding frames at given timestamps with PyAV.

Untrusted files are decoded inside :class:`longreel.pipelines.media.worker.IsolatedWorker` (op
``decode``), which writes the frames to an ``.npy`` file (never a pickle) that
:func:`decode_in_worker` loads and deletes. Trusted, already-probed files may call
:func:`decode_frames` in-process.

Frame choice: for a timestamp ``t`` the last frame whose presentation time is ``<= t + half a
frame`` is taken, i.e. the frame nearest to ``t`` on a constant-rate stream. The
decoder runs forward through the file and seeks only across gaps longer than
``seek_gap_s``, so a dense set of timestamps costs one pass and a sparse one a few seeks.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import numpy as np

DECODE_VERSION = "decode-v1"


class DecodeError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class DecodedFrames:
    frames: np.ndarray          # uint8 [N, H, W, 3], RGB
    timestamps: list[float]     # presentation time of each returned frame, seconds
    indices: list[int]          # frame index on the average-rate grid: round(time * fps)
    fps: float


def sample_timestamps(start_s: float, end_s: float, n: int) -> list[float]:
    """``n`` timestamps at the centres of ``n`` equal bins of [start_s, end_s)."""
    if n <= 0 or end_s <= start_s:
        raise ValueError(f"cannot sample {n} frames from [{start_s}, {end_s})")
    step = (end_s - start_s) / n
    return [round(start_s + (i + 0.5) * step, 6) for i in range(n)]


def upright(frames, rotation: int | None):
    """``[N, H, W, 3]`` frames as displayed: turned counterclockwise by the stream's display rotation (degrees, as
    probed: 90 = a phone video shot upright), the way ffmpeg's autorotate shows them."""
    import numpy as np

    k = (int(rotation or 0) % 360) // 90
    return np.ascontiguousarray(np.rot90(frames, k, axes=(1, 2))) if k else frames


def decode_frames(path: str, timestamps: list[float], *, width: int | None = None, height: int | None = None,
                  seek_gap_s: float = 3.0, threads: bool = True) -> DecodedFrames:
    """Decode the frames shown at ``timestamps`` (any order; output follows the input order).

    ``width``/``height`` resize with swscale (bilinear) while converting to RGB; leave them
    ``None`` to get the source size (and resize with the target processor's own rules).
    """
    import av

    if not timestamps:
        raise ValueError("no timestamps")
    order = sorted(range(len(timestamps)), key=lambda i: timestamps[i])
    want = [timestamps[i] for i in order]
    try:
        container = av.open(path, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise DecodeError("not_a_video", f"cannot open {path}: {e}") from None
    with container:
        if not container.streams.video:
            raise DecodeError("no_video_stream", f"{path} has no video stream")
        vs = container.streams.video[0]
        if threads:
            vs.thread_type = "AUTO"
        tb = vs.time_base
        fps = float(vs.average_rate or vs.guessed_rate or 0) or 25.0
        half = 0.5 / fps
        start = float(vs.start_time * tb) if vs.start_time is not None else 0.0

        picked: list = [None] * len(want)
        picked_t: list[float] = [0.0] * len(want)
        j = 0
        prev = None  # (time, frame)

        def frames_from(seek_to: float | None):
            if seek_to is not None:
                container.seek(int(max(seek_to, 0.0) / tb) + (vs.start_time or 0), stream=vs, backward=True)
            for pkt in container.demux(vs):
                # Empty packets with a timestamp (Theora in Ogg, repeated AVI frames) carry no picture; sending
                # them makes the decoder fail with EINVAL. The final empty packet (no timestamp) flushes it.
                if pkt.size == 0 and pkt.pts is not None:
                    continue
                for f in pkt.decode():
                    if f.pts is None:
                        continue
                    yield float(f.pts * tb) - start, f

        try:
            it = frames_from(None)
            sought = -1
            while j < len(want):
                # Far from the next target: seek (once per target) instead of decoding everything in between.
                if prev is not None and want[j] - prev[0] > seek_gap_s and sought != j:
                    it = frames_from(want[j] - 0.5)
                    sought = j
                    prev = None
                try:
                    t, f = next(it)
                except StopIteration:
                    break
                while j < len(want) and t > want[j] + half:
                    if prev is None:  # the target lies before the first frame: take the first frame
                        prev = (t, f)
                    picked[j], picked_t[j] = prev[1], prev[0]
                    j += 1
                prev = (t, f)
            while j < len(want) and prev is not None:  # targets beyond the last frame get the last frame
                picked[j], picked_t[j] = prev[1], prev[0]
                j += 1
        except av.error.FFmpegError as e:
            raise DecodeError("decode_failed", f"{path}: {e}") from None
        if any(p is None for p in picked):
            raise DecodeError("decode_failed", f"{path}: no frame decodes near t={want[j] if j < len(want) else '?'}")

        arrays = []
        cache: dict[int, np.ndarray] = {}
        for f in picked:  # the same frame picked twice is converted once
            key = id(f)
            if key not in cache:
                cache[key] = f.to_ndarray(format="rgb24", width=width, height=height) if (width or height) \
                    else f.to_ndarray(format="rgb24")
            arrays.append(cache[key])
    frames = np.empty((len(timestamps),) + arrays[0].shape, dtype=np.uint8)
    ts = [0.0] * len(timestamps)
    for k, i in enumerate(order):
        frames[i] = arrays[k]
        ts[i] = round(picked_t[k], 6)
    return DecodedFrames(frames=frames, timestamps=ts, indices=[round(t * fps) for t in ts], fps=fps)


def decode_to_npy(tmpdir: str, path: str, timestamps: list[float], width: int | None = None,
                  height: int | None = None) -> dict:
    """Worker side of op ``decode``: frames to ``tmpdir/<random>.npy``, metadata in the reply."""
    try:
        d = decode_frames(path, timestamps, width=width, height=height, threads=False)
    except DecodeError:
        raise
    except Exception as e:  # a decoder failure of any kind is one reject for this input
        raise DecodeError("decode_failed", f"{path}: {type(e).__name__}: {e}") from None
    out = os.path.join(tmpdir, f"{uuid.uuid4().hex}.npy")
    np.save(out, d.frames, allow_pickle=False)
    return {"npy": out, "timestamps": d.timestamps, "indices": d.indices, "fps": d.fps}


def decode_in_worker(worker, path: str, timestamps: list[float], *, width: int | None = None,
                     height: int | None = None, timeout: float | None = None) -> DecodedFrames:
    """Decode in an :class:`IsolatedWorker`; a hang or crash raises a WorkerError (one reject)."""
    reply = worker.call("decode", timeout=timeout, path=path, timestamps=list(timestamps), width=width,
                        height=height)
    try:
        frames = np.load(reply["npy"], allow_pickle=False)
    finally:
        try:
            os.unlink(reply["npy"])
        except OSError:
            pass
    return DecodedFrames(frames=frames, timestamps=reply["timestamps"], indices=reply["indices"], fps=reply["fps"])
