"""The curation pipeline: ingest -> dedup -> segment (later stages append themselves here).

Outputs under ``out_dir``: ``videos-*.parquet``, ``clips-*.parquet``, ``rejects-*.parquet``,
``stats.json`` (the funnel), ``config.yaml`` (the resolved config) and, in materialize mode,
``clips/<video_id>/NNNNN.<ext>``. Re-running into the same directory with the same inputs and
config rewrites identical files.
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

STAGE_ORDER = ["ingest", "dedup", "segment"]
STAGE_UNITS = {"ingest": "video", "dedup": "video", "segment": "video"}
VIDEO_STAGES = ("ingest", "dedup", "segment")


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


def build_curate(p: beam.Pipeline, items: list[dict], out_dir: str, cfg: CurateConfig) -> dict:
    """Add the curation stages to ``p``; return the main PCollections by table name."""
    shards = cfg.output.parquet_shards
    inputs = p | "Inputs" >> beam.Create(items)
    probed = inputs | "Ingest" >> ProbeVideos(cfg.ingest.probe_timeout_s)
    deduped = probed[MAIN] | "Dedup" >> DedupVideos()
    clips_dir = FileSystems.join(out_dir, "clips") if cfg.segment.mode == "materialize" else None
    segmented = deduped[MAIN] | "Segment" >> SegmentVideos(cfg.segment, clips_dir)

    rejects = (probed[REJECTS], deduped[REJECTS], segmented[REJECTS]) | "AllRejects" >> beam.Flatten()
    deduped[MAIN] | "WriteVideos" >> WriteSortedParquet(out_dir, "videos", "video", shards)
    segmented[MAIN] | "WriteClips" >> WriteSortedParquet(out_dir, "clips", "clip", shards)
    rejects | "WriteRejects" >> WriteSortedParquet(out_dir, "rejects", "reject", shards)

    counts = (
        stage_counts("Ingest", "ingest", inputs, probed[MAIN], probed[REJECTS]),
        stage_counts("Dedup", "dedup", probed[MAIN], deduped[MAIN], deduped[REJECTS]),
        stage_counts("Segment", "segment", deduped[MAIN], segmented[MAIN], segmented[REJECTS],
                     out_units=lambda c: c["video_id"]),
        extra_count("Clips", "segment", "clips", segmented[MAIN]),
    ) | "AllCounts" >> beam.Flatten()
    meta = {"config_hash": config_hash(cfg), "code_version": code_version(), "inputs": len(items)}
    counts | "WriteStats" >> WriteStats(FileSystems.join(out_dir, "stats.json"), STAGE_ORDER, STAGE_UNITS, meta,
                                        finish=add_totals)
    return {"videos": deduped[MAIN], "clips": segmented[MAIN], "rejects": rejects}


def run_curate(items: list[dict], out_dir: str, cfg: CurateConfig, beam_args: list[str] | None = None) -> dict:
    """Run the pipeline to completion; return the stats document."""
    import json

    if "://" not in out_dir:
        import os
        os.makedirs(out_dir, exist_ok=True)
    with FileSystems.create(FileSystems.join(out_dir, "config.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("curate: %d inputs -> %s (config %s)", len(items), out_dir, config_hash(cfg)[:12])
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    build_curate(p, items, out_dir, cfg)
    result = p.run()
    result.wait_until_finish()
    with FileSystems.open(FileSystems.join(out_dir, "stats.json")) as fh:
        stats = json.loads(fh.read())
    log.info("curate: done in %.1f s: %s", time.monotonic() - t0, stats.get("totals"))
    return stats
