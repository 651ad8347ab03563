"""Caption: ``clip`` (+ ``video``) records -> ``clip_facts`` and ``caption`` records, through three counted stages.

::

    videos, clips --CoGroupByKey(video_id)--> decode tasks (per clip, or per video in chunks)
      -> clip_facts   decode N frames per clip in the killable worker, resized to the backend's pixel budget;
                      measure facts                       rejects: video_missing, video_changed, decode_*
      -> clip_filter  optional static/black filter         rejects: black_clip, static_clip
      -> caption      RunInference(GenerationModelHandler).with_exception_handling()
                                                           rejects: request_*, model_error, bad_response,
                                                                    empty_caption, repetitive_caption,
                                                                    prompt_echo, schema_violation

Each stage counts in clips: ``in == out + rejected``. The ``clip_facts`` table holds every decoded
clip (filtered ones too: their facts explain the reject); the ``captions`` table the captions.

Frame sampling: ``frames.n`` timestamps at the centres of equal bins of the clip's range
(:func:`longreel.pipelines.media.decode.sample_timestamps`); each frame is the one shown at its timestamp,
and the recorded ``frame_timestamps`` are the decoded frames' own presentation times.
``frames.decode``: ``per_video`` sends the timestamps of many consecutive clips of a video
(up to ``max_frames_per_call``) in one worker call, which decodes forward once and is sliced per
clip; ``per_clip`` makes one call (open, seek, decode) per clip. A failed ``per_video`` call is
retried clip by clip, so a damaged stretch costs only the clips that lie in it.

Entry points: :class:`CaptionClips` (the composite) and :func:`add_caption_stage` (composite + the
``captions`` / ``clip_facts`` Parquet tables + funnel counts, for ``longreel curate`` and
``longreel caption``).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.caption_config import CaptionConfig
from longreel.pipelines.inference.base import GenerationParams, ModelInfo, Request, fit_pixels, weights_revision
from longreel.pipelines.inference.beam_ml import PredictionResult, RunInference
from longreel.pipelines.inference.degenerate import degenerate_reason
from longreel.pipelines.compute import call_pairs
from longreel.pipelines.inference.handler import ClientSpec, GenerationModelHandler
from longreel.pipelines.media import facts as F
from longreel.pipelines.media.decode import DECODE_VERSION, sample_timestamps, upright  # noqa: F401 (upright: re-exported)
from longreel.pipelines.prompts import load_template, render
from longreel.pipelines.resources import on_model_step
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, checked, rejected
from longreel.pipelines.tmp_dirs import make_tmpdir

STAGE_FACTS = "clip_facts"
STAGE_FILTER = "clip_filter"
STAGE_CAPTION = "caption"
CAPTION_STAGES = [STAGE_FACTS, STAGE_FILTER, STAGE_CAPTION]
CAPTION_UNITS = {s: "clip" for s in CAPTION_STAGES}
TIMING = "timing"                 # output tag of the model's latency per clip (-> stats.json["run"]["caption"])
COMPUTE = "compute"               # output tag of the compute bill's counts per model call (-> stats.json extra)
CACHE_PARTS = "cache_parts"       # output tag of a long video's frame cache / filter frames, part by part (AssembleFrameCache)

FACTS_MAX_PIXELS = 128 * 128      # the facts backend only measures: small frames are plenty (170x96 for 16:9)
VLM_MAX_PIXELS = 448 * 448
QWEN_MULTIPLE = 28                # patch 14 x merge 2


# -- configuration helpers (run where the pipeline is built) ---------------------------------------------------

def frame_budget(cfg: CaptionConfig) -> tuple[int, int, int]:
    """``(max_pixels, multiple, min_pixels)`` of the frames decoded for ``cfg.backend``."""
    if cfg.backend == "facts":
        return (cfg.frames.max_pixels or FACTS_MAX_PIXELS), 2, 0
    if cfg.backend in ("transformers", "vllm") and cfg.model.path and os.path.isdir(cfg.model.path):
        from longreel.pipelines.inference.base import processor_pixel_budget
        max_px, multiple, min_px = processor_pixel_budget(cfg.model.path)
        return (cfg.frames.max_pixels or max_px), multiple, min_px
    return (cfg.frames.max_pixels or VLM_MAX_PIXELS), QWEN_MULTIPLE, 0


def client_spec(cfg: CaptionConfig) -> ClientSpec:
    m = cfg.model
    if cfg.backend == "facts":
        return ClientSpec("facts", {})
    if cfg.backend == "transformers":
        return ClientSpec("transformers", {"path": m.path, "revision": m.revision, "kind": "vision",
                                           "trust_remote_code": m.trust_remote_code, "dtype": m.dtype,
                                           "device": m.device, "batch_size": m.batch_size})
    if cfg.backend == "openai":
        o = cfg.openai
        return ClientSpec("openai", {"base_url": o.base_url, "model": m.path, "api_key_env": o.api_key_env,
                                     "timeout_s": o.timeout_s, "max_retries": o.max_retries,
                                     "concurrency": o.concurrency,
                                     "jpeg_quality": o.jpeg_quality, "image_detail": o.image_detail,
                                     "revision": m.revision})
    if cfg.backend == "vllm":
        v = cfg.vllm
        return ClientSpec("vllm", {"path": m.path, "revision": m.revision, "trust_remote_code": m.trust_remote_code,
                                   "dtype": m.dtype, "tensor_parallel_size": v.tensor_parallel_size,
                                   "gpu_memory_utilization": v.gpu_memory_utilization,
                                   "max_model_len": v.max_model_len, "enforce_eager": v.enforce_eager,
                                   "seed": m.seed})
    raise ValueError(f"unknown caption backend {cfg.backend!r}")


def model_info(cfg: CaptionConfig) -> ModelInfo:
    """Provenance recorded in every caption, computed once where the pipeline is built (no model load)."""
    if cfg.backend == "facts":
        from longreel.pipelines.inference.facts_captioner import MODEL_NAME
        return ModelInfo("facts", MODEL_NAME, F.FACTS_VERSION)
    if cfg.backend == "openai":
        return ModelInfo("openai", cfg.model.path, cfg.model.revision)
    return ModelInfo(cfg.backend, cfg.model.path, weights_revision(cfg.model.path, cfg.model.revision))


def prompt_name(cfg: CaptionConfig) -> str:
    if cfg.backend == "facts":
        from longreel.pipelines.inference.facts_captioner import TEMPLATE
        return TEMPLATE
    return cfg.prompt


def generation_params(cfg: CaptionConfig) -> GenerationParams:
    m = cfg.model
    return GenerationParams(max_new_tokens=m.max_new_tokens, temperature=m.temperature, top_p=m.top_p, seed=m.seed)


def sampling_json(cfg: CaptionConfig, max_pixels: int) -> str:
    frames = {"n_frames": cfg.frames.n, "max_pixels": max_pixels, "decode": DECODE_VERSION}
    # recorded only when not the default, so that existing runs' caption rows keep their bytes
    if cfg.frames.sampling != "exact":
        frames["sampling"] = cfg.frames.sampling
    if cfg.frames.backend != "pyav":
        frames["decoder"] = cfg.frames.backend
    if cfg.backend == "facts":
        doc = {"deterministic": True, "facts_version": F.FACTS_VERSION, **frames,
               "black_luma": cfg.facts.black_luma, "black_share": cfg.facts.black_share,
               "blank_std": cfg.facts.blank_std, "cut_threshold": cfg.facts.cut_threshold}
    else:
        doc = {**generation_params(cfg).to_dict(), **frames, "seed_per_item": True}
        if cfg.backend == "openai":
            doc["endpoint"] = cfg.openai.base_url
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


# -- decode + facts ----------------------------------------------------------------------------------------------

@dataclass
class DecodeTask:
    video: dict
    clips: list[dict]
    cache: bool = False  # this task's decode pass also builds the video's frame cache entry (when there is a cache)
    #: ``(k, n, lo, hi)``: this chunk is part k of n of a long video and its pass also decodes the frame cache's
    #: frames (and the filter's uniform frames) timed in ``[lo, hi)`` (None: unbounded), which
    #: :class:`AssembleFrameCache` puts together
    cache_part: tuple | None = None


def shares_filter_pass(cfg: CaptionConfig, filter_cfg) -> bool:
    """Whether the caption's pass decodes the filter's uniform frames: the filter decodes exact frames with the
    default decoder, so the pass must too for the frames to be the same."""
    from longreel.pipelines.media.decode import DEFAULT_BACKEND

    return (filter_cfg is not None and filter_cfg.frame_source == "uniform" and cfg.frames.sampling == "exact"
            and cfg.frames.backend == DEFAULT_BACKEND)


def filter_frames_dir(out_dir: str, pack_cfg=None) -> str:
    """Where the caption's pass stores the filter's uniform frames: beside the frame cache."""
    from apache_beam.io.filesystems import FileSystems

    return (pack_cfg.cache_dir if pack_cfg is not None and pack_cfg.cache_dir else None) or \
        FileSystems.join(out_dir, "frame_cache")


def plan_decode(element, n_frames: int, mode: str, max_frames_per_call: int | None, frame_cache: bool = False,
                cache_in_chunks: bool = False):
    """``(video_id, {"videos": [...], "clips": [...]})`` -> DecodeTasks (or ``video_missing`` rejects).

    ``per_video``: consecutive clips in chunks of at most ``max_frames_per_call`` frames, so that a long video's
    decode spreads over the workers (a 10-minute film in one task kept one worker busy for most of a 2-worker run
    while the other sat idle: benchmarks/results/scale.json). ``frame_cache``: a video of one chunk builds its
    frame cache entry (and the filter's uniform frames) in that chunk's pass (one decode). For a longer video,
    ``cache_in_chunks`` splits those frames among the chunks by time (chunk k takes those from its first clip's start
    to the next chunk's), so each is decoded in a pass that runs over its stretch anyway; otherwise the video gets
    one more task for them, whose sparse timestamps cost a seek each: 5 CPU-s for the 64 frames of the 10-minute
    Big Buck Bunny here, a third of decoding the whole film."""
    vid, groups = element
    clips = sorted(groups["clips"], key=lambda c: (c["index"], c["clip_id"]))
    videos = list(groups["videos"])
    if not clips:
        return
    if not videos:
        for c in clips:
            yield rejected(STAGE_FACTS, c["clip_id"], "video_missing",
                           f"no video record {vid} for clip {c['clip_id']}", video_id=vid)
        return
    if mode == "per_clip":
        per = 1
    elif max_frames_per_call is None:  # the whole video in one task (one pass; the decoder streams to disk)
        per = len(clips)
    else:
        per = max(1, max_frames_per_call // n_frames)
    chunks = [clips[i:i + per] for i in range(0, len(clips), per)]
    if frame_cache and len(chunks) == 1:
        yield DecodeTask(videos[0], chunks[0], cache=True)
        return
    if frame_cache and cache_in_chunks:
        starts = [chunk[0]["start_s"] for chunk in chunks]
        n = len(chunks)
        for k, chunk in enumerate(chunks):
            yield DecodeTask(videos[0], chunk, cache_part=(k, n, starts[k] if k else None,
                                                           starts[k + 1] if k + 1 < n else None))
        return
    if frame_cache:
        yield DecodeTask(videos[0], [], cache=True)
    for chunk in chunks:
        yield DecodeTask(videos[0], chunk)


#: what a decode task costs besides its frames, in source pixels decoded: opening the file, the first seek and the
#: task's own bookkeeping came to 0.1-0.4 s a task here, where about 1e9 source pixels decode per second
#: (per-task timings of the shared corpus on 2 workers, this 2-core machine)
TASK_OVERHEAD_PX = 150e6
#: source frames decoded to reach one sparse frame (frame cache, filter frames): one GOP at a common 2-s keyframe
#: interval
SPARSE_FRAME_SPAN_S = 2.0


def decode_cost(task: DecodeTask, sparse_frames: int = 0) -> float:
    """A task's estimated decode cost, in source pixels decoded: its clips' source frames (dense: every frame of a
    clip is decoded to reach its samples) times the frame size, plus, for a task that only builds the frame cache or
    the filter's frames, ``sparse_frames`` seeks of :data:`SPARSE_FRAME_SPAN_S` each. Used to deal tasks out to a
    local run's workers (:class:`~longreel.pipelines.cost_shares.SpreadByCost`); a wrong guess costs balance, not
    correctness."""
    v = task.video
    pixels = max(1, int(v.get("width") or 0) * int(v.get("height") or 0))
    duration, n_frames = float(v.get("duration_s") or 0.0), float(v.get("n_frames") or 0.0)
    fps = n_frames / duration if duration > 0 else 0.0
    frames = 0.0
    for c in task.clips:
        if c.get("start_frame") is not None and c.get("end_frame") is not None:
            frames += max(0, c["end_frame"] - c["start_frame"])
        else:
            frames += max(0.0, (c.get("end_s") or 0.0) - (c.get("start_s") or 0.0)) * fps
    if task.cache and not task.clips:
        frames = min(n_frames, sparse_frames * SPARSE_FRAME_SPAN_S * fps)
    return TASK_OVERHEAD_PX + frames * pixels


def task_order(task: DecodeTask) -> tuple:
    """A key that sorts decode tasks the same way on every run."""
    first = task.clips[0]["index"] if task.clips else -1
    return task.video["video_id"], first, task.cache


def decode_size(video: dict, budget: tuple[int, int, int]) -> tuple[int, int]:
    """``(width, height)`` of the frames as displayed (the decoder turns them upright), fitting the budget."""
    from longreel.pipelines.media.decode import displayed_size

    max_px, multiple, min_px = budget
    return fit_pixels(*displayed_size(video), max_px, multiple, min_px)


def open_frame_cache(pack_cfg, cache_dir: str):
    """The pack stage's :class:`~longreel.pipelines.pack.frame_cache.FrameCache` for ``pack_cfg`` (a PackConfig)."""
    from longreel.pipelines.pack.frame_cache import FrameCache, FrameParams, frame_processor

    vp = frame_processor(pack_cfg.processor, min_pixels=pack_cfg.min_pixels, max_pixels=pack_cfg.max_pixels)
    return FrameCache(cache_dir, FrameParams(pack_cfg.fps, pack_cfg.max_frames, pack_cfg.min_frames), vp)


def _reason(worker_reason: str) -> str:
    return {"timeout": "decode_timeout", "worker_crashed": "decode_crashed"}.get(worker_reason, None) or (
        worker_reason if worker_reason in ("not_a_video", "no_video_stream") else "decode_failed")


def _run_quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - a head start only: the stage that needs it loads it again and reports
        logging.getLogger("longreel").debug("after-decode warm-up failed", exc_info=True)


class DecodeClipFrames(beam.DoFn):
    """DecodeTask -> one element per clip ``{"clip", "facts", "frames" (or None), "timestamps", "indices", "fps"}``."""

    def __init__(self, cfg: CaptionConfig, budget: tuple[int, int, int], keep_frames: bool, frame_cache=None,
                 filter_frames=None, after_decode=None):
        self.cfg, self.budget, self.keep_frames = cfg, budget, keep_frames
        self.frame_cache = frame_cache  # (PackConfig, cache_dir) or None: see CaptionClips
        self.filter_frames = filter_frames  # (FilterConfig, store_dir) or None: see CaptionClips
        self.after_decode = after_decode  # see add_caption_stage
        self._after_started = False

    def setup(self):
        from longreel.pipelines.media.worker import IsolatedWorker
        self.worker = IsolatedWorker(default_timeout=self.cfg.frames.timeout_s)
        self.cache = open_frame_cache(*self.frame_cache) if self.frame_cache else None
        self.store = None
        if self.filter_frames:
            from longreel.pipelines.pack.frame_cache import DecodedFrameStore
            self.store = DecodedFrameStore(self.filter_frames[1])
        self.tmpdir = make_tmpdir("caption")
        self.verified: dict[tuple, str] = {}
        self.remote: tuple[str, str, str] | None = None  # (uri, sha256, local copy) of the last remote video
        self.progress = Progress(STAGE_FACTS, "clips decoded")
        self.decode_s = 0.0

    def finish_bundle(self):
        # A local runner gives each worker one bundle of this stage: its end is where this worker's share of the
        # decoding is done and it waits for the other workers' shares.
        if self.after_decode is not None and not self._after_started:
            self._after_started = True
            threading.Thread(target=_run_quietly, args=(self.after_decode,), name="after-decode",
                             daemon=True).start()

    def teardown(self):
        if self.progress.n:
            from longreel.pipelines.stages.base import log
            elapsed = time.monotonic() - self.progress.t0
            log.info("%s: %d clips, %.1f s in decode calls of %.1f s since the first clip", STAGE_FACTS,
                     self.progress.n, self.decode_s, elapsed)
        self._drop_remote()
        self.worker.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _local(self, video: dict) -> tuple[str | None, bool, tuple[str, str] | None]:
        """(local path, is_temp, reject) for the task's video, verifying its sha256 when configured.

        A remote video (gs://, s3://, http...) is copied once and the copy kept until a task of another remote
        video arrives, so the chunks of a long video do not download it again and again."""
        from longreel.pipelines.stages.ingest import hash_and_localize

        uri = video["uri"]
        remote = "://" in uri
        if not remote and not self.cfg.frames.verify_sha256:
            return uri, False, None
        if remote and self.remote and self.remote[0] == uri and self.remote[1] == video["sha256"]:
            return self.remote[2], False, None
        try:
            if not remote:
                st = os.stat(uri)
                key = (uri, st.st_size, st.st_mtime_ns)
                if self.verified.get(key) == video["sha256"]:
                    return uri, False, None
            local, sha, _, is_temp = hash_and_localize(uri, self.tmpdir)
        except OSError as e:
            return None, False, ("video_unreadable", f"cannot read {uri}: {e}")
        if self.cfg.frames.verify_sha256 and sha != video["sha256"]:
            if is_temp:
                os.unlink(local)
            return None, False, ("video_changed", f"{uri} no longer has the ingested content (sha256 {sha[:16]}… "
                                                  f"!= {video['sha256'][:16]}…)")
        if not remote:
            self.verified[key] = sha
        elif is_temp and sha == video["sha256"]:
            self._drop_remote()
            self.remote = (uri, sha, local)
            return local, False, None
        return local, is_temp, None

    def _drop_remote(self) -> None:
        if self.remote:
            try:
                os.unlink(self.remote[2])
            except OSError:
                pass
            self.remote = None

    def _size(self, video: dict) -> tuple[int, int]:
        return decode_size(video, self.budget)

    def _decode(self, path: str, requests: list, rotation) -> list:
        """Every request's frames from one decode pass in the worker (memory-mapped, see decode_many_in_worker)."""
        from longreel.pipelines.media.decode import decode_many_in_worker
        t0 = time.monotonic()
        f = self.cfg.frames
        try:
            return decode_many_in_worker(self.worker, path, requests, rotation=rotation, backend=f.backend,
                                         mode=f.sampling, timeout=f.timeout_s)
        finally:
            self.decode_s += time.monotonic() - t0

    def _cache_request(self, video: dict):
        """The frame cache's request when this video has no valid entry yet (else None): decoded in the caption's
        pass, so the pack stage (and a pass-rate filter on cached frames) finds the entry instead of decoding."""
        from longreel.pipelines.media.decode import FrameRequest
        from longreel.pipelines.pack.frame_cache import CacheError

        if self.cache is None or self.cache.lookup(video["sha256"], verify=self.frame_cache[0].cache_verify)[0]:
            return None
        try:
            return FrameRequest(self.cache.plan(video)[1])
        except CacheError:
            return None  # the pack stage rejects it with its reason

    def _part_requests(self, video: dict, part: tuple) -> list[tuple]:
        """``(kind, request, frames in the whole entry)`` of this chunk's share of each per-video entry the video
        still needs: ``cache`` (the frame cache's frames) and ``filter`` (the filter's uniform frames). The request
        is None when none of the entry's frames falls in the chunk's stretch."""
        from longreel.pipelines.media.decode import FrameRequest

        _k, _n, lo, hi = part
        out = []
        for kind, whole in (("cache", self._cache_request(video)), ("filter", self._filter_request(video))):
            if whole is not None:
                mine = [t for t in whole.timestamps if (lo is None or t >= lo) and (hi is None or t < hi)]
                out.append((kind, FrameRequest(mine, whole.width, whole.height) if mine else None,
                            len(whole.timestamps)))
        return out

    def _cache_part(self, video: dict, part: tuple, kind: str, decoded, whole: int, failed: bool = False):
        """The CACHE_PARTS element of a chunk for one entry: its share of the entry's frames, for the frame cache
        resized as the whole video's (the filter's are stored as decoded)."""
        import numpy as np

        from longreel.pipelines.pack.frame_cache import processor_resize

        frames, stamps, indices, fps = None, [], [], None
        if decoded is not None and not failed:
            frames = np.array(decoded.frames)  # out of the worker's memory map
            if kind == "cache":
                frames = processor_resize(self.cache.vp, frames, num_frames=whole)
            stamps, indices, fps = [float(t) for t in decoded.timestamps], [int(i) for i in decoded.indices], \
                float(decoded.fps)
        return TaggedOutput(CACHE_PARTS, ((video["video_id"], kind), {
            "k": part[0], "n": part[1], "video": video, "frames": frames, "timestamps": stamps, "indices": indices,
            "fps": fps, "failed": failed}))

    def _filter_request(self, video: dict):
        """The pass-rate filter's uniform frames when this video has no stored entry yet (else None)."""
        if self.store is None:
            return None
        from longreel.pipelines.stages.passrate import uniform_request

        req = uniform_request(video, self.filter_frames[0])
        return None if self.store.lookup(video, req) is not None else req

    def _store(self, video: dict, decoded) -> None:
        from longreel.pipelines.pack.frame_cache import CacheError
        from longreel.pipelines.stages.base import log

        try:
            self.cache.store(video, decoded)
        except CacheError as e:  # not this stage's output: the pack stage retries and rejects
            log.warning("%s: frame cache entry of %s not written: %s", STAGE_FACTS, video["video_id"], e)

    def _store_extras(self, path: str, video: dict, cache_req, filter_req) -> None:
        """A long video's frame cache entry and the filter's uniform frames, in one pass of their own task."""
        from longreel.pipelines.media.worker import WorkerError

        reqs = [r for r in (cache_req, filter_req) if r]
        if not reqs:
            return
        try:
            got = self._decode(path, reqs, video.get("rotation"))
        except WorkerError:
            return  # not this stage's output: the pack stage and the filter decode again and reject with a reason
        if cache_req:
            self._store(video, got[0])
        if filter_req:
            self.store.store(video, filter_req, got[-1])

    def process(self, task: DecodeTask):
        import numpy as np

        from longreel.pipelines.media.decode import FrameRequest
        from longreel.pipelines.media.worker import WorkerError

        video, clips = task.video, task.clips
        vid = video["video_id"]
        path, is_temp, problem = self._local(video)
        if problem:
            for c in clips:
                yield rejected(STAGE_FACTS, c["clip_id"], problem[0], problem[1], video_id=vid)
            return
        try:
            n = self.cfg.frames.n
            size = self._size(video)
            stamps = [sample_timestamps(c["start_s"], c["end_s"], n) for c in clips]
            decoded: list = [None] * len(clips)
            cache_req = self._cache_request(video) if task.cache else None
            filter_req = self._filter_request(video) if task.cache else None
            parts = self._part_requests(video, task.cache_part) if task.cache_part else []
            if not clips:  # the per-video extras' own task (a long video's clips are decoded in other tasks)
                self._store_extras(path, video, cache_req, filter_req)
                return
            for kind, req, whole in parts:
                if req is None:  # no frame of the entry in this chunk's stretch: an empty part
                    yield self._cache_part(video, task.cache_part, kind, None, whole)
            parts = [(kind, req, whole) for kind, req, whole in parts if req is not None]
            if len(clips) > 1 or cache_req or filter_req or parts:
                extras = [(name, r) for name, r in (("cache", cache_req), ("filter", filter_req)) if r]
                extras += [(f"part:{kind}", req) for kind, req, _ in parts]
                try:
                    reqs = [FrameRequest([t for s in stamps for t in s], *size)] + [r for _, r in extras]
                    got = self._decode(path, reqs, video.get("rotation"))
                    of = {name: got[1 + i] for i, (name, _) in enumerate(extras)}
                    d = got[0]
                    for i in range(len(clips)):  # copied out of the mapping: one clip's frames in memory at a time
                        decoded[i] = (np.array(d.frames[i * n:(i + 1) * n]), d.timestamps[i * n:(i + 1) * n],
                                      d.indices[i * n:(i + 1) * n], d.fps)
                    if cache_req:
                        self._store(video, of["cache"])
                    if filter_req:
                        self.store.store(video, filter_req, of["filter"])
                    for kind, _, whole in parts:
                        yield self._cache_part(video, task.cache_part, kind, of[f"part:{kind}"], whole)
                except WorkerError:
                    # retried clip by clip below: only the clips in a damaged stretch are lost; the entries are then
                    # left to the stages that read them (pack, filter), which decode them and reject with a reason
                    for kind, _, whole in parts:
                        yield self._cache_part(video, task.cache_part, kind, None, whole, failed=True)
            for i, c in enumerate(clips):
                if decoded[i] is None:
                    try:
                        d = self._decode(path, [FrameRequest(stamps[i], *size)], video.get("rotation"))[0]
                        decoded[i] = (np.array(d.frames), d.timestamps, d.indices, d.fps)
                    except WorkerError as e:
                        yield rejected(STAGE_FACTS, c["clip_id"], _reason(e.reason), f"{video['uri']}: {e.message}",
                                       video_id=vid, details=json.dumps({"worker_reason": e.reason,
                                                                         "timestamps": stamps[i]}))
                        continue
                frames, ts, idx, fps = decoded[i]
                yield self._element(c, video, frames, ts, idx, fps, size)
                self.progress.tick(c["clip_id"])
        finally:
            if is_temp and path:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def _element(self, clip: dict, video: dict, frames, timestamps, indices, fps, size) -> dict:
        fc = self.cfg.facts
        f = F.clip_facts(frames, black_luma=fc.black_luma, black_share=fc.black_share, blank_std=fc.blank_std,
                         cut_threshold=fc.cut_threshold)
        row = {"clip_id": clip["clip_id"], "video_id": clip["video_id"], "start_s": clip["start_s"],
               "end_s": clip["end_s"], "frame_timestamps": [float(t) for t in timestamps],
               "motion": f["motion"], "black_ratio": f["black_ratio"], "brightness": f["brightness"],
               "n_cuts": f["n_cuts"], "dominant_color": f["dominant_color"], "facts_version": F.FACTS_VERSION,
               "frame_indices": [int(i) for i in indices], "frame_width": int(frames.shape[2]),
               "frame_height": int(frames.shape[1])}
        bad = checked(STAGE_FACTS, "clip_facts", row, row["clip_id"])
        if bad is not row:
            return bad
        return {"clip": {k: clip[k] for k in ("clip_id", "video_id", "index", "start_s", "end_s")},
                "facts": row, "frames": frames if self.keep_frames else None, "fps": float(fps)}


class AssembleFrameCache(beam.DoFn):
    """``((video_id, kind), parts)`` -> ``video_id``, once the video's entry of that kind is written from the parts
    of its frames the chunks decoded (:func:`plan_decode`'s ``cache_in_chunks``): ``cache``, the frame cache entry
    (frames resized in the parts), or ``filter``, the filter's uniform frames (a ``DecodedFrameStore`` entry). An
    entry with a part missing or failed is not written: the stage that reads it (pack, filter) then decodes the
    video itself and rejects it with a reason if that fails too."""

    def __init__(self, frame_cache=None, filter_frames=None):
        self.frame_cache = frame_cache  # (PackConfig, cache_dir) or None
        self.filter_frames = filter_frames  # (FilterConfig, store_dir) or None

    def setup(self):
        from longreel.pipelines.pack.frame_cache import DecodedFrameStore

        self.cache = open_frame_cache(*self.frame_cache) if self.frame_cache else None
        self.store = DecodedFrameStore(self.filter_frames[1]) if self.filter_frames else None

    def process(self, element):
        import numpy as np

        from longreel.pipelines.media.decode import DecodedFrames
        from longreel.pipelines.pack.frame_cache import CacheError
        from longreel.pipelines.stages.base import log
        from longreel.pipelines.stages.passrate import uniform_request

        (vid, kind), parts = element
        parts = sorted(parts, key=lambda part: part["k"])
        if [part["k"] for part in parts] != list(range(parts[0]["n"])) or any(part["failed"] for part in parts):
            log.warning("%s: %s frames of %s not written: a part of them was not decoded", STAGE_FACTS, kind, vid)
            return
        video = parts[0]["video"]
        frames = [part["frames"] for part in parts if part["frames"] is not None]
        stamps = [t for part in parts for t in part["timestamps"]]
        try:
            if kind == "cache":
                self.cache.store_resized(video, np.concatenate(frames), stamps)
            else:
                request = uniform_request(video, self.filter_frames[0])
                joined = np.concatenate(frames)
                if joined.shape[0] != len(request.timestamps):
                    raise ValueError(f"{joined.shape[0]} frames for {len(request.timestamps)} timestamps")
                self.store.store(video, request, DecodedFrames(
                    frames=joined, timestamps=stamps, indices=[i for part in parts for i in part["indices"]],
                    fps=next(part["fps"] for part in parts if part["fps"] is not None)))
        except (CacheError, ValueError) as e:  # not this stage's output: the reading stage decodes and rejects
            log.warning("%s: %s frames of %s not written: %s", STAGE_FACTS, kind, vid, e)
            return
        yield vid


class FilterClips(beam.DoFn):
    def __init__(self, cfg: CaptionConfig):
        self.cfg = cfg

    def process(self, el: dict):
        f = self.cfg.filter
        if f.enabled:
            verdict = F.classify_clip(el["facts"], black_ratio_min=f.black_ratio_min,
                                      static_motion_max=f.static_motion_max)
            if verdict:
                c = el["clip"]
                yield rejected(STAGE_FILTER, c["clip_id"], verdict[0], verdict[1], video_id=c["video_id"],
                               details=json.dumps({k: el["facts"][k] for k in ("motion", "black_ratio",
                                                                               "brightness", "n_cuts")}))
                return
        yield el


# -- caption -------------------------------------------------------------------------------------------------------

def to_request(el: dict, cfg: CaptionConfig) -> Request:
    c, f = el["clip"], el["facts"]
    text = ""
    if cfg.backend != "facts":
        text, _ = render(cfg.prompt, n_frames=len(f["frame_timestamps"]), start_s=c["start_s"], end_s=c["end_s"],
                         duration_s=c["end_s"] - c["start_s"], timestamps=f["frame_timestamps"])
    # the facts captioner reads only the facts; frames kept for the embedding gates are not its input
    return Request(key=c["clip_id"], text=text, frames=el["frames"] if cfg.backend != "facts" else None,
                   timestamps=f["frame_timestamps"],
                   fps=el["fps"], frame_indices=f["frame_indices"], meta={"clip": c, "facts": f})


class ToCaptionRow(beam.DoFn):
    def __init__(self, cfg: CaptionConfig, info: ModelInfo, prompt: str, prompt_hash: str, sampling: str):
        self.cfg, self.info, self.prompt, self.prompt_hash, self.sampling = cfg, info, prompt, prompt_hash, sampling

    def setup(self):
        self.progress = Progress(STAGE_CAPTION, "clips captioned")

    def process(self, result: PredictionResult):
        req, gen = result.example, result.inference
        c, f = req.meta["clip"], req.meta["facts"]
        cid, vid = c["clip_id"], c["video_id"]
        # wall-clock time goes to stats.json["run"]["caption"], never into a row or a reject's details (re-runs are
        # byte-identical)
        yield TaggedOutput(TIMING, float(gen.latency_s or 0.0))
        if gen.prompt_tokens is not None or not gen.ok:  # a model call (the facts captioner makes none)
            for pair in call_pairs(STAGE_CAPTION, gen.prompt_tokens, gen.vision_tokens, gen.output_tokens):
                yield TaggedOutput(COMPUTE, pair)
        if not gen.ok:
            yield rejected(STAGE_CAPTION, cid, gen.error_reason, gen.error_message or gen.error_reason, video_id=vid,
                           details=json.dumps({"attempts": gen.attempts}))
            return
        d = self.cfg.degenerate
        bad = degenerate_reason(gen.text, req.text or None, min_chars=d.min_chars,
                                max_repeat_share=d.max_repeat_share, echo_share=d.echo_share)
        if bad:
            yield rejected(STAGE_CAPTION, cid, bad[0], bad[1], video_id=vid,
                           details=json.dumps({"text": (gen.text or "")[:2000]}))
            return
        row = {"clip_id": cid, "video_id": vid, "start_s": c["start_s"], "end_s": c["end_s"], "text": gen.text,
               "backend": self.info.backend, "model": self.info.model, "model_revision": self.info.revision,
               "prompt_hash": self.prompt_hash, "prompt_name": self.prompt, "sampling": self.sampling,
               "frame_timestamps": f["frame_timestamps"],
               "frame_width": f["frame_width"], "frame_height": f["frame_height"],
               "finish_reason": gen.finish_reason, "input_tokens": gen.prompt_tokens,
               "vision_tokens": gen.vision_tokens, "output_tokens": gen.output_tokens}
        self.progress.tick(cid)
        yield checked(STAGE_CAPTION, "caption", row, cid)


def _dead_letters(bad):
    """``(batch, (exc_type, exc_repr, traceback))`` from RunInference's dead-letter output -> one reject per clip."""
    batch, (exc_type, exc_repr, _tb) = bad
    name = getattr(exc_type, "__name__", str(exc_type))
    for req in batch:
        c = req.meta["clip"]
        yield rejected(STAGE_CAPTION, c["clip_id"], "model_error", f"{name}: {exc_repr}"[:2000],
                       video_id=c["video_id"]).value


class CaptionClips(beam.PTransform):
    """``{"videos": videos, "clips": clips}`` -> ``{"main": captions, "rejects", "facts", "counts"}``.

    ``counts`` are ``((stage, metric), n)`` pairs for :class:`longreel.pipelines.stats.WriteStats` covering the
    three stages ``clip_facts``, ``clip_filter`` and ``caption``, plus the model's latency per clip as
    ``run:caption`` pairs (``stats.json["run"]["caption"]``; no table holds wall-clock time).

    ``frame_cache=(pack_cfg, cache_dir)``: each video is decoded in one pass that also builds the pack stage's frame
    cache entry, so the pack stage and a pass-rate filter on cached frames decode nothing. A long video cut into
    chunks for several workers builds it in parts, one per chunk's pass (:class:`AssembleFrameCache`); the
    ``cache_ready`` output completes once those entries are written.

    ``keep_frames``: keep the decoded frames of every clip the filter passes even for the facts captioner, and
    return them as ``"frames"`` (``{"clip", "facts", "frames", "fps"}`` per clip) for the embedding gates
    (:mod:`longreel.pipelines.stages.clip_gates`), which embed them where they were decoded.

    ``filter_frames=(filter_cfg, store_dir)``: the same pass decodes the pass-rate filter's uniform frames into a
    :class:`~longreel.pipelines.pack.frame_cache.DecodedFrameStore`, where the filter reads them.
    """

    def __init__(self, cfg: CaptionConfig, handler=None, frame_cache=None, keep_frames: bool = False,
                 filter_frames=None, split_long_videos: bool = True, local_workers: int = 0, after_decode=None):
        super().__init__()
        self.cfg = cfg
        self.after_decode = after_decode
        self.frame_cache = frame_cache
        self.keep_frames = keep_frames or cfg.backend != "facts"
        self.filter_frames = filter_frames
        self.split_long_videos = split_long_videos
        self.local_workers = local_workers
        self.budget = frame_budget(cfg)
        self.info = model_info(cfg)
        self.prompt = prompt_name(cfg)
        self.prompt_hash = load_template(self.prompt)[1]
        self.sampling = sampling_json(cfg, self.budget[0])
        # a handler may be injected (tests; a custom client); by default one is built from the config
        self.handler = handler or GenerationModelHandler(
            client_spec(cfg), generation_params(cfg), batch_size=cfg.model.batch_size,
            share_across_processes=cfg.model.share_across_processes or cfg.backend == "vllm",
            namespace="longreel_caption")

    def _frames_per_task(self) -> int | None:
        """Chunks spread a long video over workers; with one worker they only cost passes: when the same pass also
        feeds the frame cache or the filter, the video stays one task (one decode) unless the run has workers to
        spread it over."""
        if not self.split_long_videos and (self.frame_cache is not None or self.filter_frames is not None):
            return None
        return self.cfg.frames.max_frames_per_call

    def _spread(self):
        """Decode tasks differ a hundredfold in cost: a local run of several workers deals them out by cost, any
        other run reshuffles them (see :mod:`longreel.pipelines.cost_shares`)."""
        if self.local_workers <= 1:
            return beam.Reshuffle()
        from longreel.pipelines.cost_shares import SpreadByCost
        sparse = (self.frame_cache[0].max_frames if self.frame_cache else 0) + \
            (self.filter_frames[0].n_frames if self.filter_frames else 0)
        return SpreadByCost(self.local_workers, functools.partial(decode_cost, sparse_frames=sparse), task_order)

    def expand(self, pcolls):
        from longreel.pipelines.stats import stage_counts, timing_pairs

        cfg = self.cfg
        videos, clips = pcolls["videos"], pcolls["clips"]
        grouped = ({"videos": videos | "KeyVideos" >> beam.Map(lambda v: (v["video_id"], v)),
                    "clips": clips | "KeyClips" >> beam.Map(lambda c: (c["video_id"], c))}
                   | "ClipsPerVideo" >> beam.CoGroupByKey())
        # a long video's frame cache and filter frames ride on its chunks' passes (when there are chunks)
        cache_in_chunks = (self.frame_cache is not None or self.filter_frames is not None) and \
            self._frames_per_task() is not None
        tasks = grouped | "PlanDecode" >> beam.FlatMap(
            plan_decode, cfg.frames.n, cfg.frames.decode, self._frames_per_task(),
            self.frame_cache is not None or self.filter_frames is not None, cache_in_chunks).with_outputs(
            REJECTS, main=MAIN)
        decoded = (tasks[MAIN]
                   | "SpreadTasks" >> self._spread()
                   | "DecodeAndMeasure" >> beam.ParDo(DecodeClipFrames(
                       cfg, self.budget, keep_frames=self.keep_frames, frame_cache=self.frame_cache,
                       filter_frames=self.filter_frames, after_decode=self.after_decode)
                   ).with_outputs(REJECTS, CACHE_PARTS, main=MAIN))
        cache_ready = None
        if cache_in_chunks:
            cache_ready = (decoded[CACHE_PARTS]
                           | "CachePartsPerVideo" >> beam.GroupByKey()
                           | "AssembleFrameCache" >> beam.ParDo(AssembleFrameCache(self.frame_cache,
                                                                                 self.filter_frames)))
        facts = decoded[MAIN] | "FactsRows" >> beam.Map(lambda el: el["facts"])
        filtered = decoded[MAIN] | "StaticBlackFilter" >> beam.ParDo(FilterClips(cfg)).with_outputs(
            REJECTS, main=MAIN)
        requests = filtered[MAIN] | "ToRequests" >> beam.Map(to_request, cfg)
        results, dlq = requests | "Caption" >> on_model_step(RunInference(self.handler).with_exception_handling(),
                                                             cfg.resources)
        rows = results | "ToCaptionRows" >> beam.ParDo(ToCaptionRow(
            cfg, self.info, self.prompt, self.prompt_hash, self.sampling)).with_outputs(REJECTS, TIMING, COMPUTE,
                                                                                       main=MAIN)
        dead = dlq.failed_inferences | "ModelErrors" >> beam.FlatMap(_dead_letters)

        facts_rejects = (tasks[REJECTS], decoded[REJECTS]) | "FactsRejects" >> beam.Flatten()
        caption_rejects = (rows[REJECTS], dead) | "CaptionRejects" >> beam.Flatten()
        rejects = (facts_rejects, filtered[REJECTS], caption_rejects) | "AllCaptionRejects" >> beam.Flatten()
        counts = (
            stage_counts("ClipFacts", STAGE_FACTS, clips, facts, facts_rejects),
            stage_counts("ClipFilter", STAGE_FILTER, facts, filtered[MAIN], filtered[REJECTS]),
            stage_counts("Captions", STAGE_CAPTION, filtered[MAIN], rows[MAIN], caption_rejects),
            timing_pairs("Captions", STAGE_CAPTION, rows[TIMING]),
            rows[COMPUTE],
        ) | "CaptionCounts" >> beam.Flatten()
        return {MAIN: rows[MAIN], REJECTS: rejects, "facts": facts, "counts": counts, "frames": filtered[MAIN],
                "cache_ready": cache_ready}


def add_caption_stage(p, videos_pcoll, clips_pcoll, out_dir: str, cfg: CaptionConfig, handler=None,
                      pack_cfg=None, filter_cfg=None, gates=None, split_long_videos: bool = True,
                      tables=None, local_workers: int = 0, after_decode=None) -> dict:
    """Add captioning to pipeline ``p``; write ``captions-*`` and ``clip_facts-*`` Parquet tables under ``out_dir``.

    ``pack_cfg`` (a PackConfig, when the run packs too): the caption's decode pass also builds the frame cache
    (``pack_cfg.cache_dir`` or ``<out_dir>/frame_cache``, as the pack stage reads it).
    ``filter_cfg`` (a FilterConfig, when the run's pass-rate filter decodes ``uniform`` frames): the same pass
    decodes them into :func:`filter_frames_dir`, where the filter reads them (only with exact sampling on the
    default decoder, which is how the filter decodes; otherwise the filter decodes its own).

    Returns ``{"captions", "facts", "rejects", "counts", "cache_ready"}`` PCollections: the caller flattens
    ``rejects`` into its rejects table and ``counts`` into its :class:`~longreel.pipelines.stats.WriteStats` (stage
    order: ``CAPTION_STAGES``, units ``CAPTION_UNITS``). ``cache_ready`` (None unless long videos' frame cache
    entries are put together from their chunks' parts) completes once those entries are written: a stage reading
    the frame cache waits on it (``beam.transforms.util.WaitOn``).

    ``gates`` (optional): ``gates(captions, frames) -> {"captions", "rejects", "counts"}``, applied before the
    ``captions`` table is written (the embedding gates: their per-caption fields land in that table).
    ``split_long_videos=False`` (a run on one worker): a video whose pass also feeds the frame cache or the filter
    is decoded in one task rather than in ``max_frames_per_call`` chunks plus a task of their own.
    ``tables``: a :class:`~longreel.pipelines.io.parquet_sink.TableSink` that writes the run's tables together.
    ``local_workers``: the worker count of a local multi-worker run (Beam's FnApiRunner, which gives each worker a
    fixed share of a stage): its decode tasks are dealt out by estimated cost. 0 for any other runner.
    ``after_decode`` (a picklable callable, or None): run once per worker, in a background thread, when the worker's
    decode bundle ends: the caller loads there what later stages load in their setup, while this worker waits for
    the other workers' decoding instead of on the run's serial end.
    """
    from longreel.pipelines.io.parquet_sink import write_table

    del p  # the PCollections carry the pipeline; kept in the signature for symmetry with the other stages
    frame_cache = None
    if pack_cfg is not None:
        from apache_beam.io.filesystems import FileSystems
        frame_cache = (pack_cfg, pack_cfg.cache_dir or FileSystems.join(out_dir, "frame_cache"))
    filter_frames = None
    if shares_filter_pass(cfg, filter_cfg):
        filter_frames = (filter_cfg, filter_frames_dir(out_dir, pack_cfg))
    out = {"videos": videos_pcoll, "clips": clips_pcoll} | "CaptionClips" >> CaptionClips(
        cfg, handler, frame_cache, keep_frames=gates is not None, filter_frames=filter_frames,
        split_long_videos=split_long_videos, local_workers=local_workers, after_decode=after_decode)
    if gates is not None:
        g = gates(out[MAIN], out["frames"])
        out = {**out, MAIN: g["captions"],
               REJECTS: (out[REJECTS], g["rejects"]) | "CaptionAndGateRejects" >> beam.Flatten(),
               "counts": (out["counts"], g["counts"]) | "CaptionAndGateCounts" >> beam.Flatten()}
    write_table(out[MAIN], "WriteCaptions", out_dir, "captions", "caption", cfg.parquet_shards, tables)
    write_table(out["facts"], "WriteClipFacts", out_dir, "clip_facts", "clip_facts", cfg.parquet_shards, tables)
    return {"captions": out[MAIN], "facts": out["facts"], "rejects": out[REJECTS], "counts": out["counts"],
            "cache_ready": out["cache_ready"]}
