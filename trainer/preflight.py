"""Checks of a training or evaluation run's inputs before anything heavy starts.

A mistyped ``model.path`` or shard pattern is a user's mistake: the commands report it in one line and exit 2
(``longreel.cli``'s exit codes) instead of failing minutes later, after the process group, the imports and the
model load, with a traceback that reads like a bug. Only what can be checked cheaply and without credentials is:
local directories and files, and the expansion of brace patterns, local globs and wids indexes. Remote shards are
opened when the loader reaches them (their errors name the shard).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from longreel.schemas.config import to_dict
from longreel.task.shard_reader import local_path, resolve_shards
from longreel.trainer.config import absolute_path

log = logging.getLogger("longreel")

__all__ = ["InputCheckError", "check_model_dir", "check_shards", "check_cache_space", "check_out_dir", "check_topology",
           "check_output_file", "ensure_writable_dir",
           "check_environment", "check_launch", "check_resume", "check_run_inputs", "Launch", "read_launch",
           "config_record", "keys_the_engine_ignores", "model_fingerprint", "warn_ignored_keys", "ENGINE_KEYS",
           "RESUMABLE", "RESUMABLE_WITHIN_ROUNDING"]

#: keys a resumed run may change: where and how long it runs, what it logs and saves, how it is launched, and its
#: evaluation; none of them changes a training step's arithmetic (a different world size is warned about), but for
#: run.steps under a linear or cosine schedule, which is laid out over it (check_resume refuses that)
RESUMABLE = ("run.out_dir", "run.steps", "run.stop_after", "run.save_every", "run.keep_checkpoints", "run.resume",
             "run.save_final", "run.log_every", "run.tensorboard", "run.progress", "run.threads", "run.device",
             "run.dump_grads", "run.stop_signals", "data.eval_urls", "data.cache_remote", "data.cache_dir", "eval.",
             "dist.", "data.fetch_retries", "mrsp.frozen_cache_mb", "mrsp.frozen_cache_offload",
             "mrsp.frozen_feature_dir")

#: memory settings a resumed run may change too, to fit where the first run ran out of memory: each computes the same
#: step, but to within floating-point rounding rather than bitwise (another decode batch, K/V from a store, activations
#: recomputed); :func:`check_resume` returns the ones that changed, for the run to say so
RESUMABLE_WITHIN_ROUNDING = ("rollout.prompts_per_decode", "mrsp.ref_prefix_cache_mb", "model.gradient_checkpointing")


#: the weight files ``from_pretrained`` reads (one file, or an index of several)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class InputCheckError(ValueError):
    """A run's input that cannot be used: the message names the key and the value."""


def check_model_dir(path: str, key: str = "model.path") -> None:
    """``path`` must be a local ``save_pretrained`` directory (a run's ``final/`` or ``checkpoints/step-N/``)."""
    if not path:
        raise InputCheckError(f"{key} is required (a local model directory)")
    if not os.path.isdir(path):
        near = run_models_near(path)
        raise InputCheckError(f"{key} {path!r} is not a local directory" + (
            f"; the run's models are {near}" if near else
            " (hub ids are not downloaded here: download the model first)"))
    if not os.path.isfile(os.path.join(path, "config.json")):
        near = run_models_near(path)
        raise InputCheckError(f"{key} {path!r} holds no config.json: not a model directory" + (
            f"; the run's models are {near}" if near else " (a run's final/ or checkpoints/step-N/ is one)"))
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        if os.path.isdir(os.path.join(path, "sharded")):  # checkpoint.SHARDED: an FSDP run's step checkpoint
            raise InputCheckError(f"{key} {path!r} is a sharded (FSDP) step checkpoint: `longreel train export "
                                  f"{path} --out DIR` writes a model directory from it")
        raise InputCheckError(f"{key} {path!r} holds no weights ({', '.join(WEIGHT_FILES)}): not a model directory")
    from longreel.trainer.checkpoint import safetensors_problem

    for name in sorted(os.listdir(path)):  # headers only: milliseconds for a 7B model's files
        problem = safetensors_problem(os.path.join(path, name)) if name.endswith(".safetensors") else None
        if problem is not None:
            raise InputCheckError(f"{key} {path!r}: {problem} (a copy that stopped early? copy it again)")
    problem = _processor_files_problem(path)
    if problem is not None:
        raise InputCheckError(f"{key} {path!r} {problem} (a copy that left files behind? a model directory holds "
                              "the processor's files beside the weights)")


