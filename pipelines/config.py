"""Configuration of the curation pipeline (YAML + validation, see :mod:`longreel.schemas.config`)."""
from __future__ import annotations

from longreel.pipelines.blind_config import BlindConfig
from longreel.pipelines.caption_config import CaptionConfig
from longreel.pipelines.embed_config import EmbedConfig
from longreel.pipelines.filter_config import FilterConfig
from longreel.pipelines.judge_config import CurateJudgeConfig
from longreel.pipelines.pack.config import PackConfig
from longreel.pipelines.qra_config import QRAConfig
from longreel.schemas.config import ConfigError, ConfigModel, cfg


class IngestConfig(ConfigModel):
    probe_timeout_s: float = cfg(120.0, "Seconds a probe of one file may take before its worker is killed and the "
                                        "file rejected with reason 'timeout'.")

    def check(self):
        if self.probe_timeout_s <= 0:
            raise ConfigError("ingest.probe_timeout_s must be > 0")


class DedupConfig(ConfigModel):
    near_duplicates: bool = cfg(True, "Besides identical bytes, reject videos whose perceptual signature (dHashes of "
                                      "small grayscale frames at fixed relative times, decoded during the probe) "
                                      "matches another's: the same footage re-encoded or resized. The kept one of a "
                                      "group has the most pixels, then the longest duration, bytes, smallest sha256.")
    signature_frames: int = cfg(8, "Frames of a signature (one seek and decode each, at (i + 0.5) / n of the video).")
    max_mean_bits: float = cfg(6.0, "Two signatures are near-identical when their mean Hamming distance over the "
                                    "frames (64-bit dHashes) is at most this many bits.")

    def check(self):
        if self.signature_frames < 1:
            raise ConfigError("dedup.signature_frames must be >= 1")
        if not 0 <= self.max_mean_bits < 32:
            raise ConfigError("dedup.max_mean_bits must be in [0, 32)")


class SegmentConfig(ConfigModel):
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

    def check(self):
        if self.clip_s <= 0:
            raise ConfigError("segment.clip_s must be > 0")
        if self.stride_s is not None and not (0 < self.stride_s):
            raise ConfigError("segment.stride_s must be > 0")
        if self.min_tail_s < 0 or self.min_video_s < 0:
            raise ConfigError("segment.min_tail_s and min_video_s must be >= 0")


class OutputConfig(ConfigModel):
    parquet_shards: int | None = cfg(None, "Parquet files per table of ingest/segment (videos, clips, rejects; "
                                           "rows assigned by key hash); null: follows the table's size, one file "
                                           "per 256 MB of rows.")

    def check(self):
        if self.parquet_shards is not None and self.parquet_shards < 1:
            raise ConfigError("output.parquet_shards must be >= 1 (or null: follows the table's size)")


OPTIONAL_STAGES = ("caption", "align", "clip_dedup", "qra", "question_dedup", "judge", "blind", "filter", "pack",
                   "card")
# A stage needs the ones it reads from.
STAGE_NEEDS = {"caption": (), "align": ("caption",), "clip_dedup": ("caption",), "qra": ("caption",),
               "question_dedup": ("qra",), "judge": ("qra",), "blind": ("qra",), "filter": ("qra",), "pack": ("qra",),
               "card": ()}


def _default_stages() -> list[str]:
    return ["caption", "qra", "pack", "card"]


class CurateConfig(ConfigModel):
    ingest: IngestConfig = cfg(default_factory=IngestConfig, help="Ingest + probe.")
    segment: SegmentConfig = cfg(default_factory=SegmentConfig, help="Cutting videos into clips.")
    output: OutputConfig = cfg(default_factory=OutputConfig, help="Output tables.")
    dedup: DedupConfig = cfg(default_factory=DedupConfig, help="Exact and near-duplicate videos.")
    stages: list[str] = cfg(default_factory=_default_stages,
                            help="Stages after ingest/dedup/segment, in order: caption, align and clip_dedup "
                                 "(CLIP caption-frame score and near-duplicate clips, off by default: they need "
                                 "embed.clip.checkpoint), qra, question_dedup (near-identical questions per video, "
                                 "off by default), judge (an LLM checks each question against its captions, off by "
                                 "default: SmolLM2 takes ~10 s a question on a CPU), blind (text-only "
                                 "answerability filter, off by default: SmolLM2 takes ~6 s a question on a CPU), "
                                 "filter (needs an answerer model: filter.model), pack (frame cache + WebDataset shards), card "
                                 "(data card in <out>/card). [] stops after segment.")
    caption: CaptionConfig = cfg(default_factory=CaptionConfig, help="Clip captioning.")
    qra: QRAConfig = cfg(default_factory=QRAConfig, help="Question-reasoning-answer generation.")
    embed: EmbedConfig = cfg(default_factory=EmbedConfig, help="The embedding gates: align, clip_dedup, "
                                                                "question_dedup.")
    judge: CurateJudgeConfig = cfg(default_factory=CurateJudgeConfig,
                                   help="Judge (its model defaults to the question writer's).")
    blind: BlindConfig = cfg(default_factory=BlindConfig, help="Blind (text-only) answerability filter.")
    filter: FilterConfig = cfg(default_factory=FilterConfig, help="Pass-rate filter.")
    pack: PackConfig = cfg(default_factory=PackConfig, help="Frame cache and shards.")

    def check(self):
        unknown = [s for s in self.stages if s not in OPTIONAL_STAGES]
        if unknown:
            raise ConfigError(f"stages: unknown {unknown}; choose from {list(OPTIONAL_STAGES)}")
        if len(set(self.stages)) != len(self.stages):
            raise ConfigError("stages: a stage is listed twice")
        for s in self.stages:
            missing = [n for n in STAGE_NEEDS[s] if n not in self.stages]
            if missing:
                raise ConfigError(f"stages: {s} needs {missing}")
        if "align" in self.stages or "clip_dedup" in self.stages:
            self.embed.check_clip_model()
        if "filter" in self.stages and self.filter.backend in ("transformers", "vllm") and not self.filter.model:
            raise ConfigError("stages: filter needs an answering model: set filter.model to a local directory")
