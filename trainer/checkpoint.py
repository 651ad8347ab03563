"""Resumable checkpoints, written atomically; no pickle anywhere.

A step checkpoint is a directory ``<out>/checkpoints/step-000006/`` holding

``model.safetensors``      the policy weights (``safetensors.torch.save_model``: tied weights handled)
``optimizer.safetensors``  every tensor of the optimizer state, keyed ``state.<param index>.<name>``
``optimizer.json``         param groups and non-tensor state
``scheduler.json``         the LR scheduler's ``state_dict`` (its callables are not state)
``rng-rank<R>.safetensors`` + ``rng-rank<R>.json``  torch CPU/CUDA, numpy and Python RNG states of each rank
``trainer_state.json``     step, loader position, config hash, anything else the loop needs to continue

plus, from a training run, the policy's ``config.json``, generation config and processor files (``policy_files``),
so that a step checkpoint is also a policy directory: ``load_policy``, ``longreel eval`` and ``from_pretrained`` read
it as they read ``final/``, as with the Hugging Face Trainer's ``checkpoint-N`` directories.

A sharded checkpoint (an FSDP run) holds ``sharded/`` instead of ``model.safetensors`` and
``optimizer.safetensors``: every rank writes its own shards of the weights and of the AdamW state through
``torch.distributed.checkpoint`` (``get_state_dict`` / ``set_state_dict`` and the safetensors storage writer, whose
index lives in each file's JSON header; no pickle), one ``shard-000RR-*.safetensors`` per rank, and
``optimizer.json`` keeps the param groups. Loading reshards: the saved layout need not match the loading world.
It also holds the policy files, so that ``longreel train export`` (``trainer.export``) can gather it into a policy
directory in one process.

It is written to a temp directory beside it, every file flushed to the disk (``fsync``; torch.distributed.checkpoint
does its own), and renamed into place, then ``latest`` (a one-line text file) is replaced atomically; a crash mid-save
leaves the previous checkpoint as the latest, and a machine that loses power just after a save does not come back
with a renamed directory of empty files. Loading uses safetensors and JSON only (``torch.load`` is never needed;
were it used, it would be with ``weights_only=True``).

Each checkpoint lists its files: ``trainer_state.json`` those rank 0 wrote (``files``), and each rank's
``rng-rank<R>.json`` that rank's shards (``files``; each rank names only what it wrote itself, so no rank lists a
shared directory another machine is still writing). :func:`checkpoint_problem` checks a checkpoint against them in
milliseconds whatever its size, and :func:`resumable_checkpoint` resumes the newest one that passes: a checkpoint
cut short by a copy that stopped, or one whose files were removed, is named and passed over instead of failing the
run with a traceback, or when it is the only one, refused with the way out.
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from longreel.schemas.atomic import temp_target, write_atomic

log = logging.getLogger("longreel")

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "prune_checkpoints", "clear_checkpoints",
           "rng_state", "set_rng_state", "write_json_atomic", "tied_aliases", "is_sharded_checkpoint", "TRAINING_STATE",
           "RNG_PREFIX", "checkpoint_problem", "safetensors_problem", "resumable_checkpoint", "remove_unfinished_saves",
           "FINAL_TMP"]

LATEST = "latest"
#: the names of a save in progress: a step's directory, ``latest``'s next text, ``final/`` (``remove_unfinished_saves``)
TMP_PREFIX, LATEST_TMP, FINAL_TMP = ".tmp-", ".latest.", ".final-"


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


SHARDED = "sharded"
#: a step checkpoint's files that are training state rather than part of a policy directory (with the RNG files)
TRAINING_STATE = ("optimizer.safetensors", "optimizer.json", "scheduler.json", "trainer_state.json")
RNG_PREFIX = "rng-rank"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds an FSDP run's per-rank shards (``sharded/``) rather than ``model.safetensors``."""
    return (Path(path) / SHARDED).is_dir()


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}`` for the parameters of ``model`` that are another parameter (tied weights: an LM head that is
    the token embeddings), by object identity, so every rank finds the same. safetensors refuses to write one tensor
    twice, and a gathered copy would write it twice over: checkpoints store it once, under its first name, and
    loading points the alias back at it (``from_pretrained`` ties it again from the config)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def save_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list:
    """Every rank writes its shards of ``model`` (and of ``optimizer``'s tensor state) under ``path``; collective.
    Returns the optimizer's param groups (parameters named by FQN) for the caller to keep as JSON."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        msd, groups, state = get_model_state_dict(model), [], {}
    else:
        msd, osd = get_state_dict(model, optimizer)
        groups, state = osd["param_groups"], osd["state"]
    aliases = tied_aliases(model)
    msd = {k: v for k, v in msd.items() if k not in aliases}
    dcp.save({"model": msd, "optim": state}, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))
    return groups


def load_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 param_groups: list | None = None) -> None:
    """Read what :func:`save_sharded` wrote into the (sharded) ``model`` and ``optimizer``; collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict

    if optimizer is None:
        sd = {"model": get_model_state_dict(model), "optim": {}}
    else:
        msd, osd = get_state_dict(model, optimizer)  # the target layout (initialises an empty optimizer's state)
        sd = {"model": msd, "optim": osd["state"]}
    aliases = tied_aliases(model)
    sd["model"] = {k: v for k, v in sd["model"].items() if k not in aliases}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(path)))
    sd["model"].update({alias: sd["model"][key] for alias, key in aliases.items()})
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=sd["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"],
                       optim_state_dict={"state": sd["optim"], "param_groups": param_groups})


