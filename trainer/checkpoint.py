"""Resumable checkpoints, written atomically; no pickle anywhere.

A step checkpoint is a directory ``<out>/checkpoints/step-000006/`` holding

``model.safetensors``      the policy weights (``safetensors.torch.save_model``: tied weights handled)
``optimizer.safetensors``  every tensor of the optimizer state, keyed ``state.<param index>.<name>``
``optimizer.json``         param groups and non-tensor state
``scheduler.json``         the LR scheduler's ``state_dict`` (its callables are not state)
``rng-rank<R>.safetensors`` + ``rng-rank<R>.json``  torch CPU/CUDA, numpy and Python RNG states of each rank
``trainer_state.json``     step, loader position, config hash, anything else the loop needs to continue

It is written to a temp directory beside it and renamed into place, then ``latest`` (a one-line text file) is
replaced atomically; a crash mid-save leaves the previous checkpoint as the latest. Loading uses safetensors and
JSON only (``torch.load`` is never needed; were it used, it would be with ``weights_only=True``).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from longreel.schemas.atomic import write_atomic

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "prune_checkpoints", "rng_state",
           "set_rng_state", "write_json_atomic"]

LATEST = "latest"


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", fsync=True)


# --------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    py_version, py_state, py_gauss = random.getstate()
    meta = {"numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss}}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.random.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    n = meta["numpy"]
    np.random.set_state((n["kind"], tensors["numpy_keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = meta["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


# --------------------------------------------------------------------------------------------------
# optimizer state without pickle
# --------------------------------------------------------------------------------------------------


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for name, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for idx, sc in meta.get("scalars", {}).items():
        state.setdefault(int(idx), {}).update(sc)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# --------------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------------


def _step_name(step: int) -> str:
    return f"step-{step:06d}"


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, scheduler, trainer_state: dict, rank: int = 0,
                    world: int = 1, barrier=None, model_state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` (rank 0 writes the shared files; every rank its RNG).

    ``barrier``: a callable synchronising ranks (``torch.distributed.barrier``) when ``world > 1``.
    ``model_state``: a full state dict to save instead of ``model`` (FSDP: gathered by the caller).
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _step_name(step)
    tmp = root / f".tmp-{_step_name(step)}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if barrier is not None and world > 1:
        barrier()
    t, meta = rng_state()
    save_file(t, str(tmp / f"rng-rank{rank}.safetensors"))
    write_json_atomic(tmp / f"rng-rank{rank}.json", meta)
    if rank == 0:
        if model_state is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()},
                      str(tmp / "model.safetensors"))
        else:
            save_model(model, str(tmp / "model.safetensors"))
        if optimizer is not None:
            ot, om = _optimizer_to_files(optimizer)
            save_file(ot, str(tmp / "optimizer.safetensors"))
            write_json_atomic(tmp / "optimizer.json", om)
        if scheduler is not None:
            sd = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
            write_json_atomic(tmp / "scheduler.json", sd)
        write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "step": step, "world": world})
    if barrier is not None and world > 1:
        barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fd, tmp_latest = tempfile.mkstemp(prefix=".latest.", dir=root)
        with os.fdopen(fd, "w") as fh:
            fh.write(final.name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_latest, root / LATEST)
    if barrier is not None and world > 1:
        barrier()
    return final


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    root = Path(ckpt_root)
    marker = root / LATEST
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def prune_checkpoints(ckpt_root: str | os.PathLike, keep: int) -> None:
    root = Path(ckpt_root)
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    latest = latest_checkpoint(root)
    for p in steps[:-keep] if keep > 0 else []:
        if latest is None or p.resolve() != latest.resolve():
            shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                    rank: int = 0, load_model_weights: bool = True) -> dict:
    """Restore a checkpoint written by ``save_checkpoint``; return its ``trainer_state``."""
    path = Path(path)
    if load_model_weights:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if optimizer is not None:
        with open(path / "optimizer.json", encoding="utf-8") as fh:
            om = json.load(fh)
        _optimizer_from_files(optimizer, load_file(str(path / "optimizer.safetensors")), om)
    if scheduler is not None:
        with open(path / "scheduler.json", encoding="utf-8") as fh:
            sd = json.load(fh)
        scheduler.load_state_dict({**scheduler.state_dict(), **sd})
    rng_file = path / f"rng-rank{rank}.safetensors"
    if rng_file.is_file():
        with open(path / f"rng-rank{rank}.json", encoding="utf-8") as fh:
            set_rng_state(load_file(str(rng_file)), json.load(fh))
    with open(path / "trainer_state.json", encoding="utf-8") as fh:
        return json.load(fh)
