"""Shared run-time pieces of the SFT and GRPO loops: distributed setup, seeding, optimizer + schedule, data order.

Distributed: started by ``torchrun`` (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in the environment), gloo on CPU and
NCCL on GPU. Data parallelism keeps one full replica per rank and sums gradients with ``all_reduce`` after the
backward passes of a step (``sum_gradients``): each rank's loss is already divided by the *global* token (or
sequence) count, so the summed gradient equals the single-process gradient of the same global batch.

FSDP (``dist.strategy=fsdp``, :func:`shard_fsdp`): the model is wrapped with FSDP2 ``fully_shard`` (one unit per
decoder layer, one for the vision tower, one for the token embeddings, the root holding the final norm and LM head),
so weights,
gradients and AdamW state are sharded over the ranks; FSDP reduce-scatters and averages, so the loss is scaled by
the world size. FSDP runs a collective in every unit's forward and backward, so the ranks must run the same passes
in the same order, which a trainer whose ranks generate responses of different lengths does not do by itself:

* the no-grad phases (rollouts, old/reference log-probs, evaluation) run inside ``TrainSession.gathered()``: every
  unit is gathered once, by every rank together, and the phase runs without collectives;
* the root, the embeddings and the vision tower stay gathered from then until the optimizer step
  (``hold_resident``): MR-SP calls the tower and the embeddings directly rather than through the root's forward,
  and the deferred vision backward reuses the rollout's encode graph;
* the update's decoder-layer passes are FSDP's usual per-layer gather / reduce-scatter (ZeRO-3, or ZeRO-2 with
  ``dist.fsdp_reshard_after_forward=false``); a rank with fewer passes (a skipped item) pads with zero-weight passes
  (``lockstep_passes``).

Checkpoints of an FSDP run are sharded (``torch.distributed.checkpoint`` into safetensors, see
``longreel.trainer.checkpoint``).

MR-SP sequence parallelism (GRPO, ``mrsp.sp_size = S > 1``): the world is cut into groups of ``S`` consecutive
ranks (``init_sp_groups``); the ranks of a group take the same prompts, so data parallelism runs over
``world / S`` replicas (``DistInfo.dp_size`` / ``dp_rank``, used by ``TrainSession.local_batch``). Every rank of a
group holds its share of the group's gradient (the ``longreel.trainer.mrsp.dist_ops`` convention), so the one world-wide
gradient sum (``sum_gradients``) is at once the sum over the SP group and over the data-parallel replicas. Under
FSDP the same holds for the reduce-scatter (a world-wide average, times ``loss_scale`` = world size), with the
weights sharded over the whole world; the sequence-parallel prefill runs each decoder layer as a forward of its FSDP
unit (``longreel.trainer.mrsp.fsdp_calls``) so that every rank gathers, and reduces, the same layers in the same order.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import math
import os
import random
import signal
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from longreel.trainer.activation_checkpointing import enable_checkpointing
from longreel.trainer.config import DataConfig, OptimConfig
from longreel.trainer.preflight import InputCheckError, read_launch
from longreel.trainer.run_lock import RunLock, seen_as_rank_0_sees
from longreel.trainer.stop_signals import StopSignals

__all__ = ["DistInfo", "init_distributed", "init_sp_groups", "sum_gradients", "all_gather_objects", "first_problem",
           "all_reduce_sum", "all_reduce_max", "fsdp_mixed_precision", "shard_fsdp",
           "seed_everything", "build_optimizer", "build_scheduler", "ItemStream", "load_items", "open_item_stream",
           "rollout_seed"]

log = logging.getLogger("longreel.trainer")


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str = ""
    sp_size: int = 1
    sp_group: Any = None  # this rank's sequence-parallel process group (None: no SP)
    owns_group: bool = False  # init_distributed created the process group (and the session destroys it)
    timeout: datetime.timedelta | None = None  # of every group the trainer creates (None: torch's default)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: SP groups take the same prompts."""
        return self.world // self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_size

    @property
    def sp_leader(self) -> bool:
        """The rank that speaks for its SP group in sums of per-replica quantities (token counts, losses)."""
        return self.sp_rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group when launched by torchrun; a single process otherwise. ``timeout_s``: the group's
    collective (and rendezvous) timeout; None keeps torch's default."""
    import torch.distributed as dist

    launch = read_launch()  # a library caller's launch mistakes get the command's messages too
    if launch.world == 1:
        return DistInfo(device=device)
    world, rank, local_rank = launch.world, launch.rank, launch.local_rank or 0
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    owns = not dist.is_initialized()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if owns:
        try:
            dist.init_process_group(backend=backend, timeout=timeout)
        except dist.DistError as e:  # the store could not be set up or reached: the launch, not the code
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            said = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__).rstrip(". ")
            raise InputCheckError(f"rank {rank}: the {world} ranks could not meet at MASTER_ADDR:MASTER_PORT "
                                  f"({where}): {said}. Is the port free on rank 0's host and reachable from the "
                                  f"others, and were all {world} ranks started?") from e
        # a gloo group still alive at interpreter exit (an exception that skipped close()) can abort the process
        # with "terminate called without an active exception", hiding the real error: destroy it while Python is
        # still whole
        atexit.register(_destroy_at_exit)
    return DistInfo(rank=rank, world=world, local_rank=local_rank, device=device, backend=backend, owns_group=owns,
                    timeout=timeout)


