"""A run's log holds what the run says, not the libraries' complaints about how they are called: in training, no
transformers deprecation (the K/V cache keyword ``past_key_values`` renamed ``cache`` in 5.24, the checkpointing
calls renamed ``activation_checkpointing_*``) and no torch warning about the schedule stepping first (a GRPO step
whose groups all tie skips its update on purpose); in curation, the workers' lines in the launcher's format. Each
run is a subprocess, so transformers' warn-once memory starts empty.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from longreel.engines.kv_cache import cache_keyword, cache_kwargs, output_cache
from longreel.testing.tiny_model import build_tiny_qwen2vl
from longreel.trainer.logging_utils import read_metrics

REPO = Path(__file__).resolve().parents[1]

#: what the libraries print when a call uses a name they renamed, or steps the schedule before the optimizer
COMPLAINTS = ("deprecated", "Detected call of `lr_scheduler.step()`", "FutureWarning")


def test_the_cache_keyword_is_the_one_the_installed_transformers_takes():
    from transformers import Qwen2VLForConditionalGeneration

    params = inspect.signature(Qwen2VLForConditionalGeneration.forward).parameters
    assert cache_keyword() in params
    assert cache_kwargs(7) == {cache_keyword(): 7}

    class Out:
        cache = past_key_values = None

    setattr(Out, cache_keyword(), "kv")
    assert output_cache(Out()) == "kv"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _train(tmp_path: Path, stage: str, *sets: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    common = [f"run.out_dir={tmp_path / stage}", "run.steps=2", "run.save_final=false", "run.progress=false",
              "run.tensorboard=false", "run.threads=1", "data.source=synthetic", "data.synthetic_train=4",
              "data.batch_size=2"]
    cmd = [sys.executable, "-m", "longreel", "train", stage, *[a for s in common + list(sets) for a in ("--set", s)]]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("variant", ["mrsp-tower-trained-checkpointed", "mrsp-frozen-ref-prefix", "plain"])
def test_a_grpo_run_logs_no_library_complaints(tiny, tmp_path, variant):
    """The paths a default (SDPA) run takes that pass or read a K/V cache: the shared-prefix rollout, the MR-SP
    log-prob passes on the prompt's kept K/V (packed responses), the reference's stored video prefix, the
    shared-prefix log-probs without MR-SP; and checkpointing switched on and read by the deferred tower encode. The random tiny policy writes
    no answer, so its groups tie, and without a KL term the steps skip their updates (the schedule still moves)."""
    sets = {"mrsp-tower-trained-checkpointed": ["model.gradient_checkpointing=true", "grpo.beta=0.0"],
            "mrsp-frozen-ref-prefix": ["model.freeze_vision=true", "mrsp.vision=frozen", "grpo.beta=0.1",
                                       "mrsp.ref_prefix_cache_mb=16"],
            "plain": ["mrsp.enabled=false", "grpo.beta=0.1"]}[variant]
    proc = _train(tmp_path, "grpo", f"model.path={tiny}", "rollout.n=2", "rollout.max_new_tokens=6", *sets)
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = [line for line in proc.stderr.splitlines() if any(c in line for c in COMPLAINTS)]
    assert not said, "\n".join(said)
    steps = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    if "grpo.beta=0.0" in sets:  # no KL term: tied groups leave no gradient, the update is skipped
        assert [m["skipped_update"] for m in steps] == [1.0, 1.0]


def test_a_curate_run_logs_in_one_format(tmp_path):
    """The pipeline workers' lines (forked processes: probe, segment, caption progress) look like the launcher's.
    They once came out in Python's default ``INFO:longreel:...`` form: importing Beam logs through the root logger
    before the worker set its format, which made that setting a no-op."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, "-m", "longreel", "curate", "--demo", "--out", "out"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    line = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) [\w.]+: ")
    assert [s for s in lines if not line.match(s)] == []
    assert any(" longreel: ingest: " in s for s in lines)  # a worker's progress line is among them
    said = [s for s in lines if any(c in s for c in COMPLAINTS)]
    assert not said, "\n".join(said)
