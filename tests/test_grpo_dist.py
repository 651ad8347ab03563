"""Data parallel GRPO: ``torchrun --nproc_per_node 2`` (gloo, CPU) gives the step-1 gradients of the 1-process run
on the same global batch, within 1e-5."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch  # noqa: F401
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from conftest import free_port, run_until_signalled, signal_after_two_steps  # noqa: E402

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


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                **extra)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
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
    e1, e2 = m1[0]["entropy_estimate"], m2[0]["entropy_estimate"]
    assert abs(e1 - e2) <= 1e-5 * e1, (e1, e2)  # each rank's sums of its groups, added up



def _launch_like_srun(sets: list[str], timeout: int = 300, cwds=(REPO, REPO),
                      meanwhile=None) -> list[tuple[int, str]]:
    """``longreel train sft`` on 2 ranks started the way ``srun`` starts them, each on its own with RANK and
    WORLD_SIZE set, so that no launcher stops the others when one exits; (exit code, stderr) of each.
    ``meanwhile(ranks)`` is called with the 2 processes once they are started."""
    env = _env(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = [sys.executable, "-m", "longreel", "train", "sft"]
    for s in ("run.progress=false", "run.threads=1", "run.tensorboard=false", *sets):
        argv += ["--set", s]
    ranks = [subprocess.Popen(argv, cwd=cwds[r], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    results = []
    if meanwhile is not None:
        try:
            meanwhile(ranks)
        except BaseException:
            for p in ranks:
                p.kill()
            raise
    try:
        for p in ranks:
            try:
                results.append((p.wait(timeout=timeout), p.stderr.read()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a rank was still running {timeout} s after the start: it waited for another "
                                     "rank") from None
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    return results


def test_a_held_run_dir_stops_every_rank_with_one_line(tmp_path):
    """Another run holds ``run.out_dir``: rank 0 finds the lock taken, and every rank stops with its message (exit 2,
    no traceback) instead of the other ranks going on to their next collective without rank 0 (before: an 'internal
    error' traceback from gloo on rank 1)."""
    from longreel.trainer.run_lock import RunLock

    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    out = tmp_path / "run"
    held = RunLock(out).acquire()
    try:
        results = _launch_like_srun([f"model.path={model}", f"run.out_dir={out}", "run.steps=1",
                                     "data.source=synthetic", "data.synthetic_train=4", "data.batch_size=2"])
    finally:
        held.release()
    for rc, err in results:
        assert rc == 2 and "is in use by another longreel train run" in err and "Traceback" not in err, err[-3000:]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_run_dir_the_ranks_do_not_share_stops_every_rank(tmp_path):
    """``run.out_dir`` on each node's own disk (here: a relative path, each rank started in its own directory):
    every rank writes checkpoints there and reads them to resume, so the run would split its checkpoints and could
    resume its ranks from different steps. Every rank stops with one line before the first step, and rank 0's lock
    is released."""
    from longreel.trainer.run_lock import LOCK_NAME

    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    results = _launch_like_srun([f"model.path={model}", "run.out_dir=run", "run.steps=1", "data.source=synthetic",
                                 "data.synthetic_train=4", "data.batch_size=2"], cwds=nodes)
    # every rank says rank 1's problem, naming the directory 'run' is from where rank 1 started (the CLI makes the
    # path absolute against each rank's working directory)
    said = f"run.out_dir '{nodes[1] / 'run'}' is not the same directory for every rank: rank 1 on"
    for rc, err in results:
        assert rc == 2 and said in err, err[-3000:]
        assert "finds no run lock there, not rank 0's (pid" in err and "Traceback" not in err, err[-3000:]
    assert not (nodes[0] / "run" / LOCK_NAME).exists() and not (nodes[0] / "run" / "metrics.jsonl").exists()


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Slurm signals every task, but not at the same instant, and a rank may miss it (a node's own preemption):
    SIGUSR1 to rank 1 alone stops both ranks after the same step, with one checkpoint holding both ranks' states,
    and both exit 138. Before, rank 1 died in its step and rank 0 failed (or waited) at its next collective."""
    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    out = tmp_path / "run"
    results = _launch_like_srun([f"model.path={model}", f"run.out_dir={out}", "run.steps=100000", "run.save_every=0",
                                 "data.source=synthetic", "data.synthetic_train=8", "data.batch_size=2"],
                                meanwhile=lambda ranks: signal_after_two_steps(out, ranks, ranks[1], signal.SIGUSR1))
    for rank, (rc, err) in enumerate(results):
        assert rc == 128 + signal.SIGUSR1 and "Traceback" not in err, (rank, err[-3000:])
    n = _stopped_with_both_ranks_saved(out)
    assert f"stopped after step {n} on SIGUSR1" in results[0][1]


def test_torchrun_forwards_sigterm_and_every_rank_saves(tmp_path):
    """SIGTERM to torchrun (what Kubernetes or Slurm send the job's launcher): torchrun sends it on to the ranks
    and waits --shutdown_timeout seconds; the ranks end their step and save. torchrun itself then exits 1 with its
    own traceback (torch's behaviour, not longreel's)."""
    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", "longreel", "train", "sft"]
    for s in (f"model.path={model}", f"run.out_dir={out}", "run.steps=100000", "run.save_every=0",
              "run.progress=false", "run.threads=1", "run.tensorboard=false", "data.source=synthetic",
              "data.synthetic_train=8", "data.batch_size=2"):
        argv += ["--set", s]
    _, _, err = run_until_signalled(argv, out, signal.SIGTERM, cwd=REPO, env=_env())
    n = _stopped_with_both_ranks_saved(out)
    assert f"stopped after step {n} on SIGTERM" in err, err[-3000:]


def _stopped_with_both_ranks_saved(out: Path) -> int:
    """The step the run in ``out`` stopped after, checking that its checkpoint holds both ranks' states."""
    from longreel.trainer.checkpoint import latest_checkpoint

    n = read_metrics(out / "metrics.jsonl")[-1]["step"]
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt.name == f"step-{n:06d}" and 2 <= n < 100000
    assert {p.name.split(".")[0] for p in ckpt.glob("rng-rank*")} == {"rng-rank0", "rng-rank1"}
    assert not (out / "final").exists()
    return n


def test_unreadable_held_out_shards_stop_every_rank_with_one_line(tmp_path):
    """Held-out shards that cannot be read at the first evaluation stop every rank with the lowest rank's message;
    readable ones are evaluated a share a rank, to what one process finds."""
    from longreel.trainer.synthetic_task import make_items, write_shards

    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    train = write_shards(make_items(4, seed=5, kinds=("colour",)), str(tmp_path / "train"))
    bad = tmp_path / "heldout-000000.tar"
    bad.write_bytes(b"not a tar archive" * 64)  # found by the start's checks, unreadable when read
    results = _launch_like_srun([f"model.path={model}", f"run.out_dir={tmp_path / 'run'}", "run.steps=2",
                                 "run.save_every=0", "run.save_final=false", f"data.train_urls=[{train}]",
                                 f"data.eval_urls=[{bad}]", "eval.every=1", "data.batch_size=2"])
    for rc, err in results:
        assert rc == 2 and str(bad) in err and "Traceback" not in err, err[-3000:]
    # the same run with readable held-out shards evaluates at every step, each rank a share of the items
    held_out = write_shards(make_items(5, seed=6, kinds=("colour", "count")), str(tmp_path / "held_out"))
    results = _launch_like_srun([f"model.path={model}", f"run.out_dir={tmp_path / 'run2'}", "run.steps=2",
                                 "run.save_every=0", f"data.train_urls=[{train}]", f"data.eval_urls=[{held_out}]",
                                 "eval.every=1", "eval.max_new_tokens=8", "data.batch_size=2"])
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    rows = read_metrics(tmp_path / "run2" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["eval_n"] == 5 and r["eval_skipped"] == 0 for r in rows)  # both ranks' shares (3 and 2 items)
    # the last evaluation is what one process makes of the saved model: `longreel eval` on final/
    evaluate = ["-m", "longreel", "eval", "--model", str(tmp_path / "run2" / "final"), "--outputs",
                "--set", f"data.eval_urls=[{held_out}]", "--set", "eval.max_new_tokens=8", "--set", "run.progress=false"]
    proc = subprocess.run([sys.executable, *evaluate], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = json.loads(proc.stdout)
    assert alone["n"] == 5 and len(alone["outputs"]) == 5
    assert (rows[-1]["eval_accuracy"], rows[-1]["eval_format_rate"]) == (alone["accuracy"], alone["format_rate"])
    assert [rows[-1]["eval_accuracy_ci95_low"], rows[-1]["eval_accuracy_ci95_high"]] == alone["accuracy_ci95"]
    assert {k: rows[-1][f"eval_accuracy/{k}"] for k in ("colour", "count")} == \
        {k: v["accuracy"] for k, v in alone["per_category"].items()}
    # `longreel eval` under torchrun: each rank a share, rank 0 alone prints the one-process result
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), *evaluate[1:]], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout)  # one JSON document: rank 1 prints nothing
    assert shared.pop("ranks") == 2 and shared == alone
