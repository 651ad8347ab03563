"""torchrun worker for tests/test_dist_resume.py (not collected by pytest: no test_ prefix).

Usage: torchrun --nproc_per_node N tests/dist_resume_worker.py MODEL_DIR OUT_DIR STAGE STRATEGY [key=value ...]

In one launch (one process group, which the worker owns, so the sessions leave it alone): trains ``run.steps=6``
straight; then the same run stopped after step 3 (a checkpoint); scrambles every RNG; resumes it to step 6 (the runs'
weights and metrics are in ``OUT_DIR/straight`` and ``OUT_DIR/resumed``). Then, since the trainer's sampling is
seeded per prompt and leaves the global RNGs alone, a direct check that a checkpoint gives every rank back its own
RNG states: each rank draws from rank-dependent RNGs, saves a checkpoint (sharded under fsdp), scrambles them and
loads it. Every rank writes ``OUT_DIR/rng-rank<R>.json`` with the sha256 of its RNG states at each point.
"""
from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rng_digest() -> str:
    h = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes())
    h.update(np.random.get_state()[1].tobytes())
    h.update(repr(random.getstate()).encode())
    return h.hexdigest()


def rng_roundtrip(out: str, rank: int, strategy: str) -> dict:
    from longreel.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from longreel.trainer.config import OptimConfig
    from longreel.trainer.runtime import build_optimizer, build_scheduler

    def net():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        if strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(m[0])
            fully_shard(m)
        opt = build_optimizer(m, OptimConfig(lr=0.1))
        return m, opt, build_scheduler(opt, OptimConfig(lr=0.1), 10)

    m, opt, sched = net()
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    torch.manual_seed(77 + rank)
    np.random.seed(77 + rank)
    random.seed(77 + rank)
    torch.rand(3), np.random.rand(2), random.random()
    saved = rng_digest()
    root = os.path.join(out, "rng-ckpt")
    save_checkpoint(root, 1, model=m, optimizer=opt, scheduler=sched, trainer_state={}, rank=rank,
                    world=dist.get_world_size(), barrier=dist.barrier, sharded=strategy == "fsdp")
    m2, opt2, sched2 = net()
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    scrambled = rng_digest()
    load_checkpoint(latest_checkpoint(root), model=m2, optimizer=opt2, scheduler=sched2, rank=rank,
                    sharded=strategy == "fsdp")
    return {"saved": saved, "scrambled": scrambled, "loaded": rng_digest()}


def length_parity_rewards(self, texts, item):
    """A GRPOTrainer._score for tests of dynamic sampling: a random tiny model never writes the answer format, so
    every real reward would tie. Scores the parity of each response's length on the 'count' items (mixed groups)
    and 0 on the 'colour' ones (tied groups). On in this worker when DIST_WORKER_PARITY_REWARDS=1."""
    r = [float(len(t) % 2) if item["category"] == "count" else 0.0 for t in texts]
    return r, [0.0] * len(texts), r


def main(argv: list[str]) -> None:
    model, out, stage, strategy, *sets = argv
    if os.environ.get("DIST_WORKER_PARITY_REWARDS") == "1":
        from longreel.trainer.grpo import GRPOTrainer

        GRPOTrainer._score = length_parity_rewards
    # a collective mismatch would hang every rank: dump the stacks and exit instead
    faulthandler.dump_traceback_later(float(os.environ.get("DIST_WORKER_TIMEOUT", "400")), exit=True)
    dist.init_process_group("gloo")
    try:
        from longreel.schemas.config import load_yaml
        from longreel.trainer.config import TrainConfig
        from longreel.trainer.grpo import run_grpo
        from longreel.trainer.runtime import seed_everything
        from longreel.trainer.sft import run_sft

        run = run_grpo if stage == "grpo" else run_sft

        def cfg(name: str, *extra: str) -> TrainConfig:
            return load_yaml(TrainConfig, None, [
                f"model.path={model}", f"run.out_dir={out}/{name}", f"dist.strategy={strategy}", "run.steps=6",
                "run.save_every=3", "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=3",
                "data.source=synthetic", "data.synthetic_train=8", "data.synthetic_kinds=[colour, count]",
                "data.batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=2", "optim.schedule=cosine",
                "rollout.n=4", "rollout.max_new_tokens=8", *sets, *extra])

        rank = dist.get_rank()
        digests = {}
        run(cfg("straight"))
        digests["straight"] = rng_digest()
        stopped = run(cfg("resumed", "run.stop_after=3"))
        assert stopped.get("stopped") and stopped["step"] == 3, stopped
        # what a fresh process would have: other RNG states, which the checkpoint must replace
        torch.manual_seed(1000 + rank)
        np.random.seed(1000 + rank)
        random.seed(1000 + rank)
        resumed = run(cfg("resumed"))
        assert resumed["step"] == 6, resumed
        digests["resumed"] = rng_digest()
        seed_everything(3)
        digests["fresh"] = rng_digest()
        digests.update(rng_roundtrip(out, rank, strategy))
        with open(os.path.join(out, f"rng-rank{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump(digests, fh)
        dist.barrier()
    finally:
        # every exit path destroys the group: a gloo group left to the interpreter's teardown can abort the process
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
