"""GRPO's ``entropy_estimate`` metric: the mean ``-log p`` of the sampled response tokens under the policy before
the update, over the sampled rows only (not mix-policy targets, not FSDP lockstep pads), logged every step."""
from __future__ import annotations

from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.trainer import grpo as G  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from test_checkpoint import _cfg as checkpoint_cfg, tiny  # noqa: E402,F401 - the tiny model fixture


def _batch(old: list[list[float]] | None, mask: list[list[float]], **kw) -> G.GroupBatch:
    m = torch.tensor(mask)
    return G.GroupBatch(0, None, torch.zeros(m.shape, dtype=torch.long), m, torch.zeros(len(mask)),
                        torch.zeros(len(mask)), old_logp=None if old is None else torch.tensor(old), **kw)


def test_sums_count_sampled_tokens_only():
    a = _batch([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0]], [[1, 1, 0], [1, 0, 0]])
    offline = _batch([[-1.0, -1.0, -1.0], [-4.0, -4.0, -4.0]], [[1, 1, 1], [1, 1, 1]], offline=True)
    pad = _batch([[-3.0]], [[1]], pad=True)
    total, tokens = G.sampled_nll_sums([a, offline, pad])
    # a: 1 + 2 + 0.5 over 3 tokens; offline: only its first row (the last is the target); pad: nothing
    assert (total, tokens) == (3.5 + 3.0, 6.0)
    assert G.sampled_nll_sums([]) == [0.0, 0.0]
    assert G.sampled_nll_sums([_batch(None, [[1]])]) == [0.0, 0.0]


def _run(model: str, out: Path, monkeypatch, *extra: str) -> tuple[list[dict], list[list[G.GroupBatch]]]:
    """A GRPO run, with each step's groups (their old log-probs) as the update received them."""
    seen = []
    update = G.GRPOTrainer._update

    def recording(self, step, batches):
        seen.append([G.GroupBatch(**vars(b)) for b in batches])
        return update(self, step, batches)

    monkeypatch.setattr(G.GRPOTrainer, "_update", recording)
    G.run_grpo(checkpoint_cfg(model, out, "run.steps=2", "run.save_every=0", "run.save_final=false", *extra))
    return read_metrics(out / "metrics.jsonl"), seen


@pytest.mark.parametrize("extra", [(), ("grpo.mix_policy=true",), ("mrsp.enabled=true",)],
                         ids=["sampled", "mix_policy", "mrsp"])
def test_each_step_logs_the_mean_negative_log_prob_of_its_sampled_tokens(tiny, tmp_path, monkeypatch, extra):
    rows, seen = _run(tiny, tmp_path / "run", monkeypatch, *extra)
    assert [r["step"] for r in rows] == [1, 2] and len(seen) == 2
    for row, batches in zip(rows, seen):
        nll, count = [], 0
        for b in batches:
            sampled = b.response_ids.shape[0] - (1 if b.offline else 0)
            assert b.old_logp is not None
            for i in range(sampled):
                n = int(b.response_mask[i].sum())
                nll += (-b.old_logp[i, :n]).tolist()
                count += n
        assert count > 0 and any(b.offline for b in batches) == ("grpo.mix_policy=true" in extra)
        assert row["entropy_estimate"] == pytest.approx(sum(nll) / count, rel=1e-6)


def test_a_hotter_sampling_temperature_gives_a_higher_estimate(tiny, tmp_path, monkeypatch):
    cold, _ = _run(tiny, tmp_path / "cold", monkeypatch, "rollout.temperature=0.3")
    hot, _ = _run(tiny, tmp_path / "hot", monkeypatch, "rollout.temperature=3.0")
    assert all(c["entropy_estimate"] > 0 for c in cold)
    assert min(h["entropy_estimate"] for h in hot) > max(c["entropy_estimate"] for c in cold)


@pytest.mark.parametrize("mrsp", [False, True], ids=["plain", "mrsp"])
def test_step_one_estimates_from_the_initial_policy_at_the_sampling_temperature(tiny, tmp_path, monkeypatch, mrsp):
    # whichever pass gave the old log-probs (the decode's own, or an old pass), they are the initial weights'
    # log-probs at rollout.temperature: recomputed here with the plain per-sequence forward
    from longreel.trainer.policy import load_policy, sequence_logprobs

    rows, seen = _run(tiny, tmp_path / "run", monkeypatch, "rollout.temperature=0.7", f"mrsp.enabled={mrsp}")
    model, _ = load_policy(tiny)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for b in seen[0]:
            logp = sequence_logprobs(model, b.prompt, b.response_ids, b.response_mask, temperature=0.7,
                                     share_prompt=False)
            total += float(-(logp * b.response_mask).sum())
            count += float(b.response_mask.sum())
    assert rows[0]["entropy_estimate"] == pytest.approx(total / count, rel=1e-5)
    # and step 2 logs its own samples' estimate, not step 1's again
    assert rows[0]["entropy_estimate"] != pytest.approx(rows[1]["entropy_estimate"], rel=1e-5)
