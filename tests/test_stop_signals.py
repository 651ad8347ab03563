"""A scheduler's signal (``run.stop_signals``) stops a run after the step in flight, with a checkpoint the same command
resumes from as if the run had not stopped."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.schemas.config import ConfigError, load_yaml  # noqa: E402
from longreel.trainer.checkpoint import latest_checkpoint  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.stop_signals import StopSignals, parse_signal  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from conftest import run_until_signalled  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_signal_names_are_checked_in_the_config():
    assert parse_signal("SIGTERM") is parse_signal("term") is parse_signal(str(int(signal.SIGTERM))) is \
        signal.SIGTERM
    assert load_yaml(TrainConfig, None, []).run.stop_signals == ["SIGTERM", "SIGUSR1"]
    assert load_yaml(TrainConfig, None, ["run.stop_signals=[]"]).run.stop_signals == []
    with pytest.raises(ConfigError, match="run.stop_signals: 'SIGBOGUS' is not a signal"):
        load_yaml(TrainConfig, None, ["run.stop_signals=[SIGTERM, SIGBOGUS]"])
    with pytest.raises(ConfigError, match="SIGKILL cannot be handled"):
        load_yaml(TrainConfig, None, ["run.stop_signals=[SIGKILL]"])


def test_the_first_signal_is_noted_and_the_second_acts_as_before():
    seen: list[int] = []

    def prior(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGUSR1, prior)
    try:
        with StopSignals(["SIGUSR1", "SIGUSR2"]) as stops:
            assert stops.received is None
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stops.received is signal.SIGUSR1 and seen == []
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler that was there before gets it
            assert seen == [signal.SIGUSR1] and stops.received is signal.SIGUSR1
        with StopSignals(["SIGUSR1", "usr1"]) as stops:  # named twice: still the handler before is put back
            pass
        assert signal.getsignal(signal.SIGUSR1) is prior  # put back on the way out too
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, before)


def _sets(model: str, out: Path, steps: int) -> list[str]:
    return [f"model.path={model}", f"run.out_dir={out}", f"run.steps={steps}", "run.save_every=0", "run.log_every=1",
            "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=2", "data.source=synthetic",
            "data.synthetic_train=8", "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "optim.lr=3e-3"]


def _steps_logged(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl")]


def test_a_run_stopped_by_sigterm_resumes_as_if_it_had_not_stopped(tmp_path):
    """SIGTERM (Slurm preemption, Kubernetes) mid-run: the step in flight ends, a checkpoint of it is saved, the
    command exits 143 with one line and no final/; the same command resumes, and the result is bitwise the run that
    was never stopped. Without the handler the process dies in the step with no checkpoint (SIGTERM's default)."""
    from longreel.trainer.sft import run_sft

    model = build_tiny_qwen2vl(tmp_path / "m", seed=0)
    stopped = tmp_path / "stopped"
    argv = [sys.executable, "-m", "longreel", "train", "sft"]
    for s in _sets(model, stopped, 100_000):  # far more steps than the test waits for
        argv += ["--set", s]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    rc, out, err = run_until_signalled(argv, stopped, signal.SIGTERM, cwd=REPO, env=env)
    steps = _steps_logged(stopped)
    n = steps[-1]
    assert rc == 128 + signal.SIGTERM, err[-3000:]
    assert f"stopped after step {n} on SIGTERM, with a checkpoint in {stopped}/checkpoints; the same command " \
           "resumes the run" in err and "Traceback" not in err, err[-3000:]
    assert '"signal": "SIGTERM"' in out and '"stopped": true' in out
    assert steps == list(range(1, n + 1)) and n < 100_000
    assert latest_checkpoint(stopped / "checkpoints").name == f"step-{n:06d}"
    assert not (stopped / "final").exists() and not (stopped / ".longreel-train.lock").exists()

    # the same command (its run length cut to two more steps, a key a resume may change) continues the run
    resumed = run_sft(load_yaml(TrainConfig, None, _sets(model, stopped, n + 2)))
    assert resumed["step"] == n + 2 and "signal" not in resumed
    straight = tmp_path / "straight"
    run_sft(load_yaml(TrainConfig, None, _sets(model, straight, n + 2)))
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(stopped / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = ("step", "loss", "grad_norm", "lr")
    assert [tuple(r[k] for k in keys) for r in read_metrics(straight / "metrics.jsonl")] == \
        [tuple(r[k] for k in keys) for r in read_metrics(stopped / "metrics.jsonl")]
