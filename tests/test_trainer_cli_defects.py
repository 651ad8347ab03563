"""Defects of ``longreel train`` / ``longreel eval`` found by an audit: a malformed wids index was a traceback
reported as a bug; options of other train stages were accepted and ignored; ``run.stop_after`` at the last step left
no ``final/``; a resume was refused when the same shards were reached at a new location."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from longreel.cli import main
from longreel.testing.tiny_model import build_tiny_qwen2vl
from conftest import file_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    """Two small shard sets of 4 items, 2 shards each: ``a`` and ``b``, another copy of ``a`` elsewhere, and ``other``
    (other items, so other sha256s)."""
    from longreel.trainer.synthetic_task import make_items, write_shards

    root = tmp_path_factory.mktemp("shards")
    a = write_shards(make_items(4, seed=5, kinds=("colour", "count")), str(root / "a"), per_shard=2)
    other = write_shards(make_items(4, seed=6, kinds=("colour", "count")), str(root / "other"), per_shard=2)
    shutil.copytree(root / "a", root / "copy")
    return {"a": a, "copy": str(root / "copy" / Path(a).name), "other": other}


def _run(capsys, argv):
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def _train(model: str, out: Path | None, *extra: str) -> list[str]:
    """A 2-step SFT run on synthetic items, saved only at its end (``out`` None: in the default run.out_dir)."""
    return _sets(f"model.path={model}", *([f"run.out_dir={out}"] if out else []), "data.source=synthetic",
                 "data.synthetic_train=4", "data.synthetic_kinds=[colour, count]", "data.batch_size=2", "run.steps=2",
                 "run.save_every=0", "run.progress=false", "run.tensorboard=false", "optim.schedule=constant", *extra)


# defect 1: a malformed wids index -----------------------------------------------------------------------------------

ENTRY = {"url": "x-000000.tar", "nsamples": 1, "bytes": 10, "sha256": "0" * 64}


@pytest.mark.parametrize("text, says", [
    ("[]", "is not a wids shard index (a JSON list, not an object)"),
    ('{"__kind__":"wids-shard-index-v1","shardlist":[{"nsamples":1}]}', "shardlist entry 0 has no url"),
    ('{"shardlist": [', "is not a wids shard index (not JSON: Expecting value: line 1 column 16"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": ["x.tar"]}), "entry 0 is a JSON str, not an object"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": [ENTRY, {**ENTRY, "url": 3}]}),
     "entry 1 has url 3, not a shard URL"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": [{**ENTRY, "nsamples": "1"}]}),
     "entry 0 has nsamples '1', not a count of samples"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": [{"url": "x-000000.tar"}]}),
     "entry 0 has no nsamples"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": [{**ENTRY, "sha256": 12}]}),
     "entry 0 has sha256 12, not 64 hex digits"),
    (json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": [{**ENTRY, "bytes": "10"}]}),
     "entry 0 has bytes '10', not a size in bytes"),
])
def test_a_malformed_wids_index_is_one_line_naming_it(tiny, tmp_path, capsys, text, says):
    """``[]`` was "AttributeError: 'list' object has no attribute 'get'", an entry without url "KeyError: 'url'"
    (internal errors, exit 1, in train and eval), and bad JSON named no file."""
    index = tmp_path / "bad.index.json"
    index.write_text(text)
    for argv in (["train", "sft", *_sets(f"model.path={tiny}", f"run.out_dir={tmp_path / 'run'}",
                                         f"data.train_urls=[{index}]")],
                 ["eval", "--model", tiny, "--set", f"data.eval_urls=[{index}]"]):
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and f"{index}" in err and says in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


# defect 2: options of other train stages ------------------------------------------------------------------------


def test_an_option_of_another_train_stage_is_refused(tiny, tmp_path, capsys, monkeypatch):
    """``train sft --out DIR`` trained into ./runs/train (exit 0) and DIR never existed; --keys, --smooth and
    --trust-remote-code were ignored by sft/grpo, and ``train plot ... --set`` ignored the --set."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "wanted"
    rc, _, err = _run(capsys, ["train", "sft", "--out", str(out), *_train(tiny, None)])
    assert rc == 2 and "--out is not an option of train sft" in err and "use --set run.out_dir=DIR" in err, err
    assert not out.exists() and not (tmp_path / "runs").exists()
    run = tmp_path / "plotted"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "stage": "sft", "loss": 1.0 / i}) + "\n"
                                               for i in range(1, 4)))
    cases = [
        (["train", "grpo", "--keys", "loss"], "--keys is not an option of train grpo: it is train plot's"),
        (["train", "sft", "--smooth", "3"], "--smooth is not an option of train sft: it is train plot's"),
        (["train", "grpo", "--trust-remote-code"], "use --set model.trust_remote_code=true"),
        (["train", "plot", str(run), "--set", "run.steps=3"], "--set is not an option of train plot"),
        (["train", "plot", str(run), "--config", "x.yaml"], "--config is not an option of train plot"),
        (["train", "plot", str(run), "--trust-remote-code"], "it is train export's; plot loads no model"),
        (["train", "plot", str(run), "--print-config"], "--print-config is not an option of train plot"),
        (["train", "export", str(run), "--out", str(tmp_path / "x"), "--smooth", "2"], "it is train plot's"),
    ]
    for argv, message in cases:
        rc, _, err = _run(capsys, argv)
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (run / "curves.png").exists() and not (tmp_path / "x").exists()
    # each stage's own options still work
    rc, _, err = _run(capsys, ["train", "plot", str(run), "--keys", "loss", "--smooth", "2", "--out",
                               str(tmp_path / "c.png")])
    assert rc == 0 and (tmp_path / "c.png").is_file(), err
    rc, _, err = _run(capsys, ["train", "export", str(run), "--out", str(tmp_path / "x"), "--trust-remote-code"])
    assert rc == 2 and "not an option" not in err and "not a step checkpoint" in err, err
    rc, printed, _ = _run(capsys, ["train", "sft", "--print-config", *_train(tiny, tmp_path / "r")])
    assert rc == 0 and "out_dir:" in printed


