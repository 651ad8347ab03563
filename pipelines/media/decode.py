"""Decoding frames at given timestamps, once per video for every consumer.

Untrusted files are decoded inside :class:`longreel.pipelines.media.worker.IsolatedWorker` (op
``decode``), which writes each consumer's frames to an ``.npy`` file (never a pickle) that
:func:`decode_many_in_worker` memory-maps and deletes. Trusted, already-probed files may call
:func:`decode_frames` / :func:`decode_requests` in-process.

One pass, many consumers: a :class:`FrameRequest` is one consumer's timestamps and frame size (the caption
stage's clip frames, the frame cache's processor grid, the pass-rate filter's uniform frames). The decoder
walks the union of all requests' timestamps in time order, so a video is decoded once however many consumers
want frames from it, and converts each picked frame straight into every request's output array: memory holds
one decoded frame at a time, and in the worker the outputs are ``.npy`` files on disk written frame by frame
(:class:`NpyFrameWriter`), so a long video does not grow the worker.

Every decode pass through the worker is logged on the ``longreel.decode`` logger (DEBUG: path, requests,
frames), so a run can count its passes per video (``benchmarks/throughput.py`` does).

Rotation: frames leave this module as displayed (a phone video shot upright is portrait), turned by the
stream's display rotation with :func:`upright`; sizes in a request are the displayed size. Every consumer gets
its frames through here, so the caption frames, the frame cache and the pass-rate frames agree.

Frame choice (``mode="exact"``): for a timestamp ``t`` the last frame whose presentation time is
``<= t + half a frame`` is taken, i.e. the frame nearest to ``t`` on a constant-rate stream. The decoder runs
forward through the file and seeks only across gaps longer than ``seek_gap_s``, so a dense set of timestamps
costs one pass and a sparse one a few seeks. Single-threaded (in the worker), non-reference frames far from
every target are not decoded at all (:class:`_Dropped`: the same picks, 35-45% less CPU on B-frame H.264).
``mode="keyframe"``: the keyframe nearest to ``t`` (only
keyframes are decoded: several times faster on long-GOP H.264); the frame's real time is returned.

Backends: ``pyav`` (threaded decoding) and ``decord``; ``benchmarks/decoders.py`` chose the default
(:data:`DEFAULT_BACKEND`). Both pick frames with the rule above.
"""
from __future__ import annotations

import bisect
import heapq
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

log = logging.getLogger("longreel.decode")

DECODE_VERSION = "decode-v1"
BACKENDS = ("pyav", "decord")
DEFAULT_BACKEND = "pyav"
MODES = ("exact", "keyframe")


class DecodeError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class DecodedFrames:
    frames: np.ndarray          # uint8 [N, H, W, 3], RGB, as displayed
    timestamps: list[float]     # presentation time of each returned frame, seconds
    indices: list[int]          # frame index on the average-rate grid: round(time * fps)
    fps: float


@dataclass
class FrameRequest:
    """One consumer's frames: ``timestamps`` (any order; output follows it) at ``width`` x ``height`` as displayed
    (``None``: the source size)."""
    timestamps: list[float]
    width: int | None = None
    height: int | None = None

    def as_dict(self) -> dict:
        return {"timestamps": list(self.timestamps), "width": self.width, "height": self.height}


def sample_timestamps(start_s: float, end_s: float, n: int) -> list[float]:
    """``n`` timestamps at the centres of ``n`` equal bins of [start_s, end_s)."""
    if n <= 0 or end_s <= start_s:
        raise ValueError(f"cannot sample {n} frames from [{start_s}, {end_s})")
    step = (end_s - start_s) / n
    return [round(start_s + (i + 0.5) * step, 6) for i in range(n)]


def upright(frames, rotation: int | None):
    """``[N, H, W, 3]`` frames as displayed: turned counterclockwise by the stream's display rotation (degrees, as
    probed: 90 = a phone video shot upright), the way ffmpeg's autorotate shows them."""
    k = (int(rotation or 0) % 360) // 90
    return np.ascontiguousarray(np.rot90(frames, k, axes=(1, 2))) if k else frames


