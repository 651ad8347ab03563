"""``grpo.dynamic_sampling`` (DAPO's online filter): groups whose rewards all tie are dropped and more prompts are
drawn until the step holds ``data.batch_size`` groups with signal (at most ``grpo.max_draws`` batches); the first
groups by position are kept, every rank decides alike, and a resumed run draws and trains exactly as a straight one."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.schemas.config import ConfigError, load_yaml  # noqa: E402
from longreel.trainer import grpo as G  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.runtime import DistInfo  # noqa: E402
from dist_resume_worker import length_parity_rewards as _length_parity_rewards  # noqa: E402
from test_checkpoint import _cfg as checkpoint_cfg, tiny  # noqa: E402,F401 - the tiny model fixture


def _group(position: int, rewards: list[float]) -> G.GroupBatch:
    r = torch.tensor(rewards)
    return G.GroupBatch(position, None, torch.zeros(len(rewards), 3, dtype=torch.long), torch.ones(len(rewards), 3),
                        r - r.mean(), r, position=position)


def _fake_trainer(batch_size: int, max_draws: int, draws: list[list[G.GroupBatch]], fsdp: bool = False):
    """What ``_fill_with_signal`` reads of a trainer, with the later draws' groups served in order."""
    cfg = SimpleNamespace(data=SimpleNamespace(batch_size=batch_size), grpo=SimpleNamespace(max_draws=max_draws))
    later = iter(draws)
    calls = []

    def draw_and_score(step, draw, clock, stats=None):
        calls.append(draw)
        return next(later), stats

    fake = SimpleNamespace(cfg=cfg, sess=SimpleNamespace(info=DistInfo(), fsdp=fsdp), _draw_and_score=draw_and_score)
    return fake, calls


def test_tied_groups_are_replaced_by_later_draws_and_the_first_by_position_kept():
    tied, mixed = [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]
    first = [_group(0, tied), _group(1, mixed), _group(2, [0.0] * 4), _group(3, mixed)]
    second = [_group(4, mixed), _group(5, tied), _group(6, mixed), _group(7, mixed)]
    fake, calls = _fake_trainer(4, 3, [second])
    stats: dict = {}
    kept = G.GRPOTrainer._fill_with_signal(fake, 1, first, stats, {})
    assert calls == [1]  # one more draw gave enough; the third was never drawn
    assert [b.position for b in kept] == [1, 3, 4, 6]  # 7 had signal too, but the first 4 by position win
    assert all(G.has_signal(b.rewards.tolist()) for b in kept)
    assert (stats["draws"], stats["kept_groups"]) == (2, 4)


def test_draws_stop_at_max_draws_and_a_step_without_any_signal_keeps_its_first_draw():
    tied = [0.5] * 4
    first = [_group(0, tied), _group(1, [1.0, 0.0, 0.0, 0.0])]
    fake, calls = _fake_trainer(2, 2, [[_group(2, tied), _group(3, tied)]])
    stats: dict = {}
    kept = G.GRPOTrainer._fill_with_signal(fake, 1, first, stats, {})
    assert calls == [1] and [b.position for b in kept] == [1]  # short of the batch: trains on what it found
    assert (stats["draws"], stats["kept_groups"]) == (2, 1)

    nothing = [_group(0, tied), _group(1, tied)]
    fake, calls = _fake_trainer(2, 3, [[_group(2, tied), _group(3, tied)], [_group(4, tied), _group(5, tied)]])
    kept = G.GRPOTrainer._fill_with_signal(fake, 1, nothing, stats, {})
    assert calls == [1, 2] and kept == nothing and stats["kept_groups"] == 0


def test_an_fsdp_rank_whose_groups_were_all_dropped_runs_one_at_weight_zero(monkeypatch):
    # the other rank kept positions 1 and 3; this rank's groups (0, 2) tied: it must still run the update's passes
    monkeypatch.setattr(G, "all_gather_objects", lambda obj, info: [obj, [1, 3]])
    mine = [_group(0, [1.0] * 4), _group(2, [0.0] * 4)]
    fake, _ = _fake_trainer(2, 1, [], fsdp=True)
    kept = G.GRPOTrainer._fill_with_signal(fake, 1, mine, {}, {})
    assert [(b.position, b.pad) for b in kept] == [(0, True)]
    info = DistInfo()
    real = _group(1, [1.0, 0.0, 1.0, 0.0])
    # the pad's tokens are not in the loss's denominator
    assert G._denominator(kept + [real], "token_mean", info) == G._denominator([real], "token_mean", info) == 12.0


def test_max_draws_is_validated():
    with pytest.raises(ConfigError, match="max_draws"):
        load_yaml(TrainConfig, None, ["grpo.max_draws=0"])


def _cfg(model: str, out: Path, *extra: str) -> TrainConfig:
    """tests/test_checkpoint.py's resume run (6 steps, a checkpoint at 3) with dynamic sampling on."""
    return checkpoint_cfg(model, out, "data.synthetic_train=12", "grpo.dynamic_sampling=true", "grpo.max_draws=3",
                          *extra)


def test_dynamic_sampling_trains_only_on_groups_with_signal_and_resumes_exactly(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(G.GRPOTrainer, "_score", _length_parity_rewards)
    straight = tmp_path / "straight"
    G.run_grpo(_cfg(tiny, straight))
    resumed = tmp_path / "resumed"
    assert G.run_grpo(_cfg(tiny, resumed, "run.stop_after=3"))["stopped"]
    assert G.run_grpo(_cfg(tiny, resumed))["step"] == 6

    rows = [r for r in read_metrics(straight / "metrics.jsonl") if r.get("stage") == "grpo"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # a step whose first batch held a tied group (every colour item) drew again, until it had 2 groups with signal
    # or had drawn 3 batches; the step's metrics cover every group sampled, the dropped ones too
    draws = [r["dynamic_draws"] for r in rows]
    assert 1 in draws and any(d > 1 for d in draws), draws
    for r in rows:
        assert (r["groups_with_signal"] == 1.0) == (r["dynamic_draws"] == 1)
        assert r["dynamic_kept_groups"] == 2 or r["dynamic_draws"] == 3
    keys = ("step", "loss", "reward_mean", "grad_norm", "dynamic_draws", "dynamic_kept_groups")
    resumed_rows = [r for r in read_metrics(resumed / "metrics.jsonl") if r.get("stage") == "grpo"]
    assert [tuple(r[k] for k in keys) for r in rows] == [tuple(r[k] for k in keys) for r in resumed_rows]
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_first_draw_samples_what_a_step_without_dynamic_sampling_does(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(G.GRPOTrainer, "_score", _length_parity_rewards)
    on = G.GRPOTrainer(_cfg(tiny, tmp_path / "on", "run.steps=1"))
    off = G.GRPOTrainer(_cfg(tiny, tmp_path / "off", "run.steps=1", "grpo.dynamic_sampling=false"))
    try:
        clock = {"time_rollout": 0.0, "time_reward": 0.0}
        a, _ = on._draw_and_score(1, 0, clock)
        b, _ = off._draw_and_score(1, 0, dict(clock))
        assert [x.position for x in a] == [x.position for x in b] == [0, 1]
        for x, y in zip(a, b):
            assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.rewards, y.rewards)
        c, _ = on._draw_and_score(1, 1, clock)  # a later draw: the next prompts, at positions past the first's
        assert [x.position for x in c] == [2, 3] and [x.item_index for x in c] != [x.item_index for x in a]
    finally:
        for t in (on, off):
            t.engine.close()
            t.sess.close()
