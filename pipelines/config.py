"""Configuration of the curation pipeline (YAML + validation, see :mod:`schemas.config`)."""
from __future__ import annotations

from dataclasses import dataclass

from schemas.config import ConfigError, cfg


@dataclass
class IngestConfig:
    probe_timeout_s: float = cfg(120.0, "Seconds a probe of one file may take before its worker is killed and the "
                                        "file rejected with reason 'timeout'.")

    def validate(self):
        if self.probe_timeout_s <= 0:
            raise ConfigError("ingest.probe_timeout_s must be > 0")


@dataclass
class SegmentConfig:
    clip_s: float = cfg(10.0, "Clip length in seconds.")
    stride_s: float | None = cfg(None, "Seconds between clip starts; null means clip_s (no overlap).")
    tail_policy: str = cfg("merge", "What to do with a final clip shorter than min_tail_s: merge it into the "
                                    "previous clip, keep it, or drop it.", choices=("merge", "keep", "drop"))
    min_tail_s: float = cfg(5.0, "A tail shorter than this is merged or dropped (per tail_policy).")
    min_video_s: float = cfg(1.0, "Videos shorter than this are rejected with reason 'too_short'.")
    mode: str = cfg("virtual", "virtual: clips are time ranges; materialize: write one file per clip.",
                    choices=("virtual", "materialize"))
    cut: str = cfg("copy", "materialize only. copy: stream copy (keyframe-aligned, fast); exact: re-encode with "
                          "keyframes forced at the cut times.", choices=("copy", "exact"))
    materialize_timeout_s: float = cfg(1800.0, "Seconds ffmpeg may take to cut one video.")

    def validate(self):
        if self.clip_s <= 0:
            raise ConfigError("segment.clip_s must be > 0")
        if self.stride_s is not None and not (0 < self.stride_s):
            raise ConfigError("segment.stride_s must be > 0")
        if self.min_tail_s < 0 or self.min_video_s < 0:
            raise ConfigError("segment.min_tail_s and min_video_s must be >= 0")


@dataclass
class OutputConfig:
    parquet_shards: int = cfg(1, "Parquet files per stage table (rows assigned by key hash).")

    def validate(self):
        if self.parquet_shards < 1:
            raise ConfigError("output.parquet_shards must be >= 1")


@dataclass
class CurateConfig:
    ingest: IngestConfig = cfg(default_factory=IngestConfig, help="Ingest + probe.")
    segment: SegmentConfig = cfg(default_factory=SegmentConfig, help="Cutting videos into clips.")
    output: OutputConfig = cfg(default_factory=OutputConfig, help="Output tables.")
