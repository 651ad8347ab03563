"""``longreel filter --shards``: the pass-rate filter on packed shards (the synthetic task written with the pack
writer), and the filtered items written back as shards the trainer reads (the set-up of
``benchmarks/passrate_value.py``)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from longreel.pipelines.io.parquet_sink import read_table
from longreel.testing.answerers import ScriptedAnswerer
from longreel.trainer.synthetic_solvers import oracle_answer
from longreel.trainer.synthetic_task import make_items, write_shards


class PixelAnswerer(ScriptedAnswerer):
    """Answers every sample with the multi-frame oracle's letter, read from the frames the stage hands over: all
    k pass only if those are the packed frames, in order."""

    def answer(self, model, example):
        q = example["qra"]
        letter = oracle_answer(np.asarray(example["frames"]), q["question"], q["options"])
        return [f"<think>I read the frames.</think><answer>{letter}</answer>"] * self.cfg.k


@pytest.fixture
def pool(tmp_path):
    items = make_items(10, seed=21, kinds=("order", "direction", "change", "count_colours", "colour"), size=56)
    return items, write_shards(items, str(tmp_path / "pool"), dataset="pool", split="rl", per_shard=4)


def _cli(monkeypatch, handler_factory, out, index, *extra):
    import longreel.pipelines.stages.passrate as stage
    from longreel.cli import main

    monkeypatch.setattr(stage, "make_handler", handler_factory)
    return main(["filter", "--out", str(out), "--shards", index, "--model", "scripted", "--set", "k=4", *extra])


def test_filter_reads_questions_and_frames_from_packed_shards(pool, tmp_path, monkeypatch, capsys):
    items, index = pool
    out = tmp_path / "filtered"  # does not exist yet: --shards needs no run directory
    rc = _cli(monkeypatch, lambda cfg: PixelAnswerer(cfg), out, index)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # every question read (3 shards), every sample right: the answerer saw the packed frames
    assert summary["pass_count_histogram"] == [0, 0, 0, 0, 10] and summary["balanced"]
    assert summary["dropped_by_reason"]["too_easy"] == 10 and summary["kept"] == 0
    assert rc != 0  # nothing survived is reported as such
    rows = {r["qra_id"]: r for r in read_table(str(out), "pass_rate").to_pylist()}
    assert set(rows) == {i["key"] for i in items}
    for it in items:
        r = rows[it["key"]]
        assert r["video_id"] == it["video_id"] and r["label"] == "easy"
        assert r["frame_timestamps"] == [t / 2.0 for t in range(4)]  # the packed metadata's, not a decoder's
    stats = json.loads((out / "stats.json").read_text())
    st = next(s for s in stats["stages"] if s["stage"] == "passrate")
    assert st["in"] == 10 and st["in"] == st["out"] + sum(st["rejected"].values())


def test_medium_items_go_back_to_shards_the_trainer_reads(pool, tmp_path, monkeypatch, capsys):
    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items

    items, index = pool
    script = {it["key"]: n for it, n in zip(items, [0, 1, 2, 3, 4, 2, 4, 0, 1, 3])}
    out = tmp_path / "filtered"
    assert _cli(monkeypatch, lambda cfg: ScriptedAnswerer(cfg, script), out, index, "--set", "sft_fraction=0") == 0
    capsys.readouterr()
    rows = {r["qra_id"]: r for r in read_table(str(out), "pass_rate").to_pylist()}
    medium = [it for it in items if rows[it["key"]]["label"] == "medium"]
    assert [it["key"] for it in medium] == [it["key"] for it in items if 0 < script[it["key"]] < 4]
    assert {rows[it["key"]]["split"] for it in medium} == {"rl"}  # sft_fraction 0: every kept item is for GRPO
    arm = write_shards(medium, str(tmp_path / "arm"), dataset="medium", split="rl")
    back = load_items(DataConfig(source="shards", train_urls=[arm]), "train")
    assert sorted(b["qra_id"] for b in back) == sorted(it["key"] for it in medium)
    by_key = {it["key"]: it for it in medium}
    for b in back:
        want = by_key[b["qra_id"]]
        assert b["frames"].numpy().tobytes() == want["frames"].numpy().tobytes()
        assert (b["answer"], b["category"], list(b["options"])) == (want["answer"], want["category"], want["options"])
