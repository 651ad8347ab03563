"""The local model paths a run will load, checked on the launcher before the run takes its output directory.

A mistyped ``--set filter.model=/models/...`` used to surface only when the model step first ran, after ingest,
segment, captions and the frame cache, as a dozen copies of the worker's traceback and an "internal error". When
the workers share this machine's filesystem (the local runner, or any runner whose workers live in the launcher),
a path that is not there is the user's mistake: :class:`~longreel.pipelines.io.inputs.InputError`, one line, exit
2, nothing written. When they run elsewhere (Dataflow, Flink, Spark, a worker pool), the path is the workers' (a
model baked into the image): it is not checked here, and the log says so.

Only values written as filesystem paths are checked (absolute, ``./``, ``../`` or ``~``): the other values are
names a backend resolves itself (``smollm2``, ``minilm``, a hub id in the local cache, a served model's name).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("longreel")

__all__ = ["looks_like_path", "caption_models", "qra_models", "judge_models", "blind_models", "filter_models",
           "embed_models", "curate_models", "check_model_paths"]

#: backends that load weights on the worker (an OpenAI-compatible server holds its own)
LOCAL_BACKENDS = ("transformers", "vllm")


def looks_like_path(value: str | None) -> bool:
    return bool(value) and value.startswith(("/", "./", "../", "~"))


def caption_models(c, prefix: str = "caption.") -> list[tuple[str, str]]:
    return [(f"{prefix}model.path", c.model.path)] if c.backend in LOCAL_BACKENDS else []


def qra_models(c, prefix: str = "qra.") -> list[tuple[str, str]]:
    return [(f"{prefix}model", c.model)] if c.backend in LOCAL_BACKENDS else []


def judge_models(c, writer_backend: str | None = None, prefix: str = "judge.") -> list[tuple[str, str]]:
    """``c.backend`` / ``c.model`` null (curate's judge) take the question writer's, which ``qra_models`` checks."""
    backend = c.backend or writer_backend
    return [(f"{prefix}model", c.model)] if c.model and backend in LOCAL_BACKENDS else []


def blind_models(c, prefix: str = "blind.") -> list[tuple[str, str]]:
    return [(f"{prefix}model", c.model)] if c.backend in LOCAL_BACKENDS else []


def filter_models(c, prefix: str = "filter.") -> list[tuple[str, str]]:
    return [(f"{prefix}model", c.model)] if c.backend in LOCAL_BACKENDS else []


def embed_models(c, stages, prefix: str = "embed.") -> list[tuple[str, str]]:
    out = []
    if {"align", "clip_dedup"} & set(stages):
        out.append((f"{prefix}clip.checkpoint", c.clip.checkpoint))
    if "question_dedup" in stages:
        out.append((f"{prefix}question_dedup.model", c.question_dedup.model))
    return out


def curate_models(cfg) -> list[tuple[str, str]]:
    """``(key, value)`` of every model a ``longreel curate`` run with ``cfg`` loads, stage by stage."""
    stages = set(cfg.stages)
    out = []
    if "caption" in stages:
        out += caption_models(cfg.caption)
    out += embed_models(cfg.embed, stages)
    if "qra" in stages:
        out += qra_models(cfg.qra)
    if "judge" in stages:
        out += judge_models(cfg.judge, cfg.qra.backend)
    if "blind" in stages:
        out += blind_models(cfg.blind)
    if "filter" in stages:
        out += filter_models(cfg.filter)
    if "pack" in stages and getattr(cfg.pack, "processor", None):
        out.append(("pack.processor", cfg.pack.processor))
    return out


def check_model_paths(models: list[tuple[str, str]], beam_args: list[str]) -> None:
    """Raise ``InputError`` naming every model path that does not exist, when the workers share this filesystem."""
    from longreel.pipelines.io.inputs import InputError
    from longreel.pipelines.portable import workers_elsewhere

    missing = [(k, v) for k, v in models if looks_like_path(v) and not os.path.exists(os.path.expanduser(v))]
    if not missing:
        return
    runner = workers_elsewhere(list(beam_args))
    listed = "; ".join(f"{k}: {v!r}" for k, v in missing)
    if runner is not None:
        log.info("%s runs the workers elsewhere: these model paths must exist there (not here): %s", runner, listed)
        return
    raise InputError(f"no such model file or directory ({listed}); nothing is downloaded: give a local path")
