"""The curation pipeline: ingest -> dedup -> segment -> caption -> qra -> judge -> blind -> filter -> pack, then the
card.

Outputs under ``out_dir``: ``videos-*.parquet``, ``clips-*.parquet``, ``rejects-*.parquet``,
``stats.json`` (the funnel and the card's distributions), ``config.yaml`` (the resolved config), in
materialize mode ``clips/<video_id>/NNNNN.<ext>``, and per optional stage its tables (``captions``,
``clip_facts``, ``qras``, ``pass_rate``), the frame cache and shards (``frame_cache/``, ``shards/``) and
the data card (``card/``), and last ``_SUCCESS.json`` (the completion marker: config, stages, every file with
its size and sha256). Re-running into the same directory with the same inputs and config rewrites identical
files; the rules for a directory that holds another run are in :mod:`longreel.pipelines.io.run_dir`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shlex
import sys
import threading
import time

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines import heap
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.io.inputs import InputError, InputPlan, ReadInputs, input_error_of
from longreel.pipelines.io.parquet_sink import TableSink, write_table
from longreel.pipelines.provenance import code_version
from longreel.pipelines.runner import make_pipeline, names_runner
from longreel.pipelines.stages.base import MAIN, REJECTS
from longreel.pipelines.stages.ingest import DedupVideos, ProbeVideos
from longreel.pipelines.stages.segment import SegmentVideos
from longreel.pipelines.stats import WriteStats, extra_count, stage_counts
from longreel.schemas.config import config_hash, dump_yaml

log = logging.getLogger("longreel")

BASE_STAGES = ["ingest", "dedup", "segment"]
BASE_UNITS = {"ingest": "video", "dedup": "video", "segment": "video"}
VIDEO_STAGES = ("ingest", "dedup", "segment")


def stage_layout(stages: list[str]) -> tuple[list[str], dict[str, str]]:
    """The funnel's stage order and units for ``stages`` (a config's ``stages``)."""
    order, units = list(BASE_STAGES), dict(BASE_UNITS)
    if "caption" in stages:
        from longreel.pipelines.stages.caption import CAPTION_STAGES, CAPTION_UNITS
        order += CAPTION_STAGES
        units.update(CAPTION_UNITS)
    for s in ("align", "clip_dedup"):
        if s in stages:
            order.append(s)
            units[s] = "clip"
    if "qra" in stages:
        from longreel.pipelines.stages.qra import QRA_STAGES, QRA_UNITS
        order += QRA_STAGES
        units.update(QRA_UNITS)
    if "question_dedup" in stages:
        order.append("question_dedup")
        units["question_dedup"] = "question"
    if "judge" in stages:
        order.append("judge")
        units["judge"] = "question"
    if "blind" in stages:
        order.append("blind")
        units["blind"] = "question"
    if "filter" in stages:
        from longreel.pipelines.stages.passrate import STAGE as FILTER_STAGE
        order.append(FILTER_STAGE)
        units[FILTER_STAGE] = "question"
    if "pack" in stages:
        from longreel.pipelines.stages.pack import STAGE_ORDER as PACK_STAGES, STAGE_UNITS as PACK_UNITS
        order += PACK_STAGES
        units.update(PACK_UNITS)
    return order, units


def add_totals(doc: dict) -> dict:
    """Top-level video totals: every input video is either ok (has clips) or rejected at one stage."""
    by = {s["stage"]: s for s in doc["stages"]}
    videos_in = by["ingest"]["in"]
    videos_ok = by["segment"]["out"]
    rejected = sum(by[s]["rejected_total"] for s in VIDEO_STAGES if s in by)
    doc["totals"] = {"videos_in": videos_in, "videos_ok": videos_ok, "videos_rejected": rejected,
                     "clips": by["segment"]["extra"].get("clips", 0),
                     "balanced": videos_in == videos_ok + rejected}
    return doc


def videos_with_clips(videos, clips):
    """The videos segment kept (it rejects a video it cuts no clip from). Stages counted per video take these: given
    every video, qra_context rejected a video segment had rejected (too_short) a second time, as "no captions", so
    its funnel did not follow segment's and the rejects table listed the video twice."""
    keyed = videos | "KeyVideosForClips" >> beam.Map(lambda v: (v["video_id"], v))
    cut = clips | "ClipVideoIds" >> beam.Map(lambda c: (c["video_id"], 1)) | "ClipsPerVideo" >> beam.CombinePerKey(sum)
    return ({"video": keyed, "clips": cut} | "JoinVideoClips" >> beam.CoGroupByKey()
            | "VideosWithClips" >> beam.FlatMap(lambda kv: list(kv[1]["video"]) if list(kv[1]["clips"]) else []))


