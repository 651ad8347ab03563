"""Hand-computed checks of the GRPO tensor functions in trainer.algorithms."""

from __future__ import annotations

import math

import pytest

import torch

from longreel.trainer.algorithms import (  # noqa: E402
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    GroupRollouts,
    OfflineTrajectories,
    agg_loss,
    behaviour_weight,
    get_adv_estimator,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    substitute_offline,
)

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------------------------------- helpers


def test_masked_sum_and_mean_ignore_masked_entries_even_nan():
    v = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = t([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(v, m).item() == 13.0
    assert masked_mean(v, m).item() == pytest.approx(13.0 / 4)
    assert masked_sum(v, m, dim=-1).tolist() == [3.0, 10.0]
    assert masked_mean(v, m, dim=-1).tolist() == [1.5, 5.0]
    # nothing unmasked: 0, not NaN
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0
    assert masked_mean(v, t([[0, 0, 0], [1, 0, 0]]), dim=-1).tolist() == [0.0, 4.0]


# ------------------------------------------------------------------------------------- advantages


def test_group_advantages_hand_computed():
    r = t([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0]])
    adv = group_advantages(r, eps=0.0)
    assert adv.shape == (3, 4)
    # group 0: mean 0.5, sample std sqrt(1/3) -> +-0.5*sqrt(3)
    h = 0.5 * math.sqrt(3.0)
    assert adv[0].tolist() == pytest.approx([h, -h, -h, h])
    # group 1: all tied -> exactly zero
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: mean 1.5, sample std sqrt(5/3)
    s = math.sqrt(3.0 / 5.0)
    assert adv[2].tolist() == pytest.approx([-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s])
    # matches torch.std (Bessel-corrected) with eps in the denominator
    eps = 1e-6
    ref = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + eps)
    got = group_advantages(r, eps=eps)
    assert torch.allclose(got[[0, 2]], ref[[0, 2]])

    # Dr. GRPO: mean-centering only
    dr = group_advantages(r, scale="none")
    assert dr.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-1.5, -0.5, 0.5, 1.5]]
    assert torch.equal(get_adv_estimator("dr_grpo")(r), dr)
    assert torch.equal(get_adv_estimator("grpo")(r), group_advantages(r))
    assert set(ADV_ESTIMATORS) >= {"grpo", "dr_grpo"}


def test_group_advantages_ties_are_exactly_zero():
    # 0.1 is not representable: a naive (r - mean) can leave a tiny residue that eps then amplifies
    r = torch.full((2, 7), 0.1, dtype=torch.float32)
    r[1] = 0.3
    assert torch.equal(group_advantages(r), torch.zeros_like(r))
    assert torch.equal(group_advantages(r, scale="none"), torch.zeros_like(r))
    assert torch.equal(group_advantages(t([[5.0], [1.0]])), torch.zeros(2, 1, dtype=F64))  # G = 1
    with pytest.raises(ValueError):
        group_advantages(t([[1.0, float("nan")]]))
    with pytest.raises(ValueError):
        group_advantages(t([1.0, 2.0]))
    with pytest.raises(ValueError):
        group_advantages(t([[1.0, 2.0]]), scale="mad")
    with pytest.raises(ValueError):
        get_adv_estimator("ppo_gae")


# ------------------------------------------------------------------------------------ policy loss