# defect 3: run.stop_after at the last step ----------------------------------------------------------------------


def test_stop_after_at_the_last_step_finishes_the_run(tiny, tmp_path, capsys):
    """``run.steps=2 run.stop_after=2`` printed "stopped": true and left no final/, so the next stage's
    ``model.path=RUN/final`` failed; the last step finishes the run whatever run.stop_after says."""
    from longreel.trainer.preflight import check_model_dir

    out = tmp_path / "run"
    rc, printed, err = _run(capsys, ["train", "sft", *_train(tiny, out, "run.stop_after=2")])
    assert rc == 0, err
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["step"] == 2 and "stopped" not in result
    check_model_dir(str(out / "final"))  # the next stage can train from it
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000002"]


# defect 4: the same shards at a new location --------------------------------------------------------------------


def test_a_resume_finds_its_shards_at_a_new_location_by_their_sha256(tiny, shards, tmp_path, capsys, caplog):
    """A run started on ``http://HOST/ds.index.json`` and relaunched on the same index, now local, was refused as
    "a run with another configuration: data.train_urls"; both list the same shards with the same sha256s."""
    from longreel.trainer.preflight import InputCheckError, check_resume
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig

    out = tmp_path / "run"
    sets = [f"model.path={tiny}", f"run.out_dir={out}", "data.source=shards", "data.batch_size=2", "run.steps=2",
            "run.save_every=0", "run.progress=false", "run.tensorboard=false", "optim.schedule=constant",
            f"data.cache_dir={tmp_path / 'cache'}"]
    name = Path(shards["a"]).name
    with file_server(Path(shards["a"]).parent) as (base, _):
        rc, printed, err = _run(capsys, ["train", "sft", *_sets(*sets, f"data.train_urls=[{base}/{name}]",
                                                                 "run.stop_after=1")])
        assert rc == 0 and json.loads(printed.strip().splitlines()[-1])["stopped"], err
        saved = tmp_path / "saved"  # the step-1 checkpoint's record, for when the server is gone
        saved.mkdir()
        shutil.copy(out / "checkpoints" / "step-000001" / "trainer_state.json", saved)
        # other shards are still another configuration, and the message says how they differ
        rc, _, err = _run(capsys, ["train", "sft", *_sets(*sets, f"data.train_urls=[{shards['other']}]")])
        assert rc == 2 and "data.train_urls" in err and "other shards: shard 1 of 2" in err, err
        with caplog.at_level(logging.INFO, logger="longreel"):
            rc, printed, err = _run(capsys, ["train", "sft", *_sets(*sets, f"data.train_urls=[{shards['copy']}]")])
        assert rc == 0, err
    assert json.loads(printed.strip().splitlines()[-1])["step"] == 2 and (out / "final" / "config.json").is_file()
    said = [r.getMessage() for r in caplog.records if "the same content at a new location" in r.getMessage()]
    assert len(said) == 1 and shards["copy"] in said[0]
    # the earlier URLs gone, and the checkpoint recording no shard digest: refused, saying why
    cfg = load_yaml(TrainConfig, None, [*sets, f"data.train_urls=[{shards['copy']}]"])
    with pytest.raises(InputCheckError, match="could not be read there to compare their content"):
        check_resume(cfg, "sft", saved)
