"""What ``longreel eval`` and ``longreel train plot`` report matches what was evaluated: no accuracy (and exit 1) when
no item was scored, the shards and samples the loader skipped in the result itself, and a run's lone eval point
drawn with its interval."""
from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from longreel.cli import main
from longreel.testing.tiny_model import build_tiny_qwen2vl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "m", seed=0))


def _eval(capsys, model: str, out, *sets: str) -> tuple[int, str, str, dict]:
    argv = ["eval", "--model", model, "--out", str(out), "--set", "run.progress=false", "--set", "run.threads=2",
            "--set", "eval.max_new_tokens=4"]
    for s in sets:
        argv += ["--set", s]
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, json.loads(out.read_text()) if out.is_file() else {}


def test_nothing_scored_has_no_accuracy():
    """``summarize`` of skipped items only said accuracy 0.0 (a model that got every item wrong)."""
    from longreel.trainer.eval import summarize

    skipped = [{"index": i, "key": f"k{i}", "skipped": {"reason": "ValueError", "message": "no template"}}
               for i in range(3)]
    res = summarize(skipped)
    assert res["n"] == 0 and res["skipped"] == 3
    assert res["accuracy"] is None and res["format_rate"] is None and res["accuracy_ci95"] is None
    assert summarize([])["accuracy"] is None


def test_eval_with_every_item_skipped_fails_naming_the_reasons(tiny, tmp_path, monkeypatch, capsys):
    """Every item skipped: "accuracy": 0.0 and exit 0 before; now null, the result still written, and exit 1 with
    one line naming the reasons."""
    import longreel.trainer.eval as ev

    def no_prompt(processor, item, video_token_id):
        raise ValueError(f"cannot render {item['key']}: the processor has no chat template")

    monkeypatch.setattr(ev, "encode_prompt", no_prompt)
    out = tmp_path / "r.json"
    rc, printed, err, res = _eval(capsys, tiny, out, "data.source=synthetic", "data.synthetic_eval=3")
    lines = [x for x in err.splitlines() if x.startswith("longreel eval:")]
    assert rc == 1, err
    assert len(lines) == 1 and lines[0].startswith("longreel eval: no item could be evaluated: 3 skipped (3 ValueError"
                                                   ": cannot render "), err
    assert "has no chat template" in lines[0] and f"the result is in {out}" in lines[0]
    assert "accuracy 0.0000" not in printed + err
    assert res["accuracy"] is None and res["n"] == 0 and res["skipped"] == 3


