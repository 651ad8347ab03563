"""The one place where every record that crosses a stage boundary is defined.

Each record kind is a pyarrow schema plus the few rules pyarrow cannot express
(required fields, allowed values). Stages pass rows as plain dicts; they are
checked with :func:`longreel.schemas.validate.validate_row` before they leave a stage
and written to Parquet with :func:`longreel.schemas.validate.to_table`.

Bump ``SCHEMA_VERSION`` when a field changes meaning or is removed; adding a
nullable field is backwards compatible and only bumps the minor number.

No record holds wall-clock time or anything else that differs between two runs of the same
config on the same inputs: wall-clock times go to ``stats.json["run"]`` (:mod:`longreel.pipelines.stats`).
2.0 removed ``caption.latency_s`` for that reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

SCHEMA_VERSION = "2.3"


@dataclass(frozen=True)
class RecordKind:
    name: str
    schema: pa.Schema
    key: str  # the field that identifies a row (sort key of the stage's Parquet output)
    required: tuple[str, ...] = ()
    allowed: dict[str, frozenset] = field(default_factory=dict)

    def arrow_schema(self) -> pa.Schema:
        return self.schema.with_metadata(
            {b"longreel.record": self.name.encode(), b"longreel.schema_version": SCHEMA_VERSION.encode()}
        )


def _f(name: str, typ: pa.DataType, nullable: bool = True) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


_str, _f64, _i64, _i32, _bool = pa.string(), pa.float64(), pa.int64(), pa.int32(), pa.bool_()

VIDEO = RecordKind(
    name="video",
    key="video_id",
    schema=pa.schema([
        _f("video_id", _str, False),       # first 16 hex digits of sha256: the stable id
        _f("sha256", _str, False),         # of the file's bytes
        _f("uri", _str, False),            # as given (path or URL)
        _f("bytes", _i64, False),
        _f("container", _str),
        _f("duration_s", _f64, False),
        _f("fps_avg", _f64),               # average frame rate (frames / duration as muxed)
        _f("fps_real", _f64),              # the stream's base ("real") frame rate
        _f("n_frames", _i64, False),       # counted by demuxing, not read from the header
        _f("n_frames_header", _i64),       # what the container claims (0/None when it does not say)
        _f("width", _i32, False),
        _f("height", _i32, False),
        _f("rotation", _i32),              # degrees, from the display matrix
        _f("decode_delay_s", _f64),        # how far B-frames push the first decode timestamp below zero
        _f("video_codec", _str, False),
        _f("pix_fmt", _str),
        _f("has_audio", _bool, False),
        _f("audio_codec", _str),
        _f("license", _str),
        _f("attribution", _str),
        _f("probe_version", _str, False),
    ]),
    required=("video_id", "sha256", "uri", "bytes", "duration_s", "n_frames", "width", "height",
              "video_codec", "has_audio", "probe_version"),
)

CLIP = RecordKind(
    name="clip",
    key="clip_id",
    schema=pa.schema([
        _f("clip_id", _str, False),
        _f("video_id", _str, False),
        _f("index", _i32, False),
        _f("start_s", _f64, False),        # planned range, snapped to frame boundaries
        _f("end_s", _f64, False),
        _f("start_frame", _i64, False),    # first frame in the clip
        _f("end_frame", _i64, False),      # one past the last frame
        _f("mode", _str, False),           # virtual | materialize
        _f("cut", _str, False),            # none | copy | exact
        _f("clip_uri", _str),              # materialized file, if any
        _f("actual_start_s", _f64),        # where a stream copy really cut (keyframe aligned)
        _f("actual_end_s", _f64),
        _f("segment_params", _str, False), # JSON of the segmenting parameters
    ]),
    required=("clip_id", "video_id", "index", "start_s", "end_s", "start_frame", "end_frame", "mode", "cut"),
    allowed={"mode": frozenset({"virtual", "materialize"}), "cut": frozenset({"none", "copy", "exact"})},
)

CLIP_FACTS = RecordKind(
    name="clip_facts",
    key="clip_id",
    schema=pa.schema([
        _f("clip_id", _str, False),
        _f("video_id", _str, False),
        _f("start_s", _f64, False),
        _f("end_s", _f64, False),
        _f("frame_timestamps", pa.list_(_f64), False),
        _f("motion", _f64, False),         # mean absolute difference of consecutive sampled frames, 0..255
        _f("black_ratio", _f64, False),    # share of sampled frames that are black or blank
        _f("brightness", _f64, False),     # mean luma 0..255
        _f("n_cuts", _i32, False),         # shot cuts between sampled frames
        _f("dominant_color", _str),        # the colour name covering most pixels of the sampled frames
        _f("facts_version", _str),         # version of the facts rules (pipelines.media.facts.FACTS_VERSION)
        _f("frame_indices", pa.list_(_i64)),  # source frame numbers of the sampled frames
        _f("frame_width", _i32),           # size the frames were decoded at (the backend's pixel budget)
        _f("frame_height", _i32),
    ]),
    required=("clip_id", "video_id", "start_s", "end_s", "frame_timestamps", "motion", "black_ratio",
              "brightness", "n_cuts"),
)

CAPTION = RecordKind(
    name="caption",
    key="clip_id",
    schema=pa.schema([
        _f("clip_id", _str, False),
        _f("video_id", _str, False),
        _f("start_s", _f64, False),
        _f("end_s", _f64, False),
        _f("text", _str, False),
        _f("backend", _str, False),        # facts | transformers | openai | vllm
        _f("model", _str, False),
        _f("model_revision", _str),        # revision or content hash of the weights
        _f("prompt_hash", _str, False),
        _f("sampling", _str, False),       # JSON
        _f("frame_timestamps", pa.list_(_f64), False),
        # 2.0: latency_s removed (wall-clock time: stats.json["run"]["caption"])
        _f("prompt_name", _str),           # template name in pipelines/prompts (prompt_hash is its sha256)
        _f("frame_width", _i32),           # size of the frames the model saw
        _f("frame_height", _i32),
        _f("finish_reason", _str),         # stop | length (as the backend reports)
        # 2.1: the compute bill of the model call (null: no model, e.g. the facts captioner)
        _f("input_tokens", _i64),          # prompt tokens, vision tokens included
        _f("vision_tokens", _i64),         # of which the video's (null: the engine cannot tell)
        _f("output_tokens", _i64),
        # 2.3: embedding gates (null: the gate did not run)
        _f("clip_score", _f64),            # mean cosine of the caption's CLIP text embedding and its frames'
        _f("near_duplicate_of", _str),     # clip_dedup action keep: the earlier kept clip this one duplicates
    ]),
    required=("clip_id", "video_id", "text", "backend", "model", "prompt_hash", "sampling", "frame_timestamps"),
)

CATEGORIES = ("temporal", "goal_purpose", "spatial", "plot_narrative")
PROBLEM_TYPES = ("multiple_choice", "open_ended", "numerical", "boolean", "temporal_grounding",
                 "spatial_grounding", "math")

QRA = RecordKind(
    name="qra",
    key="qra_id",
    schema=pa.schema([
        _f("qra_id", _str, False),
        _f("video_id", _str, False),
        _f("category", _str, False),
        _f("problem_type", _str, False),
        _f("question", _str, False),
        _f("options", pa.list_(_str)),     # A..D texts for multiple choice, else null
        _f("answer", _str, False),         # a letter for multiple choice, else the answer text
        _f("reasoning", _str, False),
        _f("target", _str, False),         # <think>reasoning</think><answer>answer</answer>
        _f("generator", _str, False),      # template | transformers | openai | vllm
        _f("model", _str, False),
        _f("model_revision", _str),
        _f("prompt_hash", _str, False),
        _f("sampling", _str, False),       # JSON
        _f("seed", _i64),
        _f("source_caption_ids", pa.list_(_str), False),
        _f("refined", _bool, False),
        _f("refine_prompt_hash", _str),    # prompt hash of the accepted refinement, if any
        _f("draft_reasoning", _str),       # the reasoning before an accepted refinement
        _f("context", _str),               # JSON: caption window (strategy, window, n_windows, span, prompt tokens)
        # 2.2: quality gates (null: the gate did not run)
        _f("option_permutation", pa.list_(_i32)),  # option i shown at position i came from position perm[i]
        _f("blind_k", _i32),               # text-only samples drawn (blind filter)
        _f("blind_pass_count", _i32),      # of which correct
        _f("judge_verdict", _str),         # JSON: the judge's verdict, model, revision and prompt hash
    ]),
    required=("qra_id", "video_id", "category", "problem_type", "question", "answer", "reasoning", "target",
              "generator", "model", "prompt_hash", "sampling", "source_caption_ids", "refined"),
    allowed={"category": frozenset(CATEGORIES), "problem_type": frozenset(PROBLEM_TYPES)},
)

PASS_RATE = RecordKind(
    name="pass_rate",
    key="qra_id",
    schema=pa.schema([
        _f("qra_id", _str, False),
        _f("video_id", _str, False),
        _f("k", _i32, False),
        _f("pass_count", _i32, False),
        _f("mean_reward", _f64, False),
        _f("rewards", pa.list_(_f64), False),
        _f("label", _str, False),          # easy | medium | hard
        _f("split", _str, False),          # sft | rl | drop
        _f("answerer", _str, False),
        _f("answerer_revision", _str),
        _f("temperature", _f64, False),
        _f("seed", _i64, False),
        # 1.3: provenance and per-sample detail of the pass-rate filter (nullable)
        _f("backend", _str),               # transformers | vllm (a test double records its own name)
        _f("top_p", _f64),
        _f("top_k", _i32),
        _f("max_new_tokens", _i32),
        _f("prompt_hash", _str),           # longreel.task.prompting.prompt_hash(): the trainer's prompt format
        _f("pass_threshold", _f64),        # null: a sample passes when accuracy == 1; else reward >= this
        _f("policy", _str),                # medium | band (which rule set split=drop)
        _f("frame_timestamps", pa.list_(_f64)),
        _f("completions", pa.list_(_str)), # the k samples, in order
        _f("sample_reasons", pa.list_(_str)),  # longreel.task.rewards reason code per sample
        # 2.1: the compute bill of the question's k samples (one model call)
        _f("input_tokens", _i64),          # prompt tokens, vision tokens included (prefilled once for the k)
        _f("vision_tokens", _i64),
        _f("output_tokens", _i64),         # all k samples
    ]),
    required=("qra_id", "video_id", "k", "pass_count", "mean_reward", "rewards", "label", "split", "answerer",
              "temperature", "seed"),
    allowed={"label": frozenset({"easy", "medium", "hard"}), "split": frozenset({"sft", "rl", "drop"})},
)

BLIND = RecordKind(
    name="blind",
    key="qra_id",
    schema=pa.schema([
        _f("qra_id", _str, False),
        _f("video_id", _str, False),
        _f("k", _i32, False),
        _f("pass_count", _i32, False),
        _f("text_answerable", _bool, False),  # pass_count / k >= max_pass_rate: rejected
        _f("max_pass_rate", _f64, False),
        _f("rewards", pa.list_(_f64), False),
        _f("completions", pa.list_(_str)),  # the k samples, rotation by rotation
        _f("sample_reasons", pa.list_(_str)),
        _f("rotate_options", _bool),
        _f("answerer", _str, False),
        _f("answerer_revision", _str),
        _f("backend", _str, False),
        _f("temperature", _f64, False),
        _f("seed", _i64, False),
        _f("prompt_hash", _str, False),
        _f("input_tokens", _i64),          # prompt tokens over the question's requests (one per rotation)
        _f("output_tokens", _i64),
    ]),
    required=("qra_id", "video_id", "k", "pass_count", "text_answerable", "max_pass_rate", "rewards", "answerer",
              "backend", "temperature", "seed", "prompt_hash"),
)

REJECT = RecordKind(
    name="reject",
    key="key",
    schema=pa.schema([
        _f("stage", _str, False),
        _f("key", _str, False),            # the input's key (uri, video id, clip id, qra id)
        _f("reason", _str, False),         # machine-readable code, snake_case
        _f("message", _str, False),        # for a person
        _f("video_id", _str),
        _f("details", _str),               # JSON, optional
    ]),
    required=("stage", "key", "reason", "message"),
)

KINDS: dict[str, RecordKind] = {k.name: k for k in (VIDEO, CLIP, CLIP_FACTS, CAPTION, QRA, PASS_RATE, BLIND,
                                                    REJECT)}


def reject(stage: str, key: str, reason: str, message: str, video_id: str | None = None,
           details: str | None = None) -> dict:
    """Build a reject row. ``reason`` is a stable code that funnel statistics group by."""
    return {"stage": stage, "key": key, "reason": reason, "message": message, "video_id": video_id,
            "details": details}