# --------------------------------------------------------------------------------------------------
# what a resume can trust
# --------------------------------------------------------------------------------------------------


def share_files(directory: str | os.PathLike) -> None:
    """Every file under ``directory`` readable by others (0644), as files a user writes are: safetensors'
    ``save_file`` (and so ``save_pretrained``) creates its files 0600, which would keep a run's weights from the
    other users of a shared disk."""
    for where, _dirs, files in os.walk(directory):
        for name in files:
            try:
                os.chmod(os.path.join(where, name), 0o644)
            except PermissionError:  # another user's file (a rank on another node): its mode is its writer's
                pass


def _fsync(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_under(root: Path, skip=lambda rel: False) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and not skip(p.relative_to(root).as_posix()))


def _written_by_others(rel: str) -> bool:
    """The files of a checkpoint directory that some rank other than 0 may be writing while rank 0 lists its own, and
    ``write_atomic``'s temporary names: another rank's JSON on its way to its name (``.tmp-<hex>-rng-rank1.json``,
    renamed a moment later; a 2-rank test on a busy machine caught rank 0 listing one)."""
    parts = rel.split("/")
    return parts[0].startswith(RNG_PREFIX) or parts[0] == SHARDED or any(temp_target(p) for p in parts)


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why the safetensors file ``path`` cannot be read whole, or None. Opening one checks that its header parses and
    that its tensors' byte ranges end exactly at the end of the file, so a file cut short (a copy that stopped, a
    crash before the data reached the disk) or one with bytes added is found without reading the tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except (SafetensorError, OSError, ValueError) as err:
        return f"{Path(path).name} ({os.path.getsize(path):,} bytes) cannot be read: {err}"
    return None


def _file_problem(root: Path, rel: str) -> str | None:
    if Path(rel).is_absolute() or ".." in Path(rel).parts:  # the lists only ever name files inside the checkpoint
        return f"it lists {rel!r}, not a file inside it"
    path = root / rel
    if not path.is_file():
        return f"{rel} is missing"
    if rel.endswith(".safetensors"):
        return safetensors_problem(path)
    if rel.endswith(".json"):
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as err:
            return f"{rel} ({path.stat().st_size:,} bytes) is not whole JSON: {err}"
    return None


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the step checkpoint ``path`` cannot be resumed, or None: a file it lists is missing, a JSON file does not
    parse, or a safetensors file is not whole (:func:`safetensors_problem`). Reads the small JSON files and the
    safetensors headers only. A checkpoint written before the lists existed is checked for its weights and the
    files present. A bit flipped inside a tensor is not found: that needs a hash of every byte, minutes a save for a
    7B model's weights and AdamW state."""
    root = Path(path)
    problem = _file_problem(root, "trainer_state.json")
    if problem is not None:
        return problem
    try:
        return _listed_files_problem(root, json.loads((root / "trainer_state.json").read_bytes()))
    except (AttributeError, TypeError, ValueError) as err:  # whole JSON, but not what a checkpoint writes
        return f"its state files do not describe a checkpoint ({type(err).__name__}: {err})"