def _damage_a_sample(shard, key: str) -> None:
    """Rewrite ``shard`` with ``key``'s meta.json no longer JSON: one bad sample in a readable shard."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, data in members:
            if m.name == f"{key}.meta.json":
                data = b"{not json"
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data))


def test_eval_result_records_what_the_loader_skipped(tiny, tmp_path, capsys):
    """data.on_error=skip: a shard missing, one unreadable and one sample bad were only warnings on stderr; the
    result said "skipped": 0 as if every item were there. The result now lists each with its reason."""
    from longreel.trainer.synthetic_task import make_items, write_shards

    items = make_items(6, seed=6, kinds=("colour",))
    write_shards(items, str(tmp_path / "s"), per_shard=3)  # synthetic-rl-000000.tar, -000001.tar
    shards = sorted((tmp_path / "s").glob("*.tar"))
    assert [p.name for p in shards] == ["synthetic-rl-000000.tar", "synthetic-rl-000001.tar"]
    bad_key = sorted(it["video_id"] for it in items)[0]  # the first sample of the first shard
    _damage_a_sample(shards[0], bad_key)
    shards[1].write_bytes(b"not a tar archive" * 64)  # unreadable; -000002.tar is not there at all
    pattern = str(tmp_path / "s" / "synthetic-rl-{000000..000002}.tar")
    out = tmp_path / "r.json"
    rc, printed, err, res = _eval(capsys, tiny, out, f'data.eval_urls=["{pattern}"]', "data.on_error=skip")
    assert rc == 0, err
    assert res["n"] + res["skipped"] == 2  # what shard 0 still gave
    assert res["loader_skipped"]["shards"] == 2 and res["loader_skipped"]["samples"] >= 1
    urls = [s["url"] for s in res["skipped_shards"]]
    assert urls == [str(shards[1]), str(tmp_path / "s" / "synthetic-rl-000002.tar")], res["skipped_shards"]
    assert all(s["reason"] for s in res["skipped_shards"])
    assert "No such file" in res["skipped_shards"][1]["reason"]
    [sample] = res["skipped_samples"]
    assert (sample["url"], sample["key"]) == (str(shards[0]), bad_key) and sample["reason"], sample
    assert "; the loader skipped 2 shards and 1 sample); wrote" in printed, printed


def _blue_rows(png) -> list[int]:
    """The pixel rows of ``png`` holding the first curve's colour (matplotlib's C0 blue, faded or not)."""
    from matplotlib import image

    img = image.imread(str(png))
    blue = (img[..., 2] - img[..., 0] > 0.2) & (img[..., 2] > 0.5)
    return [i for i in range(blue.shape[0]) if blue[i].any()]


def test_plot_draws_a_lone_eval_point_with_its_interval(tmp_path):
    """A run that evaluated once (eval.every=2, run.steps=3) got an empty eval_accuracy panel: a line through one
    point draws nothing, nor does a shaded area one step wide. Now a marker and an error bar over its interval."""
    from longreel.trainer.plot import plot_metrics

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "stage": "sft", "loss": 6.0 - i / 10} for i in range(1, 4)]
    rows[1].update(eval_accuracy=0.5, eval_accuracy_ci95_low=0.2, eval_accuracy_ci95_high=0.8)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "p.png"
    assert plot_metrics([run], out, keys=["eval_accuracy"]) == ["eval_accuracy"]
    drawn = _blue_rows(out)
    assert drawn, "nothing drawn in the eval_accuracy panel"
    assert drawn[-1] - drawn[0] > 100, (drawn[0], drawn[-1])  # the interval, most of the panel's 300 px
    del rows[1]["eval_accuracy_ci95_low"], rows[1]["eval_accuracy_ci95_high"]  # a lone point with no interval
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics([run], out, keys=["eval_accuracy", "loss"])
    assert _blue_rows(out)


def test_unreadable_held_out_shards_stop_the_run_before_its_first_step(tiny, tmp_path):
    """They were read at the first evaluation: a truncated held-out shard stopped a run ``eval.every`` steps in,
    with no checkpoint of the steps since the last save."""
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.sft import run_sft
    from longreel.trainer.synthetic_task import make_items, write_shards

    write_shards(make_items(4, seed=6, kinds=("colour",)), str(tmp_path / "held"), per_shard=4)
    write_shards(make_items(4, seed=7, kinds=("colour",)), str(tmp_path / "train"), per_shard=4)
    [held], [train] = sorted((tmp_path / "held").glob("*.tar")), sorted((tmp_path / "train").glob("*.tar"))
    held.write_bytes(held.read_bytes()[:held.stat().st_size // 2])
    out = tmp_path / "run"
    cfg = load_yaml(TrainConfig, None, [f"model.path={tiny}", f"run.out_dir={out}", f"data.train_urls=[{train}]",
                                        f"data.eval_urls=[{held}]", "eval.every=3", "run.steps=4",
                                        "run.save_every=0", "run.progress=false", "data.batch_size=1"])
    with pytest.raises(InputCheckError, match="truncated"):
        run_sft(cfg)
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""


def test_eval_show_config_lists_the_keys_eval_reads(capsys):
    """`longreel eval` takes the trainer's config: --show-config lists the part of it eval reads (it had none)."""
    from longreel.schemas.config import describe
    from longreel.trainer.cli_eval import EVAL_KEYS
    from longreel.trainer.config import TrainConfig

    assert main(["eval", "--show-config"]) == 0
    shown = [line.split(" = ")[0] for line in capsys.readouterr().out.splitlines() if " = " in line]
    assert set(shown) == EVAL_KEYS  # each one a real key: a renamed key fails here
    assert {"data.eval_urls", "model.path", "eval.max_items"} <= set(shown)
    assert "data.train_urls" not in shown and "optim.lr" not in shown
    assert len(shown) < len(list(describe(TrainConfig)))
