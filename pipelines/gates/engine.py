"""The text engine of a quality gate, built from its config's engine keys."""
from __future__ import annotations

from longreel.engines.base import Engine


def build_engine(cfg) -> Engine:
    """The text engine a gate's config names (not set up yet): a :class:`~longreel.pipelines.blind_config.BlindConfig`
    or a :class:`~longreel.pipelines.judge_config.JudgeConfig` (the same engine keys)."""
    if cfg.backend == "transformers":
        from longreel.engines.transformers_engine import TransformersEngine
        return TransformersEngine(cfg.model, cfg.model_revision or None, kind="text",
                                  trust_remote_code=cfg.trust_remote_code,
                                  dtype="float32" if cfg.dtype == "auto" else cfg.dtype, batch_size=cfg.batch_size,
                                  threads=cfg.threads)
    if cfg.backend == "openai":
        from longreel.engines.openai_engine import OpenAIEngine
        return OpenAIEngine(cfg.base_url, cfg.model, revision=cfg.model_revision or None,
                            api_key_env=cfg.api_key_env, timeout_s=cfg.request_timeout_s,
                            guided_mode=cfg.guided_mode, concurrency=4, max_retries=4)
    if cfg.backend == "vllm":
        from longreel.engines.vllm_engine import VLLMEngine
        return VLLMEngine(cfg.model, cfg.model_revision or None, trust_remote_code=cfg.trust_remote_code,
                          dtype=cfg.dtype, max_model_len=cfg.max_model_len)
    raise ValueError(f"unknown backend {cfg.backend!r}")
