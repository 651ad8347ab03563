"""Checks of a training or evaluation run's inputs before anything heavy starts.

A mistyped ``model.path`` or shard pattern is a user's mistake: the commands report it in one line and exit 2
(``longreel.cli``'s exit codes) instead of failing minutes later, after the process group, the imports and the
model load, with a traceback that reads like a bug. Only what can be checked cheaply and without credentials is:
local directories and files, and the expansion of brace patterns, local globs and wids indexes. Remote shards are
opened when the loader reaches them (their errors name the shard).
"""
from __future__ import annotations

import os

from longreel.task.shard_reader import local_path, resolve_shards

__all__ = ["InputCheckError", "check_model_dir", "check_shards", "check_run_inputs"]


class InputCheckError(ValueError):
    """A run's input that cannot be used: the message names the key and the value."""


def check_model_dir(path: str, key: str = "model.path") -> None:
    """``path`` must be a local ``save_pretrained`` directory (a run's ``final/`` or ``checkpoints/step-N/``)."""
    if not path:
        raise InputCheckError(f"{key} is required (a local model directory)")
    if not os.path.isdir(path):
        raise InputCheckError(f"{key} {path!r} is not a local directory (hub ids are not downloaded here: download "
                              "the model first)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputCheckError(f"{key} {path!r} holds no config.json: not a model directory (a run's final/ or "
                              "checkpoints/step-N/ is one)")


def check_shards(urls: list[str], key: str) -> int:
    """Expand ``urls`` as the loader will; every local shard must be a file. Returns the number of shards."""
    if not urls:
        raise InputCheckError(f"{key} is empty (data.source=shards)")
    try:
        specs = resolve_shards(list(urls))
    except (ValueError, OSError) as e:
        raise InputCheckError(f"{key}: {e}") from e
    for spec in specs:
        path = local_path(spec.url)
        if path is not None and not os.path.isfile(path):
            raise InputCheckError(f"{key}: no such shard file: {path}")
    return len(specs)


def check_run_inputs(cfg) -> None:
    """What ``longreel train`` reads before its first step: the policy directory and, for shard data, the
    training shards (and the held-out ones when the run evaluates during training)."""
    check_model_dir(cfg.model.path)
    if cfg.data.source != "shards":
        return
    check_shards(cfg.data.train_urls, "data.train_urls")
    if cfg.eval.every > 0:
        check_shards(cfg.data.eval_urls, "data.eval_urls")