def _json_file(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _processor_files_problem(path: str) -> str | None:
    """What a policy directory lacks that the processor needs, or None. Without these the model loaded and every
    item was then skipped one by one (no chat template: ``apply_chat_template`` failed; no tokenizer: the prompt had
    no video placeholder), and the run ended as a success having trained on nothing."""
    def has(*names: str) -> bool:
        return any(os.path.isfile(os.path.join(path, n)) for n in names)

    if _json_file(os.path.join(path, "config.json")) is None:
        return "has a config.json that is not a JSON object"
    if not has("tokenizer.json", "vocab.json", "tokenizer.model"):
        return "holds no tokenizer (tokenizer.json, vocab.json or tokenizer.model)"
    if not has("preprocessor_config.json", "processor_config.json"):
        return "holds no image processor config (preprocessor_config.json or processor_config.json)"
    templated = has("chat_template.jinja", "chat_template.json") or any(
        "chat_template" in (_json_file(os.path.join(path, n)) or {})
        for n in ("tokenizer_config.json", "processor_config.json"))
    if not templated:
        return ("holds no chat template (chat_template.jinja, chat_template.json, or a chat_template key in "
                "tokenizer_config.json)")
    return None


def run_models_near(path: str, limit: int = 5) -> str:
    """The model directories of the training run ``path`` is in or names (``RUN``, ``RUN/checkpoints``, a pruned or
    mistyped ``RUN/checkpoints/step-6``), newest first, for an error message; "" when it is in no run. Steps are
    named ``step-000006``, which a user types as ``step-6``, and a run keeps only its newest few."""
    here = Path(path)
    run = next((d for d in (here, here.parent, here.parent.parent) if (d / "checkpoints").is_dir()
                or (d / "final" / "config.json").is_file()), None)
    if run is None:
        return ""
    steps = sorted((d for d in (run / "checkpoints").glob("step-*") if d.is_dir() and d.name[5:].isdigit()),
                   key=lambda d: int(d.name[5:]), reverse=True)
    found = ([run / "final"] if (run / "final" / "config.json").is_file() else []) + steps
    named = ", ".join(str(d) for d in found[:limit])
    return named + (f" ({len(found)} in all)" if len(found) > limit else "")


def check_shards(urls: list[str], key: str) -> list:
    """Expand ``urls`` as the loader will; every local shard must be a file. Returns the shards (``ShardSpec``)."""
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
    return specs


def check_cache_space(data_cfg, specs: list) -> None:
    """Remote training shards that ``data.cache_remote`` will download must fit on the cache's disk: all of them
    before step 1 when the items are loaded, the largest two (one read, one downloading ahead) with ``data.stream``.
    A wids index gives each shard's size; shards of unknown size (a bare URL list) are not counted. Without this the
    download ran out of disk partway, minutes or hours in."""
    import shutil

    from longreel.trainer.shard_cache import cached_name, default_cache_dir

    if not data_cfg.cache_remote:
        return
    root = Path(os.path.expanduser(data_cfg.cache_dir or default_cache_dir()))
    missing = [s.bytes for s in specs
               if local_path(s.url) is None and s.bytes and not (root / cached_name(s)).is_file()]
    if not missing:
        return
    need = sum(sorted(missing)[-2:]) if data_cfg.stream else sum(missing)
    probe = root
    while not probe.exists() and probe != probe.parent:  # the cache directory may not be made yet
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        way = ("set data.cache_dir to a larger disk" if data_cfg.stream else
               "set data.stream=true to download the shards as they are read, or data.cache_dir to a larger disk")
        raise InputCheckError(f"data.cache_dir {str(root)!r}: the {len(missing)} remote training shard(s) not yet "
                              f"cached need {need / 1e9:.1f} GB{' (the largest two)' if data_cfg.stream else ''}, "
                              f"{free / 1e9:.1f} GB is free there: {way}")


def config_record(cfg) -> dict:
    """The config as a checkpoint keeps it (``trainer_state.json``): plain JSON values, compared on resume."""
    return json.loads(json.dumps(to_dict(cfg), sort_keys=True, default=str))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def _same_paths(there, here) -> bool:
    """The same training data written two ways: a run from before the trainer made its paths absolute recorded them
    as typed (relative to the directory it was launched in, which a resume from there resolves alike)."""
    return isinstance(there, list) and isinstance(here, list) and len(there) == len(here) and all(
        isinstance(a, str) and isinstance(b, str) and absolute_path(a) == absolute_path(b) for a, b in zip(there, here))


_SAID_SAME_SHARDS: set[tuple] = set()


def _train_shards_kept(there, here, data_cfg, notes: dict) -> bool:
    """``data.train_urls`` names the run's shards still: the same paths written another way, or the same shards in
    the same order at a new location (a bucket's index copied to local disk), by the sha256 each one's index records
    on both sides. The checkpoint records no digest of its own, so the earlier URLs are resolved again; when they
    cannot be, or an index records no sha256, the content cannot be compared and the change is refused, with why in
    ``notes``."""
    if _same_paths(there, here):
        return True
    if not (isinstance(there, list) and isinstance(here, list) and all(isinstance(u, str) for u in there + here)):
        return False
    try:
        new = resolve_shards(list(here))
    except (ValueError, OSError):
        return False  # this run's own shards are check_shards' to name
    key = "data.train_urls"
    try:
        old = resolve_shards(list(there))
    except (ValueError, OSError) as e:
        notes[key] = (f" (the run's shards could not be read there to compare their content: {e}; its checkpoint "
                      "records no shard digests)")
        return False
    if len(old) != len(new):
        notes[key] = f" ({len(old)} shards there, {len(new)} in this run)"
        return False
    if any(s.sha256 is None for s in old + new):
        notes[key] = " (not every shard has a sha256 in a wids index there and here: the content cannot be compared)"
        return False
    differ = next((i for i, (a, b) in enumerate(zip(old, new)) if a.sha256 != b.sha256), None)
    if differ is not None:
        notes[key] = (f" (other shards: shard {differ + 1} of {len(new)}, {new[differ].url}, has another sha256 than "
                      f"{old[differ].url})")
        return False
    names = [s.url.rsplit("/", 1)[-1] for s in old], [s.url.rsplit("/", 1)[-1] for s in new]
    if data_cfg.stream and names[0] != names[1]:  # the stream's saved position names the shards by file name
        notes[key] = " (the same shards under other file names: data.stream's saved position names them by file name)"
        return False
    said = (tuple(here), tuple(there))
    if said not in _SAID_SAME_SHARDS:  # the launch's checks and the session's both look: one line
        _SAID_SAME_SHARDS.add(said)
        log.info("data.train_urls %r: the same content at a new location, %d shards with the sha256s and order of "
                 "the run's %r", here, len(new), there)
    return True


def _same_dir(a, b) -> bool:
    """One directory written two ways (relative to another working directory, through a symlink)."""
    return isinstance(a, str) and isinstance(b, str) and os.path.isdir(a) and os.path.isdir(b) \
        and os.path.samefile(a, b)


def model_fingerprint(path: str) -> str:
    """sha256 over a model directory's weight files and config.json, names and bytes
    (:func:`longreel.engines.local_models.weights_hash`)."""
    from longreel.engines.local_models import weights_hash

    return weights_hash(os.path.abspath(path))


def _same_model(saved_fingerprint, path) -> bool:
    """A model directory moved: ``path`` holds the weights and config the checkpoint's run started from."""
    if not saved_fingerprint or not isinstance(path, str) or not os.path.isdir(path):
        return False
    try:
        return model_fingerprint(path) == saved_fingerprint
    except OSError:
        return False


def check_out_dir(cfg) -> None:
    out = cfg.run.out_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputCheckError(f"run.out_dir {out!r} is not a directory")
    ensure_writable_dir(out, "run.out_dir")


def ensure_writable_dir(path: str, what: str, shown: str | None = None) -> None:
    """Refuse a directory ``path`` that could not be made or written in, before a model loads rather than at the
    first save. Nothing is left behind (a refused run writes nothing): the nearest existing ancestor must be a
    directory in which this process can make one, tried with a uniquely named one removed at once (unique, so that
    the ranks of a launch checking together do not race). ``shown``: the path the message names (default ``path``)."""
    import tempfile

    shown = path if shown is None else shown
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise InputCheckError(f"{what} {shown!r}: {here} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".longreel-probe-", dir=here))
    except OSError as e:
        raise InputCheckError(f"{what} {shown!r}: cannot write in {here}: {e.strerror}") from None


def check_output_file(path: str, what: str) -> None:
    """``path`` can be written as a file: not a directory, and in a directory that can be made and written in."""
    if os.path.isdir(path):
        raise InputCheckError(f"{what} {path!r} is a directory")
    ensure_writable_dir(os.path.dirname(os.path.abspath(path)), what, shown=path)


#: rollout keys that only one rollout engine reads, by the prefix of their name (the other engine ignores them)
ENGINE_KEYS = {"vllm_": "vllm", "prompts_per_decode": "transformers"}


def keys_the_engine_ignores(rollout_cfg) -> list[str]:
    """``rollout.key=value`` for each key set away from its default that only the other rollout engine reads: a
    ``rollout.vllm_sleep_level`` under ``rollout.engine=transformers`` frees no memory, and says nothing about it."""
    defaults = type(rollout_cfg)()
    out = []
    for name in type(rollout_cfg).model_fields:
        engine = next((e for prefix, e in ENGINE_KEYS.items() if name.startswith(prefix)), None)
        value = getattr(rollout_cfg, name)
        if engine is not None and engine != rollout_cfg.engine and value != getattr(defaults, name):
            out.append(f"rollout.{name}={value}")
    return out


def warn_ignored_keys(cfg, stage: str) -> None:
    """A key the run will not read is a setting the user believes in: say so once (rank 0), without stopping a run
    whose config file serves both engines."""
    if stage != "grpo" or read_launch().rank != 0:
        return
    ignored = keys_the_engine_ignores(cfg.rollout)
    if ignored:
        log.warning("%s: not read with rollout.engine=%s (%s)", ", ".join(ignored), cfg.rollout.engine,
                    "the vllm_* keys apply to rollout.engine=vllm, prompts_per_decode to rollout.engine=transformers")


@dataclass(frozen=True)
class Launch:
    """How this process was started: one process, or one rank of ``world`` (``local_rank``: its GPU on its node;
    None when the launcher did not say)."""
    world: int = 1
    rank: int = 0
    local_rank: int | None = None


def read_launch(environ=None) -> Launch:
    """The launch that ``torchrun`` describes in the environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, and the
    rendezvous ``MASTER_ADDR``/``MASTER_PORT``), or that a user set by hand for a launcher such as ``srun``.

    A missing or malformed variable is a launch mistake: read unchecked it surfaced as a ``KeyError`` or a
    ``ValueError`` traceback reported as a bug, and a ``RANK`` outside the world waited at the rendezvous for a rank
    that never comes."""
    env = os.environ if environ is None else environ
    world = _env_int(env, "WORLD_SIZE", 1)
    if world < 1:
        raise InputCheckError(f"WORLD_SIZE={world}: the number of ranks must be at least 1")
    if world == 1:
        return Launch()
    hint = ("torchrun sets it for each rank; under srun set RANK=$SLURM_PROCID, LOCAL_RANK=$SLURM_LOCALID and "
            "WORLD_SIZE=$SLURM_NTASKS")
    rank = _env_int(env, "RANK", None)
    if rank is None:
        raise InputCheckError(f"WORLD_SIZE={world} but RANK is not set ({hint})")
    if not 0 <= rank < world:
        raise InputCheckError(f"RANK={rank} with WORLD_SIZE={world}: the ranks are 0 to {world - 1}")
    local = _env_int(env, "LOCAL_RANK", None)
    if local is not None and local < 0:
        raise InputCheckError(f"LOCAL_RANK={local}: a rank's GPU index on its node cannot be negative")
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(key):
            raise InputCheckError(f"WORLD_SIZE={world} but {key} is not set: the ranks meet at MASTER_ADDR:"
                                  "MASTER_PORT, a free port on rank 0's host (torchrun sets both)")
    port = _env_int(env, "MASTER_PORT", None)
    if not 0 < port < 65536:
        raise InputCheckError(f"MASTER_PORT={port}: not a TCP port (1 to 65535)")
    return Launch(world=world, rank=rank, local_rank=local)


def _env_int(env, key: str, default: int | None) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputCheckError(f"{key}={raw!r} is not an integer") from None


def check_launch(cfg, launch: Launch) -> None:
    """A launch of several ranks must fit the machine: NCCL needs the ranks on GPUs, and each rank of a GPU launch
    must know its own GPU. Without ``LOCAL_RANK`` every rank of a node takes GPU 0, which NCCL reports only at its
    first collective (or every rank runs out of memory on one device)."""
    if launch.world == 1:
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() and cfg.run.device != "cpu" else 0
    if cfg.dist.backend == "nccl" and gpus == 0:
        raise InputCheckError("dist.backend=nccl needs the ranks on GPUs (run.device=cuda or auto, with a GPU); on "
                              "CPUs give dist.backend=gloo (auto picks it)")
    if gpus == 0:
        return  # run.device=cuda without a GPU is check_environment's; auto runs on the CPU
    if launch.local_rank is None and gpus > 1:
        raise InputCheckError(f"LOCAL_RANK is not set and this node has {gpus} GPUs: every rank would take GPU 0. "
                              "torchrun sets it; under srun set LOCAL_RANK=$SLURM_LOCALID (or give each rank one GPU "
                              "with CUDA_VISIBLE_DEVICES)")
    if launch.local_rank is not None and launch.local_rank >= gpus:
        raise InputCheckError(f"LOCAL_RANK={launch.local_rank} but {gpus} GPU{'s are' if gpus > 1 else ' is'} "
                              "visible on this node: more ranks were started on it than it has GPUs")


def check_environment(cfg, stage: str) -> None:
    """What the config asks of this machine and its packages: a CUDA device, the vLLM rollout engine, FlashAttention
    2. Each is otherwise found after the imports and the model load, as a traceback."""
    import importlib.util

    if cfg.run.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputCheckError("run.device=cuda but no CUDA device is available (run.device=auto picks the CPU "
                                  "here)")
    if stage == "grpo" and cfg.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise InputCheckError("rollout.engine=vllm needs vllm installed (pip install 'longreel[gpu]') and a GPU; "
                              "rollout.engine=transformers runs anywhere")
    if cfg.model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise InputCheckError("model.attn_implementation=flash_attention_2 needs the flash-attn package (and a "
                              "GPU); sdpa runs anywhere")


def check_topology(cfg, stage: str, world: int) -> None:
    """The launch must fit the config: sequence-parallel groups cut the world evenly (GRPO with MR-SP), and the
    global batch splits evenly over the data-parallel replicas (``torchrun`` sets ``WORLD_SIZE``). And a GRPO group
    has two rollouts at least: its advantages are the rollouts' rewards against their own mean."""
    if stage == "sft" and cfg.data.stream and cfg.sft.max_items:  # a GRPO run never reads sft.max_items
        raise InputCheckError("data.stream cannot take the first sft.max_items items (they are not known before the "
                              "shards are read)")
    if stage == "grpo" and cfg.rollout.n < 2:
        raise InputCheckError(f"rollout.n={cfg.rollout.n}: GRPO compares the rollouts of a prompt with each other, so "
                              "one alone has advantage 0 and the run could never learn; use 2 or more (8 is usual)")
    sp = cfg.mrsp.sp_size if stage == "grpo" and cfg.mrsp.enabled else 1
    if sp < 1 or world % sp or (sp > 1 and world == 1):
        raise InputCheckError(f"mrsp.sp_size={sp} needs torchrun with a world size divisible by it (world size "
                              f"{world})")
    dp = world // sp
    if cfg.data.batch_size % dp:
        what = (f"the data-parallel size {dp} (world {world} / mrsp.sp_size {sp})" if sp > 1
                else f"the world size {world}")
        raise InputCheckError(f"data.batch_size {cfg.data.batch_size} must divide by {what}")


def check_resume(cfg, stage: str, checkpoint: Path) -> list[str]:
    """A run resumes only what it would have written itself: the same stage, and the same config but for
    :data:`RESUMABLE` keys and the memory settings of :data:`RESUMABLE_WITHIN_ROUNDING`. Otherwise the saved
    optimizer, schedule and loader state would be continued under other settings (a changed ``optim.lr`` was silently
    replaced by the saved schedule's). Returns the memory settings that changed, as ``"key: old -> new"``."""
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    out = cfg.run.out_dir
    if state.get("stage") != stage:
        raise InputCheckError(f"run.out_dir {out!r} holds a {state.get('stage')!r} run ({checkpoint.name}), not "
                              f"{stage!r}: give this stage its own run.out_dir")
    saved = state.get("config")
    if saved is None:  # written before checkpoints kept their config: nothing to compare
        return []
    there, here = _flat(saved), _flat(config_record(cfg))
    notes: dict[str, str] = {}
    changed = [k for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k)
               and not (k == "model.path" and _model_path_kept(there.get(k), here.get(k), state))
               and not (k == "data.train_urls" and _train_shards_kept(there.get(k), here.get(k), cfg.data, notes))]
    rounding = [f"{k}: {there.get(k)!r} -> {here.get(k)!r}" for k in changed if k in RESUMABLE_WITHIN_ROUNDING]
    unused = unread_by(stage, cfg)
    differ = [k for k in changed if not _resumable(k) and k not in RESUMABLE_WITHIN_ROUNDING
              and not k.startswith(unused)]
    if "run.steps" in changed and cfg.optim.schedule != "constant":
        # a linear or cosine schedule is laid out over run.steps: another total changes every later step's rate
        differ.insert(0, "run.steps")
    if differ:
        why = {"run.steps": f" (optim.schedule={cfg.optim.schedule} is laid out over run.steps)", **notes}
        shown = "; ".join(f"{k}: {there.get(k)!r} there, {here.get(k)!r} in this run{why.get(k, '')}"
                          for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        raise InputCheckError(f"run.out_dir {out!r} holds {checkpoint.name} of a run with another configuration: "
                              f"{shown}{more}. Resume it with its own settings, give another run.out_dir, or set "
                              "run.resume=false to start over there")
    return rounding


def unread_by(stage: str, cfg) -> tuple[str, ...]:
    """Key prefixes a stage never reads: SFT no rollout, GRPO or MR-SP setting, GRPO no sft one, and a run on shards
    no synthetic-task key. A change there changes nothing of a resumed run, so it is not refused: one config file
    serves both stages (a resumed SFT run refused over a grpo.beta its GRPO stage was to use)."""
    unread = ("rollout.", "grpo.", "mrsp.") if stage == "sft" else ("sft.",)
    return unread + (("data.synthetic_",) if cfg.data.source == "shards" else ())


def check_start_over(cfg) -> None:
    """``run.resume=false`` removes the directory's checkpoints and final/: refused when the model it is to train
    from is among them (GRPO from ``RUN/final`` into ``RUN``), which it deleted before loading it."""
    out = Path(cfg.run.out_dir).resolve()
    model = Path(cfg.model.path).resolve()
    for removed in (out / "checkpoints", out / "final"):
        if model == removed or removed in model.parents:
            raise InputCheckError(f"run.resume=false would remove model.path {cfg.model.path!r} with the earlier "
                                  f"run's {removed.name}/ in run.out_dir {cfg.run.out_dir!r}: give this run another "
                                  "run.out_dir, or copy the model out first")


def check_sharding(cfg, checkpoint: Path, world: int) -> None:
    """An FSDP run's sharded checkpoint resumes under FSDP with several ranks, a full one without: found when the
    checkpoint loaded, after the model, it was a traceback reported as a bug."""
    from longreel.trainer.checkpoint import is_sharded_checkpoint

    fsdp = cfg.dist.strategy == "fsdp" and world > 1
    if is_sharded_checkpoint(checkpoint) and not fsdp:
        raise InputCheckError(f"run.out_dir {cfg.run.out_dir!r} holds {checkpoint.name} of an FSDP run (sharded): "
                              "resume it with dist.strategy=fsdp under torchrun (2 or more ranks), or export it "
                              f"(`longreel train export {checkpoint} --out DIR`)")
    if fsdp and not is_sharded_checkpoint(checkpoint):
        raise InputCheckError(f"run.out_dir {cfg.run.out_dir!r} holds {checkpoint.name} of a single-process or DDP "
                              "run (full weights): resume it without dist.strategy=fsdp")


_SAID_MOVED: set[tuple] = set()


def _model_path_kept(there, here, state: dict) -> bool:
    """``model.path`` names the run's model still: the same directory written another way, or the directory moved
    with its content unchanged (by the fingerprint the checkpoint keeps)."""
    if _same_dir(there, here):
        return True
    if _same_model(state.get("model_fingerprint"), here):
        said = (here, there)
        if said not in _SAID_MOVED:  # the launch's checks and the session's both look: one line
            _SAID_MOVED.add(said)
            log.info("model.path %r is where the run's model (%s) was, as %r: the same weights and config", here,
                     state["model_fingerprint"], there)
        return True
    return False


def resume_point(cfg, ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint the run resumes (``checkpoint.resumable_checkpoint``) and a line for each newer one it passes
    over. A run whose every checkpoint is damaged is refused with the way out rather than started over, which would
    drop its logged steps."""
    from longreel.trainer.checkpoint import resumable_checkpoint

    path, passed_over = resumable_checkpoint(ckpt_root)
    lines = [f"{p.name}: {why}" for p, why in passed_over]
    if path is None and passed_over:
        raise InputCheckError(f"run.out_dir {cfg.run.out_dir}: no checkpoint there can be resumed ({'; '.join(lines)}"
                              "): copy its files back, or start over there with --set run.resume=false (which removes "
                              "the checkpoints)")
    return path, lines


def check_run_inputs(cfg, stage: str) -> None:
    """What ``longreel train <stage>`` reads before its first step: the policy directory, the output directory and
    the checkpoint it would resume, and, for shard data, the training shards (and the held-out ones when the run
    evaluates during training)."""
    check_model_dir(cfg.model.path)
    check_out_dir(cfg)
    launch = read_launch()
    check_topology(cfg, stage, launch.world)
    check_environment(cfg, stage)
    check_launch(cfg, launch)
    warn_ignored_keys(cfg, stage)
    if not cfg.run.resume:
        check_start_over(cfg)
    latest = resume_point(cfg, Path(cfg.run.out_dir) / "checkpoints")[0] if cfg.run.resume else None
    if latest is not None:
        check_resume(cfg, stage, latest)
        check_sharding(cfg, latest, launch.world)
    if cfg.data.source != "shards":
        return
    check_cache_space(cfg.data, check_shards(cfg.data.train_urls, "data.train_urls"))
    if cfg.eval.every > 0:
        check_shards(cfg.data.eval_urls, "data.eval_urls")