def _listed_files_problem(root: Path, state: dict) -> str | None:
    listed = state.get("files")
    if listed is None:  # an older checkpoint: what it must hold, and whatever is there
        weights = [] if is_sharded_checkpoint(root) else ["model.safetensors"]
        listed = sorted({*weights, *_files_under(root, _written_by_others)} - {"trainer_state.json"})
    for r in range(int(state.get("world", 1))):
        meta = f"{RNG_PREFIX}{r}.json"
        problem = _file_problem(root, meta)
        if problem is not None:
            return problem
        listed = [*listed, f"{RNG_PREFIX}{r}.safetensors",
                  *json.loads((root / meta).read_bytes()).get("files", [])]
    if state.get("files") is None and is_sharded_checkpoint(root):
        listed += [f"{SHARDED}/{n}" for n in _files_under(root / SHARDED)]
    for rel in listed:
        problem = _file_problem(root, rel)
        if problem is not None:
            return problem
    return None


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def resumable_checkpoint(ckpt_root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint a run in ``ckpt_root`` resumes from: the newest that passes :func:`checkpoint_problem`, starting
    at the one ``latest`` names (or at the newest step directory when ``latest`` is gone), and the newer ones passed
    over with why. A step directory newer than ``latest`` is a save that did not finish and is not considered.
    ``(None, [])``: nothing to resume."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None, []
    steps = sorted((p for p in root.glob("step-*") if p.is_dir() and _step_of(p) >= 0), key=_step_of, reverse=True)
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        steps = [p for p in steps if _step_of(p) <= _step_of(named)]
        if not named.is_dir():
            steps = [named, *steps]
    passed_over = []
    for path in steps:
        problem = checkpoint_problem(path) if path.is_dir() else "the directory is missing"
        if problem is None:
            return path, passed_over
        passed_over.append((path, problem))
    return None, passed_over


def save_checkpoint(ckpt_root: str | os.PathLike, step: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, scheduler, trainer_state: dict, rank: int = 0,
                    world: int = 1, barrier=None, sharded: bool = False, policy_files=None) -> Path:
    """Write checkpoint ``step`` under ``ckpt_root`` (rank 0 writes the shared files; every rank its RNG).

    ``barrier``: a callable synchronising ranks (``torch.distributed.barrier``) when ``world > 1``.
    ``sharded``: every rank writes its shards of the (FSDP) model and optimizer (``save_sharded``); collective.
    ``policy_files``: a callable writing the policy's config and processor files into a directory (rank 0). A sharded
    checkpoint has no ``model.safetensors`` for ``from_pretrained`` to read; with them, ``longreel train export``
    (``trainer.export``) turns it into a policy directory.
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / _step_name(step)
    tmp = root / f"{TMP_PREFIX}{_step_name(step)}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    if barrier is not None and world > 1:
        barrier()
    try:
        _write_checkpoint(tmp, rank, world, barrier, model, optimizer, scheduler, step, trainer_state, sharded,
                          policy_files)
    except BaseException:
        if rank == 0:  # a disk that filled up mid-save: the partial files would only hold on to its space
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        share_files(tmp)  # after the barrier: every rank's files are there
        for d in (tmp / SHARDED, tmp):
            if d.is_dir():
                _fsync(d)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
        fd, tmp_latest = tempfile.mkstemp(prefix=LATEST_TMP, dir=root)
        with os.fdopen(fd, "w") as fh:
            fh.write(final.name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_latest, root / LATEST)
        _fsync(root)
    if barrier is not None and world > 1:
        barrier()
    return final


def _write_checkpoint(tmp: Path, rank: int, world: int, barrier, model, optimizer, scheduler, step: int,
                      trainer_state: dict, sharded: bool, policy_files) -> None:
    """Every file of a checkpoint into ``tmp``, each rank its own, synced to the disk; returns after the ranks'
    barrier."""
    t, meta = rng_state()
    save_file(t, str(tmp / f"{RNG_PREFIX}{rank}.safetensors"))
    _fsync(tmp / f"{RNG_PREFIX}{rank}.safetensors")
    mine = []
    if sharded:
        groups = save_sharded(tmp / SHARDED, model, optimizer)  # synced to the disk by torch.distributed.checkpoint
        mine = [f"{SHARDED}/{n}" for n in _files_under(tmp / SHARDED) if n.startswith(f"shard-{rank + 1:05d}-")]
        if rank == 0 and optimizer is not None:
            write_json_atomic(tmp / "optimizer.json", {"param_groups": groups, "sharded": True})
    write_json_atomic(tmp / f"{RNG_PREFIX}{rank}.json", {**meta, "files": mine})
    if rank == 0:
        if not sharded:
            save_model(model, str(tmp / "model.safetensors"))
        if policy_files is not None:
            policy_files(tmp)
        if optimizer is not None and not sharded:
            ot, om = _optimizer_to_files(optimizer)
            save_file(ot, str(tmp / "optimizer.safetensors"))
            write_json_atomic(tmp / "optimizer.json", om)
        if scheduler is not None:
            sd = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
            write_json_atomic(tmp / "scheduler.json", sd)
        files = _files_under(tmp, _written_by_others)
        for rel in files:
            _fsync(tmp / rel)
        write_json_atomic(tmp / "trainer_state.json", {**trainer_state, "step": step, "world": world, "files": files})
    if barrier is not None and world > 1:
        barrier()


def remove_unfinished_saves(ckpt_root: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Remove what saves that never finished left (a step's temp directory, ``latest``'s temp file, a ``final/`` being
    written): a run killed or out of disk mid-save. Only the one run holding the directory's lock may call this: another
    run's save in progress would look the same. Returns what was removed, with sizes, for the log."""
    import re

    # the exact names save_checkpoint, tempfile.mkstemp and tempfile.mkdtemp give (8 characters of [a-z0-9_])
    ours = {Path(ckpt_root): re.compile(rf"{re.escape(TMP_PREFIX)}step-\d{{6,}}|{re.escape(LATEST_TMP)}[a-z0-9_]{{8}}"),
            Path(out_dir): re.compile(rf"{re.escape(FINAL_TMP)}[a-z0-9_]{{8}}")}
    removed = []
    candidates = [p for d, name in ours.items() if d.is_dir() for p in d.iterdir() if name.fullmatch(p.name)]
    for p in sorted(candidates):
        if p.is_symlink():
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(f"{p.name} ({size:,} bytes)")
    return removed


def clear_checkpoints(ckpt_root: str | os.PathLike) -> int:
    """Remove every step checkpoint (and ``latest``) under ``ckpt_root``: a run that starts over
    (``run.resume=false``) must not leave an earlier run's steps beside its own. Returns how many were removed."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return 0
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    if steps:
        which = steps[0].name if len(steps) == 1 else f"{steps[0].name} ... {steps[-1].name}"
        log.warning("run.resume=false: removing the earlier run's %s in %s (%s)",
                    "checkpoint" if len(steps) == 1 else f"{len(steps)} checkpoints", root, which)
    for p in steps:
        shutil.rmtree(p)
    (root / LATEST).unlink(missing_ok=True)
    return len(steps)


def clear_final(out_dir: str | os.PathLike) -> bool:
    """Remove ``out_dir/final`` left by an earlier run in the directory (``run.resume=false``); whether there was one."""
    final = Path(out_dir) / "final"
    if not final.is_dir():
        return False
    log.warning("run.resume=false: removing the earlier run's final/ in %s", out_dir)
    shutil.rmtree(final)
    return True


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
                    rank: int = 0, load_model_weights: bool = True, sharded: bool = False) -> dict:
    """Restore a checkpoint written by ``save_checkpoint``; return its ``trainer_state``.

    ``sharded``: ``model`` (and ``optimizer``) are FSDP-sharded; every rank calls this together. A sharded
    checkpoint needs a sharded model and the other way round (an FSDP run resumes an FSDP run)."""
    path = Path(path)
    is_sharded = is_sharded_checkpoint(path)
    if is_sharded != sharded:
        if is_sharded:
            raise ValueError(f"{path} is a sharded checkpoint (an FSDP run): resume it with dist.strategy=fsdp "
                             "under torchrun (2 or more ranks)")
        raise ValueError(f"{path} holds full weights (a single-process or DDP run): resume it without "
                         "dist.strategy=fsdp")
    if sharded:
        groups = None
        if optimizer is not None:
            with open(path / "optimizer.json", encoding="utf-8") as fh:
                groups = json.load(fh)["param_groups"]
        load_sharded(path / SHARDED, model, optimizer, groups)
    elif load_model_weights:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if optimizer is not None and not sharded:
        with open(path / "optimizer.json", encoding="utf-8") as fh:
            om = json.load(fh)
        _optimizer_from_files(optimizer, load_file(str(path / "optimizer.safetensors")), om)
    if scheduler is not None:
        with open(path / "scheduler.json", encoding="utf-8") as fh:
            sd = json.load(fh)
        scheduler.load_state_dict({**scheduler.state_dict(), **sd})
    rng_file = path / f"{RNG_PREFIX}{rank}.safetensors"
    if rng_file.is_file():
        with open(path / f"{RNG_PREFIX}{rank}.json", encoding="utf-8") as fh:
            set_rng_state(load_file(str(rng_file)), json.load(fh))
    with open(path / "trainer_state.json", encoding="utf-8") as fh:
        return json.load(fh)
