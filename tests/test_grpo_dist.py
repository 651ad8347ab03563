"""Data parallel GRPO: ``torchrun --nproc_per_node 2`` (gloo, CPU) gives the step-1 gradients of the 1-process run
on the same global batch, within 1e-5."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from conftest import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _args(model: str, out: Path, grads: Path) -> list[str]:
    sets = [f"model.path={model}", f"run.out_dir={out}", f"run.dump_grads={grads}", "run.steps=1",
            "run.save_final=false", "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=5",
            "data.source=synthetic", "data.synthetic_train=8", "data.synthetic_kinds=[colour, count]",
            "data.batch_size=4", "rollout.n=4", "rollout.max_new_tokens=10", "grpo.mix_policy=true",
            "optim.grad_accum=2"]
    out_args = ["train", "grpo"]
    for s in sets:
        out_args += ["--set", s]
    return out_args


def _run(cmd: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd[:6]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_torchrun_two_ranks_match_one_process(tmp_path):
    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, "-m", "longreel", *_args(model, one, tmp_path / "g1.safetensors")])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), "-m", "longreel", *_args(model, two, tmp_path / "g2.safetensors")])

    g1, g2 = load_file(str(tmp_path / "g1.safetensors")), load_file(str(tmp_path / "g2.safetensors"))
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0  # a real gradient, not an all-tied batch
    worst = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    assert worst <= 1e-5, f"max |grad(1 proc) - grad(2 ranks)| = {worst}"

    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 1
    for k in ("reward_mean", "accuracy", "format_rate", "response_len_mean", "groups_with_signal",
              "reward_mean/colour", "reward_mean/count"):
        assert m1[0][k] == m2[0][k], k  # the same rollouts were sampled and scored (tallies summed over ranks)
    assert abs(m1[0]["loss"] - m2[0]["loss"]) <= 1e-6


def test_a_held_run_dir_stops_every_rank_with_one_line(tmp_path):
    """Another run holds ``run.out_dir``: rank 0 finds the lock taken, and every rank stops with its message (exit 2,
    no traceback) instead of the other ranks waiting in their next collective for a rank that has left. The ranks are
    started the way ``srun`` starts them, each on its own with RANK and WORLD_SIZE set, so no launcher stops them."""
    from longreel.trainer.run_lock import RunLock

    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    out = tmp_path / "run"
    held = RunLock(out).acquire()
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    argv = [sys.executable, "-m", "longreel", "train", "sft"]
    for s in (f"model.path={model}", f"run.out_dir={out}", "run.steps=1", "run.progress=false", "run.threads=1",
              "run.tensorboard=false", "data.source=synthetic", "data.synthetic_train=4", "data.batch_size=2"):
        argv += ["--set", s]
    try:
        ranks = [subprocess.Popen(argv, cwd=REPO, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
        results = []
        for p in ranks:
            try:
                results.append((p.wait(timeout=300), p.stderr.read()))
            except subprocess.TimeoutExpired:
                for q in ranks:
                    q.kill()
                raise AssertionError("a rank was still running 300 s after the start: it waited for rank 0")
    finally:
        held.release()
    for rc, err in results:
        assert rc == 2 and "is in use by another longreel train run" in err and "Traceback" not in err, err[-3000:]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