def _ratio_case():
    """Row 0 has A = +1, row 1 has A = -1; the ratios are set by hand."""
    ratios = t([[1.5, 1.1, 0.5], [1.5, 0.9, 0.5]])
    old = torch.full((2, 3), math.log(0.5), dtype=F64)
    logp = (old + ratios.log()).clone().requires_grad_(True)
    adv = t([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=F64)
    return logp, old, adv, mask


def test_policy_loss_asymmetric_clipping_and_zero_grad_on_clipped_tokens():
    logp, old, adv, mask = _ratio_case()
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token_mean")
    # per-token losses -min(rA, clip(r, 0.8, 1.28) A):
    #   A=+1: r=1.5 -> -1.28 (clipped high) | r=1.1 -> -1.1 | r=0.5 -> -0.5 (not clipped: A > 0)
    #   A=-1: r=1.5 -> +1.5 (not clipped: A < 0) | r=0.9 -> +0.9 | r=0.5 -> +0.8 (clipped low)
    per_token = [[-1.28, -1.1, -0.5], [1.5, 0.9, 0.8]]
    assert loss.item() == pytest.approx(sum(map(sum, per_token)) / 6)
    loss.backward()
    # d/dlogp of -A*r is -A*r on unclipped tokens, exactly 0 on clipped ones (then / 6 tokens)
    expected = t([[0.0, -1.1, -0.5], [1.5, 0.9, 0.0]]) / 6
    assert torch.allclose(logp.grad, expected)
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 2].item() == 0.0

    assert m["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    assert m["ratio_max"].item() == pytest.approx(1.5) and m["ratio_min"].item() == pytest.approx(0.5)
    r = t([1.5, 1.1, 0.5, 1.5, 0.9, 0.5])
    assert m["approx_kl"].item() == pytest.approx(((r - 1) - r.log()).mean().item())
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert all(not v.requires_grad for v in m.values())

    # the same with [N, T] advantages
    logp2, old2, _, _ = _ratio_case()
    loss2, _ = policy_loss(logp2, old2, adv[:, None].expand(2, 3), mask)
    assert loss2.item() == pytest.approx(loss.item())


def test_policy_loss_symmetric_clip_changes_which_tokens_clip():
    logp, old, adv, mask = _ratio_case()
    # with clip_high = 0.6, r = 1.5 is inside [0.8, 1.6]: nothing clipped on the high side
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.6)
    assert m["clip_frac_high"].item() == 0.0 and m["clip_frac_low"].item() == pytest.approx(1 / 6)
    assert loss.item() == pytest.approx((-1.5 - 1.1 - 0.5 + 1.5 + 0.9 + 0.8) / 6)


def test_policy_loss_masks_padding_and_applies_behaviour_weight():
    logp, old, adv, _ = _ratio_case()
    mask = t([[1, 1, 0], [1, 0, 0]])
    w = t([[2.0, 1.0, 7.0], [0.5, 1.0, 1.0]])
    loss, m = policy_loss(logp, old, adv, mask, behav_weight=w)
    assert loss.item() == pytest.approx((2.0 * -1.28 + 1.0 * -1.1 + 0.5 * 1.5) / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == 0.0
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0 and logp.grad[1, 1].item() == 0.0 and logp.grad[1, 2].item() == 0.0
    assert logp.grad[1, 0].item() == pytest.approx(0.5 * 1.5 / 3)
    with pytest.raises(ValueError):
        policy_loss(logp, old, t([1.0, 2.0, 3.0]), mask)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, agg="sum_of_everything")


def test_all_tied_group_gives_zero_gradient():
    torch.manual_seed(0)
    rewards = t([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])  # group 0 all correct
    b, g, T = 2, 4, 5
    old = -torch.rand(b * g, T, dtype=F64) - 0.1
    logp = (old + 0.3 * torch.randn(b * g, T, dtype=F64)).requires_grad_(True)
    mask = torch.ones(b * g, T, dtype=F64)
    mask[1, 3:] = 0
    for scale in ("std", "none"):
        adv = group_advantages(rewards, scale=scale).reshape(-1)  # [B*G], group-major
        for agg in LOSS_AGG_MODES:
            logp.grad = None
            loss, _ = policy_loss(logp, old, adv, mask, agg=agg)
            loss.backward()
            assert torch.count_nonzero(logp.grad[:g]) == 0, (scale, agg)
            assert torch.count_nonzero(logp.grad[g:]) > 0, (scale, agg)


# ------------------------------------------------------------------------------------ aggregation


