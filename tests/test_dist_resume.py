"""Distributed training on 2 gloo ranks (torchrun, CPU): FSDP2 (``dist.strategy=fsdp``) gives the step-1 gradients of
the 1-process run within 1e-5, for GRPO with MR-SP (the vision tower trained through the deferred backward), also
with the 2 ranks one sequence-parallel group (``mrsp.sp_size=2``), and for SFT; and under DDP and FSDP alike (and
FSDP with SP), 6 steps equal 3 steps + resume + 3 steps bitwise (weights, logged losses), every
rank getting its own RNG states back from the checkpoint (sharded through torch.distributed.checkpoint under
FSDP)."""
from __future__ import annotations

import json
import os
import shutil
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
WORKER = REPO / "tests" / "dist_resume_worker.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory) -> str:
    """The LM head is the token embeddings (Qwen2-VL-2B's geometry): FSDP2 must keep them in one unit."""
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny-tied") / "m", seed=0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def stream_index(tmp_path_factory) -> str:
    """Shards of 4 items each, read as a stream (``data.stream``) by the ``ddp-stream`` case."""
    from longreel.trainer.synthetic_task import make_items, write_shards

    return write_shards(make_items(18, seed=5, kinds=("colour", "count")), str(tmp_path_factory.mktemp("stream")),
                        per_shard=4)


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]


