"""The pack stage: QRA (+ pass-rate) and video tables -> frame cache + WebDataset shards + wids index.

Three funnel stages, each balanced (``in == out + rejected``):

* ``pack_select`` (unit: qra): every QRA gets a split: the pass-rate record's ``sft``/``rl``
  (``drop`` -> reject ``pass_rate_drop``, none -> ``no_pass_rate``), or ``default_split`` when
  there is no pass-rate table; a QRA whose video is not in the videos table -> ``unknown_video``.
* ``frame_cache`` (unit: video): each video with at least one selected QRA is decoded once per
  parameter set into the frame cache (``extra``: ``frames``; whether its entry was a ``hit``, ``built``
  or ``rebuilt`` depends on earlier runs and goes to ``stats.json["run"]["frame_cache"]``);
  a failure (decode error, timeout, too few frames, changed content) is a reject of the video.
* ``pack_write`` (unit: qra): selected QRAs written into shards (``out`` is summed from what the
  shard writer reports); QRAs of a video that could not be cached -> ``video_not_cached``
  (``extra``: ``samples``, ``shards``, ``shard_bytes``).

Sample layout (one tar sample = one video in one split; frames stored once, all its questions
with it): ``<video_id>.frames.npy``, ``.meta.json``, ``.qras.json``, ``.sums.json``. See
``docs/SHARDS.md``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import time

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.pack.config import PackConfig
from longreel.pipelines.pack.frame_cache import CacheError, FrameCache, FrameParams, frame_processor
from longreel.pipelines.pack.shards import WriteWebDatasetShards, ensure_dir, sample_bytes
from longreel.task.shard_format import SAMPLE_LAYOUT
from longreel.pipelines.stages.base import Progress
from longreel.pipelines.stats import one_element, run_count
from longreel.schemas import reject
from longreel.pipelines.tmp_dirs import make_tmpdir

log = logging.getLogger("longreel")

STAGE_ORDER = ["pack_select", "frame_cache", "pack_write"]
STAGE_UNITS = {"pack_select": "qra", "frame_cache": "video", "pack_write": "qra"}
COUNTS, REJECTS = "counts", "rejects"

QRA_ITEM_FIELDS = ("qra_id", "video_id", "category", "problem_type", "question", "options", "answer", "reasoning",
                   "target", "generator", "model", "model_revision", "prompt_hash", "sampling", "seed",
                   "source_caption_ids", "refined", "option_permutation", "blind_k", "blind_pass_count")
PASS_RATE_FIELDS = ("k", "pass_count", "mean_reward", "label", "answerer", "answerer_revision", "temperature")


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _count(stage: str, metric: str, n: int = 1):
    return TaggedOutput(COUNTS, ((stage, metric), n))


def _reject(stage: str, key: str, reason: str, message: str, video_id: str | None = None):
    return TaggedOutput(REJECTS, reject(stage, key, reason, message, video_id=video_id))


class _SelectSplit(beam.DoFn):
    """(qra_id, {"qra": [...], "pr": [...]}) or a bare QRA row -> (video_id, qra with split)."""

    def __init__(self, default_split: str | None):
        self.default_split = default_split

    def process(self, element):
        if self.default_split is not None:
            qra = element
            yield _count("pack_select", "in")
            yield qra["video_id"], {"split": self.default_split, "qra": qra, "pass_rate": None}
            return
        qra_id, g = element
        qras, prs = list(g["qra"]), list(g["pr"])
        if not qras:  # a pass-rate row for a question that is not in the QRA table: not an input of this stage
            yield _count("pack_select", "orphan_pass_rate", len(prs))
            return
        if list(g.get("filtered") or []):
            # the pass-rate filter already rejected it (with its reason): not an input here, so the funnel reads
            # filter out == pack in and no question is listed as rejected twice
            yield _count("pack_select", "rejected_by_filter", len(qras))
            return
        for qra in qras:
            yield _count("pack_select", "in")
            if not prs:
                yield _reject("pack_select", qra_id, "no_pass_rate", f"{qra_id} has no pass-rate record",
                              qra["video_id"])
                continue
            pr = sorted(prs, key=_dumps)[0]
            if pr["split"] == "drop":
                yield _reject("pack_select", qra_id, "pass_rate_drop",
                              f"{qra_id}: pass-rate split is drop ({pr['pass_count']}/{pr['k']}, {pr['label']})",
                              qra["video_id"])
                continue
            yield qra["video_id"], {"split": pr["split"], "qra": qra,
                                    "pass_rate": {k: pr.get(k) for k in PASS_RATE_FIELDS}}


class _CacheAndBuild(beam.DoFn):
    """(video_id, {"video": [...], "qra": [...]}) -> cache entry + one sample descriptor per split."""

    def __init__(self, cfg: PackConfig, cache_dir: str):
        self.cfg, self.cache_dir = cfg, cache_dir

    def setup(self):
        from longreel.pipelines.media.worker import IsolatedWorker
        self.vp = frame_processor(self.cfg.processor, min_pixels=self.cfg.min_pixels, max_pixels=self.cfg.max_pixels)
        self.cache = FrameCache(self.cache_dir, FrameParams(self.cfg.fps, self.cfg.max_frames, self.cfg.min_frames),
                                self.vp)
        self.worker = IsolatedWorker(default_timeout=self.cfg.decode_timeout_s)
        self.tmpdir = None  # made on first use: only remote videos are copied locally
        self.progress = Progress("frame_cache", "videos")

    def teardown(self):
        self.worker.close()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _entry(self, video: dict):
        entry, state = self.cache.lookup(video["sha256"], verify=self.cfg.cache_verify)
        if entry is not None:
            return entry, "hit"
        from longreel.pipelines.media.decode import decode_in_worker
        from longreel.pipelines.media.worker import WorkerError
        from longreel.pipelines.stages.ingest import hash_and_localize

        if self.tmpdir is None and "://" in video["uri"]:
            self.tmpdir = make_tmpdir("pack")
        try:
            local, sha, _size, is_temp = hash_and_localize(video["uri"], self.tmpdir)
        except OSError as e:
            raise CacheError("read_failed", f"{video['uri']}: {e}") from None
        try:
            if sha != video["sha256"]:
                raise CacheError("content_changed", f"{video['uri']} no longer has sha256 {video['sha256'][:16]}…")

            def decode(path, timestamps, rotation):
                try:
                    return decode_in_worker(self.worker, path, timestamps, rotation=rotation)
                except WorkerError as e:
                    raise CacheError(e.reason, e.message) from None

            entry = self.cache.build(video, local, decode)
        finally:
            if is_temp:
                FileSystems.delete([local])
        return entry, ("rebuilt" if state.startswith("corrupt") else "built")

    def process(self, element):
        video_id, g = element
        videos, items = list(g["video"]), list(g["qra"])
        if not items:
            yield _count("frame_cache", "videos_without_qra")
            return
        if not videos:
            for it in items:
                q = it["qra"]
                yield _reject("pack_select", q["qra_id"], "unknown_video",
                              f"{q['qra_id']}: video {video_id} is not in the videos table", video_id)
            return
        video = sorted(videos, key=_dumps)[0]
        yield _count("pack_select", "out", len(items))
        yield _count("pack_write", "in", len(items))
        yield _count("frame_cache", "in")
        t0 = time.monotonic()
        try:
            entry, how = self._entry(video)
        except CacheError as e:
            yield _reject("frame_cache", video_id, e.reason, str(e), video_id)
            for it in items:
                q = it["qra"]
                yield _reject("pack_write", q["qra_id"], "video_not_cached",
                              f"{q['qra_id']}: video {video_id} could not be cached ({e.reason})", video_id)
            return
        yield _count("frame_cache", "out")
        # hit / built / rebuilt depends on what earlier runs left in the cache, not on the inputs: stats.json["run"]
        yield TaggedOutput(COUNTS, run_count("frame_cache", how))
        yield _count("frame_cache", "frames", entry.meta["num_frames"])
        yield TaggedOutput("frames", entry.meta["num_frames"])
        self.progress.tick(f"{video_id} {how} {entry.meta['num_frames']} frames in {time.monotonic() - t0:.1f} s")

        by_split: dict[str, list[dict]] = {}
        for it in items:
            q = {k: it["qra"].get(k) for k in QRA_ITEM_FIELDS}
            if it["qra"].get("judge_verdict"):  # only where the judge ran: other runs' shards keep their bytes
                q["judge_verdict"] = json.loads(it["qra"]["judge_verdict"])
            q["split"] = it["split"]
            q["pass_rate"] = it["pass_rate"]
            by_split.setdefault(it["split"], []).append(q)
        for split, qs in sorted(by_split.items()):
            yield sample_descriptor(split, video, entry, sorted(qs, key=lambda q: q["qra_id"]))

def sample_descriptor(split: str, video: dict, entry, qras: list[dict]) -> dict:
    """One tar sample (see :mod:`longreel.pipelines.pack.shards`): a video's frames (by reference to the cache),
    meta.json (VideoMetadata, sizes, processor, licence), qras.json (its questions in ``split``, sorted)
    and sums.json (bytes + sha256 of the three)."""
    m = entry.meta
    meta = {
        "sample_layout": SAMPLE_LAYOUT,
        "key": video["video_id"],
        "split": split,
        "video_id": video["video_id"],
        "video_sha256": video["sha256"],
        "license": video.get("license"),
        "attribution": video.get("attribution"),
        "source": {"duration_s": video["duration_s"], "width": video["width"], "height": video["height"],
                   "fps_avg": video.get("fps_avg"), "n_frames": video["n_frames"],
                   "video_codec": video.get("video_codec"), "container": video.get("container")},
        # transformers VideoMetadata (source video) + what the frames are
        "video_metadata": {"total_num_frames": m["total_num_frames"], "fps": m["fps"], "duration": m["duration"],
                           "width": m["width"], "height": m["height"], "frames_indices": m["frames_indices"]},
        "timestamps": m["timestamps"],
        "num_frames": m["num_frames"],
        "resized_height": m["resized_height"],
        "resized_width": m["resized_width"],
        "video_grid_thw": m["video_grid_thw"],
        "processor": m["processor"],
        "sampling": m["sampling"],
        "versions": m["versions"],
        "cache_key": entry.key,
        "nquestions": len(qras),
    }
    meta_text = _dumps(meta)
    qras_text = _dumps(qras)

    def digest(text: str) -> dict:
        data = text.encode("utf-8")
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    sums = {"frames.npy": {"bytes": entry.frames_bytes, "sha256": entry.frames_sha256},
            "meta.json": digest(meta_text), "qras.json": digest(qras_text)}
    files = [{"name": "frames.npy", "path": entry.npy_path, "size": entry.frames_bytes,
              "sha256": entry.frames_sha256},
             {"name": "meta.json", "text": meta_text},
             {"name": "qras.json", "text": qras_text},
             {"name": "sums.json", "text": _dumps(sums)}]
    return {"split": split, "key": video["video_id"], "nquestions": len(qras), "bytes": sample_bytes(files),
            "files": files}


def _summary(shards: list[dict], frames: list[int], dataset: str) -> dict:
    splits: dict[str, dict] = {}
    for s in sorted(shards, key=lambda s: (s["split"], s["index"])):
        d = splits.setdefault(s["split"], {"index": f"{dataset}-{s['split']}.index.json", "shards": [],
                                           "samples": 0, "questions": 0, "bytes": 0})
        d["shards"].append({k: s[k] for k in ("url", "nsamples", "nquestions", "bytes", "sha256")})
        d["samples"] += s["nsamples"]
        d["questions"] += s["nquestions"]
        d["bytes"] += s["bytes"]
    frames = sorted(frames)
    fpv = {"videos": len(frames), "total": sum(frames), "min": frames[0] if frames else 0,
           "max": frames[-1] if frames else 0, "mean": round(sum(frames) / len(frames), 3) if frames else 0.0,
           "histogram": {str(k): frames.count(k) for k in sorted(set(frames))}}
    sizes = [s["bytes"] for s in shards]
    return {"dataset": dataset, "splits": splits, "frames_per_video": fpv,
            "shard_bytes": {"shards": len(sizes), "total": sum(sizes), "min": min(sizes) if sizes else 0,
                            "max": max(sizes) if sizes else 0}}


def index_extra(cfg: PackConfig) -> dict:
    """What the index records about how the frames were made (no paths: byte-identical across locations)."""
    from longreel.pipelines.pack.frame_cache import _versions, processor_params
    vp = frame_processor(cfg.processor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return {"frames": {"fps": cfg.fps, "max_frames": cfg.max_frames, "min_frames": cfg.min_frames},
            "processor": processor_params(vp), "versions": _versions()}


def add_pack_stage(p, videos_pcoll, qras_pcoll, passrate_pcoll_or_none, out_dir: str, cfg: PackConfig, *,
                   standalone: bool = True, filter_rejects=None) -> dict:
    """Add the pack stage to pipeline ``p``.

    Inputs are PCollections of VIDEO, QRA and (optionally) PASS_RATE rows. Writes the frame cache
    (``cfg.cache_dir`` or ``<out_dir>/frame_cache``) and shards + one index per split
    (``cfg.shards_dir`` or ``<out_dir>/shards``).

    ``standalone=True`` (``longreel pack``): also rewrites ``<out_dir>/rejects-*.parquet`` (other
    stages' rejects kept, this stage's replaced) and merges the ``pack_select`` / ``frame_cache`` /
    ``pack_write`` funnel plus a ``pack`` summary (frames per video, shard sizes) into
    ``<out_dir>/stats.json``. ``standalone=False`` (wired into a pipeline that writes those files
    itself, e.g. ``longreel curate``): writes neither; flatten ``counts`` into that pipeline's
    ``((stage, metric), n)`` pairs (order :data:`STAGE_ORDER`, units :data:`STAGE_UNITS`) and
    ``rejects`` into its rejects, and put ``summary`` under ``stats["pack"]`` if wanted.

    ``filter_rejects``: reject rows of the run (any stage; the pass-rate filter's are used). A question the filter
    rejected is not an input of ``pack_select`` (counted as ``rejected_by_filter``), so that the filter's out is
    the pack's in and the question is listed as rejected once, by the stage that decided.

    Returns ``{"shards": one dict per shard {split, index, num_shards, url, nsamples, nquestions,
    bytes, sha256}, "indexes": {split, index (path), doc}, "rejects": reject rows, "counts": pairs,
    "summary": one dict, "samples": sample descriptors}``.
    """
    from longreel.schemas.config import config_hash

    cache_dir = cfg.cache_dir or FileSystems.join(out_dir, "frame_cache")
    shards_dir = cfg.shards_dir or FileSystems.join(out_dir, "shards")
    ensure_dir(shards_dir)
    ensure_dir(cache_dir)

    if passrate_pcoll_or_none is None:
        selected = qras_pcoll | "PackSelect" >> beam.ParDo(_SelectSplit(cfg.default_split)).with_outputs(
            COUNTS, REJECTS, main="main")
    else:
        by_q = qras_pcoll | "PackKeyQra" >> beam.Map(lambda r: (r["qra_id"], r))
        pr_by_q = passrate_pcoll_or_none | "PackKeyPassRate" >> beam.Map(lambda r: (r["qra_id"], r))
        joined = {"qra": by_q, "pr": pr_by_q}
        if filter_rejects is not None:
            from longreel.pipelines.stages.passrate import STAGE as FILTER_STAGE
            joined["filtered"] = (filter_rejects | "PackFilterRejectsOnly" >> beam.Filter(
                lambda r: r["stage"] == FILTER_STAGE) | "PackKeyFiltered" >> beam.Map(lambda r: (r["key"], 1)))
        selected = (joined | "PackJoinPassRate" >> beam.CoGroupByKey()
                    | "PackSelect" >> beam.ParDo(_SelectSplit(None)).with_outputs(COUNTS, REJECTS, main="main"))
    vids = videos_pcoll | "PackKeyVideo" >> beam.Map(lambda v: (v["video_id"], v))
    built = ({"video": vids, "qra": selected.main} | "PackJoinVideos" >> beam.CoGroupByKey()
             | "PackCacheFrames" >> beam.ParDo(_CacheAndBuild(cfg, cache_dir)).with_outputs(
                 COUNTS, REJECTS, "frames", main="samples"))
    # the run's own OUT/shards is longreel's whole; a pack.shards_dir may hold another run's split of the dataset
    written = built.samples | "PackWriteShards" >> WriteWebDatasetShards(shards_dir, cfg.dataset,
                                                                         cfg.target_shard_bytes,
                                                                         functools.partial(index_extra, cfg),
                                                                         remove_other_splits=cfg.shards_dir is None)
    write_counts = written["shards"] | "PackShardCounts" >> beam.FlatMap(
        lambda s: [(("pack_write", "out"), s["nquestions"]), (("pack_write", "samples"), s["nsamples"]),
                   (("pack_write", "shards"), 1), (("pack_write", "shard_bytes"), s["bytes"])])
    rejects = (selected[REJECTS], built[REJECTS]) | "PackAllRejects" >> beam.Flatten()
    reject_counts = rejects | "PackRejectCounts" >> beam.Map(lambda r: ((r["stage"], "rejected:" + r["reason"]), 1))
    # a zero pair per stage marks each as counted by this run, also when nothing reached it: a pack that kept
    # nothing replaces the earlier pack's numbers with zeros (and exits 3) instead of keeping them
    present = one_element(p) | "PackPresent" >> beam.FlatMap(lambda _: [((s, "in"), 0) for s in STAGE_ORDER])
    counts = ((selected[COUNTS], built[COUNTS], write_counts, reject_counts, present)
              | "PackAllCounts" >> beam.Flatten())
    shard_list = written["shards"] | "PackShardList" >> beam.combiners.ToList()
    frame_list = built["frames"] | "PackFrameList" >> beam.combiners.ToList()
    summary = (shard_list | "PackSummary" >> beam.Map(
        lambda shards, frames: _summary(shards, frames, cfg.dataset), beam.pvalue.AsSingleton(frame_list)))
    if standalone:
        # Like the other stages run alone on an output directory: other stages' rejects and funnel entries are kept.
        from longreel.pipelines.stage_rerun import write_rerun_outputs
        write_rerun_outputs(p, out_dir, STAGE_ORDER, STAGE_UNITS, rejects, counts,
                            {"pack_config_hash": config_hash(cfg)}, 1, extras={"pack": summary})
    return {"shards": written["shards"], "indexes": written["indexes"], "rejects": rejects, "counts": counts,
            "summary": summary, "samples": built.samples}


def run_pack(out_dir: str, cfg: PackConfig, beam_args: list[str] | None = None, command: str | None = None) -> dict:
    """Read ``out_dir``'s videos / qra (/ pass_rate) tables, pack them (holding the directory's lock; see
    :mod:`longreel.pipelines.io.run_dir`); return the stats document."""
    from longreel.pipelines.stage_session import StageSession
    from longreel.schemas.config import config_hash

    with StageSession(out_dir, "pack", config_hash(cfg), command) as session:
        return _run_pack(session, out_dir, cfg, beam_args)


def _run_pack(session, out_dir: str, cfg: PackConfig, beam_args) -> dict:
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stats import read_json

    videos = read_table(out_dir, cfg.videos_table).to_pylist()
    qras = read_table(out_dir, cfg.qra_table).to_pylist()
    try:
        pass_rates = read_table(out_dir, cfg.pass_rate_table).to_pylist()
    except FileNotFoundError:
        pass_rates = None
    log.info("pack: %d videos, %d QRAs, %s pass-rate rows -> %s", len(videos), len(qras),
             "no" if pass_rates is None else len(pass_rates), out_dir)
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    v = p | "Videos" >> beam.Create(videos)
    q = p | "Qras" >> beam.Create(qras)
    pr = (p | "PassRates" >> beam.Create(pass_rates)) if pass_rates is not None else None
    frej = None
    if pass_rates is not None:
        from longreel.pipelines.stages.passrate import STAGE as FILTER_STAGE
        try:
            earlier = [r for r in read_table(out_dir, "rejects").to_pylist() if r["stage"] == FILTER_STAGE]
        except FileNotFoundError:
            earlier = []
        frej = p | "FilterRejects" >> beam.Create(earlier)
    add_pack_stage(p, v, q, pr, out_dir, cfg, filter_rejects=frej)
    session.begin_writes()
    from longreel.pipelines.io.run_dir import STAGE_CONFIG_FILES
    from longreel.schemas.config import dump_yaml

    with FileSystems.create(FileSystems.join(out_dir, STAGE_CONFIG_FILES["pack"])) as fh:
        fh.write(dump_yaml(cfg).encode())  # what the card states of this pack (config.yaml keeps curate's)
    p.run().wait_until_finish()
    stats = read_json(FileSystems.join(out_dir, "stats.json"))
    session.finish()
    log.info("pack: done in %.1f s", time.monotonic() - t0)
    return stats