def test_token_vs_sequence_aggregation_on_unequal_lengths():
    loss_mat = t([[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, float("nan"), 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])  # lengths 4, 2 and an empty response
    assert agg_loss(loss_mat, mask, "token_mean").item() == pytest.approx(10 / 6)
    assert agg_loss(loss_mat, mask, "seq_mean_token_mean").item() == pytest.approx((1 + 3) / 2)
    assert agg_loss(loss_mat, mask, "seq_mean_token_sum").item() == pytest.approx((4 + 6) / 2)
    assert agg_loss(loss_mat, mask, "seq_mean_token_sum_norm").item() == pytest.approx((4 / 4 + 6 / 4) / 2)
    # micro-batches with the global denominator add up to the full-batch loss
    full = agg_loss(loss_mat, mask, "token_mean")
    parts = sum(agg_loss(loss_mat[i : i + 1], mask[i : i + 1], "token_mean", denominator=6) for i in range(3))
    assert parts.item() == pytest.approx(full.item())
    parts = sum(
        agg_loss(loss_mat[i : i + 1], mask[i : i + 1], "seq_mean_token_mean", denominator=2) for i in range(3)
    )
    assert parts.item() == pytest.approx(2.0)
    with pytest.raises(ValueError):
        agg_loss(loss_mat, mask, "median")
    with pytest.raises(ValueError):
        agg_loss(loss_mat[0], mask[0])


# ------------------------------------------------------------------------------- KL and weights


def test_kl_penalty_values():
    logp = t([[math.log(0.5), math.log(0.25), 0.0]])
    ref = t([[math.log(0.25), math.log(0.5), -100.0]])
    k1 = kl_penalty(logp, ref, "k1")
    assert k1[0, :2].tolist() == pytest.approx([math.log(2), -math.log(2)])
    k2 = kl_penalty(logp, ref, "k2")
    assert k2[0, :2].tolist() == pytest.approx([0.5 * math.log(2) ** 2] * 2)
    k3 = kl_penalty(logp, ref, "k3")
    # d = ref - logp: exp(d) - d - 1
    assert k3[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1)  # d = -log 2
    assert k3[0, 1].item() == pytest.approx(2.0 - math.log(2) - 1)  # d = +log 2
    assert k3[0, 2].item() == 10.0  # d = -100 clamped to -20 -> 19, then capped at 10
    assert torch.equal(kl_penalty(logp, ref, "low_var_kl"), k3)
    assert (k3 >= 0).all() and (kl_penalty(ref, ref, "k3") == 0).all()
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3"}
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_behaviour_weight_is_capped_and_detached():
    prox = t([[0.0, math.log(2.0), math.log(10.0), math.log(0.5)]]).requires_grad_(True)
    behav = torch.zeros(1, 4, dtype=F64)
    w = behaviour_weight(prox, behav, cap=5.0)
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 5.0, 0.5])
    assert not w.requires_grad
    w = behaviour_weight(prox, behav, cap=5.0, mode="drop")
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.0, 0.5])
    w = behaviour_weight(prox, behav, cap=None, mask=t([[1, 1, 1, 0]]))
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 10.0, 0.0])
    with pytest.raises(ValueError):
        behaviour_weight(prox, behav, cap=0.0)


# ------------------------------------------------------------------------------------ mix-policy


