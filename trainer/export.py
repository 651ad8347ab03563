"""A step checkpoint turned into a plain policy directory (``longreel train export``).

An FSDP run's step checkpoints hold the weights as every rank's shards (``checkpoint.SHARDED``, written by
``torch.distributed.checkpoint``), which ``from_pretrained`` cannot read; only ``final/`` was a policy directory.
:func:`export_checkpoint` reads the shards back in one process, with no process group, into the full model built
from the checkpoint's own ``config.json`` (``checkpoint.save_checkpoint`` writes the policy files into sharded
checkpoints too), and writes ``save_pretrained`` safetensors beside the processor files: what ``longreel eval``,
``load_policy`` and any transformers user read. From an unsharded checkpoint it copies the weights and policy files
and leaves the optimizer, RNG and trainer state behind: a directory to publish.

``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` would write a ``torch.save`` pickle; here the
weights stay safetensors end to end.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from longreel.trainer.checkpoint import (RNG_PREFIX, SHARDED, TRAINING_STATE, checkpoint_problem, is_sharded_checkpoint,
                                         load_sharded, safetensors_problem, share_files)

__all__ = ["export_checkpoint"]


def export_checkpoint(step_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                      trust_remote_code: bool = False) -> Path:
    """Write the policy of ``step_dir`` (a run's ``checkpoints/step-N``, sharded or not) to ``out_dir``, which must
    not exist; written beside it and renamed into place."""
    from longreel.trainer.preflight import run_models_near

    src, out = Path(step_dir), Path(out_dir)
    if not src.is_dir():
        near = run_models_near(str(src))
        raise ValueError(f"{src} is not a directory" + (f"; the run's models are {near}" if near else
                                                        " (a run's checkpoints/step-N)"))
    if not (src / "config.json").is_file():
        near = run_models_near(str(src))
        raise ValueError(f"{src} holds no config.json: not a step checkpoint of a longreel run" + (
            f"; the run's models are {near}" if near else " (checkpoints written before config files were saved "
                                                          "with them cannot be exported)"))
    if not (src / "model.safetensors").is_file() and not (src / SHARDED).is_dir():
        raise ValueError(f"{src} holds neither model.safetensors nor {SHARDED}/: not a step checkpoint")
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new directory")
    # the shards hold the optimizer's state beside the weights: the whole checkpoint must be readable to gather them
    problem = (checkpoint_problem(src) if is_sharded_checkpoint(src)
               else safetensors_problem(src / "model.safetensors"))
    if problem is not None:
        raise ValueError(f"{src} is damaged: {problem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        copy_policy_files(src, tmp)
        if is_sharded_checkpoint(src):
            model = gather_sharded_model(src, trust_remote_code=trust_remote_code)
            model.save_pretrained(tmp)  # config.json (the same) and model.safetensors
        else:
            shutil.copy2(src / "model.safetensors", tmp / "model.safetensors")
        share_files(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the directory from other users of a shared disk
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def copy_policy_files(src: Path, dest: Path) -> None:
    """The config, generation config, tokenizer and processor files: every plain file of ``src`` that is neither
    the weights nor training state."""
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name == "model.safetensors" or f.name in TRAINING_STATE or f.name.startswith(RNG_PREFIX):
            continue
        shutil.copy2(f, dest / f.name)


def gather_sharded_model(src: Path, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The full model of a sharded checkpoint, in the dtype its weights were saved in, on the CPU."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import AutoConfig, AutoModelForImageTextToText

    meta = HuggingFaceStorageReader(str(src / SHARDED)).read_metadata().state_dict_metadata
    dtypes = {m.properties.dtype for k, m in meta.items()
              if k.startswith("model.") and hasattr(m, "properties") and m.properties.dtype.is_floating_point}
    if len(dtypes) != 1:
        raise ValueError(f"{src / SHARDED}: expected the model's floating-point weights in one dtype, found {dtypes}")
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=trust_remote_code)
    # every weight is read from the shards next: a random init first would only cost time (24 s of 26 for a
    # 2B-geometry model on this machine's CPU). Skipping it skips the init's tying too, so tie again before the load,
    # which stores a tied weight once (checkpoint.tied_aliases).
    with no_init_weights():
        model = AutoModelForImageTextToText.from_config(config, dtype=dtypes.pop(),
                                                        trust_remote_code=trust_remote_code)
    model.tie_weights()
    # with no process group torch.distributed.checkpoint reads every rank's shards in this one process and
    # reassembles each tensor; it warns that it assumes so ("torch.distributed is disabled"): it is meant
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_sharded(src / SHARDED, model, None)
    return model.eval()
