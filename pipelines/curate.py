"""The curation pipeline: ingest -> dedup -> segment -> caption -> qra -> filter -> pack, then the card.

Outputs under ``out_dir``: ``videos-*.parquet``, ``clips-*.parquet``, ``rejects-*.parquet``,
``stats.json`` (the funnel and the card's distributions), ``config.yaml`` (the resolved config), in
materialize mode ``clips/<video_id>/NNNNN.<ext>``, and per optional stage its tables (``captions``,
``clip_facts``, ``qras``, ``pass_rate``), the frame cache and shards (``frame_cache/``, ``shards/``) and
the data card (``card/``). Re-running into the same directory with the same inputs and config rewrites
identical files.
"""
from __future__ import annotations

import logging
import time

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from pipelines.config import CurateConfig
from pipelines.io.parquet_sink import WriteSortedParquet
from pipelines.provenance import code_version
from pipelines.runner import make_pipeline
from pipelines.stages.base import MAIN, REJECTS
from pipelines.stages.ingest import DedupVideos, ProbeVideos
from pipelines.stages.segment import SegmentVideos
from pipelines.stats import WriteStats, extra_count, stage_counts
from schemas.config import config_hash, dump_yaml

log = logging.getLogger("longreel")

BASE_STAGES = ["ingest", "dedup", "segment"]
BASE_UNITS = {"ingest": "video", "dedup": "video", "segment": "video"}
VIDEO_STAGES = ("ingest", "dedup", "segment")


def stage_layout(cfg: CurateConfig) -> tuple[list[str], dict[str, str]]:
    """The funnel's stage order and units for the stages this config runs."""
    order, units = list(BASE_STAGES), dict(BASE_UNITS)
    if "caption" in cfg.stages:
        from pipelines.stages.caption import CAPTION_STAGES, CAPTION_UNITS
        order += CAPTION_STAGES
        units.update(CAPTION_UNITS)
    if "qra" in cfg.stages:
        from pipelines.stages.qra import QRA_STAGES, QRA_UNITS
        order += QRA_STAGES
        units.update(QRA_UNITS)
    if "filter" in cfg.stages:
        from pipelines.stages.passrate import STAGE as FILTER_STAGE
        order.append(FILTER_STAGE)
        units[FILTER_STAGE] = "question"
    if "pack" in cfg.stages:
        from pipelines.pack.stage import STAGE_ORDER as PACK_STAGES, STAGE_UNITS as PACK_UNITS
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


def build_curate(p: beam.Pipeline, items: list[dict], out_dir: str, cfg: CurateConfig,
                 command: str | None = None, handlers: dict | None = None) -> dict:
    """Add the curation stages ``cfg`` asks for to ``p``; return the main PCollections by table name.

    ``handlers`` (tests, custom clients) may inject a caption ``ModelHandler`` (``"caption"``), a QRA backend
    factory (``"qra"``) or an answerer handler (``"filter"``).
    """
    handlers = handlers or {}
    shards = cfg.output.parquet_shards
    inputs = p | "Inputs" >> beam.Create(items)
    probed = inputs | "Ingest" >> ProbeVideos(cfg.ingest.probe_timeout_s)
    deduped = probed[MAIN] | "Dedup" >> DedupVideos()
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

    if "caption" in cfg.stages:
        from pipelines.stages.caption import add_caption_stage
        cap = add_caption_stage(p, videos, clips, out_dir, cfg.caption, handler=handlers.get("caption"))
        rejects.append(cap["rejects"])
        counts.append(cap["counts"])
        tables.update(captions=cap["captions"], clip_facts=cap["facts"])
    if "qra" in cfg.stages:
        from pipelines.stages.qra import add_qra_stage
        qra = add_qra_stage(p, tables["captions"], tables["clip_facts"], videos, out_dir, cfg.qra,
                            backend_factory=handlers.get("qra"))
        rejects.append(qra["rejects"])
        counts.append(qra["counts"])
        tables["qras"] = qra["qras"]
    passrates = None
    if "filter" in cfg.stages:
        from pipelines.stages.passrate import add_filter_stage, finish_filter_stats
        flt = add_filter_stage(p, videos, tables["qras"], out_dir, cfg.filter, handler=handlers.get("filter"))
        rejects.append(flt["rejects"])
        counts.append(flt["counts"])
        passrates = flt["pass_rates"]
        tables["pass_rate"] = passrates
        k, prov = cfg.filter.k, flt["provenance"]
        finishers.append(lambda d: finish_filter_stats(d, k, prov))
    if "pack" in cfg.stages:
        from pipelines.pack.stage import add_pack_stage
        pack = add_pack_stage(p, videos, tables["qras"], passrates, out_dir, cfg.pack, standalone=False,
                              filter_rejects=flt["rejects"] if passrates is not None else None)
        rejects.append(pack["rejects"])
        counts.append(pack["counts"])
        tables.update(pack_samples=pack["samples"], shards=pack["shards"])

    from pipelines.card.distributions import add_distributions
    counts.append(add_distributions({k: v for k, v in tables.items() if k != "clip_facts"}))

    all_rejects = tuple(rejects) | "AllRejects" >> beam.Flatten()
    videos | "WriteVideos" >> WriteSortedParquet(out_dir, "videos", "video", shards)
    clips | "WriteClips" >> WriteSortedParquet(out_dir, "clips", "clip", shards)
    all_rejects | "WriteRejects" >> WriteSortedParquet(out_dir, "rejects", "reject", shards)

    order, units = stage_layout(cfg)
    meta = {"config_hash": config_hash(cfg), "code_version": code_version(), "inputs": len(items)}
    if command:
        meta["command"] = command

    def finish(doc: dict) -> dict:
        doc = add_totals(doc)
        for f in finishers:
            doc = f(doc)
        return doc

    tuple(counts) | "AllCounts" >> beam.Flatten() | "WriteStats" >> WriteStats(
        FileSystems.join(out_dir, "stats.json"), order, units, meta, finish=finish)
    return {**tables, "rejects": all_rejects}


def run_curate(items: list[dict], out_dir: str, cfg: CurateConfig, beam_args: list[str] | None = None,
               command: str | None = None, handlers: dict | None = None) -> dict:
    """Run the pipeline to completion (and build the data card when ``card`` is a stage); return the stats."""
    import json

    if "://" not in out_dir:
        import os
        os.makedirs(out_dir, exist_ok=True)
    with FileSystems.create(FileSystems.join(out_dir, "config.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("curate: %d inputs -> %s (config %s)", len(items), out_dir, config_hash(cfg)[:12])
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    build_curate(p, items, out_dir, cfg, command=command, handlers=handlers)
    result = p.run()
    result.wait_until_finish()
    with FileSystems.open(FileSystems.join(out_dir, "stats.json")) as fh:
        stats = json.loads(fh.read())
    log.info("curate: pipeline done in %.1f s: %s", time.monotonic() - t0, stats.get("totals"))
    if "card" in cfg.stages:
        from pipelines.card.build import build_card
        card_dir = FileSystems.join(out_dir, "card")
        shards = None
        if "pack" in cfg.stages:
            shards = cfg.pack.shards_dir or FileSystems.join(out_dir, "shards")
        build_card(out_dir, card_dir, shards, command=command)
        log.info("curate: data card in %s", card_dir)
    return stats
