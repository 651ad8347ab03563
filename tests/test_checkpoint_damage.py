"""Damaged checkpoints: a step checkpoint cut short or missing files is found before anything loads. A resume passes
over it to the newest whole one (and still ends bitwise where an unbroken run ends); with none whole, the run is
refused with the way out; `longreel eval` and `longreel train export` name the damaged file. Before, each of these
ended in a safetensors or file-not-found traceback reported as "internal error ... this is a bug"."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import torch
from safetensors.torch import load_file, save_file

from longreel.cli import main
from longreel.testing.tiny_model import build_tiny_qwen2vl
from longreel.trainer.checkpoint import (checkpoint_problem, latest_checkpoint, resumable_checkpoint,
                                         safetensors_problem)
from longreel.trainer.logging_utils import read_metrics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def _overrides(model: str, out: Path, steps: int) -> list[str]:
    return [f"model.path={model}", f"run.out_dir={out}", "data.source=synthetic", "data.synthetic_train=8",
            "data.synthetic_kinds=[colour, count]", "data.batch_size=2", f"run.steps={steps}", "run.save_every=2",
            "run.keep_checkpoints=3", "run.progress=false", "run.tensorboard=false", "run.seed=3", "optim.lr=3e-3",
            "rollout.n=4", "rollout.max_new_tokens=8", "grpo.mix_policy=true"]


def _train(model: str, out: Path, steps: int) -> int:
    return main(["train", "grpo", *[a for o in _overrides(model, out, steps) for a in ("--set", o)]])


def _cut(path: Path, keep: int) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(keep)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """A 6-step run straight through, and one stopped after step 4 (checkpoints 2 and 4) to damage and resume."""
    root = tmp_path_factory.mktemp("runs")
    assert _train(tiny, root / "straight", 6) == 0
    assert _train(tiny, root / "stopped", 4) == 0
    return root


def _copy(runs: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs / "stopped", out)
    shutil.rmtree(out / "final")
    return out


def test_a_whole_checkpoint_lists_its_files_and_passes(runs):
    ckpt = runs / "stopped" / "checkpoints" / "step-000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert {"model.safetensors", "optimizer.safetensors", "optimizer.json", "scheduler.json",
            "config.json"} <= set(state["files"])
    assert not [f for f in state["files"] if f.startswith("rng-")] and "trainer_state.json" not in state["files"]
    assert json.loads((ckpt / "rng-rank0.json").read_text())["files"] == []  # no shards: an unsharded run
    assert checkpoint_problem(ckpt) is None
    assert resumable_checkpoint(ckpt.parent) == (ckpt, [])
    assert resumable_checkpoint(runs / "nothing-here") == (None, [])


def test_rank_0_does_not_list_another_ranks_file_on_its_way_to_its_name(tmp_path):
    """Rank 0 lists its own files while the other ranks may still be writing theirs: rank 1's RNG JSON under its
    temporary name (``.tmp-<hex>-rng-rank1.json``, renamed a moment later) was once listed, and the checkpoint then
    failed its own check (caught by the 2-rank FSDP test in a newcomer run of the whole suite)."""
    from longreel.trainer.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    temp = ".tmp-0123456789abcdef0123456789abcdef-rng-rank1.json"

    def policy_files(d):  # rank 0's own files are written while another rank's temp file sits beside them
        (d / "config.json").write_text("{}")
        (d / temp).write_text("{")

    path = save_checkpoint(tmp_path, 1, model=model, optimizer=None, scheduler=None, trainer_state={"loader": {}},
                           policy_files=policy_files)
    assert json.loads((path / "trainer_state.json").read_text())["files"] == ["config.json", "model.safetensors"]
    (path / temp).unlink()  # the other rank renamed it
    assert checkpoint_problem(path) is None


@pytest.mark.parametrize("damage", ["cut", "empty", "missing", "json", "rng", "state", "outside"])
def test_checkpoint_problem_names_what_is_wrong(runs, tmp_path, damage):
    ckpt = _copy(runs, tmp_path) / "checkpoints" / "step-000004"
    if damage == "cut":  # a copy that stopped part way: the header says more bytes than there are
        _cut(ckpt / "optimizer.safetensors", (ckpt / "optimizer.safetensors").stat().st_size // 2)
        want = "optimizer.safetensors"
    elif damage == "empty":  # a crash before the data reached the disk
        _cut(ckpt / "model.safetensors", 0)
        want = "model.safetensors (0 bytes) cannot be read"
    elif damage == "missing":
        (ckpt / "scheduler.json").unlink()
        want = "scheduler.json is missing"
    elif damage == "json":
        _cut(ckpt / "optimizer.json", 10)
        want = "optimizer.json (10 bytes) is not whole JSON"
    elif damage == "rng":
        (ckpt / "rng-rank0.safetensors").unlink()
        want = "rng-rank0.safetensors is missing"
    elif damage == "state":  # whole JSON, but not a checkpoint's
        (ckpt / "trainer_state.json").write_text('{"world": "two"}')
        want = "its state files do not describe a checkpoint (ValueError"
    else:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        (ckpt / "trainer_state.json").write_text(json.dumps({**state, "files": ["../../../etc/hostname"]}))
        want = "it lists '../../../etc/hostname', not a file inside it"
    problem = checkpoint_problem(ckpt)
    assert problem is not None and want in problem, problem
    path, passed_over = resumable_checkpoint(ckpt.parent)
    assert path == ckpt.parent / "step-000002" and [p.name for p, _ in passed_over] == ["step-000004"]


def test_safetensors_problem_finds_a_file_longer_or_shorter_than_its_header(tmp_path):
    f = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(10.0)}, str(f))
    assert safetensors_problem(f) is None
    with open(f, "ab") as fh:
        fh.write(b"\0" * 8)
    assert safetensors_problem(f) is not None
    _cut(f, f.stat().st_size - 12)
    assert safetensors_problem(f) is not None


def test_a_resume_passes_over_a_damaged_checkpoint_and_ends_as_an_unbroken_run(tiny, runs, tmp_path, caplog):
    out = _copy(runs, tmp_path)
    _cut(out / "checkpoints" / "step-000004" / "model.safetensors", 1000)
    with caplog.at_level("WARNING", logger="longreel.trainer"):
        assert _train(tiny, out, 6) == 0
    warned = [r.getMessage() for r in caplog.records if "passing over" in r.getMessage()]
    assert len(warned) == 1 and "resuming from step-000002" in warned[0], warned
    assert "step-000004: model.safetensors (1,000 bytes) cannot be read" in warned[0]
    a = load_file(str(runs / "straight" / "final" / "model.safetensors"))
    b = load_file(str(out / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # steps 3-6 ran again, exactly
    keys = ("step", "loss", "reward_mean", "grad_norm", "lr")
    rows = [[tuple(r.get(k) for k in keys) for r in read_metrics(d / "metrics.jsonl")] for d in (runs / "straight",
                                                                                                     out)]
    assert rows[0] == rows[1] and [r[0] for r in rows[0]] == [1, 2, 3, 4, 5, 6]
    # the damaged step was written again when the run came back to it
    assert checkpoint_problem(out / "checkpoints" / "step-000004") is None
    assert latest_checkpoint(out / "checkpoints").name == "step-000006"


def test_a_run_with_no_whole_checkpoint_is_refused_with_the_way_out(tiny, runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    _cut(out / "checkpoints" / "step-000004" / "model.safetensors", 1000)
    (out / "checkpoints" / "step-000002" / "optimizer.json").unlink()
    before = (out / "metrics.jsonl").read_bytes()
    assert _train(tiny, out, 6) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no checkpoint there can be resumed" in err and "--set run.resume=false" in err
    assert "step-000004: model.safetensors" in err and "step-000002: optimizer.json is missing" in err
    assert (out / "metrics.jsonl").read_bytes() == before  # nothing started over
    # `latest` naming a directory that is gone is the same: no silent start from step 0
    shutil.rmtree(out / "checkpoints" / "step-000002")
    shutil.rmtree(out / "checkpoints" / "step-000004")
    assert _train(tiny, out, 6) == 2
    assert "step-000004: the directory is missing" in capsys.readouterr().err


def test_eval_and_export_name_a_damaged_weights_file(runs, tmp_path, capsys):
    ckpt = _copy(runs, tmp_path) / "checkpoints" / "step-000004"
    _cut(ckpt / "model.safetensors", 5000)
    rc = main(["eval", "--model", str(ckpt), "--set", "data.source=synthetic", "--set", "data.synthetic_eval=2",
               "--set", "run.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.safetensors (5,000 bytes) cannot be read" in err and "Traceback" not in err, err
    rc = main(["train", "export", str(ckpt), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert rc == 2 and "is damaged: model.safetensors (5,000 bytes)" in err and "Traceback" not in err, err
    assert not (tmp_path / "exported").exists() and not list(tmp_path.glob(".exported.*"))


def test_a_checkpoint_from_before_the_lists_is_still_checked(runs, tmp_path):
    ckpt = _copy(runs, tmp_path) / "checkpoints" / "step-000004"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["files"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_problem(ckpt) is None
    os.unlink(ckpt / "model.safetensors")
    assert checkpoint_problem(ckpt) == "model.safetensors is missing"


def test_a_save_that_fails_removes_its_partial_files(tiny, tmp_path, monkeypatch, capsys):
    import errno

    import longreel.trainer.checkpoint as checkpoint

    def disk_full(model, filename, *a, **k):
        Path(filename).write_bytes(b"\0" * 4096)  # part of the weights had reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", disk_full)
    out = tmp_path / "run"
    assert _train(tiny, out, 4) == 1
    err = capsys.readouterr().err
    assert "failed: No space left on device" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []  # no partial step directory kept


def test_a_run_removes_what_unfinished_saves_left(tiny, runs, tmp_path, caplog):
    out = _copy(runs, tmp_path)
    ckpts = out / "checkpoints"
    (ckpts / ".tmp-step-000006").mkdir()
    (ckpts / ".tmp-step-000006" / "model.safetensors").write_bytes(b"\0" * 3000)  # a save killed part way
    (ckpts / ".latest.k2j4_a9b").write_text("step-0000")
    (out / ".final-x8a1q0zz").mkdir()
    (out / ".final-x8a1q0zz" / "model.safetensors").write_bytes(b"\0" * 500)
    keep = out / ".final-notes.txt.d"  # not a save's: a directory of the user's own named otherwise is kept
    keep.mkdir()
    (out / "notes.tmp-step").write_text("mine")
    with caplog.at_level("WARNING", logger="longreel.trainer"):
        assert _train(tiny, out, 6) == 0
    warned = [r.getMessage() for r in caplog.records if "saves that did not finish" in r.getMessage()]
    assert len(warned) == 1, warned
    for name in (".tmp-step-000006 (3,000 bytes)", ".latest.k2j4_a9b (9 bytes)", ".final-x8a1q0zz (500 bytes)"):
        assert name in warned[0]
    assert not list(ckpts.glob(".tmp-*")) and not list(ckpts.glob(".latest.*"))
    assert sorted(p.name for p in out.glob(".final-*")) == [keep.name] and (out / "notes.tmp-step").exists()


@pytest.mark.parametrize("torn", ['{"step": 5, "stage": "grpo", "loss": 0.1', "\0" * 64 + "\n"],
                         ids=["half-a-line", "nul-bytes"])
def test_a_metrics_line_cut_short_by_a_kill_does_not_stop_the_resume(tiny, runs, tmp_path, caplog, torn):
    """A run killed (or a machine gone down) while it wrote a line of metrics.jsonl: the resume read the file with
    json.loads and failed with a JSONDecodeError reported as an internal error."""
    out = _copy(runs, tmp_path)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write(torn)
    with caplog.at_level("WARNING", logger="longreel.trainer"):
        assert _train(tiny, out, 6) == 0
    if torn.startswith("{"):
        assert any("left out 1 line(s) that are not whole JSON (line 5)" in r.getMessage() for r in caplog.records)
    rows = [[(r["step"], r.get("loss")) for r in read_metrics(d / "metrics.jsonl")] for d in (runs / "straight", out)]
    assert rows[0] == rows[1]