def spread(pcoll, label: str):
    """A fusion break before work that costs more per element than what produced it (one video fans out into
    clips, one clip into model calls): without it the runner fuses the expensive step into the cheap one and
    runs it where the cheap one's few elements happened to be. Elements and their order-free meaning are
    unchanged, so the funnel and the (sorted) outputs are too."""
    return pcoll | f"Spread{label}" >> beam.Reshuffle()


def _with_shards(section, shards: int):
    return section if section.parquet_shards is not None else section.model_copy(update={"parquet_shards": shards})


def read_inputs(p: beam.Pipeline, inputs: InputPlan | list[dict]):
    """Items from an :class:`InputPlan` (found on the workers) or from a list the caller already has."""
    if isinstance(inputs, InputPlan):
        return p | "Inputs" >> ReadInputs(inputs)
    return p | "Inputs" >> beam.Create(inputs)


def build_curate(p: beam.Pipeline, items: InputPlan | list[dict], out_dir: str, cfg: CurateConfig,
                 command: str | None = None, handlers: dict | None = None, split_long_videos: bool = True,
                 local_workers: int = 0) -> dict:
    """Add the curation stages ``cfg`` asks for to ``p``; return the main PCollections by table name.

    ``items``: an :class:`~longreel.pipelines.io.inputs.InputPlan` (``longreel curate``: the inputs are listed on
    the workers) or a list of items ``{"uri", "license", "attribution"}``.
    ``handlers`` (tests, custom clients) may inject a caption ``ModelHandler`` (``"caption"``), a QRA backend
    factory (``"qra"``), a judge or blind-filter engine factory (``"judge"``, ``"blind"``) or an answerer handler
    (``"filter"``).
    ``local_workers``: the worker count when the run is on the local runner with several workers (expensive work
    is then dealt out to them by cost: :mod:`longreel.pipelines.cost_shares`); 0 otherwise.
    """
    handlers = handlers or {}
    shards = cfg.output.parquet_shards
    chash = config_hash(cfg)  # of the config as given
    if shards is not None:  # the stages' own tables follow output.parquet_shards unless their section sets one
        cfg = cfg.model_copy(update={s: _with_shards(getattr(cfg, s), shards)
                                     for s in ("caption", "qra", "blind", "filter")})
    # every table of the run goes through one writer (see WriteTables: a transform's cost is per transform)
    sink = TableSink()
    inputs = read_inputs(p, items)
    dd = cfg.dedup
    probed = inputs | "Ingest" >> ProbeVideos(cfg.ingest.probe_timeout_s,
                                              dd.signature_frames if dd.near_duplicates else 0)
    deduped = probed[MAIN] | "Dedup" >> DedupVideos(dd.near_duplicates, dd.max_mean_bits)
    clips_dir = FileSystems.join(out_dir, "clips") if cfg.segment.mode == "materialize" else None
    segmented = deduped[MAIN] | "Segment" >> SegmentVideos(cfg.segment, clips_dir)
    videos, clips = deduped[MAIN], segmented[MAIN]

    rejects = [probed[REJECTS], deduped[REJECTS], segmented[REJECTS]]
    counts = [
        stage_counts("Ingest", "ingest", inputs, probed[MAIN], probed[REJECTS]),
        stage_counts("Dedup", "dedup", probed[MAIN], deduped[MAIN], deduped[REJECTS]),
        stage_counts("Segment", "segment", deduped[MAIN], segmented[MAIN], segmented[REJECTS],
                     out_units=lambda c: c["video_id"]),
        extra_count("Clips", "segment", "clips", segmented[MAIN]),
    ]
    tables = {"videos": videos, "clips": clips}
    finishers = []
    cached_videos = videos  # the videos as the stages reading the frame cache get them (see below)

    if "caption" in cfg.stages:
        from longreel.pipelines.stages.caption import add_caption_stage
        gates = None
        if "align" in cfg.stages or "clip_dedup" in cfg.stages:  # on the frames the caption stage decoded
            from longreel.pipelines.stages.clip_gates import ClipGates, finish_clip_gate_stats
            clip_gates = ClipGates(cfg.embed, cfg.stages)
            finishers.append(lambda d, prov=clip_gates.provenance(): finish_clip_gate_stats(d, cfg.embed, prov))

            def gates(captions, frames, t=clip_gates):
                g = {"captions": captions, "frames": frames} | "ClipGates" >> t
                return {"captions": g[MAIN], "rejects": g[REJECTS], "counts": g["counts"]}
        # a run that packs builds the frame cache in the caption's decode pass: one decode per video
        cap = add_caption_stage(p, videos, spread(clips, "Clips"), out_dir, cfg.caption,
                                handler=handlers.get("caption"), pack_cfg=cfg.pack if "pack" in cfg.stages else None,
                                filter_cfg=cfg.filter if "filter" in cfg.stages else None, gates=gates,
                                split_long_videos=split_long_videos, tables=sink, local_workers=local_workers,
                                after_decode=functools.partial(warm_tail, cfg) if local_workers > 1 else None)
        rejects.append(cap["rejects"])
        counts.append(cap["counts"])
        tables.update(captions=cap["captions"], clip_facts=cap["facts"])
        if cap["cache_ready"] is not None:  # long videos' entries are put together after the decode: wait for them
            cached_videos = videos | "AfterFrameCache" >> beam.transforms.util.WaitOn(cap["cache_ready"])
    if "qra" in cfg.stages:
        from longreel.pipelines.stages.qra import add_qra_stage
        qra = add_qra_stage(p, spread(tables["captions"], "Captions"), tables["clip_facts"],
                            videos_with_clips(videos, clips), out_dir, cfg.qra, backend_factory=handlers.get("qra"),
                            tables=sink)
        rejects.append(qra["rejects"])
        counts.append(qra["counts"])
        tables["qras"] = qra["qras"]
    if "question_dedup" in cfg.stages:  # cheap: before the blind filter and the pass-rate filter pay per question
        from longreel.pipelines.stages.question_dedup import add_question_dedup_stage, finish_question_dedup_stats
        qd = add_question_dedup_stage(tables["qras"], cfg.embed)
        rejects.append(qd["rejects"])
        counts.append(qd["counts"])
        tables["qras"] = qd["qras"]
        finishers.append(lambda d, prov=qd["provenance"]: finish_question_dedup_stats(d, cfg.embed, prov))
    if "judge" in cfg.stages:  # before the blind filter: one greedy verdict costs less than k blind samples
        from longreel.pipelines.judge_config import follow_generator
        from longreel.pipelines.stages.judge import add_judge_stage, finish_judge_stats
        jd = add_judge_stage(tables["qras"], tables["captions"], out_dir, follow_generator(cfg.judge, cfg.qra),
                             engine_factory=handlers.get("judge"), tables=sink)
        rejects.append(jd["rejects"])
        counts.append(jd["counts"])
        tables["qras"] = jd["qras"]
        finishers.append(lambda d, prov=jd["provenance"]: finish_judge_stats(d, prov))
    if "blind" in cfg.stages:  # before the pass-rate filter: the VLM never sees a text-answerable question
        from longreel.pipelines.stages.blind import add_blind_stage, finish_blind_stats
        bl = add_blind_stage(tables["qras"], out_dir, cfg.blind, engine_factory=handlers.get("blind"), tables=sink)
        rejects.append(bl["rejects"])
        counts.append(bl["counts"])
        tables["qras"] = bl["qras"]
        finishers.append(lambda d, k=cfg.blind.k, prov=bl["provenance"]: finish_blind_stats(d, k, prov))
    passrates = None
    if "filter" in cfg.stages:
        from longreel.pipelines.stages.passrate import add_filter_stage, finish_filter_stats
        from longreel.pipelines.stages.caption import filter_frames_dir, shares_filter_pass
        shared = shares_filter_pass(cfg.caption, cfg.filter)  # its uniform frames come from the caption's pass
        flt = add_filter_stage(p, cached_videos, spread(tables["qras"], "QRAs"), out_dir, cfg.filter,
                               handler=handlers.get("filter"),
                               frames_dir=filter_frames_dir(out_dir, cfg.pack if "pack" in cfg.stages else None)
                               if shared else None, tables=sink)
        rejects.append(flt["rejects"])
        counts.append(flt["counts"])
        passrates = flt["pass_rates"]
        tables["pass_rate"] = passrates
        k, prov = cfg.filter.k, flt["provenance"]
        finishers.append(lambda d: finish_filter_stats(d, k, prov))
    extras = {}
    if "pack" in cfg.stages:
        from longreel.pipelines.stages.pack import add_pack_stage
        pack = add_pack_stage(p, cached_videos, tables["qras"], passrates, out_dir, cfg.pack, standalone=False,
                              filter_rejects=flt["rejects"] if passrates is not None else None)
        rejects.append(pack["rejects"])
        counts.append(pack["counts"])
        tables.update(pack_samples=pack["samples"], shards=pack["shards"])
        extras["pack"] = pack["summary"]  # as `longreel pack` alone writes it (docs/SHARDS.md)

    from longreel.pipelines.distributions import add_distributions
    counts.append(add_distributions({k: v for k, v in tables.items() if k != "clip_facts"}))

    all_rejects = tuple(rejects) | "AllRejects" >> beam.Flatten()
    write_table(videos, "WriteVideos", out_dir, "videos", "video", shards, sink)
    write_table(clips, "WriteClips", out_dir, "clips", "clip", shards, sink)
    write_table(all_rejects, "WriteRejects", out_dir, "rejects", "reject", shards, sink)
    sink.write()

    order, units = stage_layout(cfg.stages)
    # "inputs" keeps its place in the document; its value is ingest's count, which is known only once the
    # workers have listed the inputs (every listed input, repeats included, enters ingest)
    meta = {"config_hash": chash, "code_version": code_version(), "inputs": None}
    if command:
        meta["command"] = command

    def finish(doc: dict) -> dict:
        doc = add_totals(doc)
        doc["inputs"] = doc["totals"]["videos_in"]
        for f in finishers:
            doc = f(doc)
        return doc

    tuple(counts) | "AllCounts" >> beam.Flatten() | "WriteStats" >> WriteStats(
        FileSystems.join(out_dir, "stats.json"), order, units, meta, finish=finish, extras=extras or None)
    return {**tables, "rejects": all_rejects}


