"""Configuration of the pass-rate filter (``longreel filter`` and the filter stage of ``longreel curate``).

Rules, stated once (the stage's docstring repeats them):

* **pass**: a sample passes when its accuracy is 1.0 (``pass_threshold: null``, the default: fully correct, format
  included, since :func:`longreel.task.rewards.score` gates accuracy on the format), or, with ``pass_threshold: t``, when
  its reward is ``>= t`` (for graded types such as open-ended ROUGE-L or grounding IoU).
* **label**: ``easy`` when all k samples pass, ``hard`` when none does, ``medium`` otherwise.
* **policy** ``medium`` (default): keep medium questions; easy ones are rejects ``too_easy``, hard ones ``too_hard``.
  **policy** ``band``: keep a question when ``band_min <= mean reward <= band_max`` (LLaVA-OneVision-1.5-RL's
  reward band); outside the band it is ``too_easy`` (all k passed), ``too_hard`` (none passed) or ``out_of_band``.
* **split** of kept questions: ``hash`` (default): ``sft`` when ``u(qra_id, split_seed) < sft_fraction``, else
  ``rl``, with ``u`` the first 8 bytes of sha256(``"{split_seed}:{qra_id}"``) as a number in [0, 1): deterministic,
  independent of run order and of every other question; the default fraction 36/104 is the paper's 36K CoT-SFT /
  68K RL. ``pass_rate``: ``sft`` when pass_count / k ``>= sft_min_pass_rate`` (the easier kept questions make
  demonstrations), lower pass rates go to ``rl``.
"""
from __future__ import annotations

from longreel.pipelines.resources import ResourceHints
from longreel.schemas.config import ConfigError, ConfigModel, cfg

BACKENDS = ("transformers", "vllm")


