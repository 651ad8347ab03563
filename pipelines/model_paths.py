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

__all__ = ["looks_like_path", "stage_models", "embed_models", "curate_models", "check_model_paths"]

#: backends that load weights on the worker (an OpenAI-compatible server holds its own)
LOCAL_BACKENDS = ("transformers", "vllm")


def looks_like_path(value: str | None) -> bool:
    return bool(value) and value.startswith(("/", "./", "../", "~"))


def stage_models(stage: str, c, writer_backend: str | None = None) -> list[tuple[str, str]]:
    """``(key, value)`` of the model one model stage's config ``c`` loads (caption, qra, judge, blind, filter), when
    its backend loads weights on the worker. Curate's judge may leave ``backend`` / ``model`` null: it then takes the
    question writer's (``writer_backend``; its model is ``qra.model``, checked as the qra stage's)."""
    key, value = (f"{stage}.model.path", c.model.path) if stage == "caption" else (f"{stage}.model", c.model)
    return [(key, value)] if value and (c.backend or writer_backend) in LOCAL_BACKENDS else []


def embed_models(c, stages) -> list[tuple[str, str]]:
    out = []
    if {"align", "clip_dedup"} & set(stages):
        out.append(("embed.clip.checkpoint", c.clip.checkpoint))
    if "question_dedup" in stages:
        out.append(("embed.question_dedup.model", c.question_dedup.model))
    return out


def curate_models(cfg) -> list[tuple[str, str]]:
    """``(key, value)`` of every model a ``longreel curate`` run with ``cfg`` loads, stage by stage."""
    stages = set(cfg.stages)
    out = []
    for stage in ("caption", "qra", "judge", "blind", "filter"):
        if stage in stages:
            out += stage_models(stage, getattr(cfg, stage), cfg.qra.backend if stage == "judge" else None)
    out += embed_models(cfg.embed, stages)
    if "pack" in stages and cfg.pack.processor:
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