def run_curate(items: InputPlan | list[dict], out_dir: str, cfg: CurateConfig, beam_args: list[str] | None = None,
               command: str | None = None, handlers: dict | None = None, if_exists: str = "overwrite",
               workers: int = 1, in_process: bool = True) -> dict:
    """Run the pipeline to completion (and build the data card when ``card`` is a stage); return the stats.

    ``workers``: processes of the local runner (when ``beam_args`` name no ``--runner``; see
    :func:`~longreel.pipelines.runner.make_pipeline`). The outputs do not depend on it. ``in_process=False``: one
    worker runs in a forked process too (as the CLI runs it), its imports overlapping the graph build.

    The output directory's contract (:mod:`longreel.pipelines.io.run_dir`): the run holds ``out_dir``'s lock throughout
    (another run there raises :class:`~longreel.pipelines.io.run_dir.RunDirBusy`), ``if_exists`` says what to do with a
    previous run's outputs (``error``: refuse unless it is this same run; ``resume``: continue this same run, finished
    or not; ``overwrite``: remove the previous run's files first), and ``_SUCCESS.json`` is written last. The CLI's
    default is ``error``; a caller of this function names its directory, so the default here is ``overwrite``.
    """
    from longreel.pipelines.io.run_dir import (FileDigests, RunIdentity, RunLock, digest_inputs, prepare,
                                               remove_stage_configs, write_inputs, write_marker)
    from longreel.schemas.config import to_dict

    if isinstance(items, InputPlan):  # the inputs are listed by the job: their count is known after it
        digest, count = items.digest(), None
    else:
        digest, count = digest_inputs(items), len(items)
    ident = RunIdentity(config=to_dict(cfg), config_hash=config_hash(cfg), stages=list(cfg.stages),
                        inputs_digest=digest, n_inputs=count)
    with _undo_on_input_error(out_dir), RunLock(out_dir, command), FileDigests(out_dir) as digests:
        action, old = prepare(out_dir, ident, if_exists)
        write_inputs(out_dir, ident)
        remove_stage_configs(out_dir, cfg.stages)
        with _undo_on_input_error(out_dir, fresh=action == "fresh"):
            stats = _run_locked(items, out_dir, cfg, beam_args, command, handlers, workers, in_process, digests)
        ident.n_inputs = stats["inputs"]
        steps = [{"step": "curate", "config_hash": ident.config_hash}]
        if action == "resume" and old:  # steps run alone since (e.g. a caption pass) whose outputs are still there
            steps += [s for s in old.get("steps") or [] if s.get("step") not in {"curate", *cfg.stages}]
        write_marker(out_dir, ident, steps, digests)
    return stats