class FilterConfig(ConfigModel):
    backend: str = cfg("transformers", "Answerer backend: transformers (AutoModelForImageTextToText, CPU or GPU), "
                                       "or vllm (GPU, n=k per request).",
                       choices=BACKENDS)
    model: str = cfg("", "Local directory of the answering VLM (the policy's base model). Nothing is downloaded.")
    model_revision: str | None = cfg(None, "Revision to record; null records the model's weights revision "
                                           "('sha256:<hex>' over its weight files, or the snapshot commit of a "
                                           "Hugging Face cache directory), as every longreel backend does.")
    k: int = cfg(8, "Samples per question.")
    temperature: float = cfg(1.0, "Sampling temperature (> 0: the k samples must differ).")
    top_p: float = cfg(1.0, "Nucleus sampling mass.")
    top_k: int = cfg(0, "Top-k sampling; 0 disables it (the model's own generation_config is never used: every "
                        "sampling parameter is passed explicitly, so both backends sample alike).")
    max_new_tokens: int = cfg(512, "Tokens generated per sample at most.")
    seed: int = cfg(0, "Sampling seed. Each question is sampled under its own seed derived from this and its qra_id, "
                       "so results do not depend on batching or run order.")
    device: str = cfg("auto", "transformers: torch device; auto = cuda when available, else cpu.")
    dtype: str = cfg("auto", "Model weights dtype (auto = as saved).", choices=("auto", "float32", "bfloat16",
                                                                                 "float16"))
    trust_remote_code: bool = cfg(False, "Allow the model directory's own Python code (opt-in).")
    vllm_max_model_len: int = cfg(0, "vllm: max_model_len (0 = the model's).")
    vllm_gpu_memory_utilization: float = cfg(0.9, "vllm: share of GPU memory the engine may take.")
    frame_source: str = cfg("uniform", "uniform: n_frames at the centres of equal bins over the whole video, "
                                       "decoded for this stage; cache: the pack stage's frame cache (the processor's "
                                       "fps sampling and resize, cache_* keys), so the answerer sees exactly the "
                                       "frames the trainer will, decoded once for both stages when the parameters "
                                       "match the pack's.", choices=("uniform", "cache"))
    cache_dir: str | None = cfg(None, "frame_source cache: the frame cache directory (the pack stage's cache_dir).")
    cache_fps: float = cfg(2.0, "frame_source cache: frames per second sampled (the pack's fps).")
    cache_max_frames: int = cfg(64, "frame_source cache: at most this many frames (the pack's max_frames).")
    cache_min_frames: int = cfg(4, "frame_source cache: at least this many frames (the pack's min_frames).")
    n_frames: int = cfg(8, "frame_source uniform: frames sampled uniformly over the whole video (bin centres), "
                           "once per video and shared by all its questions.")
    max_pixels: int = cfg(64 * 28 * 28, "Pixels per frame at most; frames are resized to sides that are multiples "
                                        "of 28 within [min_pixels, max_pixels] (aspect kept; the Qwen processor's "
                                        "rule). With frame_source cache, set it to the pack's max_pixels.")
    min_pixels: int = cfg(4 * 28 * 28, "Pixels per frame at least.")
    decode_timeout_s: float = cfg(300.0, "Seconds decoding one video's frames may take before the worker is killed "
                                         "and its questions rejected with reason 'timeout'.")
    batch_size: int = cfg(4, "Questions per RunInference batch (each question is still one generate call).")
    pass_threshold: float | None = cfg(None, "null: a sample passes when its accuracy is 1.0; a number t: when its "
                                             "reward is >= t.")
    reward_params: dict = cfg(default_factory=dict, help="Keyword parameters for longreel.task.rewards.score (the "
                                                          "same ones the trainer uses), e.g. {format_weight: 0.1}.")
    policy: str = cfg("medium", "medium: keep 0 < pass_count < k; band: keep band_min <= mean reward <= band_max.",
                      choices=("medium", "band"))
    band_min: float = cfg(0.125, "policy band: lowest kept mean reward (inclusive).")
    band_max: float = cfg(0.875, "policy band: highest kept mean reward (inclusive).")
    split_rule: str = cfg("hash", "hash: sft when hash(qra_id) < sft_fraction; pass_rate: sft when "
                                  "pass_count/k >= sft_min_pass_rate.", choices=("hash", "pass_rate"))
    sft_fraction: float = cfg(36 / 104, "split_rule hash: share of kept questions for CoT-SFT (the paper: 36K of "
                                        "104K).")
    split_seed: int = cfg(0, "split_rule hash: salt of the hash.")
    sft_min_pass_rate: float = cfg(0.5, "split_rule pass_rate: lowest pass rate that goes to sft.")
    parquet_shards: int | None = cfg(None, "Parquet files for the pass_rate table; null: output.parquet_shards in longreel curate, else one file per 256 MB of rows.")
    resources: ResourceHints = cfg(default_factory=ResourceHints, help="Beam resource hints on the answering step.")

    def check(self):
        if self.k < 1:
            raise ConfigError("k must be >= 1")
        if not self.temperature > 0:
            raise ConfigError("temperature must be > 0 (k identical greedy samples measure nothing)")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.max_new_tokens < 1 or self.n_frames < 1 or self.batch_size < 1 or (self.parquet_shards or 1) < 1:
            raise ConfigError("max_new_tokens, n_frames, batch_size and parquet_shards (or null) must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError("need 0 < min_pixels <= max_pixels")
        if self.frame_source == "cache" and not self.cache_dir:
            raise ConfigError("frame_source cache needs cache_dir")
        if self.cache_fps <= 0 or not 1 <= self.cache_min_frames <= self.cache_max_frames:
            raise ConfigError("need cache_fps > 0 and 1 <= cache_min_frames <= cache_max_frames")
        if self.decode_timeout_s <= 0:
            raise ConfigError("decode_timeout_s must be > 0")
        if self.pass_threshold is not None and not 0 < self.pass_threshold <= 1:
            raise ConfigError("pass_threshold must be in (0, 1] or null")
        if not 0 <= self.band_min <= self.band_max <= 1:
            raise ConfigError("need 0 <= band_min <= band_max <= 1")
        if not 0 <= self.sft_fraction <= 1 or not 0 <= self.sft_min_pass_rate <= 1:
            raise ConfigError("sft_fraction and sft_min_pass_rate must be in [0, 1]")

    def check_runnable(self):
        """:meth:`check`, and the model that answering needs. Not part of :meth:`check`: a run that does not filter
        still writes a resolved ``filter`` section (with no model) into its config.yaml, and that file given back as
        ``--config`` was refused for it."""
        self.check()
        if not self.model:
            raise ConfigError(f"backend {self.backend} needs model (a local model directory)")

