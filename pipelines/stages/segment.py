"""Segment: ``video`` records -> ``clip`` records (~10 s), virtual or materialized.

Planning is a pure function (:func:`plan_clips`). Clip boundaries are planned in seconds and
snapped to the video's average-rate frame grid, so neighbouring clips share a boundary
exactly: no gap and no overlap (with the default stride). The short tail is handled by a
stated policy:

* ``merge`` (default): a tail shorter than ``min_tail_s`` joins the previous clip; a longer one
  is a clip of its own (Big Buck Bunny's 6.5 s tail is its 60th clip);
* ``keep``: the tail is always a clip of its own;
* ``drop``: a tail shorter than ``min_tail_s`` is left out (its length is counted in the stats).

A video shorter than ``clip_s`` is a single clip; one shorter than ``min_video_s`` (default
1 s: the 10-frame, 0.33 s openshot file) is a ``too_short`` reject.

``virtual`` mode (default) writes no media: later stages decode by time range.
``materialize`` writes one file per clip with ffmpeg, called with an argument list:
``copy`` (stream copy: fast, cuts land on keyframes, so the record states the actual cut
times ffmpeg reports) or ``exact`` (re-encode with keyframes forced at the cut times: frame-
exact). Both cut a whole video in one ffmpeg call with its segment muxer.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.config import SegmentConfig
from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, checked, rejected
from longreel.pipelines.tmp_dirs import make_tmpdir

STAGE = "segment"
EPS = 1e-6


@dataclass(frozen=True)
class PlannedClip:
    index: int
    start_s: float
    end_s: float
    start_frame: int
    end_frame: int


def plan_clips(duration_s: float, fps: float, clip_s: float = 10.0, stride_s: float | None = None,
               tail_policy: str = "merge", min_tail_s: float = 5.0) -> tuple[list[PlannedClip], float]:
    """Return (clips, dropped_tail_s). Times in seconds, frames on the ``fps`` grid, end exclusive.

    >>> [c.end_s for c in plan_clips(25.0, 10, 10)[0]]
    [10.0, 25.0]
    """
    if duration_s <= 0 or fps <= 0 or clip_s <= 0:
        raise ValueError(f"bad segment input: duration {duration_s}, fps {fps}, clip {clip_s}")
    if tail_policy not in ("merge", "keep", "drop"):
        raise ValueError(f"unknown tail_policy {tail_policy!r}")
    stride = clip_s if stride_s is None else stride_s
    if stride <= 0:
        raise ValueError("stride_s must be > 0")
    ranges: list[list[float]] = []
    start = 0.0
    while start < duration_s - EPS:
        end = min(start + clip_s, duration_s)
        ranges.append([start, end])
        if end >= duration_s - EPS:
            break
        start += stride
    dropped = 0.0
    if len(ranges) > 1:
        tail = ranges[-1][1] - ranges[-1][0]
        if tail < clip_s - EPS and tail < min_tail_s - EPS:
            if tail_policy == "merge":
                ranges.pop()
                ranges[-1][1] = duration_s
            elif tail_policy == "drop":
                dropped = tail
                ranges.pop()
    total_frames = max(1, round(duration_s * fps))
    clips = []
    for i, (s, e) in enumerate(ranges):
        sf = min(round(s * fps), total_frames - 1)
        ef = total_frames if e >= duration_s - EPS else min(round(e * fps), total_frames)
        ef = max(ef, sf + 1)
        clips.append(PlannedClip(i, 0.0 if sf == 0 else sf / fps, duration_s if ef == total_frames else ef / fps,
                                 sf, ef))
    return clips, dropped


def clip_id(video_id: str, index: int, start_frame: int, end_frame: int) -> str:
    """Deterministic from (video, index, range); readable prefix, no dots (WebDataset keys)."""
    h = hashlib.sha256(f"{video_id}:{index}:{start_frame}:{end_frame}".encode()).hexdigest()[:8]
    return f"{video_id}-{index:05d}-{h}"


class MaterializeError(RuntimeError):
    pass


def _fmt(t: float) -> str:
    return f"{t:.6f}"


def materialize_clips(src: str, clips: list[PlannedClip], out_dir: str, cut: str, fps: float,
                      timeout_s: float = 600.0, decode_delay_s: float = 0.0) -> list[tuple[str, float, float]]:
    """Cut ``src`` into files, one per clip; return (local path, actual start, actual end) per clip.

    One ffmpeg run per video through the segment muxer, whose CSV list reports where each piece
    really starts and ends. Contiguous clips only (stride == clip length); overlapping plans are
    cut one ffmpeg run per clip.
    """
    exe = ffmpeg_exe()
    ext = ".mkv" if cut == "copy" else ".mp4"  # Matroska takes any codec a stream copy may carry
    os.makedirs(out_dir, exist_ok=True)
    contiguous = all(abs(a.end_s - b.start_s) < EPS for a, b in zip(clips, clips[1:]))
    base = [exe, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", "-i", src, "-map", "0:v:0", "-map", "0:a:0?"]
    if cut == "copy":
        # bitexact: Matroska otherwise writes a random segment UID and the date, and the clips differ on every run
        codec = ["-c", "copy", "-fflags", "+bitexact"]
    elif cut == "exact":
        # No B-frames: with them the encoder delays timestamps by a frame or two inside the muxer and the segment
        # muxer misses the forced keyframes (measured: cuts at 18.4 s instead of 10 s).
        codec = ["-c:v", "libx264", "-preset", "veryfast", "-crf", "18", "-bf", "0", "-pix_fmt", "yuv420p",
                 "-c:a", "aac"]
    else:
        raise ValueError(f"unknown cut {cut!r}")
    results = []
    if contiguous:
        cuts = ",".join(_fmt(c.start_s) for c in clips[1:])
        listing = os.path.join(out_dir, "segments.csv")
        args = list(base) + codec
        if cut == "exact" and cuts:
            # A keyframe is forced on the first frame at or after each time, so the times go a quarter frame early:
            # a frame time rounded *up* by its 6 decimals (frame 59 at 30 fps = 1.9666... -> "1.966667") would
            # otherwise force the next frame and cut one frame late (tests/test_curate.py, clip_s=59/30 and 7.9 s).
            args += ["-force_key_frames", ",".join(_fmt(c.start_s - 0.25 / fps) for c in clips[1:])]
        # A quarter frame of slack so that float rounding of a frame-grid time cannot skip its keyframe.
        args += ["-f", "segment", "-segment_time_delta", _fmt(0.25 / fps), "-reset_timestamps", "1", "-segment_list", listing, "-segment_list_type", "csv"]
        if cuts:
            args += ["-segment_times", cuts]
        else:
            # One clip: a segment time no video reaches. Written as a plain integer: ffmpeg parses it as a
            # duration, and refuses exponent notation ("1e9" made every single-clip video a cut_failed reject).
            args += ["-segment_time", "1000000000"]
        args.append(os.path.join(out_dir, "%05d" + ext))
        _run(args, timeout_s)
        with open(listing, newline="") as fh:
            rows = [r for r in csv.reader(fh) if r]
        os.unlink(listing)
        if len(rows) != len(clips):
            raise MaterializeError(f"ffmpeg wrote {len(rows)} pieces for {len(clips)} planned clips "
                                   "(stream copy can only cut at keyframes: a clip without one merges into its "
                                   "neighbour; use cut=exact)")
        # A stream copy keeps the source's negative decode timestamps, so the muxer shifts all times by the decode
        # delay and the list reports shifted times; report them on the source's own clock.
        shift = decode_delay_s if cut == "copy" else 0.0
        last = clips[-1].end_s
        for c, (name, start, end) in zip(clips, rows):
            results.append((os.path.join(out_dir, name), max(0.0, float(start) - shift) if c.index else 0.0,
                            min(max(0.0, float(end) - shift), last)))
        return results
    for c in clips:
        path = os.path.join(out_dir, f"{c.index:05d}{ext}")
        args = [exe, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", "-ss", _fmt(c.start_s), "-i", src,
                "-t", _fmt(c.end_s - c.start_s), "-map", "0:v:0", "-map", "0:a:0?"] + codec + [path]
        _run(args, timeout_s)
        results.append((path, c.start_s, c.end_s))
    return results


def _run(args: list[str], timeout_s: float) -> None:
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise MaterializeError(f"ffmpeg did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        raise MaterializeError(f"ffmpeg exited with {proc.returncode}: {' | '.join(tail)}")


class SegmentVideo(beam.DoFn):
    def __init__(self, cfg: SegmentConfig, clips_dir: str | None):
        self.cfg = cfg
        self.clips_dir = clips_dir

    def setup(self):
        self.progress = Progress(STAGE, "videos segmented")

    def process(self, video: dict):
        cfg = self.cfg
        vid = video["video_id"]
        if video["duration_s"] < cfg.min_video_s:
            yield rejected(STAGE, vid, "too_short",
                           f"{video['uri']} lasts {video['duration_s']:.3f} s < min_video_s {cfg.min_video_s}",
                           video_id=vid)
            return
        fps = video.get("fps_avg") or video["n_frames"] / video["duration_s"]
        planned, dropped = plan_clips(video["duration_s"], fps, cfg.clip_s, cfg.stride_s, cfg.tail_policy,
                                      cfg.min_tail_s)
        params = json.dumps({"clip_s": cfg.clip_s, "stride_s": cfg.stride_s, "tail_policy": cfg.tail_policy,
                             "min_tail_s": cfg.min_tail_s, "dropped_tail_s": round(dropped, 6), "fps": fps},
                            sort_keys=True)
        files: list[tuple[str | None, float | None, float | None]] = [(None, None, None)] * len(planned)
        if cfg.mode == "materialize":
            try:
                files = self._materialize(video, planned, fps)
            except (MaterializeError, OSError) as e:
                yield rejected(STAGE, vid, "cut_failed", f"{video['uri']}: {e}", video_id=vid)
                return
        for c, (uri, a_start, a_end) in zip(planned, files):
            row = {"clip_id": clip_id(vid, c.index, c.start_frame, c.end_frame), "video_id": vid, "index": c.index,
                   "start_s": round(c.start_s, 6), "end_s": round(c.end_s, 6), "start_frame": c.start_frame,
                   "end_frame": c.end_frame, "mode": cfg.mode, "cut": cfg.cut if cfg.mode == "materialize" else "none",
                   "clip_uri": uri, "actual_start_s": a_start, "actual_end_s": a_end, "segment_params": params}
            yield checked(STAGE, "clip", row, row["clip_id"])
        self.progress.tick(f"{vid}: {len(planned)} clips")

    def _materialize(self, video: dict, planned: list[PlannedClip], fps: float):
        uri = video["uri"]
        tmp = make_tmpdir("cut")
        try:
            src = uri
            if "://" in uri:
                src = os.path.join(tmp, "source" + os.path.splitext(uri)[1][:8])
                with FileSystems.open(uri, compression_type="uncompressed") as fi, open(src, "wb") as fo:
                    shutil.copyfileobj(fi, fo, 1 << 20)
            local_dir = os.path.join(tmp, "clips")
            pieces = materialize_clips(src, planned, local_dir, self.cfg.cut, fps, self.cfg.materialize_timeout_s,
                                       video.get("decode_delay_s") or 0.0)
            out = []
            dest_dir = FileSystems.join(self.clips_dir, video["video_id"])
            if "://" not in dest_dir:
                os.makedirs(dest_dir, exist_ok=True)
            for path, a_start, a_end in pieces:
                dest = FileSystems.join(dest_dir, os.path.basename(path))
                if "://" in dest:
                    FileSystems.copy([path], [dest])
                else:
                    os.replace(path, dest) if _same_fs(path, dest_dir) else shutil.copyfile(path, dest)
                out.append((dest, round(a_start, 6), round(a_end, 6)))
            return out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _same_fs(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


class SegmentVideos(beam.PTransform):
    """Stage ``segment``: videos -> ``{"main": clips, "rejects"}``."""

    def __init__(self, cfg: SegmentConfig, clips_dir: str | None = None):
        super().__init__()
        if cfg.mode == "materialize" and not clips_dir:
            raise ValueError("materialize mode needs a clips directory")
        self.cfg, self.clips_dir = cfg, clips_dir

    def expand(self, videos):
        out = videos | "PlanAndCut" >> beam.ParDo(SegmentVideo(self.cfg, self.clips_dir)).with_outputs(
            REJECTS, main=MAIN)
        return {MAIN: out[MAIN], REJECTS: out[REJECTS]}
