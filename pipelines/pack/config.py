"""Configuration of ``longreel pack`` (YAML + validation, see :mod:`longreel.schemas.config`)."""
from __future__ import annotations

import re

from longreel.schemas.config import ConfigError, ConfigModel, cfg

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


class PackConfig(ConfigModel):
    dataset: str = cfg("longreel", "Dataset name: shards are {dataset}-{split}-{index:06d}.tar. Letters, digits and "
                                   "underscores only (no dots or dashes, so names parse back unambiguously).")
    fps: float = cfg(2.0, "Frames per second sampled from each video (the processor's sample_frames rule).")
    max_frames: int = cfg(64, "At most this many frames per video (rounded down to the temporal patch size).")
    min_frames: int = cfg(4, "At least this many frames per video, when the video has them.")
    processor: str | None = cfg(None, "Local directory of the target processor or checkpoint (AutoVideoProcessor). "
                                      "null: Qwen2-VL's video processor defaults.")
    max_pixels: int | None = cfg(448 * 448, "Per-frame pixel budget (the processor's size.longest_edge); null keeps "
                                            "the processor's own.")
    min_pixels: int | None = cfg(None, "Per-frame minimum pixels (size.shortest_edge); null keeps the processor's, "
                                       "dropped to one 28x28 cell when max_pixels is below it (a budget is never "
                                       "exceeded).")
    cache_dir: str | None = cfg(None, "Frame cache directory (shareable between runs and datasets); null: "
                                      "<out>/frame_cache.")
    cache_verify: str = cfg("sha256", "How an existing cache entry is checked before reuse: size only, or size and "
                                      "sha256.", choices=("size", "sha256"))
    shards_dir: str | None = cfg(None, "Where shards and index files go; null: <out>/shards.")
    target_shard_bytes: int = cfg(500 * 1000 * 1000, "Target shard size in bytes; the shard count of a split is "
                                                     "ceil(total bytes / this), samples go to shards by key hash.")
    default_split: str = cfg("train", "Split for every QRA when there is no pass_rate table.")
    videos_table: str = cfg("videos", "Input table of video records (under the output directory).")
    qra_table: str = cfg("qras", "Input table of QRA records.")
    pass_rate_table: str = cfg("pass_rate", "Input table of pass-rate records; used when present.")
    decode_timeout_s: float = cfg(600.0, "Seconds decoding one video may take before its worker is killed.")

    def check(self):
        if not _NAME.match(self.dataset):
            raise ConfigError(f"dataset {self.dataset!r}: use letters, digits and underscores only")
        if not _NAME.match(self.default_split):
            raise ConfigError(f"default_split {self.default_split!r}: use letters, digits and underscores only")
        if self.fps <= 0:
            raise ConfigError("fps must be > 0")
        if self.max_frames < 2 or self.min_frames < 1 or self.min_frames > self.max_frames:
            raise ConfigError("need 1 <= min_frames <= max_frames and max_frames >= 2")
        if self.max_pixels is not None and self.max_pixels < 28 * 28:
            raise ConfigError("max_pixels must be >= 784")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError("min_pixels must be <= max_pixels")
        if self.target_shard_bytes < 1:
            raise ConfigError("target_shard_bytes must be >= 1")
        if self.decode_timeout_s <= 0:
            raise ConfigError("decode_timeout_s must be > 0")