@contextlib.contextmanager
def _undo_on_input_error(out_dir: str, fresh: bool = False):
    """A malformed manifest is found by the worker that reads it, after the run began: leave nothing behind, as
    an input error found before the run does. ``fresh`` (around the run, in a directory that held no run): remove
    what the run wrote; a previous run's files stay (for --resume). Otherwise (around the lock): remove the
    directory if it did not exist before and is empty again."""
    created = not fresh and "://" not in out_dir and not os.path.exists(out_dir)
    try:
        yield
    except InputError:
        if fresh:
            from longreel.pipelines.io.run_dir import remove_outputs
            remove_outputs(out_dir, None)
        elif created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        raise


#: flags about the output directory, not the data: the outputs of a resumed or overwriting run are those of the
#: plain command, so the command recorded in stats.json and the card leaves them out (the lock shows them)
DIRECTORY_FLAGS = ("--resume", "--overwrite")
#: options (with a value) about how the run executes, not what it computes: left out the same way
EXECUTION_OPTIONS = ("--workers",)


def reproduction_command(command: str | None) -> str | None:
    """``command`` without :data:`DIRECTORY_FLAGS` and :data:`EXECUTION_OPTIONS` (with their values)."""
    if not command:
        return command
    kept, parts = [], iter(shlex.split(command))
    for part in parts:
        if part in EXECUTION_OPTIONS:
            next(parts, None)
        elif part not in DIRECTORY_FLAGS and not part.startswith(tuple(o + "=" for o in EXECUTION_OPTIONS)):
            kept.append(part)
    return shlex.join(kept)