def _destroy_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def init_sp_groups(info: DistInfo, sp_size: int) -> DistInfo:
    """Cut the world into sequence-parallel groups of ``sp_size`` consecutive ranks; return ``info`` with this rank's
    group. Every rank must call it (``new_group`` is collective over the world, for every group).

    With ``sp_size == 1`` under torchrun each rank still gets a group (of itself): the MR-SP collectives read
    ``group=None`` as the whole world, which would wrongly split a data-parallel rank's work with the others."""
    if sp_size < 1 or info.world % sp_size or (sp_size > 1 and not info.enabled):
        raise InputCheckError(f"mrsp.sp_size={sp_size} needs torchrun with a world size divisible by it "
                              f"(world size {info.world})")
    if not info.enabled:
        return info
    import torch.distributed as dist

    mine = None
    for start in range(0, info.world, sp_size):
        # torch gives a new group its backend's default timeout (nccl: 10 minutes), not the world's
        g = dist.new_group(list(range(start, start + sp_size)), timeout=info.timeout)
        if start <= info.rank < start + sp_size:
            mine = g
    info.sp_size, info.sp_group = sp_size, mine
    return info


def sum_gradients(model: torch.nn.Module, info: DistInfo) -> None:
    """All-reduce (sum) every gradient across ranks, in one flat bucket per dtype."""
    if not info.enabled:
        return
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if not info.enabled:
        return float(value)
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def recorded_config(cfg):
    """The config a run records in RUN/config.yaml: its own, but with ``run.resume`` true. ``run.resume=false`` is
    what one launch does (clear the directory), not a setting of the run: recorded, a later ``longreel train --config
    RUN/config.yaml --set run.steps=N``, meant to extend the run, removed its checkpoints and final/ instead."""
    recorded = cfg.model_copy(deep=True)
    recorded.run.resume = True
    return recorded


def all_reduce_max(value: int, info: DistInfo) -> int:
    if not info.enabled:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=info.device if info.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def first_problem(problem: str | None, info: DistInfo) -> str | None:
    """The problem (a user's input that cannot be used) found by the lowest rank that found one, on every rank; None
    when no rank did. Every rank must call it. A rank that raised alone would leave the others in their next
    collective: under gloo it fails there as an internal error, under NCCL (and a launcher such as ``srun`` that does
    not stop the other ranks) it waits for the collective's timeout."""
    return next((p for p in all_gather_objects(problem, info) if p is not None), None)


def all_gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rollout_seed(run_seed: int, step: int, index: int) -> int:
    """Sampling seed of one prompt's group: a function of (run seed, step, the prompt's global batch position),
    so a prompt samples the same rollouts whatever rank handles it and after a resume."""
    return (run_seed * 1_000_003 + step * 10_007 + index * 101 + 17) % (2**63 - 1)


