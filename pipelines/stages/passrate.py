"""Pass-rate filter: ``qra`` records (+ their ``video`` records) -> ``pass_rate`` records, kept questions, rejects.

GRPO learns only from questions its policy sometimes gets right and sometimes wrong, so each question is answered
k times (default 8) by the answering VLM and scored with exactly the trainer's rewards:

1. **Join** questions to their videos by ``video_id``; a question whose video is not in the videos table is a reject
   ``video_missing``. The reference answer is checked with :func:`longreel.task.rewards.validate_reference` (reject
   ``invalid_reference``) and the prompt is built with :func:`longreel.task.prompting.messages_for_qra` (reject
   ``bad_question``, e.g. more than four options).
2. **Frames**: ``n_frames`` timestamps at the centres of equal bins over the whole video, decoded once per video
   (all its questions share them) in a killable :class:`~longreel.pipelines.media.worker.IsolatedWorker`, already resized to
   the Qwen processor's grid (sides multiples of 28, pixels within [min_pixels, max_pixels], aspect kept). A video
   that fails to decode rejects its questions with the decoder's reason (``decode_failed``, ``timeout``, ...).
   In ``longreel curate`` with the caption stage (exact sampling, the default decoder) these frames are decoded in
   the caption stage's one pass per video and stored beside the frame cache
   (:class:`~longreel.pipelines.pack.frame_cache.DecodedFrameStore`, ``frames_dir``); the filter reads them there
   and decodes only a video whose entry is missing or damaged (the same frames either way).
   With ``frame_source: cache`` the frames come from the pack stage's frame cache instead
   (:mod:`longreel.pipelines.pack.frame_cache`: the processor's own fps sampling and resize, built on a miss): with the pack's
   parameters the answerer sees exactly the frames the trainer will, and each video is decoded once for both stages.
3. **Answer**: Beam ``RunInference`` with an answerer handler (:mod:`longreel.pipelines.passrate.answerers`): k samples per
   question in one call, with the trainer's prompt format, under a per-question seed derived from ``seed`` and the
   ``qra_id`` (same seed, same samples, whatever the batching). A failure on a question is ``answerer_failed``.
4. **Score** every sample with :func:`longreel.task.rewards.score` (``reward_params`` are the trainer's). A sample
   *passes* when its accuracy is 1.0 (default) or, with ``pass_threshold`` t, when its reward is >= t.
   ``pass_count`` is the number of passing samples (an integer in 0..k), ``mean_reward`` the mean of the k rewards.
5. **Label**: ``easy`` (k/k), ``hard`` (0/k), ``medium`` (in between). **Keep** by policy: ``medium`` (default)
   keeps medium questions and rejects easy ones as ``too_easy`` and hard ones as ``too_hard``; ``band`` keeps
   ``band_min <= mean_reward <= band_max`` and rejects the rest as ``too_easy`` (k/k), ``too_hard`` (0/k) or
   ``out_of_band``.
6. **Split** kept questions (see :func:`split_for`): ``hash`` (default): ``sft`` when the question's hash unit
   ``u = sha256("{split_seed}:{qra_id}")[:8] / 2**64`` is below ``sft_fraction`` (36/104 by default, the paper's 36K
   CoT-SFT / 68K RL), else ``rl``; ``pass_rate``: ``sft`` when ``pass_count / k >= sft_min_pass_rate``, else ``rl``.
   Dropped questions have ``split = "drop"``.

Outputs of :class:`PassRateFilter`: ``main``: one ``pass_rate`` row for every question that was scored (kept or
dropped: the table is the full record of what the answerer did); ``kept``: the rows with split sft/rl; ``rejects``:
one reject per question that is not kept. Funnel (unit: question): ``in`` = questions, ``out`` = kept,
``rejected`` by reason, so ``in == out + sum(rejected)``. :func:`filter_counts` adds the pass-count histogram, the
labels and the split sizes as data; :func:`finish_filter_stats` folds them into a ``passrate`` section of stats.json.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import statistics

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.compute import call_pairs
from longreel.pipelines.inference.beam_ml import RunInference
from longreel.pipelines.filter_config import FilterConfig
from longreel.pipelines.passrate.answerers import AnswererHandler, make_handler, question_seed
from longreel.pipelines.resources import on_model_step
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, checked, rejected
from longreel.task.prompting import messages_for_qra
from longreel.task.rewards import score, validate_reference
from longreel.pipelines.tmp_dirs import make_tmpdir

log = logging.getLogger("longreel")

STAGE = "passrate"
KEPT = "kept"
LABELS = ("easy", "medium", "hard")
SPLITS = ("sft", "rl", "drop")
DROP_REASONS = ("too_easy", "too_hard", "out_of_band")

__all__ = ["PassRateFilter", "ReadShardQuestions", "add_filter_stage", "filter_counts", "finish_filter_stats",
           "keep_decision", "label_for", "sample_passes", "split_for", "split_unit", "uniform_request",
           "uniform_timestamps"]


# ------------------------------------------------------------------------------------------------------------
# the rules (pure functions)
# ------------------------------------------------------------------------------------------------------------


def sample_passes(accuracy: float, reward: float, threshold: float | None = None) -> bool:
    """A sample passes when ``accuracy == 1.0`` (``threshold`` None) or when ``reward >= threshold``."""
    return accuracy >= 1.0 if threshold is None else reward >= threshold


def label_for(pass_count: int, k: int) -> str:
    if not 0 <= pass_count <= k:
        raise ValueError(f"pass_count {pass_count} outside 0..{k}")
    return "easy" if pass_count == k else "hard" if pass_count == 0 else "medium"


def keep_decision(pass_count: int, k: int, mean_reward: float, cfg: FilterConfig) -> str | None:
    """``None`` when the question is kept, else the reject reason (``too_easy``, ``too_hard``, ``out_of_band``)."""
    label = label_for(pass_count, k)
    if cfg.policy == "medium":
        return {"easy": "too_easy", "hard": "too_hard", "medium": None}[label]
    if cfg.policy == "band":
        if cfg.band_min <= mean_reward <= cfg.band_max:
            return None
        return {"easy": "too_easy", "hard": "too_hard", "medium": "out_of_band"}[label]
    raise ValueError(f"unknown policy {cfg.policy!r}")


def split_unit(qra_id: str, salt: int = 0) -> float:
    """A number in [0, 1) fixed by ``(salt, qra_id)``: the first 8 bytes of sha256 over 2**64."""
    return int.from_bytes(hashlib.sha256(f"{salt}:{qra_id}".encode()).digest()[:8], "big") / 2.0 ** 64


def split_for(qra_id: str, pass_count: int, k: int, cfg: FilterConfig) -> str:
    """``sft`` or ``rl`` for a kept question (module docstring, step 6)."""
    if cfg.split_rule == "hash":
        return "sft" if split_unit(qra_id, cfg.split_seed) < cfg.sft_fraction else "rl"
    if cfg.split_rule == "pass_rate":
        return "sft" if pass_count / k >= cfg.sft_min_pass_rate else "rl"
    raise ValueError(f"unknown split_rule {cfg.split_rule!r}")


def uniform_timestamps(duration_s: float, n: int) -> list[float]:
    """``n`` timestamps at the centres of ``n`` equal bins of [0, duration_s)."""
    from longreel.pipelines.media.decode import sample_timestamps

    return sample_timestamps(0.0, duration_s, n)


def uniform_request(video: dict, cfg: FilterConfig):
    """The :class:`~longreel.pipelines.media.decode.FrameRequest` of ``frame_source: uniform`` for a VIDEO row:
    ``n_frames`` bin centres over the whole video at the processor's grid size as displayed."""
    from longreel.pipelines.media.decode import FrameRequest, displayed_size

    w, h = frame_size(*displayed_size(video), cfg)
    return FrameRequest(uniform_timestamps(float(video["duration_s"]), cfg.n_frames), w, h)


