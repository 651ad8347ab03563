"""Configuration of the clip captioning stage (``longreel caption`` and the ``caption`` section of curate).

Loaded like every longreel config (:func:`longreel.schemas.config.load_yaml`): defaults <- YAML <- ``--set
key=value``. ``CaptionConfig`` is self-contained so that the curate config can hold it as a
section (``caption: CaptionConfig``) and ``longreel caption`` can load it alone.
"""
from __future__ import annotations

from longreel.pipelines.media import facts as F
from longreel.pipelines.resources import ResourceHints
from longreel.schemas.config import ConfigError, ConfigModel, cfg

BACKENDS = ("facts", "transformers", "openai", "vllm")


class FramesConfig(ConfigModel):
    n: int = cfg(8, "Frames sampled per clip, at the centres of n equal bins of the clip's time range.")
    decode: str = cfg("per_video", "per_video: one worker call decodes the frames of many consecutive clips of a "
                                   "video (up to max_frames_per_call) in one forward pass and slices them per clip; "
                                   "per_clip: one call (open + seek + decode) per clip. per_video used 1.2-1.3x less "
                                   "CPU per clip on Big Buck Bunny (benchmarks/caption.py).",
                      choices=("per_video", "per_clip"))
    max_frames_per_call: int = cfg(256, "per_video: at most this many frames per worker call (bounds memory: 256 "
                                        "frames of 588x336 are 150 MB; also spreads a long video over workers). "
                                        "On Big Buck Bunny 128 frames per call and one call for the whole film "
                                        "measured the same within noise.")
    sampling: str = cfg("exact", "exact: the frame shown at each sampled time; keyframe: the key frame nearest to it "
                                 "(only key frames are decoded: much cheaper on long-GOP video; the frames' real "
                                 "times are recorded in frame_timestamps).", choices=("exact", "keyframe"))
    backend: str = cfg("pyav", "Decoder: pyav (threaded FFmpeg via PyAV) or decord; chosen by benchmarks/decoders.py.",
                       choices=("pyav", "decord"))
    max_pixels: int | None = cfg(None, "Pixel budget per frame (width*height, aspect kept). null: the backend's "
                                       "own (facts: 16384; transformers: the processor's max_pixels; openai and "
                                       "vllm: 200704 = 448*448).")
    timeout_s: float = cfg(300.0, "Seconds one decode call may take before its worker is killed (the clips become "
                                  "'decode_timeout' rejects).")
    verify_sha256: bool = cfg(True, "Re-hash each video before decoding and reject its clips ('video_changed') "
                                    "when the bytes differ from the ingested ones.")

    def check(self):
        if self.n < 1:
            raise ConfigError("caption.frames.n must be >= 1")
        if self.max_frames_per_call < self.n:
            raise ConfigError("caption.frames.max_frames_per_call must be >= caption.frames.n")
        if self.max_pixels is not None and self.max_pixels < 64:
            raise ConfigError("caption.frames.max_pixels must be >= 64")
        if self.timeout_s <= 0:
            raise ConfigError("caption.frames.timeout_s must be > 0")


class FactsConfig(ConfigModel):
    black_luma: float = cfg(F.BLACK_LUMA, "A pixel with luma (0..255) below this is a black pixel.")
    black_share: float = cfg(F.BLACK_SHARE, "A frame with at least this share of black pixels is black (black "
                                            "credits with white text are about 0.7 black).")
    blank_std: float = cfg(F.BLANK_STD, "A frame whose luma standard deviation is below this is blank (one colour).")
    cut_threshold: float = cfg(F.CUT_THRESHOLD, "Colour-histogram distance (0..1) between neighbouring sampled "
                                                "frames above which a shot cut is counted.")

    def check(self):
        if not 0 < self.cut_threshold < 1 or not 0 < self.black_share <= 1:
            raise ConfigError("caption.facts.cut_threshold must be in (0, 1) and black_share in (0, 1]")


class FilterConfig(ConfigModel):
    enabled: bool = cfg(False, "Reject black and static clips before captioning (reasons black_clip, static_clip).")
    black_ratio_min: float = cfg(0.75, "A clip with at least this share of black/blank sampled frames is a "
                                       "'black_clip'.")
    static_motion_max: float = cfg(1.0, "A clip without shot cuts whose motion score (0..255) is below this is a "
                                        "'static_clip'.")

    def check(self):
        if not 0 < self.black_ratio_min <= 1:
            raise ConfigError("caption.filter.black_ratio_min must be in (0, 1]")
        if self.static_motion_max < 0:
            raise ConfigError("caption.filter.static_motion_max must be >= 0")