def _run(cmd: list[str], **extra_env: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               **extra_env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    # the head of stderr holds the first rank's traceback; the tail, torchrun's summary
    assert proc.returncode == 0, \
        f"{cmd[:8]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[:6000]}\n...\n{proc.stderr[-3000:]}"


def _train_args(stage: str, model: str, out: Path, grads: Path, *extra: str) -> list[str]:
    sets = [f"model.path={model}", f"run.out_dir={out}", f"run.dump_grads={grads}", "run.steps=1",
            "run.save_final=false", "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=5",
            "data.source=synthetic", "data.synthetic_train=8", "data.synthetic_kinds=[colour, count]",
            "data.batch_size=4", "rollout.n=4", "rollout.max_new_tokens=10", "grpo.mix_policy=true",
            "optim.grad_accum=2", *extra]
    return ["-m", "longreel", "train", stage, *[a for s in sets for a in ("--set", s)]]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo", "grpo-frozen", "sft", "grpo-tied", "grpo-stream"])
def test_fsdp_two_ranks_match_one_process(tiny, tiny_tied, stream_index, tmp_path, case):
    """``grpo``: MR-SP with the tower trained (deferred); ``grpo-frozen``: the tower frozen, so no vision backward
    runs after the update's passes (which once hid embedding gradients left behind by each pass); ``grpo-tied``: a
    model whose LM head is its embeddings (FSDP2 refused to shard it before they shared one unit); ``grpo-stream``:
    items from shards read as a stream (``data.stream``), which each rank reads whole and takes its share of."""
    stage, *mode = case.split("-")
    extra = []
    if mode == ["tied"]:
        tiny, mode = tiny_tied, []
    elif mode == ["stream"]:
        extra, mode = ["data.source=shards", f"data.train_urls=[{stream_index}]", "data.stream=true",
                       "data.shuffle_buffer=2"], []
    extra += ["mrsp.vision=frozen", "model.freeze_vision=true"] if mode else []
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, *_train_args(stage, tiny, one, tmp_path / "g1.safetensors", *extra)])
    _run([*_torchrun(2), *_train_args(stage, tiny, two, tmp_path / "g2.safetensors", "dist.strategy=fsdp", *extra)])

    g1, g2 = load_file(str(tmp_path / "g1.safetensors")), load_file(str(tmp_path / "g2.safetensors"))
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0  # a real gradient, not an all-tied batch
    # the vision tower is trained under FSDP too (GRPO: MR-SP's deferred backward through the step's one encode)
    assert any(k.startswith("model.visual.") and float(g2[k].abs().sum()) > 0 for k in g2) != bool(mode)
    assert float(g2["model.language_model.embed_tokens.weight"].abs().sum()) > 0
    worst = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    assert worst <= 1e-5, f"max |grad(1 proc) - grad(2 ranks, FSDP)| = {worst}"
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 1
    assert abs(m1[0]["loss"] - m2[0]["loss"]) <= 1e-6
    if stage == "grpo":
        for k in ("reward_mean", "accuracy", "format_rate", "response_len_mean"):
            assert m1[0][k] == m2[0][k], k  # the same rollouts were sampled (on gathered weights) and scored
        assert m2[0]["entropy_estimate"] == pytest.approx(m1[0]["entropy_estimate"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["sp-prefill", "row-split"])
def test_fsdp_with_sequence_parallel_matches_one_process(tiny, tmp_path, split):
    """``mrsp.sp_size=2`` under FSDP: the 2 ranks are one SP group (both take the whole batch, split each prompt's
    rollouts, encode half the frames, and split every log-prob pass: the sequence with ``sp-prefill``, the rows
    with ``row-split``), and FSDP shards the weights over the same 2 ranks. Step-1 gradients equal the 1-process
    run within 1e-5, with the same rollouts. ``rollout.n=3`` with ``optim.grad_accum=2`` makes a one-row
    micro-batch, so one rank has no rows of its own in it yet must still run every unit's collectives."""
    extra = ["rollout.n=3", f"mrsp.sp_min_tokens={1 if split == 'sp-prefill' else 100000}"]
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, *_train_args("grpo", tiny, one, tmp_path / "g1.safetensors", *extra)])
    _run([*_torchrun(2), *_train_args("grpo", tiny, two, tmp_path / "g2.safetensors", "dist.strategy=fsdp",
                                      "mrsp.sp_size=2", *extra)])

    g1, g2 = load_file(str(tmp_path / "g1.safetensors")), load_file(str(tmp_path / "g2.safetensors"))
    assert g1.keys() == g2.keys() and len(g1) > 10
    assert sum(float(g.abs().sum()) for g in g1.values()) > 0  # a real gradient, not an all-tied batch
    # the sharded tower is trained through the deferred backward, the embeddings through the SP prefill's lookups
    assert any(k.startswith("model.visual.") and float(g2[k].abs().sum()) > 0 for k in g2)
    assert float(g2["model.language_model.embed_tokens.weight"].abs().sum()) > 0
    worst = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    assert worst <= 1e-5, f"max |grad(1 proc) - grad(2 ranks, FSDP x SP 2)| = {worst}"
    m1, m2 = read_metrics(one / "metrics.jsonl"), read_metrics(two / "metrics.jsonl")
    assert len(m1) == len(m2) == 1
    for k in ("reward_mean", "accuracy", "format_rate", "response_len_mean", "response_len_max", "offline_groups",
              "groups_with_signal"):
        assert m1[0][k] == m2[0][k], k  # the same rollouts (each rank sampled its share), counted once
    assert abs(m1[0]["loss"] - m2[0]["loss"]) <= 1e-6
    assert m2[0]["entropy_estimate"] == pytest.approx(m1[0]["entropy_estimate"], rel=1e-5)  # same samples


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-sp", "fsdp-tied", "ddp-stream"])
def test_two_rank_resume_is_exact(tiny, tiny_tied, stream_index, tmp_path, strategy):
    """``fsdp-sp``: FSDP with the 2 ranks one sequence-parallel group (``mrsp.sp_size=2``, the SP prefill on);
    ``fsdp-tied``: a model whose LM head is its embeddings (saved, resumed and exported as one parameter);
    ``ddp-stream``: items read from shards as a stream (``data.stream``): each rank its share of the one stream."""
    strategy, *variant = strategy.split("-")
    extra = ["mrsp.sp_size=2", "mrsp.sp_min_tokens=1"] if variant == ["sp"] else []
    if variant == ["stream"]:
        extra = ["data.source=shards", f"data.train_urls=[{stream_index}]", "data.stream=true",
                 "data.shuffle_buffer=2"]
    if variant == ["tied"]:
        tiny = tiny_tied
    _run([*_torchrun(2), str(WORKER), tiny, str(tmp_path), "grpo", strategy, "grpo.mix_policy=true",
          "grpo.beta=0.05", *extra])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    a, b = load_file(str(straight / "final" / "model.safetensors")), load_file(str(resumed / "final" /
                                                                                  "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"
    base = load_file(str(Path(tiny) / "model.safetensors"))
    assert any(k in base and not torch.equal(base[k], v) for k, v in a.items())  # the run changed the weights
    keys = ("step", "loss", "reward_mean", "accuracy", "grad_norm", "lr", "kl")
    ma = [tuple(r.get(k) for k in keys) for r in read_metrics(straight / "metrics.jsonl")]
    mb = [tuple(r.get(k) for k in keys) for r in read_metrics(resumed / "metrics.jsonl")]
    assert [r[0] for r in ma] == [1, 2, 3, 4, 5, 6]
    assert ma == mb  # steps 1-3 before the stop, 4-6 after the resume: bitwise

    ckpt = resumed / "checkpoints" / "step-000003"
    assert (ckpt / "sharded").is_dir() == (strategy == "fsdp")
    loader = json.loads((ckpt / "trainer_state.json").read_text())["loader"]
    assert (loader.get("kind") == "shard_stream") == (variant == ["stream"])
    if strategy == "fsdp":  # one shard file per rank, safetensors only (no pickle)
        files = sorted(p.name for p in (ckpt / "sharded").iterdir())
        assert len(files) == 2 and all(f.endswith(".safetensors") for f in files), files
        # eval refuses the shards with the way out; `longreel train export` gathers them in one process, no group
        from longreel.cli import main
        from longreel.trainer.preflight import InputCheckError, check_model_dir

        last = resumed / "checkpoints" / "step-000006"
        with pytest.raises(InputCheckError, match="sharded \\(FSDP\\) step checkpoint: `longreel train export"):
            check_model_dir(str(last))
        assert main(["train", "export", str(last), "--out", str(tmp_path / "step6")]) == 0
        check_model_dir(str(tmp_path / "step6"))
        c = load_file(str(tmp_path / "step6" / "model.safetensors"))
        assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in b)  # the run's final/, bitwise
        # the same files as final/ (config, generation config, processor and tokenizer files, weights)
        assert sorted(os.listdir(tmp_path / "step6")) == sorted(os.listdir(resumed / "final"))
        # each rank lists the shard it wrote; one rank's shard cut short is named, and the export refuses it
        from longreel.trainer.checkpoint import checkpoint_problem

        assert checkpoint_problem(last) is None
        listed = [json.loads((last / f"rng-rank{r}.json").read_text())["files"] for r in (0, 1)]
        assert sorted(f for fs in listed for f in fs) == [f"sharded/{f}" for f in files]
        assert all(fs == [f"sharded/shard-{r + 1:05d}-model-00001-of-00001.safetensors"] for r, fs in enumerate(listed))
        broken = tmp_path / "broken-step6"
        shutil.copytree(last, broken)
        shard = broken / listed[1][0]
        os.truncate(shard, shard.stat().st_size - 100)
        assert f"shard-00002-model-00001-of-00001.safetensors ({shard.stat().st_size:,} bytes) cannot be read" in \
            checkpoint_problem(broken)
        assert main(["train", "export", str(broken), "--out", str(tmp_path / "broken-export")]) == 2
    rng = [json.loads((tmp_path / f"rng-rank{r}.json").read_text()) for r in (0, 1)]
    for r in rng:
        assert r["resumed"] == r["straight"]
        assert r["loaded"] == r["saved"] != r["scrambled"]
    assert rng[0]["saved"] != rng[1]["saved"]  # each rank got its own states back, not rank 0's


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-sp"])
def test_two_rank_dynamic_sampling_draws_as_one_process_and_resumes_exactly(tiny, tmp_path, strategy):
    """``grpo.dynamic_sampling`` on 2 ranks: the ranks agree on every extra draw and on the groups kept (each rank
    holds one prompt of a draw, so often one rank keeps nothing; under FSDP it runs a weight-0 pass; ``fsdp-sp``:
    the 2 ranks are one sequence-parallel group, holding the same prompts, which must count once), step 1 draws
    and keeps what one process does, and 3 steps + resume + 3 equal 6 straight, bitwise."""
    strategy, *sp = strategy.split("-")
    sets = ["grpo.dynamic_sampling=true", "grpo.max_draws=3", "grpo.beta=0.05"]
    sp_sets = ["mrsp.sp_size=2", "mrsp.sp_min_tokens=1"] if sp else []
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _run([*_torchrun(1), str(WORKER), tiny, str(one), "grpo", strategy, *sets], DIST_WORKER_PARITY_REWARDS="1")
    _run([*_torchrun(2), str(WORKER), tiny, str(two), "grpo", strategy, *sets, *sp_sets],
         DIST_WORKER_PARITY_REWARDS="1")
    m1, m2 = read_metrics(one / "straight" / "metrics.jsonl"), read_metrics(two / "straight" / "metrics.jsonl")
    assert [r["dynamic_draws"] for r in m2 if "dynamic_draws" in r] and m1[0]["step"] == m2[0]["step"] == 1
    for k in ("dynamic_draws", "dynamic_kept_groups", "reward_mean", "groups_with_signal", "response_len_mean"):
        assert m1[0][k] == m2[0][k], k
    assert abs(m1[0]["loss"] - m2[0]["loss"]) <= 1e-6
    assert any(r["dynamic_draws"] > 1 for r in m2)  # the tied colour groups made ranks draw again
    keys = ("step", "loss", "reward_mean", "grad_norm", "kl", "dynamic_draws", "dynamic_kept_groups")
    resumed = read_metrics(two / "resumed" / "metrics.jsonl")
    assert [tuple(r.get(k) for k in keys) for r in m2] == [tuple(r.get(k) for k in keys) for r in resumed]
    a, b = (load_file(str(two / run / "final" / "model.safetensors")) for run in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_number_of_ranks(tiny, tmp_path):
    """An FSDP run stopped at step 3 on 2 ranks goes on on 3 (uneven shards): the 3 ranks load exactly the weights
    the 2 saved (``run.steps=3`` there only loads and gathers ``final/``, which equals the 1-process export of the
    step), and then train steps 4-6."""
    from longreel.cli import main

    run = tmp_path / "run"
    sets = [f"model.path={tiny}", f"run.out_dir={run}", "dist.strategy=fsdp", "run.save_every=3", "run.progress=false",
            "run.tensorboard=false", "run.threads=1", "data.source=synthetic", "data.synthetic_train=12",
            "data.batch_size=6", "rollout.n=4", "rollout.max_new_tokens=8", "grpo.mix_policy=true", "optim.lr=1e-3"]

    def train(ranks: int, *extra: str) -> None:
        _run([*_torchrun(ranks), "-m", "longreel", "train", "grpo", *[a for x in [*sets, *extra] for a in ("--set", x)]])

    train(2, "run.steps=6", "run.stop_after=3")
    assert main(["train", "export", str(run / "checkpoints" / "step-000003"), "--out", str(tmp_path / "step3")]) == 0
    train(3, "run.steps=3")
    a, b = load_file(str(tmp_path / "step3" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    train(3, "run.steps=6")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    c = load_file(str(run / "final" / "model.safetensors"))
    assert any(not torch.equal(a[k], c[k]) for k in a)  # steps 4-6 trained on 3 ranks


EXIT_SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist

def report():  # registered before the trainer's handler, so it runs after it (atexit is last-in, first-out)
    print(f"rank {rank}: group alive at exit: {dist.is_initialized()}", flush=True)

atexit.register(report)
from longreel.trainer.runtime import init_distributed
rank = init_distributed(torch.device("cpu")).rank
t = torch.ones(4)
dist.all_reduce(t)
raise RuntimeError(f"rank {rank} fails before closing its session")
"""


def test_a_failing_rank_destroys_its_process_group_at_exit(tmp_path):
    """An exception that skips ``TrainSession.close()`` must not leave the gloo group to the interpreter's teardown,
    where its threads can abort the process (SIGABRT, "terminate called without an active exception") and bury the
    traceback: ``init_distributed`` destroys the group it created at exit."""
    script = tmp_path / "fail.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([*_torchrun(2), str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "fails before closing its session" in proc.stderr
    out = proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}: group alive at exit: False" in out, out[-4000:]


def test_fsdp_mixed_precision_follows_the_config():
    from longreel.trainer.runtime import fsdp_mixed_precision

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    off = fsdp_mixed_precision("auto", "auto", cpu)
    assert off.param_dtype is None and off.reduce_dtype is None  # auto: off on CPU
    on = fsdp_mixed_precision("auto", "auto", gpu)
    assert on.param_dtype == torch.bfloat16 and on.reduce_dtype == torch.float32  # auto: bf16 compute on CUDA
    forced = fsdp_mixed_precision("bfloat16", "off", cpu)
    assert forced.param_dtype == torch.bfloat16 and forced.reduce_dtype is None
    assert fsdp_mixed_precision("off", "float32", gpu).param_dtype is None