def coded_size(width: int | None, height: int | None, rotation: int | None) -> tuple[int | None, int | None]:
    """The size to convert a coded frame to so that, turned by ``rotation``, it is ``width`` x ``height``."""
    if (int(rotation or 0) % 180) == 90:
        return height, width
    return width, height


def displayed_size(video: dict) -> tuple[int, int]:
    """A VIDEO row's ``(width, height)`` as displayed: a 90/270-degree display rotation swaps the coded sides."""
    return coded_size(int(video["width"]), int(video["height"]), video.get("rotation"))


# -- picking frames ------------------------------------------------------------------------------------------------

@dataclass
class _Targets:
    """The union of all requests' timestamps, in time order: ``(time, request, position)``."""
    items: list[tuple[float, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, requests: list[FrameRequest]) -> "_Targets":
        items = [(float(t), r, i) for r, req in enumerate(requests) for i, t in enumerate(req.timestamps)]
        return cls(sorted(items))


class _Outputs:
    """Each request's output array, filled as frames are picked; ``alloc(request, shape)`` makes an array
    (``np.empty`` in-process, an :class:`NpyFrameWriter` in the worker)."""

    def __init__(self, requests: list[FrameRequest], rotation: int, alloc: Callable, convert: Callable):
        self.requests, self.rotation, self.alloc, self.convert = requests, rotation, alloc, convert
        self.arrays: list = [None] * len(requests)
        self.times: list[list[float]] = [[0.0] * len(r.timestamps) for r in requests]
        self._last: tuple = (None, None, None)  # (frame, size, converted): a frame picked twice is converted once

    def put(self, r: int, pos: int, t: float, frame) -> None:
        req = self.requests[r]
        size = coded_size(req.width, req.height, self.rotation)
        if self._last[0] is frame and self._last[1] == size:
            rgb = self._last[2]
        else:
            rgb = upright(self.convert(frame, *size)[None], self.rotation)[0]
            self._last = (frame, size, rgb)
        self.place(r, pos, t, rgb)

    def place(self, r: int, pos: int, t: float, rgb: np.ndarray) -> None:
        if self.arrays[r] is None:
            self.arrays[r] = self.alloc(r, (len(self.requests[r].timestamps),) + rgb.shape)
        self.arrays[r][pos] = rgb
        self.times[r][pos] = round(t, 6)


def _pick_exact(frames_from: Callable, targets: _Targets, half: float, seek_gap_s: float, out: _Outputs,
                check: Callable | None = None):
    """Walk ``frames_from(seek_to) -> iterator of (time, frame)`` forward, seeking across long gaps, and give every
    target the last frame shown at or before it (``+ half`` a frame); targets before the first frame get the first
    frame, targets after the last frame the last one. Returns the index of the first target left without a frame.
    ``check(previous frame time or None, target + half)`` runs before each pick (it may raise :class:`_Unseen`)."""
    want = targets.items
    check = check or (lambda _prev, _limit: None)
    j, prev, sought = 0, None, -1
    it = frames_from(None)
    while j < len(want):
        # Far from the next target: seek (once per target) instead of decoding everything in between.
        if prev is not None and want[j][0] - prev[0] > seek_gap_s and sought != j:
            it = frames_from(want[j][0] - 0.5)
            sought, prev = j, None
        try:
            t, f = next(it)
        except StopIteration:
            break
        while j < len(want) and t > want[j][0] + half:
            check(prev[0] if prev is not None else None, want[j][0] + half)
            if prev is None:  # the target lies before the first frame: take the first frame
                prev = (t, f)
            out.put(want[j][1], want[j][2], prev[0], prev[1])
            j += 1
        prev = (t, f)
    while j < len(want) and prev is not None:  # targets beyond the last frame get the last frame
        check(prev[0], float("inf"))
        out.put(want[j][1], want[j][2], prev[0], prev[1])
        j += 1
    return j


class _Unseen(Exception):
    """A frame the decoder was told to drop could have been a pick: decode again without dropping any."""


class _Dropped:
    """Non-reference frames far from every target are not decoded (``skip_frame = NONREF``: nothing refers to
    them, so the frames that are decoded come out the same). A dropped frame shown between the previous frame and
    a target would have been that target's pick; :meth:`check` raises :class:`_Unseen` then, and the caller
    decodes again without dropping, so the picks are always those of a full decode."""

    def __init__(self, times: list[float], window_s: float):
        self.times, self.window = sorted(times), window_s
        self.pending: set[float] = set()  # times of dropped-eligible packets that have not come out as frames
        self.heap: list[float] = []

    def wanted(self, t: float) -> bool:
        """Whether a frame shown at ``t`` lies within ``window_s`` of a target (decode it whatever it is)."""
        i = bisect.bisect_left(self.times, t - self.window)
        return i < len(self.times) and self.times[i] <= t + self.window

    def dropping(self, t: float) -> None:
        self.pending.add(t)
        heapq.heappush(self.heap, t)

    def seen(self, t: float) -> None:
        self.pending.discard(t)

    def reset(self) -> None:
        self.pending.clear()
        self.heap.clear()

    def check(self, prev: float | None, limit: float) -> None:
        # frames come out in presentation order: a time still pending below the frame now out was really dropped
        while self.heap and (self.heap[0] not in self.pending or (prev is not None and self.heap[0] <= prev)):
            heapq.heappop(self.heap)
        if self.heap and self.heap[0] <= limit:
            raise _Unseen


def _pick_nearest(frames: Callable, targets: _Targets, out: _Outputs) -> int:
    """Give every target the nearest of the (key)frames ``frames()`` yields in time order (ties: the earlier)."""
    want = targets.items
    j, prev = 0, None
    for t, f in frames():
        while j < len(want) and t >= want[j][0]:
            near = prev if prev is not None and want[j][0] - prev[0] <= t - want[j][0] else (t, f)
            out.put(want[j][1], want[j][2], near[0], near[1])
            j += 1
        if j == len(want):
            break
        prev = (t, f)
    while j < len(want) and prev is not None:
        out.put(want[j][1], want[j][2], prev[0], prev[1])
        j += 1
    return j


# -- backends ------------------------------------------------------------------------------------------------------

def _pyav(path: str, targets: _Targets, make_out: Callable, *, mode: str, seek_gap_s: float, threads: bool,
          drop_unseen: bool = True):
    import av

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
        if mode == "keyframe":
            vs.codec_context.skip_frame = "NONKEY"  # the decoder drops every other frame unseen
        tb = vs.time_base
        fps = float(vs.average_rate or vs.guessed_rate or 0) or 25.0
        start = float(vs.start_time * tb) if vs.start_time is not None else 0.0
        cc = vs.codec_context
        half = 0.5 / fps
        # single-threaded only: a frame-threaded decoder applies skip_frame as each thread takes its packet
        drop = _Dropped([t for t, _, _ in targets.items], 2.0 / fps + half) \
            if drop_unseen and mode == "exact" and not threads else None

        def frames_from(seek_to: float | None):
            if seek_to is not None:
                container.seek(int(max(seek_to, 0.0) / tb) + (vs.start_time or 0), stream=vs, backward=True)
                if drop is not None:
                    drop.reset()
            for pkt in container.demux(vs):
                # Empty packets with a timestamp (Theora in Ogg, repeated AVI frames) carry no picture; sending
                # them makes the decoder fail with EINVAL. The final empty packet (no timestamp) flushes it.
                if pkt.size == 0 and pkt.pts is not None:
                    continue
                if drop is not None:
                    pt = float(pkt.pts * tb) - start if pkt.pts is not None else None
                    if pt is not None and not drop.wanted(pt):
                        cc.skip_frame = "NONREF"
                        drop.dropping(pt)
                    else:
                        cc.skip_frame = "DEFAULT"
                for f in pkt.decode():
                    if f.pts is None:
                        continue
                    ft = float(f.pts * tb) - start
                    if drop is not None:
                        drop.seen(ft)
                    yield ft, f

        def rgb(frame, width, height):
            return frame.to_ndarray(format="rgb24", width=width, height=height) if (width or height) \
                else frame.to_ndarray(format="rgb24")

        out = make_out(rgb)
        try:
            if mode == "keyframe":
                done = _pick_nearest(lambda: frames_from(None), targets, out)
            elif drop is None:
                done = _pick_exact(frames_from, targets, half, seek_gap_s, out)
            else:
                try:
                    done = _pick_exact(frames_from, targets, half, seek_gap_s, out, drop.check)
                except _Unseen:  # a dropped frame could have been a pick: every frame this time
                    log.debug("decode: %s: a dropped frame lay next to a target; decoding again in full", path)
                    drop = None
                    cc.skip_frame = "DEFAULT"
                    done = _pick_exact(lambda seek_to: frames_from(0.0 if seek_to is None else seek_to), targets,
                                       half, seek_gap_s, out)
        except av.error.FFmpegError as e:
            raise DecodeError("decode_failed", f"{path}: {e}") from None
    return out, done, fps


class _Picks:
    """An :class:`_Outputs` stand-in that only records which frame each target gets (decord fetches in batches)."""

    def __init__(self):
        self.items: list[tuple[int, int, float, int]] = []

    def put(self, r: int, pos: int, t: float, index: int) -> None:
        self.items.append((r, pos, t, index))


def _decord(path: str, targets: _Targets, make_out: Callable, *, mode: str, seek_gap_s: float, threads: bool):
    """decord picks by frame index from its own frame table with the same rule as PyAV (the last frame shown at
    or before ``t`` + half a frame; keyframe mode: the nearest key frame), then fetches the picked frames with
    ``get_batch`` in chunks (one reader per output size: decord resizes inside the reader)."""
    import decord

    del seek_gap_s  # decord seeks by itself
    nthreads = 0 if threads else 1
    try:
        base = decord.VideoReader(path, ctx=decord.cpu(0), num_threads=nthreads)
    except Exception as e:  # decord raises its own DECORDError for unreadable files
        raise DecodeError("not_a_video", f"cannot open {path}: {e}") from None
    fps = float(base.get_avg_fps() or 0) or 25.0
    starts = np.asarray(base.get_frame_timestamp(range(len(base))))[:, 0]
    picks = _Picks()
    if mode == "keyframe":
        keys = np.asarray(base.get_key_indices(), dtype=np.int64)
        done = _pick_nearest(lambda: ((float(starts[k]), int(k)) for k in keys), targets, picks)
    else:
        half = 0.5 / fps
        # the frames that can be picked: each target's candidate and the frame after it (which closes the pick)
        cand = {int(np.searchsorted(starts, t + half, side="right")) - 1 for t, _, _ in targets.items}
        order = sorted({i for c in cand for i in (max(c, 0), c + 1) if i < len(starts)})
        done = _pick_exact(lambda _seek: ((float(starts[i]), i) for i in order), targets, half, float("inf"), picks)
    readers: dict = {}

    def convert(batch: list[tuple[int, int, float, int]], width, height):
        key = (width, height)
        if key not in readers:
            readers[key] = base if not (width or height) else decord.VideoReader(
                path, ctx=decord.cpu(0), width=width or -1, height=height or -1, num_threads=nthreads)
        return readers[key].get_batch(sorted({p[3] for p in batch})).asnumpy()

    out = make_out(None)
    for r, req in enumerate(out.requests):
        mine = sorted((p for p in picks.items if p[0] == r), key=lambda p: p[3])
        size = coded_size(req.width, req.height, out.rotation)
        for s in range(0, len(mine), _DECORD_CHUNK):
            chunk = mine[s:s + _DECORD_CHUNK]
            arr = convert(chunk, *size)
            where = {i: k for k, i in enumerate(sorted({p[3] for p in chunk}))}
            for _r, pos, t, index in chunk:
                out.place(r, pos, t, upright(arr[where[index]][None], out.rotation)[0])
    return out, done, fps


_DECORD_CHUNK = 32  # frames fetched per get_batch call (bounds the batch in memory)


_BACKENDS = {"pyav": _pyav, "decord": _decord}


def decode_requests(path: str, requests: list[FrameRequest], *, rotation: int | None = 0, backend: str = "pyav",
                    mode: str = "exact", seek_gap_s: float = 3.0, threads: bool = True,
                    alloc: Callable | None = None, drop_unseen: bool = True) -> list[DecodedFrames]:
    """Decode every request's frames from ``path`` in one pass (see the module docstring), turned upright by
    ``rotation``. ``alloc(request_index, shape) -> array`` places the outputs (default: in memory).
    ``drop_unseen`` (pyav, exact, single-threaded): leave undecoded the non-reference frames far from every
    target (:class:`_Dropped`); the frames returned are the same either way."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown decode backend {backend!r} (choose from {BACKENDS})")
    if mode not in MODES:
        raise ValueError(f"unknown decode mode {mode!r} (choose from {MODES})")
    if not requests or any(not r.timestamps for r in requests):
        raise ValueError("no timestamps")
    targets = _Targets.of(requests)
    alloc = alloc or (lambda _r, shape: np.empty(shape, dtype=np.uint8))
    extra = {"drop_unseen": drop_unseen} if backend == "pyav" else {}
    out, done, fps = _BACKENDS[backend](
        path, targets, lambda convert: _Outputs(requests, int(rotation or 0), alloc, convert),
        mode=mode, seek_gap_s=seek_gap_s, threads=threads, **extra)
    if done < len(targets.items) or any(a is None for a in out.arrays):
        near = targets.items[done][0] if done < len(targets.items) else "?"
        raise DecodeError("decode_failed", f"{path}: no frame decodes near t={near}")
    return [DecodedFrames(frames=a, timestamps=ts, indices=[round(t * fps) for t in ts], fps=fps)
            for a, ts in zip(out.arrays, out.times)]


def decode_frames(path: str, timestamps: list[float], *, width: int | None = None, height: int | None = None,
                  rotation: int | None = 0, seek_gap_s: float = 3.0, threads: bool = True, backend: str = "pyav",
                  mode: str = "exact") -> DecodedFrames:
    """Decode the frames shown at ``timestamps`` (any order; output follows the input order).

    ``width``/``height`` (as displayed) resize with swscale (bilinear) while converting to RGB; leave them
    ``None`` to get the source size (and resize with the target processor's own rules).
    """
    return decode_requests(path, [FrameRequest(list(timestamps), width, height)], rotation=rotation,
                           seek_gap_s=seek_gap_s, threads=threads, backend=backend, mode=mode)[0]


class NpyFrameWriter:
    """A uint8 ``.npy`` file of ``shape`` filled one frame at a time (``writer[pos] = frame``) with positioned
    writes. Not a memory map on purpose: the pages of a written shared mapping count in the process's RSS until
    the kernel writes them back, so a memory-mapped output grows the worker with the video's length (2,880
    caption frames of an hour-long video), while written pages only sit in the page cache."""

    def __init__(self, path: str, shape: tuple):
        self.path, self.shape = path, tuple(int(x) for x in shape)
        self.frame_bytes = int(np.prod(self.shape[1:], dtype=np.int64))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(os.dup(fd), "wb") as fh:
                np.lib.format.write_array_header_1_0(fh, {"descr": "|u1", "fortran_order": False,
                                                          "shape": self.shape})
                self.offset = fh.tell()
            os.ftruncate(fd, self.offset + self.frame_bytes * self.shape[0])
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    def __setitem__(self, pos: int, frame: np.ndarray) -> None:
        buf = np.ascontiguousarray(frame, dtype=np.uint8)
        if buf.shape != self.shape[1:]:
            raise ValueError(f"frame of shape {buf.shape} for a {self.shape} file")
        os.pwrite(self.fd, memoryview(buf).cast("B"), self.offset + int(pos) * self.frame_bytes)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def decode_to_npy(tmpdir: str, path: str, requests: list[dict], rotation: int | None = 0, backend: str = "pyav",
                  mode: str = "exact", threads: bool = False) -> dict:
    """Worker side of op ``decode``: each request's frames go straight to ``tmpdir/<random>.npy`` as they are
    picked (memory stays at one frame, see :class:`NpyFrameWriter`), metadata in the reply."""
    names = [os.path.join(tmpdir, f"{uuid.uuid4().hex}.npy") for _ in requests]
    writers: list[NpyFrameWriter] = []

    def alloc(r: int, shape: tuple) -> NpyFrameWriter:
        writers.append(NpyFrameWriter(names[r], shape))
        return writers[-1]

    try:
        done = decode_requests(path, [FrameRequest(**r) for r in requests], rotation=rotation, backend=backend,
                               mode=mode, threads=threads, alloc=alloc)
    except DecodeError:
        _close(writers)
        _unlink(names)
        raise
    except Exception as e:  # a decoder failure of any kind is one reject for this input
        _close(writers)
        _unlink(names)
        raise DecodeError("decode_failed", f"{path}: {type(e).__name__}: {e}") from None
    _close(writers)
    return {"results": [{"npy": n, "timestamps": d.timestamps, "indices": d.indices, "fps": d.fps}
                        for n, d in zip(names, done)]}


def _close(writers: list[NpyFrameWriter]) -> None:
    for w in writers:
        w.close()


def _unlink(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def decode_many_in_worker(worker, path: str, requests: list[FrameRequest], *, rotation: int | None = 0,
                          backend: str = DEFAULT_BACKEND, mode: str = "exact",
                          timeout: float | None = None) -> list[DecodedFrames]:
    """Decode several consumers' frames in one pass in an :class:`IsolatedWorker`; a hang or crash raises a
    WorkerError (one reject). The frames are memory-mapped from the worker's files (unlinked at once: the
    mapping keeps them readable), so a long video's frames are paged in as the caller uses them."""
    log.debug("decode pass: %s (%d requests, %d frames, %s, %s)", path, len(requests),
              sum(len(r.timestamps) for r in requests), backend, mode)
    reply = worker.call("decode", timeout=timeout, path=path, requests=[r.as_dict() for r in requests],
                        rotation=int(rotation or 0), backend=backend, mode=mode)
    out = []
    try:
        for r in reply["results"]:
            frames = np.load(r["npy"], mmap_mode="r", allow_pickle=False)
            out.append(DecodedFrames(frames=frames, timestamps=r["timestamps"], indices=r["indices"], fps=r["fps"]))
    finally:
        _unlink([r["npy"] for r in reply["results"]])
    return out


def decode_in_worker(worker, path: str, timestamps: list[float], *, width: int | None = None,
                     height: int | None = None, rotation: int | None = 0, backend: str = DEFAULT_BACKEND,
                     mode: str = "exact", timeout: float | None = None) -> DecodedFrames:
    """One consumer's frames via :func:`decode_many_in_worker`, loaded into memory."""
    d = decode_many_in_worker(worker, path, [FrameRequest(list(timestamps), width, height)], rotation=rotation,
                              backend=backend, mode=mode, timeout=timeout)[0]
    return DecodedFrames(frames=np.array(d.frames), timestamps=d.timestamps, indices=d.indices, fps=d.fps)