def _rollouts():
    ids = torch.arange(1, 19).reshape(2, 3, 3)  # B=2, G=3, T=3
    mask = torch.ones(2, 3, 3, dtype=torch.long)
    mask[0, 1, 2] = 0
    logp = -torch.ones(2, 3, 3, dtype=F64)
    rewards = t([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    return GroupRollouts(response_ids=ids, response_mask=mask, behav_logp=logp, rewards=rewards)


def test_substitute_offline_replaces_one_slot_per_carrying_group():
    ro = _rollouts()
    before = {k: getattr(ro, k).clone() for k in ("response_ids", "response_mask", "behav_logp", "rewards")}
    off = OfflineTrajectories(
        response_ids=torch.tensor([[101, 102, 103, 104], [201, 202, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        present=torch.tensor([True, False]),
        rewards=t([1.0, 1.0]),
    )
    out = substitute_offline(ro, off, slot=-1)
    assert out.shape == (2, 3, 4)  # time axis grows to the longer offline response
    assert out.response_ids[0, 2].tolist() == [101, 102, 103, 104]
    assert out.response_mask[0, 2].tolist() == [1, 1, 1, 1]
    assert out.behav_logp[0, 2].tolist() == [0.0, 0.0, 0.0, 0.0]  # unknown -> probability 1
    assert out.rewards.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert out.is_offline.tolist() == [[False, False, True], [False, False, False]]
    # everything else is the old data, padded with pad_id / mask 0
    assert out.response_ids[0, :2, :3].tolist() == before["response_ids"][0, :2].tolist()
    assert out.response_ids[1, :, :3].tolist() == before["response_ids"][1].tolist()
    assert out.response_ids[:, :, 3].tolist() == [[0, 0, 104], [0, 0, 0]]
    assert out.response_mask[1, :, 3].tolist() == [0, 0, 0]
    assert out.response_mask[0, 1].tolist() == [1, 1, 0, 0]
    assert out.behav_logp[1, :, :3].tolist() == before["behav_logp"][1].tolist()
    # inputs untouched (pure function)
    for k, v in before.items():
        assert torch.equal(getattr(ro, k), v)
    assert ro.is_offline is None

    # flattening is group-major and the substituted rewards drive the advantages
    assert out.flat("response_ids").shape == (6, 4)
    assert torch.equal(out.flat("response_ids")[2], out.response_ids[0, 2])
    adv = group_advantages(out.rewards)
    assert adv[0, 2] > 0 and adv[0, 0] < 0

    # another slot, offline log-probs given, shorter offline response: T stays 3
    off2 = OfflineTrajectories(
        response_ids=torch.tensor([[7, 8], [9, 0]]),
        response_mask=torch.tensor([[1, 1], [1, 0]]),
        present=torch.tensor([True, True]),
        behav_logp=t([[-0.5, -0.25], [-2.0, 0.0]]),
        rewards=t([0.5, 0.25]),
    )
    out2 = substitute_offline(ro, off2, slot=0)
    assert out2.shape == (2, 3, 3)
    assert out2.response_ids[:, 0].tolist() == [[7, 8, 0], [9, 0, 0]]
    assert out2.response_mask[:, 0].tolist() == [[1, 1, 0], [1, 0, 0]]
    assert out2.behav_logp[0, 0].tolist() == [-0.5, -0.25, 0.0]
    assert out2.rewards[:, 0].tolist() == [0.5, 0.25]
    assert out2.is_offline.tolist() == [[True, False, False], [True, False, False]]


def test_substitute_offline_validates():
    ro = _rollouts()
    off = OfflineTrajectories(
        response_ids=torch.tensor([[1, 2]] * 2), response_mask=torch.ones(2, 2), present=torch.tensor([True, True])
    )
    with pytest.raises(ValueError):  # rollouts carry rewards, offline do not
        substitute_offline(ro, off)
    with pytest.raises(IndexError):
        substitute_offline(ro, off, slot=3)
    with pytest.raises(ValueError):
        GroupRollouts(response_ids=torch.zeros(2, 3, dtype=torch.long), response_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError):
        OfflineTrajectories(response_ids=torch.zeros(2, 3), response_mask=torch.zeros(2, 3), present=torch.ones(3))
    # rollouts without rewards / behaviour log-probs need nothing more from the offline side
    bare = GroupRollouts(response_ids=ro.response_ids, response_mask=ro.response_mask)
    out = substitute_offline(bare, off, slot=1)
    assert out.rewards is None and out.behav_logp is None
    assert out.response_ids[:, 1].tolist() == [[1, 2, 0], [1, 2, 0]]