def worker_modules(cfg: CurateConfig) -> tuple[str, ...]:
    """What the workers of a run with ``cfg``'s stages import: local workers import it once, ahead, while the
    launcher builds the graph (:mod:`longreel.pipelines.forked_workers`)."""
    mods = ["longreel.pipelines.io.inputs", "longreel.pipelines.io.parquet_sink", "longreel.pipelines.stats",
            "longreel.pipelines.stages.ingest", "longreel.pipelines.stages.segment", "longreel.pipelines.media.worker"]
    mods += [f"longreel.pipelines.stages.{s}" for s in ("caption", "qra", "blind", "pack") if s in cfg.stages]
    if "filter" in cfg.stages:
        mods.append("longreel.pipelines.stages.passrate")
    if "pack" in cfg.stages:  # the frame cache's sampling and resize (in the caption's decode pass too): torch, and
        # the transformers processor only when a processor directory replaces the default (pack.frame_cache)
        mods += ["longreel.pipelines.pack.frame_cache", "longreel.pipelines.media.qwen_vl_frames", "torch"]
        if cfg.pack.processor:
            mods.append("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    return tuple(mods)


def worker_warm_modules(cfg: CurateConfig) -> tuple[str, ...]:
    """What the last stages of a run import (seconds on the path of its serial end), for :func:`_warm_imports`."""
    mods = []  # not transformers for the QRA stage's prompt-token counter: it counts without (chat_count)
    if "filter" in cfg.stages:
        mods.append("rouge_score.rouge_scorer")  # open-ended answers' reward (longreel.task.rewards)
    return tuple(mods)


def warm_tail(cfg: CurateConfig) -> None:
    """What the last stages of a run with ``cfg`` load in their setup and is slow and model-free (the imports of
    :func:`worker_warm_modules`, the QRA counter's tokenizer), loaded in this process. A local run calls it in
    each worker when that worker's share of the decoding is done (the caption stage's ``after_decode``): it runs
    while the worker waits for the others' shares instead of in the stages' setup at the serial end of the run
    (measured, 2 workers, demo config, alternating pairs: 14 videos 14.41 -> 14.21 s median over 6 pairs; 56 videos
    38.60 -> 38.76 s over 4, within noise). Importing at the start instead was slower (see
    :func:`_warm_imports`, which a one-worker run still uses: it has no other workers to wait for).

    transformers is left to :func:`~longreel.pipelines.stages.qra.warm_up`, which imports it under the tokenizer
    loader's lock: its lazy top-level module is not safe to import from two threads at once (a ``from transformers
    import PreTrainedTokenizerFast`` in the QRA stage's setup, while this thread imported a transformers module,
    raised ImportError, and the stage fell back to counting bytes)."""
    _import_quietly([m for m in worker_warm_modules(cfg) if m.split(".")[0] != "transformers"])
    if "qra" in cfg.stages:
        from longreel.pipelines.stages.qra import warm_up
        warm_up(cfg.qra)


def _import_quietly(modules) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start: the stage imports it again and reports
            log.debug("importing %s ahead failed", name, exc_info=True)


def _warm_imports(modules) -> threading.Thread | None:
    """Import ``modules`` in a daemon thread of a run whose one worker is this process: it spends most of the run
    waiting on its decode subprocesses, so the imports cost no wall time there instead of seconds on the serial
    end of the run. Not for forked workers (measured: on two cores each worker's copy of the imports competes with
    the other's decode and the first videos' probing, and the run got slower) nor in their zygote (its imports
    delay every worker's first bundle). A failure is left to the stage that needs the module, which reports it."""
    modules = [m for m in modules if m not in sys.modules]
    if not modules:
        return None

    t = threading.Thread(target=_import_quietly, args=(modules,), name="warm-imports", daemon=True)
    t.start()
    return t


def _card_imports_ahead(cfg: CurateConfig, workers: int, remote: bool, runner=None,
                        wait_s: float = 120.0) -> threading.Thread | None:
    """A thread importing the card's libraries while a local run's workers work (see
    :func:`longreel.pipelines.card.build.import_ahead`); None when the run makes no card, runs in this process
    (the thread would only take turns with it) or runs elsewhere.

    The imports wait until the runner asks for its first worker (``runner.workers_started``, at most ``wait_s``):
    before that, this process translates the graph on the path to the first bundle, and the imports (0.9 s, holding
    the GIL) made it 0.8 s later (14 sample videos, 2 workers, 3 runs each)."""
    if "card" not in cfg.stages or workers < 2 or remote:
        return None
    if hasattr(runner, "preload_launcher_modules"):  # local forked workers: their zygote must not import these too
        runner.preload_launcher_modules()
    started = getattr(runner, "workers_started", None)

    def run():
        if started is not None:
            started.wait(wait_s)
        try:
            from longreel.pipelines.card.build import import_ahead
            import_ahead()
        except Exception:  # noqa: BLE001 - only a head start: building the card imports them itself and reports
            log.debug("card: importing ahead failed", exc_info=True)

    t = threading.Thread(target=run, name="card-imports", daemon=True)
    t.start()
    return t


def _describe_inputs(items: InputPlan | list[dict]) -> str:
    if isinstance(items, InputPlan):
        return f"{len(items.specs)} input specs (listed by the workers)"
    dups = sum(1 for it in items if it.get("duplicate_of"))
    return f"{len(items)} inputs" + (f" ({dups} listed twice)" if dups else "")


def _run_locked(items: InputPlan | list[dict], out_dir: str, cfg: CurateConfig, beam_args, command, handlers,
                workers: int = 1, in_process: bool = True, digests=None) -> dict:
    command = reproduction_command(command)

    with FileSystems.create(FileSystems.join(out_dir, "config.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("curate: %s -> %s (config %s)", _describe_inputs(items), out_dir, config_hash(cfg)[:12])
    t0 = time.monotonic()
    p = make_pipeline(beam_args, workers=workers, preload=worker_modules(cfg), in_process=in_process)
    # one local worker: nothing to spread a long video over, so its decode stays one pass
    remote = names_runner(beam_args)
    build_curate(p, items, out_dir, cfg, command=command, handlers=handlers,
                 split_long_videos=workers > 1 or remote, local_workers=0 if remote else workers)
    card_imports = _card_imports_ahead(cfg, workers, remote, p.runner)
    if not remote and workers == 1 and not hasattr(p.runner, "preload_launcher_modules"):
        _warm_imports(worker_warm_modules(cfg))  # this process is the worker
    # the run's collections (this process's are the runner's and, with one worker, the stages') skip what start-up
    # made; the CLI turns collections off until here (longreel.pipelines.heap)
    with heap.frozen():
        return _run_and_card(p, out_dir, cfg, command, t0, card_imports, digests)


def _run_and_card(p, out_dir: str, cfg: CurateConfig, command: str, t0: float, card_imports, digests) -> dict:
    import json

    try:
        p.run().wait_until_finish()
    except Exception as e:
        # A malformed manifest is found by the worker that reads it: still the user's input error, not a crash.
        bad_input = input_error_of(e)
        if bad_input is not None:
            raise bad_input from None
        raise
    with FileSystems.open(FileSystems.join(out_dir, "stats.json")) as fh:
        stats = json.loads(fh.read())
    log.info("curate: pipeline done in %.1f s: %s", time.monotonic() - t0, stats.get("totals"))
    if digests is not None:
        digests.start()  # the marker's hashing of the pipeline's files overlaps the card
    if "card" in cfg.stages:
        if card_imports is not None:
            card_imports.join()
        from longreel.pipelines.card.build import build_card
        card_dir = FileSystems.join(out_dir, "card")
        shards = None
        if "pack" in cfg.stages:
            shards = cfg.pack.shards_dir or FileSystems.join(out_dir, "shards")
        build_card(out_dir, card_dir, shards, command=command)
        log.info("curate: data card in %s", card_dir)
    return stats
