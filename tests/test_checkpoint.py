"""Checkpoints: atomic, pickle-free, and resuming continues exactly (bitwise on CPU) where a run stopped."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.schemas.config import load_yaml  # noqa: E402
from longreel.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _overrides(model: str, out: Path) -> list[str]:
    return [f"model.path={model}", f"run.out_dir={out}", "data.source=synthetic", "data.synthetic_train=8",
            "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "run.steps=6", "run.save_every=3",
            "run.progress=false", "run.tensorboard=false", "run.seed=3", "optim.lr=3e-3", "optim.warmup_steps=2",
            "optim.schedule=cosine", "rollout.n=4", "rollout.max_new_tokens=8"]


def _cfg(model: str, out: Path, *extra: str) -> TrainConfig:
    return load_yaml(TrainConfig, None, [*_overrides(model, out), *extra])


def _weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def _losses(run: Path, keys) -> list[tuple]:
    return [tuple(r.get(k) for k in ("step", *keys)) for r in read_metrics(run / "metrics.jsonl")]


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("stage", ["grpo", "sft"])
def test_resume_is_exact(tiny, tmp_path, stage):
    from longreel.trainer.grpo import run_grpo
    from longreel.trainer.sft import run_sft

    run = run_grpo if stage == "grpo" else run_sft
    extra = ("grpo.mix_policy=true", "grpo.beta=0.05") if stage == "grpo" else ()
    keys = ("loss", "reward_mean", "accuracy", "grad_norm", "lr", "kl") if stage == "grpo" else ("loss", "grad_norm")

    straight = tmp_path / "straight"
    run(_cfg(tiny, straight, *extra))

    resumed = tmp_path / "resumed"
    out = run(_cfg(tiny, resumed, "run.stop_after=3", *extra))
    assert out["stopped"] and out["step"] == 3
    assert latest_checkpoint(resumed / "checkpoints").name == "step-000003"
    assert not (resumed / "final").exists()
    out = run(_cfg(tiny, resumed, *extra))
    assert out["step"] == 6

    _assert_bitwise_equal(_weights(straight), _weights(resumed))
    a, b = _losses(straight, keys), _losses(resumed, keys)
    assert [r[0] for r in a] == [1, 2, 3, 4, 5, 6]
    assert a == b  # the logged losses of steps 1-6, bitwise (floats round-trip through JSON exactly)
    # and the run actually changed the weights
    base = load_file(str(Path(tiny) / "model.safetensors"))
    assert any(not torch.equal(base[k], v) for k, v in _weights(straight).items())


@pytest.mark.parametrize("stage", ["grpo", "sft"])
def test_a_step_checkpoint_is_a_policy_directory(tiny, tmp_path, stage):
    from longreel.trainer.grpo import run_grpo
    from longreel.trainer.policy import load_policy
    from longreel.trainer.sft import run_sft

    run = run_grpo if stage == "grpo" else run_sft
    # mix-policy: a random policy's own groups may all score the same, and then no step changes the weights
    extra = ("grpo.mix_policy=true",) if stage == "grpo" else ()
    run(_cfg(tiny, tmp_path / "run", *extra))
    ckpts = tmp_path / "run" / "checkpoints"

    def loaded(path) -> dict:
        model, processor = load_policy(str(path))
        assert processor.tokenizer is not None
        return model.state_dict()

    final = loaded(tmp_path / "run" / "final")
    _assert_bitwise_equal(loaded(ckpts / "step-000006"), final)
    # step 3's checkpoint holds step 3's weights, not a copy of the last
    step3 = loaded(ckpts / "step-000003")
    assert step3.keys() == final.keys() and any(not torch.equal(step3[k], final[k]) for k in final)
    # and `longreel eval` takes it (its --out may name a directory not made yet)
    from longreel.cli import main

    res = tmp_path / "eval" / "step3" / "result.json"
    rc = main(["eval", "--model", str(ckpts / "step-000003"), "--set", "data.source=synthetic",
               "--set", "data.synthetic_eval=3", "--set", "eval.max_new_tokens=4", "--set", "run.progress=false",
               "--out", str(res)])
    doc = json.loads(res.read_text())
    assert rc == 0 and doc["n"] == 3 and doc["model"] == str(ckpts / "step-000003")
    # `longreel train export` of an unsharded step: the weights and policy files, no training state
    exported = tmp_path / "published" / "step3"
    assert main(["train", "export", str(ckpts / "step-000003"), "--out", str(exported)]) == 0
    assert not {"optimizer.safetensors", "optimizer.json", "scheduler.json", "trainer_state.json"} & {
        p.name for p in exported.iterdir()} and not list(exported.glob("rng-*"))
    _assert_bitwise_equal(loaded(exported), step3)
    assert main(["train", "export", str(ckpts / "step-000003"), "--out", str(exported)]) == 2  # never overwrites
    # readable by the other users of a shared disk: safetensors creates its files 0600
    for d in (tmp_path / "run" / "final", ckpts / "step-000003", exported):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in d.iterdir() if p.is_file()}
        assert set(modes.values()) == {"0o644"}, (d.name, modes)


def test_checkpoint_files_are_pickle_free_and_atomic(tiny, tmp_path):
    from longreel.trainer.policy import load_policy
    from longreel.trainer.runtime import build_optimizer, build_scheduler

    cfg = _cfg(tiny, tmp_path)
    model, _ = load_policy(tiny)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, 10)
    model.lm_head.weight.sum().backward()
    opt.step()
    sched.step()
    root = tmp_path / "ckpt"
    path = save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=sched, trainer_state={"loader": {"pos": 2}})
    names = sorted(p.name for p in path.iterdir())
    assert all(n.endswith((".safetensors", ".json")) for n in names), names
    assert latest_checkpoint(root) == path
    # a half-written later checkpoint (a crash mid-save) is not picked up
    (root / ".tmp-step-000002").mkdir()
    (root / ".tmp-step-000002" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(root) == path

    model2, _ = load_policy(tiny)
    opt2 = build_optimizer(model2, cfg.optim)
    sched2 = build_scheduler(opt2, cfg.optim, 10)
    torch.manual_seed(123)
    state = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert state["loader"] == {"pos": 2} and state["step"] == 1
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for i in s1["state"]:
        for name in s1["state"][i]:
            assert torch.equal(torch.as_tensor(s1["state"][i][name]), torch.as_tensor(s2["state"][i][name]))
    assert sched2.last_epoch == sched.last_epoch and sched2.get_last_lr() == sched.get_last_lr()
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 1


def test_a_run_resumes_only_its_own_configuration(tiny, tmp_path, capsys, caplog):
    from longreel.cli import main
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft

    out = tmp_path / "run"
    run_sft(_cfg(tiny, out, "run.stop_after=3"))
    # what the run trains with is written beside what it writes, and reads back as the same config
    assert load_yaml(TrainConfig, str(out / "config.yaml")) == _cfg(tiny, out, "run.stop_after=3")
    # a changed learning rate would have been replaced by the saved schedule's: refused, naming the key
    with pytest.raises(InputCheckError, match=r"optim.lr: 0.003 there, 0.01 in this run"):
        run_sft(_cfg(tiny, out, "optim.lr=1e-2"))
    rc = main(["train", "sft", *[a for o in (*_overrides(tiny, out), "optim.lr=1e-2") for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert rc == 2 and "optim.lr" in err and "Traceback" not in err
    # another stage in the same directory is refused too
    with pytest.raises(InputCheckError, match="holds a 'sft' run"):
        from longreel.trainer.grpo import run_grpo
        run_grpo(_cfg(tiny, out))
    # keys that do not change a step's arithmetic may differ (run.stop_after, run.steps' end, logging, eval), and
    # the model directory may be named another way (here through a symlink)
    # and so may the memory settings, to fit a resumed run where the first ran out of memory: the run says that it
    # then computes the same within rounding, not bitwise
    link = tmp_path / "model-link"
    link.symlink_to(tiny, target_is_directory=True)
    with caplog.at_level("WARNING", logger="longreel.trainer"):
        assert run_sft(_cfg(tiny, out, "run.progress=false", "eval.max_new_tokens=4", f"model.path={link}",
                            "rollout.prompts_per_decode=1", "mrsp.frozen_cache_mb=64"))["step"] == 6
    warned = [r.getMessage() for r in caplog.records if "other memory settings" in r.getMessage()]
    assert len(warned) == 1 and "rollout.prompts_per_decode: 0 -> 1" in warned[0]
    assert "frozen_cache_mb" not in warned[0]  # bitwise the same computation: nothing to say
    # run.resume=false starts over: the earlier run's checkpoints are removed, not left beside the new ones, and so
    # is its final/, which a new run stopped before its end would otherwise leave as if it were its own
    assert (out / "final" / "model.safetensors").is_file()
    run_sft(_cfg(tiny, out, "optim.lr=1e-2", "run.resume=false", "run.steps=2", "run.stop_after=1"))
    assert not (out / "final").exists()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]
    run_sft(_cfg(tiny, out, "optim.lr=1e-2", "run.resume=false", "run.steps=2", "run.save_every=0"))
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000002"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]


def test_a_decaying_schedule_refuses_another_run_steps(tiny, tmp_path):
    """A linear or cosine schedule is laid out over run.steps: resuming a 4-step cosine run with run.steps=8 went on
    silently, its learning rate jumping back up. A constant schedule may still be extended."""
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft

    out = tmp_path / "cos"
    run_sft(_cfg(tiny, out, "optim.schedule=cosine", "run.steps=4", "run.stop_after=2"))
    with pytest.raises(InputCheckError, match=r"run.steps: 4 there, 8 in this run \(optim.schedule=cosine is laid "
                                              r"out over run.steps\)"):
        run_sft(_cfg(tiny, out, "optim.schedule=cosine", "run.steps=8"))
    assert run_sft(_cfg(tiny, out, "optim.schedule=cosine", "run.steps=4"))["step"] == 4
    flat = tmp_path / "constant"
    run_sft(_cfg(tiny, flat, "optim.schedule=constant", "run.steps=4", "run.stop_after=2"))
    assert run_sft(_cfg(tiny, flat, "optim.schedule=constant", "run.steps=6"))["step"] == 6


def test_the_logged_lr_is_the_rate_the_step_used(tiny, tmp_path):
    """metrics.jsonl's lr was read after the schedule's step: the next step's rate (a 2-step warm-up's first step,
    at half the peak, logged the full peak)."""
    from longreel.trainer.runtime import lr_factor
    from longreel.trainer.sft import run_sft

    cfg = _cfg(tiny, tmp_path / "lr", "run.save_every=0")
    run_sft(cfg)
    logged = [r["lr"] for r in read_metrics(tmp_path / "lr" / "metrics.jsonl")]
    assert logged == pytest.approx([cfg.optim.lr * lr_factor(i, cfg.optim, 6) for i in range(6)], rel=1e-12)
    assert logged[0] == pytest.approx(cfg.optim.lr / 2)


def test_a_run_finds_its_model_moved_by_its_content(tiny, tmp_path):
    # a run resumed on another machine may find its model directory at another path: the checkpoint keeps the
    # model's content hash (weights and config.json), so the same model elsewhere resumes, exactly; another model at
    # the new path does not (GRPO's KL reference and the processor come from model.path)
    import shutil

    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft

    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(tiny, model)
    run_sft(_cfg(str(model), out, "run.stop_after=3"))
    state = json.loads((latest_checkpoint(out / "checkpoints") / "trainer_state.json").read_text())
    assert len(state["model_fingerprint"]) == 16
    moved = tmp_path / "elsewhere" / "model"
    moved.parent.mkdir()
    model.rename(moved)
    other = build_tiny_qwen2vl(tmp_path / "other", seed=1)  # the same architecture, other weights
    with pytest.raises(InputCheckError, match=rf"model.path: '{model}' there, '{other}' in this run"):
        run_sft(_cfg(other, out))
    assert run_sft(_cfg(str(moved), out))["step"] == 6
    straight = tmp_path / "straight"
    run_sft(_cfg(tiny, straight))
    _assert_bitwise_equal(_weights(out), _weights(straight))


def test_one_training_run_per_output_directory(tiny, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.run_lock import LOCK_NAME, RunLock
    from longreel.trainer.sft import run_sft

    out = tmp_path / "run"
    held = RunLock(out).acquire()  # another launch on the same run.out_dir, still running
    with pytest.raises(InputCheckError, match=rf"is in use by another longreel train run \(pid {os.getpid()}"):
        run_sft(_cfg(tiny, out))
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()  # it wrote nothing
    held.release()
    assert run_sft(_cfg(tiny, out))["step"] == 6
    assert not (out / LOCK_NAME).exists()  # released and removed at the end of the run
    # a holder killed with -9 leaves its file, not its lock: the kernel dropped the flock with the process
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from longreel.trainer.run_lock import RunLock; "
                              f"RunLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(InputCheckError, match="in use"):
            RunLock(out).acquire()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (out / LOCK_NAME).exists()
    RunLock(out).acquire().release()


def test_a_run_relaunched_from_its_config_yaml_resumes_it(tiny, tmp_path, caplog):
    """RUN/config.yaml recorded ``run.resume: false`` when the run started with it, and ``longreel train --config
    RUN/config.yaml --set run.steps=N``, meant to extend the run, then removed its checkpoints and final/. And a
    start-over whose model.path lies in what it removes deleted the model it was about to train from."""
    from longreel.cli import main
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft

    out = tmp_path / "run"
    run_sft(_cfg(tiny, out, "run.resume=false", "run.stop_after=2"))
    assert load_yaml(TrainConfig, str(out / "config.yaml")).run.resume is True
    with caplog.at_level("INFO", logger="longreel.trainer"):
        assert main(["train", "sft", "--config", str(out / "config.yaml"), "--set", "run.stop_after=0"]) == 0
    assert "removing" not in caplog.text and "resumed sft from" in caplog.text
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(InputCheckError, match="run.resume=false would remove model.path"):
        run_sft(_cfg(tiny, out, f"model.path={out / 'final'}", "run.resume=false"))
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoints" / "step-000006").is_dir()


def test_a_run_with_relative_paths_relaunched_from_inside_it_resumes_it(tiny, tmp_path, monkeypatch, caplog):
    """Paths as typed went into RUN/config.yaml: `cd RUN && longreel train sft --config config.yaml --set
    run.steps=N` then read run.out_dir 'runs/sft' from inside the run and trained a new run there from step 1
    (exit 0). The command's paths are now made absolute before the run records them."""
    import shutil

    from longreel.cli import main

    shutil.copytree(tiny, tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    argv = [f"{k}={v}" for k, v in (o.split("=", 1) for o in _overrides(tiny, tmp_path))
            if k not in ("model.path", "run.out_dir")]
    sets = [x for o in ["model.path=tiny", "run.out_dir=runs/sft", "run.stop_after=3", *argv] for x in ("--set", o)]
    assert main(["train", "sft", *sets]) == 0
    recorded = load_yaml(TrainConfig, str(tmp_path / "runs/sft/config.yaml"))
    assert (recorded.model.path, recorded.run.out_dir) == (str(tmp_path / "tiny"), str(tmp_path / "runs/sft"))
    monkeypatch.chdir(tmp_path / "runs" / "sft")
    with caplog.at_level("INFO", logger="longreel.trainer"):
        assert main(["train", "sft", "--config", "config.yaml", "--set", "run.stop_after=0"]) == 0
    assert "resumed sft from" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path / "runs/sft/metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "runs/sft/runs").exists()


def test_a_run_recorded_with_relative_train_urls_still_resumes(tmp_path, monkeypatch):
    """A checkpoint of a run from before the paths were made absolute holds data.train_urls as typed: relaunched
    from the same directory, the same shards are not "another configuration"."""
    from longreel.trainer.preflight import _same_paths

    monkeypatch.chdir(tmp_path)
    assert _same_paths(["shards/a.json", "gs://b/x.tar"], [str(tmp_path / "shards/a.json"), "gs://b/x.tar"])
    assert not _same_paths(["shards/a.json"], [str(tmp_path / "other/a.json")])
    assert not _same_paths(["shards/a.json"], [str(tmp_path / "shards/a.json"), "b.json"])
    assert not _same_paths(["gs://b/x.tar"], ["gs://b/y.tar"])


def test_a_run_without_final_still_saves_its_last_step_and_stop_after_is_kept(tiny, tmp_path, caplog):
    """``run.save_every=0`` ("only at the end") with ``run.save_final=false`` saved nothing, so a relaunch started
    over; resumed at ``run.stop_after``'s step, the same command trained one step more each time; a ``run.steps``
    below the resumed step went by without a word."""
    from longreel.trainer.sft import run_sft

    out = tmp_path / "run"
    extra = ("optim.schedule=constant", "run.save_every=0", "run.save_final=false")
    assert run_sft(_cfg(tiny, out, *extra, "run.steps=3"))["step"] == 3
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000003"]
    assert not (out / "final").exists()
    stopped = run_sft(_cfg(tiny, out, *extra, "run.steps=6", "run.stop_after=3"))
    assert stopped["step"] == 3 and stopped["stopped"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    with caplog.at_level("WARNING", logger="longreel.trainer"):
        assert run_sft(_cfg(tiny, out, *extra, "run.steps=2"))["step"] == 3
    assert "run.steps=2 is below step 3" in caplog.text


def test_a_sharded_checkpoint_is_refused_before_the_model_loads_outside_fsdp(tmp_path):
    from longreel.trainer.checkpoint import SHARDED
    from longreel.trainer.preflight import InputCheckError, check_sharding

    sharded, full = tmp_path / "step-000004", tmp_path / "step-000002"
    (sharded / SHARDED).mkdir(parents=True)
    full.mkdir()
    cfg = load_yaml(TrainConfig, None, [f"run.out_dir={tmp_path}"])
    with pytest.raises(InputCheckError, match="of an FSDP run .sharded.: resume it with dist.strategy=fsdp"):
        check_sharding(cfg, sharded, world=1)
    check_sharding(cfg, full, world=1)
    fsdp = load_yaml(TrainConfig, None, [f"run.out_dir={tmp_path}", "dist.strategy=fsdp"])
    check_sharding(fsdp, sharded, world=2)
    with pytest.raises(InputCheckError, match="full weights.: resume it without dist.strategy=fsdp"):
        check_sharding(fsdp, full, world=2)


def test_a_resume_is_not_refused_over_keys_its_stage_never_reads(tiny, tmp_path):
    """One config file serves SFT and GRPO: a resumed SFT run was refused over grpo.beta, rollout.n and
    mrsp.enabled, none of which it reads; a key it reads is still refused."""
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft

    out = tmp_path / "run"
    run_sft(_cfg(tiny, out, "run.stop_after=2"))
    with pytest.raises(InputCheckError, match="sft.epochs"):
        run_sft(_cfg(tiny, out, "sft.epochs=3", "run.stop_after=0"))
    assert run_sft(_cfg(tiny, out, "grpo.beta=0.5", "rollout.n=2", "mrsp.enabled=false", "run.stop_after=0"))[
        "step"] == 6