# --------------------------------------------------------------------------------------------------
# FSDP
# --------------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fsdp_mixed_precision(param_dtype: str, reduce_dtype: str, device: torch.device):
    """``MixedPrecisionPolicy`` of ``dist.fsdp_param_dtype`` / ``dist.fsdp_reduce_dtype``: ``auto`` is bf16 compute
    with fp32 gradient reduction on CUDA and off on CPU (bf16 matmuls on a CPU are slow and not what the CPU tests
    compare against)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cuda = device.type == "cuda"
    pick = lambda name, gpu: (gpu if cuda else None) if name == "auto" else _DTYPES.get(name)  # noqa: E731
    return MixedPrecisionPolicy(param_dtype=pick(param_dtype, torch.bfloat16),
                                reduce_dtype=pick(reduce_dtype, torch.float32))


def fsdp_parts(model: torch.nn.Module) -> tuple[torch.nn.Module | None, list[torch.nn.Module]]:
    """(vision tower or None, decoder layers) of an HF VLM (``model.model.visual``, ``...language_model.layers``)."""
    base = getattr(model, "model", model)
    lm = getattr(base, "language_model", None)
    layers = list(getattr(lm, "layers", None) or [])
    if not layers:
        raise ValueError("dist.strategy=fsdp: found no decoder layers (model.model.language_model.layers)")
    return getattr(base, "visual", None), layers


def shard_fsdp(model: torch.nn.Module, *, mp_policy=None, reshard_after_forward: bool = True) -> dict[str, list]:
    """Wrap ``model`` with FSDP2 ``fully_shard``: one unit per decoder layer, one for the vision tower, one for the
    token embeddings, and the root (final norm, LM head). Returns the units by role (``layers``, ``resident``: the
    vision tower, the embeddings and the root, which ``TrainSession`` keeps gathered through a step)."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    visual, layers = fsdp_parts(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    resident = []
    if visual is not None:
        fully_shard(visual, **kw)
        resident.append(visual)
    # the embeddings in a unit of their own: MR-SP looks them up outside the model's forward (inputs_embeds), after
    # which the root's post-backward hook (on its forward's inputs) has already reduced the root's gradients; a unit
    # whose input needs no gradient is reduced at the end of the backward, once its gradient is complete
    emb = getattr(getattr(getattr(model, "model", model), "language_model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if emb is not None and head is not None and head.weight is emb.weight:
        # tied embeddings (Qwen2-VL-2B, Qwen2.5-VL-3B): FSDP2 manages a shared parameter in one unit only, so the
        # LM head joins the embeddings' unit
        fully_shard([emb, head], **kw)
        resident.append(emb)
    elif emb is not None:
        fully_shard(emb, **kw)
        resident.append(emb)
    fully_shard(model, **kw)
    resident.append(model)
    # FSDP makes the first unit to run forward the root; MR-SP calls the tower before (or without) the model's own
    # forward, so settle the root now (private in torch 2.14; there is no public call for it)
    model._get_fsdp_state()._lazy_init()
    return {"layers": layers, "resident": resident}


# --------------------------------------------------------------------------------------------------
# optimizer and schedule
# --------------------------------------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters")
    # foreach=False: the same per-parameter arithmetic everywhere (bitwise resume on CPU)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, foreach=False)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warm-up, then the schedule."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    lo = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return lo + (1.0 - lo) * (1.0 - progress)
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


class ItemStream:
    """Deterministic, resumable order over a list of items: epoch ``e`` is a permutation seeded by
    ``(seed, e)`` (or the natural order without shuffle). ``state_dict()`` is the loader position."""

    def __init__(self, items: list[dict], seed: int = 0, shuffle: bool = True):
        if not items:
            raise InputCheckError("no training items (the shards hold no item of this split?)")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> list[int]:
        n = len(self.items)
        if not self.shuffle:
            return list(range(n))
        rng = np.random.default_rng([self.seed, epoch, 7])
        return rng.permutation(n).tolist()

    def next_batch(self, size: int) -> list[tuple[int, dict]]:
        """The next ``size`` items as ``(item index, item)``; crosses epoch boundaries."""
        out = []
        while len(out) < size:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._make_order(self.epoch)
            i = self._order[self.pos]
            self.pos += 1
            out.append((i, self.items[i]))
        return out

    def __iter__(self) -> Iterator[dict]:
        return iter(self.items)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "shuffle": self.shuffle,
                "n_items": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_items") != len(self.items):
            raise InputCheckError(f"checkpoint loader state is for {state.get('n_items')} items, the data has "
                                  f"{len(self.items)}: resuming on other data would not continue where it stopped")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order(self.epoch)

    def close(self) -> None:
        """Nothing to release (the shard stream's interface)."""


def open_item_stream(cfg, items: list[dict] | None = None):
    """The run's item order: over ``items`` (or every item of the training data, loaded now), or, with
    ``data.stream``, over the shards as they are read (:class:`longreel.trainer.shard_stream.ShardItemStream`)."""
    if items is None and cfg.data.stream:
        from longreel.trainer.shard_cache import default_cache_dir
        from longreel.trainer.shard_stream import ShardItemStream

        cache = (cfg.data.cache_dir or default_cache_dir()) if cfg.data.cache_remote else None
        return ShardItemStream(cfg.data.train_urls, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                               shuffle_buffer=cfg.data.shuffle_buffer, on_error=cfg.data.on_error, cache_dir=cache,
                               retries=cfg.data.fetch_retries)
    items = items if items is not None else load_items(cfg.data, "train")
    return ItemStream(items, seed=cfg.run.seed, shuffle=cfg.data.shuffle)


def load_items(cfg: DataConfig, split: str, loader_stats: dict | None = None) -> list[dict]:
    """Per-question items of ``split`` (``"train"`` or ``"eval"``): synthetic, or read from shards with
    ``longreel.trainer.data``. ``loader_stats``: filled with what the shard loader skipped under
    ``data.on_error=skip`` (``skipped_shards``, ``skipped_samples``, ``skips``), for a result to record."""
    if cfg.source == "synthetic":
        from longreel.trainer.synthetic_task import make_items

        if split == "train":
            return make_items(cfg.synthetic_train, seed=cfg.synthetic_seed, kinds=cfg.synthetic_kinds)
        return make_items(cfg.synthetic_eval, seed=cfg.synthetic_seed + 1000, kinds=cfg.synthetic_kinds)
    urls = cfg.train_urls if split == "train" else cfg.eval_urls
    if not urls:
        raise InputCheckError(f"data.{'train' if split == 'train' else 'eval'}_urls is empty (data.source=shards)")
    from longreel.trainer.data import ShardDataset, ShardError, resolve_shards
    from longreel.trainer.shard_cache import cache_remote_shards, default_cache_dir

    try:
        specs = resolve_shards(list(urls))
        fetch = None
        if cfg.cache_remote:  # remote frames memory-mapped from disk rather than held in RAM
            try:
                cached = dict(zip(specs, cache_remote_shards(specs, cfg.cache_dir or default_cache_dir(),
                                                             retries=cfg.fetch_retries)))
            except ShardError as e:  # every shard is fetched before step 1: data.on_error does not reach this
                raise InputCheckError(f"{e} (a shard that cannot be downloaded stops a run that loads its shards "
                                      "before step 1; with data.stream=true, data.on_error=skip skips it)") from e
            fetch = lambda spec, upcoming: cached[spec]  # noqa: E731 - read the copy, name the shard
        # every rank reads every item; ItemStream splits each global batch over the ranks
        ds = ShardDataset(specs, shuffle=False, epochs=1, rank=0, world_size=1, on_error=cfg.on_error, fetch=fetch,
                          retries=0 if cfg.cache_remote else cfg.fetch_retries)
        items = list(ds)
    except ShardError as e:  # a shard that cannot be fetched or a corrupt sample (data.on_error=raise): the input's
        raise InputCheckError(f"{e} (data.on_error=skip skips and counts bad samples and shards)") from e
    if ds.stats.skipped_samples or ds.stats.skipped_shards:
        log.warning("shard loader skipped %d samples and %d shards: %s", ds.stats.skipped_samples,
                    ds.stats.skipped_shards, ds.stats.errors[-3:])
    if loader_stats is not None:
        loader_stats.update(skipped_shards=ds.stats.skipped_shards, skipped_samples=ds.stats.skipped_samples,
                            skips=list(ds.stats.skips))
    return items


# --------------------------------------------------------------------------------------------------
# a training session: everything SFT and GRPO set up the same way
# --------------------------------------------------------------------------------------------------


class TrainSession:
    """Process group, policy, optimizer, schedule, data order, checkpoints and metrics of one stage's run.

    After construction, ``self.step`` is the number of optimizer steps already done (non-zero after a resume).
    """

    def __init__(self, cfg, stage: str, *, items: list[dict] | None = None, total_steps: int | None = None,
                 sp_size: int | None = None):
        from pathlib import Path

        from longreel.trainer.policy import load_policy, resolve_device, resolve_dtype

        self.cfg = cfg
        self.stage = stage
        device = resolve_device(cfg.run.device)
        self.info = init_distributed(device, cfg.dist.backend, cfg.dist.timeout_s)
        if sp_size is not None:  # MR-SP: sequence-parallel groups (of 1 rank each when sp_size is 1)
            init_sp_groups(self.info, sp_size)
        self.device = self.info.device
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if cfg.run.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        seed_everything(cfg.run.seed)
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.model, self.processor = load_policy(cfg.model.path, dtype=self.dtype, device=self.device,
                                                 attn_implementation=cfg.model.attn_implementation,
                                                 vision_attention=cfg.model.vision_attention,
                                                 packed_row_attention=cfg.model.packed_row_attention,
                                                 trust_remote_code=cfg.model.trust_remote_code)
        if cfg.model.freeze_vision:
            visual = getattr(self.model, "visual", None) or getattr(getattr(self.model, "model", None), "visual", None)
            if visual is None:
                raise InputCheckError("model.freeze_vision: this model has no .visual tower")
            for p in visual.parameters():
                p.requires_grad_(False)
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(self.model)
        self.model.train()
        self.out_dir = Path(cfg.run.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.take_run_lock()
        try:
            self._start(cfg, stage, items, total_steps)
        except BaseException:
            self.release_lock()
            raise

    def take_run_lock(self) -> None:
        """Rank 0 takes ``run.out_dir``'s lock; every other rank then looks for rank 0's lock record in its own
        ``run.out_dir``, to find a directory that is not one for every rank. Either problem stops every rank, so that
        none is left waiting for rank 0."""
        self.lock, taken = None, None
        if self.info.is_main:
            try:
                self.lock = RunLock(self.out_dir).acquire()
            except InputCheckError as e:
                taken = str(e)
        taken, record = all_gather_objects((taken, self.lock.record if self.lock else None), self.info)[0]
        if taken is not None:
            raise InputCheckError(taken)
        unshared = None if self.info.is_main else seen_as_rank_0_sees(self.out_dir, record, self.info.rank)
        unshared = first_problem(unshared, self.info)
        if unshared is not None:
            self.release_lock()
            raise InputCheckError(unshared)

    def _start(self, cfg, stage: str, items, total_steps) -> None:
        """Items, data order, optimizer, schedule, the checkpoint to resume and the logs (under the run's lock)."""
        from longreel.schemas.atomic import write_atomic
        from longreel.schemas.config import config_hash, dump_yaml
        from longreel.trainer.checkpoint import clear_checkpoints, clear_final, load_checkpoint, remove_unfinished_saves
        from longreel.trainer.logging_utils import MetricsLogger
        from longreel.trainer.preflight import check_resume, check_start_over, check_topology, resume_point

        check_topology(cfg, stage, self.info.world)  # the CLI checked WORLD_SIZE; a library caller gets it here
        self.stream = open_item_stream(cfg, items)
        self.total_steps = int(total_steps if total_steps is not None else cfg.run.steps)
        self.step = 0
        if self.info.is_main:
            removed = remove_unfinished_saves(self.ckpt_root, self.out_dir)  # this run holds the directory's lock
            if removed:
                log.warning("removed what saves that did not finish left in %s: %s", self.out_dir, ", ".join(removed))
        resume_from, passed_over = resume_point(cfg, self.ckpt_root) if cfg.run.resume else (None, [])
        if resume_from is not None and passed_over and self.info.is_main:
            # the steps after it run again, exactly as they ran (bitwise on CPU): lost time, not a different run
            log.warning("resuming from %s, the newest whole checkpoint, passing over %s", resume_from.name,
                        "; ".join(passed_over))
        if not cfg.run.resume and self.info.is_main:
            check_start_over(cfg)  # the CLI checked before the model loaded; a library caller gets it here
            clear_checkpoints(self.ckpt_root)
            clear_final(self.out_dir)  # else a run stopped before its end leaves the earlier run's model as final/
        self.fsdp = cfg.dist.strategy == "fsdp" and self.info.enabled
        self._units: dict[str, list] = {"layers": [], "resident": []}
        self._held = self._gathered = False
        if self.fsdp:
            self._units = shard_fsdp(self.model, reshard_after_forward=cfg.dist.fsdp_reshard_after_forward,
                                     mp_policy=fsdp_mixed_precision(cfg.dist.fsdp_param_dtype,
                                                                    cfg.dist.fsdp_reduce_dtype, self.device))
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate of the step the run takes next (see clip_and_step)
        self.config_hash = config_hash(cfg)
        if resume_from is not None:
            rounding = check_resume(cfg, stage, resume_from)
            if rounding and self.info.is_main:
                log.warning("resuming %s with other memory settings (%s): the steps from here compute the same to "
                            "within floating-point rounding, not bitwise what the unchanged run would have",
                            resume_from.name, "; ".join(rounding))
            # a sharded (FSDP) checkpoint loads into the sharded model and optimizer on every rank together
            state = load_checkpoint(resume_from, model=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, rank=self.info.rank, sharded=self.fsdp)
            if state.get("world") != self.info.world and self.info.is_main:
                # the weights, optimizer state and loader position carry over (resharded under FSDP); the ranks'
                # RNG streams do not map one to one, so the run goes on as a new world would, not bitwise
                log.warning("resuming a %s-rank checkpoint on %s ranks: weights, optimizer and data position carry "
                            "over; sampling continues from the ranks' own RNG states where they exist, not bitwise as "
                            "on %s ranks", state.get("world"), self.info.world, state.get("world"))
            self.stream.load_state_dict(state["loader"])
            self.step = int(state["step"])
            log.info("resumed %s from %s at step %d", stage, resume_from, self.step)
            if self.step > self.total_steps and self.info.is_main:
                log.warning("run.steps=%d is below step %d, where the run is: there is nothing to train, and the "
                            "run ends at step %d", self.total_steps, self.step, self.step)
        elif self.info.is_main:  # where a new run writes: its config.yaml keeps run.out_dir as typed (maybe relative)
            log.info("%s run in %s: steps 1-%d", stage, self.out_dir.resolve(), self.total_steps)
        if cfg.eval.every and self.step < self.total_steps:
            # before step 1: held-out shards that cannot be read stopped the run at its first evaluation, hours in,
            # with no checkpoint of the steps since the last save
            self._eval_items = self._load_eval_items()
        self._model_fingerprint = self._fingerprint_model(cfg.model.path)
        self.logger = MetricsLogger(self.out_dir, stage=stage, enabled=self.info.is_main,
                                    tensorboard=cfg.run.tensorboard, progress=cfg.run.progress,
                                    total_steps=self.total_steps, start_step=self.step)
        if self.info.is_main:  # what this run trains with, beside what it writes
            write_atomic(self.out_dir / "config.yaml", dump_yaml(recorded_config(cfg)))

    # ------------------------------------------------------------------ distributed helpers
    def hold_resident(self) -> None:
        """FSDP: gather the vision tower and the root (every rank together) and keep them gathered until
        ``release()`` (the optimizer step). A no-op without FSDP or when already held."""
        if not self.fsdp or self._held:
            return
        for m in self._units["resident"]:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()
        self._held = True

    @contextmanager
    def gathered(self):
        """FSDP: run a no-grad phase (rollouts, log-probs, evaluation) on gathered weights, with no collective inside,
        so ranks may run different numbers of forwards (responses of different lengths). Every rank enters and
        leaves together. The resident units stay held afterwards; the decoder layers are sharded again."""
        if not self.fsdp or self._gathered:
            yield
            return
        self.hold_resident()
        for m in self._units["layers"]:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        self._gathered = True
        try:
            yield
        finally:
            self._gathered = False
            for m in self._units["layers"]:
                m.reshard()
                m.set_reshard_after_forward(self.cfg.dist.fsdp_reshard_after_forward, recurse=False)

    def release(self) -> None:
        """FSDP: shard every unit again (before the optimizer step, which updates the shards)."""
        if not self.fsdp or not self._held:
            return
        for m in self._units["resident"]:
            m.reshard()
            # FSDP's defaults: the root keeps its weights between forward and backward, other units do not
            m.set_reshard_after_forward(m is not self.model, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        self._held = False

    def lockstep_passes(self, n: int) -> int:
        """FSDP: the most forward/backward passes any rank runs in this update (each pass runs collectives, so a
        rank with fewer pads with zero-weight passes); ``n`` otherwise."""
        if not self.fsdp:
            return n
        most = all_reduce_max(n, self.info)
        if n == 0 and most > 0:
            raise RuntimeError(f"rank {self.info.rank} has no item to train on in this step while another rank has "
                               f"{most} passes; under dist.strategy=fsdp every rank needs at least one (make "
                               "data.batch_size larger or fix the skipped items)")
        return most

    @property
    def loss_scale(self) -> float:
        """FSDP averages gradients over ranks; our losses are already global sums, so undo the average."""
        return float(self.info.world) if self.fsdp else 1.0

    def reduce_gradients(self) -> None:
        if not self.fsdp:
            sum_gradients(self.model, self.info)

    def barrier(self) -> None:
        if self.info.enabled:
            import torch.distributed as dist

            dist.barrier()

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """FSDP: the model's full weights, gathered from the shards (every rank takes part), in rank 0's CPU memory
        (the other ranks get an empty dict), for saving; None without FSDP (the model holds them)."""
        if not self.fsdp:
            return None
        self.release()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from longreel.trainer.checkpoint import tied_aliases

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # the gathered copies share no storage, so save_pretrained would write a tied LM head twice
        aliases = tied_aliases(self.model)
        return {k: v for k, v in full.items() if k not in aliases}

    def weights_for_engine(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """FSDP: the model's full weights as ``(name, tensor)`` pairs on this rank's device, each gathered from the
        shards only when the consumer asks for it, for the rank's own rollout engine to load as they come; None
        without FSDP (the engine reads the model's own tensors). Gathering them all first would hold a full copy of
        the model on every GPU while the engine loads it (Qwen2-VL-2B: 4.42 GB in bf16); this way the largest tensor
        (the token embeddings) is the most held at once. Each gather is a collective: every rank must consume every
        pair, in order."""
        if not self.fsdp:
            return None
        self.release()
        from torch.distributed.tensor import DTensor

        from longreel.trainer.checkpoint import tied_aliases

        aliases = tied_aliases(self.model)  # the engine ties them itself, as from_pretrained does
        return ((name, t.full_tensor() if isinstance(t, DTensor) else t)
                for name, t in self.model.state_dict().items() if name not in aliases)

    def skip_step(self) -> None:
        """A step without an update (every group tied: the gradient is zero, and AdamW would still move the weights
        on momentum): no optimizer step, but the schedule advances, so that its position stays the step count."""
        self.release()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # torch takes a schedule step before any optimizer step for swapped calls and warns; here it is the
            # design (a run whose first steps carry no signal, as the demo's do)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.step_lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()

    def clip_and_step(self) -> float:
        self.release()
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step used: the schedule then moves on
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def dump_grads(self, path: str) -> None:
        """Rank 0 writes every gradient (under FSDP gathered from the shards: every rank takes part)."""
        from safetensors.torch import save_file

        self.release()
        grads = {}
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                grads[n] = g.detach().float().cpu().contiguous()
        if self.info.is_main:
            save_file(grads, path)

    # ------------------------------------------------------------------ checkpoints
    def local_batch(self) -> list[tuple[int, int, dict]]:
        """Draw the next global batch; return this rank's share as ``(global position, item index, item)`` (the
        share of its data-parallel replica: every rank of an SP group gets the same)."""
        batch = self.stream.next_batch(self.cfg.data.batch_size)
        return [(j, i, it) for j, (i, it) in enumerate(batch) if j % self.info.dp_size == self.info.dp_rank]

    def _fingerprint_model(self, path: str):
        """The content hash of ``model.path`` (weights and config.json), for the checkpoints: a resumed run finds
        its model by it when the directory has moved. Hashed in a background thread on rank 0 (a 7B model is ~16 GB
        to read; the hash is remembered per machine by the files' stat, so a later start there only stats them)."""
        if not self.info.is_main:
            return None
        from concurrent.futures import ThreadPoolExecutor

        from longreel.trainer.preflight import model_fingerprint

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longreel-model-hash")
        future = pool.submit(model_fingerprint, path)
        pool.shutdown(wait=False)
        return future

    def model_fingerprint(self) -> str | None:
        """What :meth:`_fingerprint_model` found (waiting for it); None on ranks other than 0 or when unreadable."""
        if self._model_fingerprint is None:
            return None
        try:
            return self._model_fingerprint.result()
        except OSError as e:
            log.warning("model.path %r could not be hashed (%s): a resume will need it at this path",
                        self.cfg.model.path, e)
            return None

    def save(self) -> None:
        from longreel.trainer.checkpoint import prune_checkpoints, save_checkpoint
        from longreel.trainer.preflight import config_record

        state = {"stage": self.stage, "loader": self.stream.state_dict(), "config_hash": self.config_hash,
                 "config": config_record(self.cfg), "model_fingerprint": self.model_fingerprint()}
        self.release()
        save_checkpoint(self.ckpt_root, self.step, model=self.model, optimizer=self.optimizer,
                        scheduler=self.scheduler, trainer_state=state, rank=self.info.rank, world=self.info.world,
                        barrier=self.barrier, sharded=self.fsdp, policy_files=self.write_policy_files)
        if self.info.is_main:
            prune_checkpoints(self.ckpt_root, self.cfg.run.keep_checkpoints)

    def maybe_eval(self) -> dict[str, float]:
        """Held-out greedy accuracy every ``eval.every`` steps. Every rank decodes its share of the items (every
        ``world``-th one, on gathered weights under FSDP) and rank 0 puts the records together in item order: the
        result of one process evaluating them all, each rank decoding 1/world of the items (``longreel eval``, which
        shares them the same way, measured in ``benchmarks/eval_shares.py``). Before, rank 0 evaluated alone while
        the others waited at their next collective."""
        every = self.cfg.eval.every
        if not every or self.step % every:
            return {}
        if getattr(self, "_eval_items", None) is None:
            self._eval_items = self._load_eval_items()
        from longreel.trainer.eval import score_items, summarize

        items = self._eval_items[:self.cfg.eval.max_items] if self.cfg.eval.max_items else self._eval_items
        mine = list(range(self.info.rank, len(items), self.info.world))
        with self.gathered():
            records = score_items(self.model, self.processor, [items[i] for i in mine], indices=mine,
                                  max_new_tokens=self.cfg.eval.max_new_tokens, batch_size=self.cfg.eval.batch_size)
        self.release()
        self.model.train()
        everyone = all_gather_objects(records, self.info)
        if not self.info.is_main:
            return {}
        res = summarize(r for share in everyone for r in share)
        out = {"eval_accuracy": res["accuracy"], "eval_format_rate": res["format_rate"], "eval_n": res["n"],
               "eval_skipped": res["skipped"]}
        if res["accuracy_ci95"] is not None:  # `train plot` shades it around the eval_accuracy curve
            out["eval_accuracy_ci95_low"], out["eval_accuracy_ci95_high"] = res["accuracy_ci95"]
        out.update({f"eval_accuracy/{k}": v["accuracy"] for k, v in res["per_category"].items()})
        return out

    def _load_eval_items(self) -> list[dict]:
        """The held-out items, read once by every rank (each decodes a share of them). Held-out shards that cannot
        be read (corrupt, a download that failed) stop every rank with the lowest rank's message."""
        items, problem = [], None
        try:
            items = load_items(self.cfg.data, "eval")
        except InputCheckError as e:
            problem = str(e)
        problem = first_problem(problem, self.info)
        if problem is not None:
            raise InputCheckError(problem)
        return items

    def maybe_save(self, signalled: bool = False) -> bool:
        """Save on the schedule; return True when the run should stop now (run.stop_after before the last step, or
        ``signalled``: a signal of run.stop_signals reached a rank)."""
        every = self.cfg.run.save_every
        # run.stop_after stops a run short of its end: one at its last step finishes (final/), whatever it says
        stop_after = self.cfg.run.stop_after
        stop = signalled or (bool(stop_after) and stop_after <= self.step < self.total_steps)
        if (every and self.step % every == 0) or stop:
            self.save()
        return stop

    def write_policy_files(self, path) -> None:
        """Everything of a ``save_pretrained`` directory but the weights: the step checkpoint beside them is then a
        policy directory too (evaluate step 300 without copying files in)."""
        self.model.config.save_pretrained(path)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(path)
        self.processor.save_pretrained(path)

    def finish(self) -> str | None:
        """Final checkpoint + ``save_pretrained`` of model and processor to ``out_dir/final``."""
        from longreel.trainer.checkpoint import FINAL_TMP, latest_checkpoint, share_files

        latest = latest_checkpoint(self.ckpt_root)
        if latest is None or latest.name != f"step-{self.step:06d}":
            self.save()
        final = self.out_dir / "final"
        state = self.full_state_dict()
        if self.info.is_main:
            import shutil
            import tempfile

            tmp = tempfile.mkdtemp(prefix=FINAL_TMP, dir=self.out_dir)
            if state is not None:
                self.model.save_pretrained(tmp, state_dict=state)
            else:
                self.model.save_pretrained(tmp)
            self.processor.save_pretrained(tmp)
            if final.exists():
                shutil.rmtree(final)
            share_files(tmp)
            os.rename(tmp, final)
            os.chmod(final, 0o755)
        self.barrier()
        self.logger.close()
        return str(final)

    def save_last(self) -> None:
        """A checkpoint of the last step when the schedule did not save it (``run.save_every=0`` means "only at the
        end", and ``run.save_final=false`` skips ``finish``, which saved it): else such a run wrote nothing, and a
        relaunch started over."""
        from longreel.trainer.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.ckpt_root)
        if latest is None or latest.name != f"step-{self.step:06d}":
            self.save()

    def run_steps(self, step: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Call ``step()`` until ``total_steps`` (evaluating, logging and checkpointing as configured); return the
        last step's metrics with ``step`` and ``final`` (the save_pretrained dir), or ``stopped`` when
        ``run.stop_after`` or a signal of ``run.stop_signals`` (then also ``signal``, its name) ended the run early.
        The caller closes the session."""
        last: dict[str, Any] = {}
        stop_after = self.cfg.run.stop_after
        if stop_after and self.step >= stop_after and self.step < self.total_steps:
            # resumed where run.stop_after stops it: a step more each time the same command ran
            if self.info.is_main:
                log.info("run.stop_after=%d: the run is at step %d already; nothing to do", stop_after, self.step)
            return {"step": self.step, "stopped": True}
        with StopSignals(self.cfg.run.stop_signals) as signals:
            while self.step < self.total_steps:
                last = step()
                last.update(self.maybe_eval())
                if self.step % self.cfg.run.log_every == 0 or self.step == self.total_steps:
                    self.logger.log(self.step, last)
                self.logger.advance()
                # every rank asks after every step, so that all stop after the same one whichever got the signal
                number = all_reduce_max(int(signals.received or 0), self.info)
                received = signal.Signals(number).name if number else None
                if received is not None and self.info.is_main:
                    log.warning("%s received: saving a checkpoint after step %d, then stopping (run the same "
                                "command to resume)", received, self.step)
                if self.maybe_save(signalled=received is not None):
                    return {"step": self.step, "stopped": True, **last,
                            **({"signal": received} if received is not None else {})}
            final = self.finish() if self.cfg.run.save_final else None
            if final is None:
                self.save_last()
        return {"step": self.step, "final": final, **last}

    def release_lock(self) -> None:
        if getattr(self, "lock", None) is not None:
            self.lock.release()
            self.lock = None

    def close(self) -> None:
        """Close the metrics, release the run's lock and, when this session created it, the process group (a caller
        that set one up itself, e.g. to run several sessions in one launch, keeps it)."""
        self.logger.close()
        self.release_lock()
        self.stream.close()  # a shard stream's download ahead
        if self.info.enabled and self.info.owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