class ModelConfig(ConfigModel):
    path: str | None = cfg(None, "transformers/vllm: local checkpoint directory (or a hub id already in the local "
                                 "cache). openai: the model name sent to the server.")
    revision: str | None = cfg(None, "Recorded as model_revision. null: the snapshot commit when the path is inside a "
                                     "Hugging Face cache, else the sha256 of the weight files.")
    trust_remote_code: bool = cfg(False, "Run the checkpoint's own Python code (needed for NVILA). Off unless set.")
    dtype: str = cfg("auto", "transformers/vllm weights dtype: auto, float32, bfloat16, float16.",
                     choices=("auto", "float32", "bfloat16", "float16"))
    device: str = cfg("cpu", "transformers: cpu, cuda, cuda:N or auto (device_map=auto).")
    max_new_tokens: int = cfg(160, "Longest caption in tokens.")
    temperature: float = cfg(0.0, "0 = greedy (deterministic).")
    top_p: float = cfg(1.0, "Nucleus sampling mass (when temperature > 0).")
    seed: int = cfg(0, "Sampling seed; each clip gets seed + a hash of its clip id, so results do not depend on "
                       "batching.")
    batch_size: int = cfg(4, "Clips per inference batch (RunInference's BatchElements max_batch_size).")
    share_across_processes: bool = cfg(False, "Load one model per machine and share it across worker processes "
                                              "(Beam's multi_process_shared; for large GPU models). vllm always does.")

    def check(self):
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError("caption.model.max_new_tokens and batch_size must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("caption.model.temperature must be >= 0 and top_p in (0, 1]")


class OpenAIConfig(ConfigModel):
    base_url: str = cfg("http://127.0.0.1:8000/v1", "OpenAI-compatible API root (…/v1); POST {base_url}/chat/completions.")
    api_key_env: str = cfg("OPENAI_API_KEY", "Environment variable holding the API key (sent as a Bearer token; "
                                             "a placeholder when unset, which local servers ignore). The key "
                                             "itself never goes into a config.")
    timeout_s: float = cfg(120.0, "Seconds per HTTP request.")
    max_retries: int = cfg(4, "Retries after a timeout, connection error, HTTP 408/409/429 or 5xx (the openai "
                               "package's backoff: 0.5 s doubling to 8 s, with jitter; Retry-After is honoured).")
    concurrency: int = cfg(8, "Requests in flight at once per worker process.")
    jpeg_quality: int = cfg(90, "JPEG quality of the frames sent as base64 image parts.")
    image_detail: str | None = cfg(None, "Optional 'detail' of each image part (low, high, auto); null: not sent.")

    def check(self):
        if self.timeout_s <= 0 or self.max_retries < 0 or self.concurrency < 1:
            raise ConfigError("caption.openai: timeout_s > 0, max_retries >= 0, concurrency >= 1")
        if not 1 <= self.jpeg_quality <= 100:
            raise ConfigError("caption.openai.jpeg_quality must be in 1..100")


class VLLMConfig(ConfigModel):
    tensor_parallel_size: int = cfg(1, "GPUs per model.")
    gpu_memory_utilization: float = cfg(0.85, "Share of GPU memory vLLM may take.")
    max_model_len: int = cfg(32768, "Context length (frames + prompt + caption).")
    enforce_eager: bool = cfg(False, "Disable CUDA graphs (slower; faster start-up and less memory).")

    def check(self):
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("caption.vllm: tensor_parallel_size >= 1 and gpu_memory_utilization in (0, 1]")


class DegenerateConfig(ConfigModel):
    min_chars: int = cfg(8, "A caption with fewer letters and digits than this is 'empty_caption'.")
    max_repeat_share: float = cfg(0.5, "A caption in which one phrase repeated back to back covers at least this "
                                       "share of the words is 'repetitive_caption'.")
    echo_share: float = cfg(0.6, "A caption sharing at least this share of its word 4-grams with the prompt is "
                                 "'prompt_echo'.")


class CaptionConfig(ConfigModel):
    backend: str = cfg("facts", "Captioner: facts (weight-free sentence from the clip facts; the CPU default), "
                                "transformers (local VLM in-process), openai (OpenAI-compatible server), vllm (GPU).",
                       choices=BACKENDS)
    prompt: str = cfg("caption", "Prompt template name in pipelines/prompts (caption -> caption.j2). The facts "
                                 "backend renders caption_facts.j2.")
    frames: FramesConfig = cfg(default_factory=FramesConfig, help="Frame sampling and decoding.")
    facts: FactsConfig = cfg(default_factory=FactsConfig, help="Clip facts thresholds.")
    filter: FilterConfig = cfg(default_factory=FilterConfig, help="The static/black clip filter.")
    model: ModelConfig = cfg(default_factory=ModelConfig, help="Model, sampling and batching (model backends).")
    openai: OpenAIConfig = cfg(default_factory=OpenAIConfig, help="openai backend.")
    vllm: VLLMConfig = cfg(default_factory=VLLMConfig, help="vllm backend.")
    degenerate: DegenerateConfig = cfg(default_factory=DegenerateConfig, help="Degenerate-caption rejects.")
    resources: ResourceHints = cfg(default_factory=ResourceHints, help="Beam resource hints on the caption model step.")
    parquet_shards: int | None = cfg(None, "Parquet files per output table (captions, clip_facts); null: output.parquet_shards in longreel curate, else one file per 256 MB of rows.")

    def check(self):
        if self.backend in ("transformers", "vllm", "openai") and not self.model.path:
            raise ConfigError(f"caption.model.path is required for the {self.backend} backend")
        if self.parquet_shards is not None and self.parquet_shards < 1:
            raise ConfigError("caption.parquet_shards must be >= 1 (or null: follows the table's size)")
