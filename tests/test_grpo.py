"""GRPO loop pieces that are pure functions: per-group loss shares, the schedule, seeds and the data order."""
from __future__ import annotations

import pytest

import torch

from longreel.trainer import algorithms as A  # noqa: E402
from longreel.trainer.config import OptimConfig, TrainConfig  # noqa: E402
from longreel.trainer.grpo import GroupBatch, grpo_group_loss  # noqa: E402
from longreel.trainer.runtime import ItemStream, lr_factor, rollout_seed  # noqa: E402


def _group(g: int, t: int, seed: int, tied: bool = False) -> tuple[GroupBatch, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(g, t)
    for i in range(g):
        mask[i, 1 + (i * 3) % t:] = 0  # ragged lengths
    rewards = torch.ones(g) if tied else (torch.rand(g, generator=gen) > 0.5).float()
    rewards[0], rewards[-1] = (1.0, 1.0) if tied else (1.0, 0.0)
    adv = A.group_advantages(rewards[None])[0]
    old = -torch.rand(g, t, generator=gen)
    ref = -torch.rand(g, t, generator=gen)
    logp = (old + 0.3 * torch.randn(g, t, generator=gen)).requires_grad_(True)
    b = GroupBatch(0, None, torch.zeros(g, t, dtype=torch.long), mask, adv, rewards, old_logp=old, ref_logp=ref)
    return b, logp


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_group_and_chunk_shares_sum_to_the_full_batch_loss(agg, beta):
    cfg = TrainConfig()
    cfg.grpo.loss_agg, cfg.grpo.beta = agg, beta
    groups = [_group(4, 6, s) for s in range(3)]
    t_norm = 9
    # the full batch, flattened, as one call of the algorithms (padded to t_norm for Dr. GRPO's constant)
    logp = torch.cat([lp for _, lp in groups])
    mask = torch.cat([b.response_mask for b, _ in groups])
    old = torch.cat([b.old_logp for b, _ in groups])
    ref = torch.cat([b.ref_logp for b, _ in groups])
    adv = torch.cat([b.advantages for b, _ in groups])
    pad = lambda x: torch.cat([x, x.new_zeros(x.shape[0], t_norm - x.shape[1])], 1)  # noqa: E731
    if agg == "seq_mean_token_sum_norm":
        full_logp, old, ref, mask = pad(logp), pad(old), pad(ref), pad(mask)
    else:
        full_logp = logp
    full, _ = A.policy_loss(full_logp, old, adv, mask, agg=agg)
    if beta:
        full = full + beta * A.agg_loss(A.kl_penalty(full_logp, ref, "k3"), mask, agg)
    g_full = torch.autograd.grad(full, [lp for _, lp in groups])

    denom = float(mask.sum()) if agg == "token_mean" else float((mask.sum(-1) > 0).sum())
    total = 0.0
    for b, lp in groups:  # per group, in two row chunks (grad_accum=2), each a share of the global loss
        for rows in (slice(0, 2), slice(2, 4)):
            loss, m = grpo_group_loss(lp[rows], b, rows, cfg, denom, t_norm)
            total = total + loss
            assert ("kl_loss" in m) == (beta > 0)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-6)
    g_parts = torch.autograd.grad(total, [lp for _, lp in groups])
    for a, b in zip(g_full, g_parts):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_tied_group_contributes_no_gradient():
    cfg = TrainConfig()
    b, lp = _group(4, 5, 0, tied=True)
    assert torch.equal(b.advantages, torch.zeros(4))
    loss, _ = grpo_group_loss(lp, b, slice(0, 4), cfg, float(b.response_mask.sum()), 5)
    (g,) = torch.autograd.grad(loss, [lp])
    assert torch.equal(g, torch.zeros_like(g))


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, cfg, 14) for s in range(15)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and f[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    lin = OptimConfig(lr=1.0, schedule="linear")
    assert [lr_factor(s, lin, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(7, OptimConfig(), 10) == 1.0


def test_rollout_seeds_differ_by_step_and_position():
    seeds = {rollout_seed(0, step, j) for step in range(1, 50) for j in range(16)}
    assert len(seeds) == 49 * 16
    assert rollout_seed(3, 2, 1) == rollout_seed(3, 2, 1) != rollout_seed(4, 2, 1)


def test_item_stream_resumes_exactly_and_reshuffles_per_epoch():
    items = [{"i": i} for i in range(7)]
    a = ItemStream(items, seed=1)
    first = [i for i, _ in a.next_batch(5)]
    state = a.state_dict()
    rest_a = [i for i, _ in a.next_batch(12)]
    b = ItemStream(items, seed=1)
    b.load_state_dict(state)
    assert [i for i, _ in b.next_batch(12)] == rest_a
    epoch0 = first + rest_a[:2]
    epoch1 = rest_a[2:9]
    assert sorted(epoch0) == sorted(epoch1) == list(range(7)) and epoch0 != epoch1
    with pytest.raises(ValueError, match="7 items, the data has 8"):
        ItemStream(items + [{"i": 7}], seed=1).load_state_dict(state)
    assert [i for i, _ in ItemStream(items, shuffle=False).next_batch(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]
