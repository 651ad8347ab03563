"""Configuration of the judge (``longreel judge``): an LLM checks each question against the timestamped captions it
was written from. Checks and reject reasons: :mod:`longreel.pipelines.gates.judge`."""
from __future__ import annotations

from longreel.pipelines.blind_config import BACKENDS
from longreel.pipelines.resources import ResourceHints
from longreel.schemas.config import ConfigError, ConfigModel, cfg


class JudgeConfig(ConfigModel):
    backend: str = cfg("transformers", "Judge engine: transformers, vllm or openai (an OpenAI-compatible server).",
                       choices=BACKENDS)
    model: str = cfg("smollm2", "The judging LLM (a local directory or GGUF file, 'smollm2', or the served model's "
                                "name); use the question writer's model to judge with the generator.")
    model_revision: str | None = cfg(None, "Revision to record; null records the local weights' revision.")
    base_url: str = cfg("", "openai: the server's base URL.")
    api_key_env: str = cfg("OPENAI_API_KEY", "openai: environment variable holding the API key.")
    guided_mode: str = cfg("response_format", "openai: how the JSON schema is sent.",
                           choices=("response_format", "guided_json"))
    request_timeout_s: float = cfg(120.0, "openai: seconds per request.")
    dtype: str = cfg("auto", "Weights dtype (auto: float32 for transformers).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    trust_remote_code: bool = cfg(False, "Allow the model directory's own Python code (opt-in).")
    max_model_len: int = cfg(8192, "vllm: max_model_len.")
    threads: int | None = cfg(None, "transformers: torch threads (null: torch's default).")
    batch_size: int = cfg(4, "Questions per engine call.")
    max_new_tokens: int = cfg(160, "Tokens of one verdict at most.")
    explanation_chars: int = cfg(200, "Longest explanation string of the verdict.")
    seed: int = cfg(0, "Seed (the verdict is greedy; the seed matters only to engines that sample anyway).")
    timestamp_tolerance_s: float = cfg(1.0, "A time the reasoning cites exists when it lies within this many "
                                            "seconds of a caption's span (caption stamps are whole seconds).")
    multi_clip_categories: list[str] = cfg(default_factory=lambda: ["temporal", "plot_narrative"],
                                           help="Categories whose questions must need more than one clip.")
    parquet_shards: int | None = cfg(None, "Parquet files for the judged questions table; null: one file per 256 MB of rows.")
    resources: ResourceHints = cfg(default_factory=ResourceHints, help="Beam resource hints on the judging step.")

    def check(self):
        if (self.batch_size < 1 or self.max_new_tokens < 1 or self.explanation_chars < 1
                or (self.parquet_shards or 1) < 1):
            raise ConfigError("judge.batch_size, max_new_tokens, explanation_chars and parquet_shards (or null) must "
                              "be >= 1")
        if self.timestamp_tolerance_s < 0:
            raise ConfigError("judge.timestamp_tolerance_s must be >= 0")
        if self.backend == "openai" and not self.base_url:
            raise ConfigError("judge.backend openai needs judge.base_url")


class CurateJudgeConfig(JudgeConfig):
    """The judge as a stage of ``longreel curate``: by default it judges with the question writer's own model."""

    backend: str | None = cfg(None, "Judge engine: transformers, vllm or openai; null: the question writer's "
                                    "(qra.backend, with its base_url, API key variable, guided mode, dtype and "
                                    "trust_remote_code, each unless the judge's config sets it), or transformers "
                                    "when the writer is the template (no LLM).",
                              choices=BACKENDS)
    model: str | None = cfg(None, "The judging LLM; null: the question writer's (qra.model, with its revision), "
                                  "or 'smollm2' when the writer is the template.")


def follow_generator(judge: JudgeConfig, qra) -> JudgeConfig:
    """The judge's config with null engine keys filled from the question writer's config ``qra`` (a
    :class:`~longreel.pipelines.qra_config.QRAConfig`): a plain :class:`JudgeConfig` whose hash names the model
    that judged. The template writer has no model; the judge then uses the :class:`JudgeConfig` defaults."""
    values = judge.model_dump()
    llm_writer = qra.backend != "template"
    if values["backend"] is None:
        values["backend"] = qra.backend if llm_writer else JudgeConfig.model_fields["backend"].default
        if llm_writer:  # the writer's engine comes with its settings, but for those the judge's config sets
            follow = {k: getattr(qra, k) for k in ("base_url", "api_key_env", "guided_mode", "trust_remote_code",
                                                   "dtype") if k not in judge.model_fields_set}
            values.update(follow, max_model_len=max(values["max_model_len"], qra.max_model_len))
    if values["model"] is None:
        values["model"] = qra.model if llm_writer else JudgeConfig.model_fields["model"].default
        if llm_writer:
            values["model_revision"] = values["model_revision"] or qra.model_revision or None
    out = JudgeConfig(**values)
    out.check()
    return out