def frame_size(width: int, height: int, cfg: FilterConfig) -> tuple[int, int]:
    """(width, height) to decode at: the Qwen-VL processor's own rounding (``smart_resize``, factor 28)."""
    from longreel.pipelines.media.qwen_vl_frames import smart_resize

    h, w = smart_resize(height, width, factor=28, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return int(w), int(h)


# ------------------------------------------------------------------------------------------------------------
# DoFns
# ------------------------------------------------------------------------------------------------------------


class PrepareQuestions(beam.DoFn):
    """(video_id, {"videos": [...], "qras": [...]}) -> one example per answerable question (frames decoded once)."""

    def __init__(self, cfg: FilterConfig, processor_dir: str | None = None, frames_dir: str | None = None):
        self.cfg, self.processor_dir, self.frames_dir = cfg, processor_dir, frames_dir

    def setup(self):
        from longreel.pipelines.media.worker import IsolatedWorker

        cfg = self.cfg
        self.worker = IsolatedWorker(default_timeout=cfg.decode_timeout_s)
        self.progress = Progress(STAGE, "videos decoded")
        self.cache = None
        self.store = None
        self.sources: dict[str, int] = {"shared_pass": 0, "decoded_here": 0}
        if cfg.frame_source == "uniform" and self.frames_dir:
            from longreel.pipelines.pack.frame_cache import DecodedFrameStore
            self.store = DecodedFrameStore(self.frames_dir)
        if cfg.frame_source == "cache":
            from longreel.pipelines.pack.frame_cache import FrameCache, FrameParams, frame_processor

            vp = frame_processor(self.processor_dir, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
            self.cache = FrameCache(cfg.cache_dir, FrameParams(cfg.cache_fps, cfg.cache_max_frames,
                                                               cfg.cache_min_frames), vp)

    def teardown(self):
        if getattr(self, "store", None) is not None and any(self.sources.values()):
            log.info("%s: uniform frames of %d videos from the caption's decode pass, %d decoded here", STAGE,
                     self.sources["shared_pass"], self.sources["decoded_here"])
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()

    def process(self, element):
        vid, groups = element
        qras = sorted(groups["qras"], key=lambda q: q["qra_id"])
        videos = list(groups["videos"])
        if not qras:
            return
        if not videos:
            for q in qras:
                yield rejected(STAGE, q["qra_id"], "video_missing", f"video {vid} is not in the videos table",
                               video_id=vid)
            return
        video = videos[0]
        ready = []
        for q in qras:
            try:
                validate_reference(q["problem_type"], q["answer"], q.get("options"), **self.cfg.reward_params)
            except (KeyError, TypeError, ValueError) as e:  # InvalidReference / UnknownProblemType / bad params
                yield rejected(STAGE, q["qra_id"], "invalid_reference", f"{type(e).__name__}: {e}", video_id=vid)
                continue
            try:
                messages = messages_for_qra(q)
            except (KeyError, ValueError) as e:
                yield rejected(STAGE, q["qra_id"], "bad_question", str(e), video_id=vid)
                continue
            ready.append((q, messages))
        if not ready:
            return
        try:
            decoded, meta = self._frames(video)
        except Exception as e:  # WorkerError / DecodeError / OSError: one reject per question of this video
            reason = getattr(e, "reason", "decode_failed")
            for q, _ in ready:
                yield rejected(STAGE, q["qra_id"], reason, f"{video['uri']}: {e}", video_id=vid)
            return
        for q, messages in ready:
            yield {"qra": q, "messages": messages, "seed": question_seed(self.cfg.seed, q["qra_id"]),
                   "frames": decoded, "video": meta}
        self.progress.tick(f"{vid}: {len(ready)} questions")

    def _frames(self, video: dict):
        """(uint8 frames [T, H, W, 3] on the processor's grid, video metadata) for one video."""
        if video.get("frames") is not None:  # read from packed shards (ReadShardQuestions): the trainer's frames
            return video["frames"], dict(video["frame_meta"])
        if self.cache is not None:
            return self._cached_frames(video)
        # the decoder returns frames as displayed (a phone video upright), like the captioner's and the frame cache's
        req = uniform_request(video, self.cfg)
        d = self.store.lookup(video, req) if self.store is not None else None
        if d is not None:
            self.sources["shared_pass"] += 1
        else:
            with _local_copy(video["uri"]) as path:
                d = self._decode(path, req.timestamps, width=req.width, height=req.height,
                                 rotation=video.get("rotation"))
            self.sources["decoded_here"] += 1
        meta = {"fps": d.fps, "n_frames": int(video["n_frames"]), "duration_s": float(video["duration_s"]),
                "frame_indices": list(d.indices), "timestamps": list(d.timestamps)}
        return d.frames, meta

    def _decode(self, path: str, timestamps: list[float], **size):
        from longreel.pipelines.media.decode import decode_in_worker

        return decode_in_worker(self.worker, path, timestamps, timeout=self.cfg.decode_timeout_s, **size)

    def _cached_frames(self, video: dict):
        import numpy as np

        entry, _state = self.cache.lookup(video["sha256"])
        if entry is None:  # missing or corrupt: (re)build it, as the pack stage would
            with _local_copy(video["uri"]) as path:
                entry = self.cache.build(video, path, self._decode)
        m = entry.meta
        frames = np.ascontiguousarray(entry.load(mmap=False))
        meta = {"fps": float(m["fps"]), "n_frames": int(m["total_num_frames"]), "duration_s": float(m["duration"]),
                "frame_indices": [int(i) for i in m["frames_indices"]],
                "timestamps": [float(t) for t in m["timestamps"]]}
        return frames, meta


class ReadShardQuestions(beam.DoFn):
    """A packed shard's URL -> its videos (frames inline, exactly as packed) on output ``videos`` and its questions
    on output ``qras``, for :class:`PassRateFilter` run on packed shards (``longreel filter --shards``), e.g. to
    re-label the data with a later policy (the SFT model) as the answerer. Samples are checked against their
    ``sums.json``; an unreadable shard or sample fails the run (its questions cannot be counted, so they cannot
    be rejects)."""

    def process(self, url: str):
        from longreel.task.shard_reader import LoaderStats, ShardSpec, read_shard

        def fail(err, whole_shard):
            raise err

        for sample in read_shard(ShardSpec(url), LoaderStats(), fail, verify="sample", mmap=False):
            meta = sample["meta"]
            vm = meta.get("video_metadata") or {}
            vid = meta.get("video_id", sample["key"])
            fps = float(vm["fps"])
            indices = [int(i) for i in vm["frames_indices"]]
            stamps = meta.get("timestamps") or vm.get("timestamps") or [i / fps for i in indices]
            yield beam.pvalue.TaggedOutput("videos", {
                "video_id": vid, "uri": f"{url}#{sample['key']}", "frames": sample["frames"],
                "frame_meta": {"fps": fps, "n_frames": int(vm["total_num_frames"]),
                               "duration_s": float(vm["duration"]), "frame_indices": indices,
                               "timestamps": [float(t) for t in stamps]}})
            for q in sample["qras"]:
                yield beam.pvalue.TaggedOutput("qras", dict(q, video_id=q.get("video_id") or vid))


@contextlib.contextmanager
def _local_copy(uri: str):
    """A local path for ``uri`` (remote files are copied to a temp dir, removed afterwards)."""
    if uri.startswith("file://"):
        yield uri[len("file://"):]
        return
    if "://" not in uri:
        yield uri
        return
    tmp = make_tmpdir("passrate")
    try:
        path = os.path.join(tmp, "source" + os.path.splitext(uri)[1][:8])
        with FileSystems.open(uri, compression_type="uncompressed") as fi, open(path, "wb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        yield path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class ScoreQuestion(beam.DoFn):
    """PredictionResult -> a ``pass_rate`` row (main), and a reject when the question is not kept."""

    def __init__(self, cfg: FilterConfig, provenance: dict):
        self.cfg, self.prov = cfg, provenance

    def setup(self):
        self.progress = Progress(STAGE, "questions scored")

    def process(self, result):
        ex, inf = result.example, result.inference
        q = ex["qra"]
        qid, vid = q["qra_id"], q["video_id"]
        cfg = self.cfg
        if inf.get("error"):
            yield rejected(STAGE, qid, "answerer_failed", inf["error"], video_id=vid)
            return
        completions = inf["completions"]
        try:
            results = [score(c, q["problem_type"], q["answer"], q.get("options"), **cfg.reward_params)
                       for c in completions]
        except (KeyError, TypeError, ValueError) as e:  # checked up front; a scorer change could still raise
            yield rejected(STAGE, qid, "scoring_failed", f"{type(e).__name__}: {e}", video_id=vid)
            return
        k = len(results)
        rewards = [r.reward for r in results]
        passes = sum(sample_passes(r.accuracy, r.reward, cfg.pass_threshold) for r in results)
        mean = statistics.fmean(rewards)
        reason = keep_decision(passes, k, mean, cfg)
        split = "drop" if reason else split_for(qid, passes, k, cfg)
        p = self.prov
        row = {"qra_id": qid, "video_id": vid, "k": k, "pass_count": passes, "mean_reward": mean,
               "rewards": rewards, "label": label_for(passes, k), "split": split,
               "answerer": p["answerer"], "answerer_revision": p["answerer_revision"],
               "temperature": p["temperature"], "seed": p["seed"], "backend": p["backend"], "top_p": p["top_p"],
               "top_k": p["top_k"], "max_new_tokens": p["max_new_tokens"], "prompt_hash": p["prompt_hash"],
               "pass_threshold": cfg.pass_threshold, "policy": cfg.policy,
               "frame_timestamps": list(ex["video"]["timestamps"]), "completions": list(completions),
               "sample_reasons": [r.reason for r in results], **_token_fields(inf.get("tokens"))}
        out = checked(STAGE, "pass_rate", row, qid)
        yield out
        if reason and isinstance(out, dict):  # scored but not kept: in the table, and a reject with the reason
            yield rejected(STAGE, qid, reason,
                           f"{passes}/{k} samples passed (mean reward {mean:.3f}; policy {cfg.policy})",
                           video_id=vid, details=json.dumps({"pass_count": passes, "k": k,
                                                             "mean_reward": round(mean, 6)}))
        self.progress.tick(f"{qid}: {passes}/{k}")


class PassRateFilter(beam.PTransform):
    """Stage ``passrate``: ``{"videos": pcoll, "qras": pcoll}`` -> ``{"main", "kept", "rejects"}``."""

    def __init__(self, cfg: FilterConfig, handler: AnswererHandler | None = None, frames_dir: str | None = None):
        super().__init__()
        cfg.check_runnable()
        self.cfg, self.frames_dir = cfg, frames_dir
        self.handler = handler if handler is not None else make_handler(cfg)

    def provenance(self) -> dict:
        return self.handler.provenance()

    def expand(self, inputs):
        videos, qras = inputs["videos"], inputs["qras"]
        keyed_v = videos | "KeyVideos" >> beam.Map(lambda v: (v["video_id"], v))
        keyed_q = qras | "KeyQuestions" >> beam.Map(lambda q: (q["video_id"], q))
        joined = {"videos": keyed_v, "qras": keyed_q} | "JoinVideos" >> beam.CoGroupByKey()
        prepare = PrepareQuestions(self.cfg, self.handler.processor_dir(), self.frames_dir)
        prepared = joined | "FramesAndPrompts" >> beam.ParDo(prepare).with_outputs(REJECTS, main=MAIN)
        answered = prepared[MAIN] | "Answer" >> on_model_step(RunInference(self.handler), self.cfg.resources)
        scored = answered | "Score" >> beam.ParDo(ScoreQuestion(self.cfg, self.provenance())).with_outputs(
            REJECTS, main=MAIN)
        rejects = (prepared[REJECTS], scored[REJECTS]) | "Rejects" >> beam.Flatten()
        kept = scored[MAIN] | "Kept" >> beam.Filter(lambda r: r["split"] != "drop")
        return {MAIN: scored[MAIN], KEPT: kept, REJECTS: rejects}


# ------------------------------------------------------------------------------------------------------------
# funnel statistics
# ------------------------------------------------------------------------------------------------------------


def _token_fields(tokens: dict | None) -> dict:
    t = tokens or {}
    return {"input_tokens": t.get("input"), "vision_tokens": t.get("vision"), "output_tokens": t.get("output")}


def _row_counts(r: dict) -> list[tuple]:
    pairs = [((STAGE, f"pass_count:{r['pass_count']}"), 1), ((STAGE, f"label:{r['label']}"), 1),
             ((STAGE, f"split:{r['split']}"), 1), ((STAGE, "scored"), 1)]
    if r.get("input_tokens") is not None:  # a model call (a scripted answerer makes none)
        pairs += call_pairs(STAGE, r["input_tokens"], r["vision_tokens"], r["output_tokens"])
    return pairs


def filter_counts(label: str, qras, out: dict):
    """``((stage, metric), n)`` pairs: in/out/rejected (unit: question) plus ``pass_count:N``, ``label:L`` and
    ``split:S`` counts of the scored rows."""
    from longreel.pipelines.stats import stage_counts

    base = stage_counts(label, STAGE, qras, out[KEPT], out[REJECTS])
    detail = out[MAIN] | f"{label}Detail" >> beam.FlatMap(_row_counts)
    return (base, detail) | f"{label}AllCounts" >> beam.Flatten()


def finish_filter_stats(doc: dict, k: int, provenance: dict | None = None, config_hash: str | None = None) -> dict:
    """Fold the ``passrate`` stage's extra counts into ``doc["passrate"]``: the pass-count histogram over 0..k
    (zeros included), labels, kept by split, dropped/failed by reason, and the answerer's provenance."""
    st = next((s for s in doc.get("stages", []) if s["stage"] == STAGE), None)
    if st is None:
        return doc
    extra = st.get("extra", {})
    hist = [int(extra.get(f"pass_count:{i}", 0)) for i in range(k + 1)]
    others = sorted(m for m in extra if m.startswith("pass_count:") and not 0 <= int(m.split(":")[1]) <= k)
    if others:  # a row with another k (should not happen in one run) would be lost from the histogram
        raise ValueError(f"pass counts outside 0..{k}: {others}")
    rejected_ = st.get("rejected", {})
    section = {
        "k": k,
        "questions_in": st["in"],
        "scored": int(extra.get("scored", 0)),
        "pass_count_histogram": hist,
        "labels": {lab: int(extra.get(f"label:{lab}", 0)) for lab in LABELS},
        "kept": st["out"],
        "kept_by_split": {s: int(extra.get(f"split:{s}", 0)) for s in ("sft", "rl")},
        "dropped_by_reason": {r: int(rejected_.get(r, 0)) for r in DROP_REASONS},
        "failed_by_reason": {r: n for r, n in rejected_.items() if r not in DROP_REASONS},
    }
    section["balanced"] = (st["in"] == st["out"] + sum(rejected_.values())
                           and sum(hist) == section["scored"]
                           and section["scored"] == st["out"] + sum(section["dropped_by_reason"].values())
                           and sum(section["kept_by_split"].values()) == st["out"])
    if provenance:
        section["answerer"] = dict(provenance)
    if config_hash:
        section["config_hash"] = config_hash
    doc["passrate"] = section
    return doc


def add_filter_stage(p, videos_pcoll, qras_pcoll, out_dir: str, cfg: FilterConfig,
                     handler: AnswererHandler | None = None, label: str = "PassRate",
                     frames_dir: str | None = None, tables=None) -> dict:
    """Add the filter to pipeline ``p``: writes the ``pass_rate`` table under ``out_dir`` and returns
    ``dict(pass_rates=<all scored rows>, kept=<sft/rl rows>, rejects=<reject rows>, counts=<stats pairs>,
    provenance=<dict>)``. The caller writes the rejects into its rejects table, flattens ``counts`` into its
    stats pairs and applies ``finish_filter_stats(doc, cfg.k, provenance)`` in its stats ``finish``.
    ``frames_dir``: where the caption stage's pass stored this filter's uniform frames (see the module docstring)."""
    from longreel.pipelines.io.parquet_sink import write_table

    del p  # the PCollections carry the pipeline
    transform = PassRateFilter(cfg, handler, frames_dir)
    out = {"videos": videos_pcoll, "qras": qras_pcoll} | label >> transform
    write_table(out[MAIN], f"{label}WritePassRate", out_dir, "pass_rate", "pass_rate", cfg.parquet_shards, tables)
    counts = filter_counts(label, qras_pcoll, out)
    return {"pass_rates": out[MAIN], "kept": out[KEPT], "rejects": out[REJECTS], "counts": counts,
            "provenance": transform.provenance()}
