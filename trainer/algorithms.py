"""GRPO algorithms as pure tensor functions.

Nothing here touches a model, an optimizer or a process group: every function maps tensors to
tensors (plus a dict of detached metrics for the policy loss), so each one can be checked by hand.

Shape legend
------------
``B``  prompts (samples) in a batch
``G``  rollouts per prompt (the GRPO group size)
``N``  sequences in a flat batch, usually ``B * G`` (group-major: row ``b * G + g``)
``T``  response length (padded); ``mask[n, t] = 1`` on real response tokens, ``0`` on padding

Log-probabilities are per token, of the response token actually taken: ``logp[n, t] = log pi(y_t | ..)``.

Registries (small dicts from a config name to a function)
--------------------------------------------------------
``ADV_ESTIMATORS``   ``"grpo"`` (mean/std normalised per group), ``"dr_grpo"`` (mean-centred only)
``LOSS_AGG_MODES``   ``"token_mean"``, ``"seq_mean_token_mean"``, ``"seq_mean_token_sum"``,
                     ``"seq_mean_token_sum_norm"`` (Dr. GRPO: token sum divided by the constant ``T``)
``KL_ESTIMATORS``    ``"k1"``, ``"k2"``, ``"k3"`` (alias ``"low_var_kl"``)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "KL_ESTIMATORS",
    "get_adv_estimator",
    "masked_sum",
    "masked_mean",
    "agg_loss",
    "group_advantages",
    "policy_loss",
    "kl_penalty",
    "behaviour_weight",
    "GroupRollouts",
    "OfflineTrajectories",
    "substitute_offline",
]

# log-ratios are clamped to this range before exp() so a stale or corrupted log-prob cannot overflow
_MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------------------
# masked reductions
# --------------------------------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is nonzero.

    Args:
        values: ``[..]`` any shape.
        mask: broadcastable to ``values``; bool or 0/1 float.
        dim: reduce over these dims (all when ``None``).
    Returns:
        the reduced tensor. Masked-out entries never contribute, even if they hold NaN/inf.
    """
    masked = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``values`` over the entries where ``mask`` is nonzero; ``0`` where nothing is unmasked.

    Args:
        values: ``[..]`` any shape.
        mask: broadcastable to ``values``.
        dim: reduce over these dims (all when ``None``).
    """
    mask_b = torch.broadcast_to(mask.bool(), values.shape)
    count = mask_b.sum() if dim is None else mask_b.sum(dim=dim)
    total = masked_sum(values, mask_b, dim)
    return total / count.clamp_min(1).to(values.dtype)


def _token_mean(loss_mat: Tensor, mask: Tensor, denominator) -> Tensor:
    denom = mask.sum() if denominator is None else denominator
    return masked_sum(loss_mat, mask) / torch.as_tensor(denom, dtype=loss_mat.dtype).clamp_min(1e-8)


def _seq_mean(per_seq: Tensor, mask: Tensor, denominator) -> Tensor:
    # sequences with no valid token contribute nothing and are not counted
    nonempty = mask.sum(dim=-1) > 0
    denom = nonempty.sum() if denominator is None else denominator
    return masked_sum(per_seq, nonempty) / torch.as_tensor(denom, dtype=per_seq.dtype).clamp_min(1e-8)


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, denominator) -> Tensor:
    return _seq_mean(masked_mean(loss_mat, mask, dim=-1), mask, denominator)


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, denominator) -> Tensor:
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1), mask, denominator)


def _seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, denominator) -> Tensor:
    return _seq_mean(masked_sum(loss_mat, mask, dim=-1) / loss_mat.shape[-1], mask, denominator)


#: name -> fn(loss_mat [N, T], mask [N, T], denominator) -> scalar
LOSS_AGG_MODES: dict[str, Callable[[Tensor, Tensor, object], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def agg_loss(loss_mat: Tensor, mask: Tensor, agg: str = "token_mean", denominator=None) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Args:
        loss_mat: ``[N, T]`` per-token loss.
        mask: ``[N, T]`` valid-token mask.
        agg: one of ``LOSS_AGG_MODES``:
            ``token_mean``: sum over all valid tokens / number of valid tokens (DAPO; every token
            weighs the same, so long responses weigh more);
            ``seq_mean_token_mean``: per-sequence token mean, then mean over sequences (original
            GRPO; every sequence weighs the same);
            ``seq_mean_token_sum``: per-sequence token sum, then mean over sequences;
            ``seq_mean_token_sum_norm``: per-sequence token sum / ``T``, then mean (Dr. GRPO).
        denominator: overrides the count divided by (valid tokens for ``token_mean``, non-empty
            sequences for the ``seq_*`` modes). Pass the global count when a batch is split into
            micro-batches, so that the accumulated gradient equals the full-batch one.
    Returns:
        ``[]`` scalar.
    """
    try:
        fn = LOSS_AGG_MODES[agg]
    except KeyError:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose from {sorted(LOSS_AGG_MODES)}") from None
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat and mask must both be [N, T], got {tuple(loss_mat.shape)}, {tuple(mask.shape)}")
    return fn(loss_mat, mask, denominator)


# --------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------


def group_advantages(rewards: Tensor, eps: float = 1e-6, scale: str = "std") -> Tensor:
    """GRPO group-relative advantages, vectorised over groups.

    Args:
        rewards: ``[B, G]`` scalar reward of each of the ``G`` rollouts of each of the ``B`` prompts.
        eps: added to the std in the denominator.
        scale: ``"std"``: ``(r - mean) / (std + eps)`` with the sample std (Bessel-corrected, like
            ``torch.std``) of the group; ``"none"``: ``r - mean`` (Dr. GRPO, no std scaling).
    Returns:
        ``[B, G]`` advantages, same dtype as ``rewards``. A group whose rewards all tie (including a
        group of one) gets exactly ``0.0`` everywhere, so it contributes no policy gradient.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    if not torch.is_floating_point(rewards):
        rewards = rewards.to(torch.float32)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    g = rewards.shape[-1]
    mean = rewards.mean(dim=-1, keepdim=True)
    centered = rewards - mean
    tied = (rewards.amax(dim=-1, keepdim=True) - rewards.amin(dim=-1, keepdim=True)) == 0
    if scale == "std":
        var = centered.pow(2).sum(dim=-1, keepdim=True) / max(g - 1, 1)
        adv = centered / (var.sqrt() + eps)
    else:
        adv = centered
    return torch.where(tied, torch.zeros_like(adv), adv)


def _dr_grpo(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    return group_advantages(rewards, eps=eps, scale="none")


def _grpo(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    return group_advantages(rewards, eps=eps, scale="std")


#: name -> fn(rewards [B, G], eps) -> advantages [B, G]
ADV_ESTIMATORS: dict[str, Callable[..., Tensor]] = {"grpo": _grpo, "dr_grpo": _dr_grpo}


def get_adv_estimator(name: str) -> Callable[..., Tensor]:
    """Look up an advantage estimator by its config name (see ``ADV_ESTIMATORS``)."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ADV_ESTIMATORS)}") from None


# --------------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    behav_weight: Tensor | None = None,
    denominator=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate with an asymmetric clip range (DAPO's clip-higher).

    With ``r = exp(logp - old_logp)`` and advantage ``A``, the per-token loss is
    ``-w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``, aggregated with ``agg``.
    A token is *clipped* (its gradient is exactly zero) when ``A > 0 and r > 1 + clip_high`` or
    ``A < 0 and r < 1 - clip_low``.

    Args:
        logp: ``[N, T]`` log-probs under the policy being optimised (requires grad).
        old_logp: ``[N, T]`` log-probs under the policy the ratio is taken against (the rollout
            policy, or with decoupled PPO the *proximal* policy); treated as a constant.
        advantages: ``[N]`` (one per sequence, broadcast over tokens) or ``[N, T]``.
        mask: ``[N, T]`` valid response tokens.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        agg: loss aggregation, see ``agg_loss``.
        behav_weight: optional ``[N, T]`` per-token importance weight ``pi_prox / pi_behav`` (see
            ``behaviour_weight``) multiplying the per-token loss; treated as a constant.
        denominator: passed to ``agg_loss``.
    Returns:
        ``(loss, metrics)``: ``loss`` is a ``[]`` scalar; ``metrics`` maps names to detached ``[]``
        tensors, means over valid tokens: ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``,
        ``approx_kl`` (k3 estimate of KL(old || new)), ``ratio_mean``, ``ratio_max``, ``ratio_min``
        (over valid tokens) and ``pg_loss`` (= ``loss``).
    """
    if logp.dim() != 2 or logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp, old_logp and mask must all be [N, T]; got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)}, {tuple(mask.shape)}"
        )
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ValueError(f"advantages [N] must match N={logp.shape[0]}, got {tuple(advantages.shape)}")
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [N] or [N, T], got {tuple(advantages.shape)}")
    advantages = advantages.detach().to(logp.dtype)
    mask_b = mask.bool()

    log_ratio = (logp - old_logp.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * clipped_ratio
    # max of the negated surrogates == -min(r A, clip(r) A); on clipped tokens the clamped branch wins
    # and carries no gradient
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if behav_weight is not None:
        if behav_weight.shape != logp.shape:
            raise ValueError(f"behav_weight must be [N, T], got {tuple(behav_weight.shape)}")
        loss_mat = loss_mat * behav_weight.detach().to(logp.dtype)
    loss = agg_loss(loss_mat, mask_b, agg, denominator)

    with torch.no_grad():
        is_low = (advantages < 0) & (ratio < 1.0 - clip_low)
        is_high = (advantages > 0) & (ratio > 1.0 + clip_high)
        valid_ratio = ratio[mask_b]
        metrics = {
            "pg_loss": loss.detach(),
            "clip_frac_low": masked_mean(is_low.to(logp.dtype), mask_b),
            "clip_frac_high": masked_mean(is_high.to(logp.dtype), mask_b),
            "clip_frac": masked_mean((is_low | is_high).to(logp.dtype), mask_b),
            "approx_kl": masked_mean(kl_penalty(old_logp, logp, kind="k3"), mask_b),
            "ratio_mean": masked_mean(ratio, mask_b),
            "ratio_max": valid_ratio.max() if valid_ratio.numel() else ratio.new_tensor(1.0),
            "ratio_min": valid_ratio.min() if valid_ratio.numel() else ratio.new_tensor(1.0),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# KL penalty and off-policy weights
# --------------------------------------------------------------------------------------------------


def _kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def _kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp).pow(2)


def _kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    d = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return (torch.exp(d) - d - 1.0).clamp(min=0.0, max=10.0)


#: name -> fn(logp [N, T], ref_logp [N, T]) -> [N, T]
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": _kl_k1,
    "k2": _kl_k2,
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of ``pi`` (Schulman's k1/k2/k3).

    Args:
        logp: ``[N, T]`` log-probs of the sampled tokens under the policy.
        ref_logp: ``[N, T]`` log-probs of the same tokens under the reference policy.
        kind: ``"k1"``: ``logp - ref_logp`` (unbiased, can be negative);
            ``"k2"``: ``0.5 * (logp - ref_logp) ** 2``;
            ``"k3"`` / ``"low_var_kl"``: ``exp(d) - d - 1`` with ``d = ref_logp - logp`` clamped to
            ``[-20, 20]`` and the result clamped to ``[0, 10]`` (unbiased before clamping, never
            negative, low variance).
    Returns:
        ``[N, T]`` per-token penalty (mask and aggregate it with ``agg_loss``).
    """
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose from {sorted(KL_ESTIMATORS)}") from None
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp shapes differ: {tuple(logp.shape)} vs {tuple(ref_logp.shape)}")
    return fn(logp, ref_logp)


def behaviour_weight(
    prox_logp: Tensor,
    behav_logp: Tensor,
    cap: float | None = 5.0,
    mode: str = "truncate",
    mask: Tensor | None = None,
) -> Tensor:
    """Decoupled-PPO off-policy correction ``w = pi_prox / pi_behav = exp(prox_logp - behav_logp)``.

    Used when rollouts come from a stale (behaviour) policy: the PPO ratio is taken against the
    proximal policy (``old_logp=prox_logp`` in ``policy_loss``) and this weight, passed as
    ``behav_weight``, corrects for the sampling distribution.

    Args:
        prox_logp: ``[N, T]`` log-probs under the proximal policy (recomputed before the update).
        behav_logp: ``[N, T]`` log-probs under the policy that generated the tokens.
        cap: upper bound on the weight (``None``: no cap). Must be > 0.
        mode: ``"truncate"``: weights above ``cap`` become ``cap`` (truncated importance sampling);
            ``"drop"``: tokens whose weight exceeds ``cap`` get weight ``0``.
        mask: optional ``[N, T]``; padding tokens get weight ``0``.
    Returns:
        ``[N, T]`` non-negative weights, detached (no gradient flows through them).
    """
    if prox_logp.shape != behav_logp.shape:
        raise ValueError(f"shape mismatch: {tuple(prox_logp.shape)} vs {tuple(behav_logp.shape)}")
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode not in ("truncate", "drop"):
        raise ValueError(f"mode must be 'truncate' or 'drop', got {mode!r}")
    with torch.no_grad():
        log_w = (prox_logp - behav_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        w = torch.exp(log_w)
        if cap is not None:
            if mode == "truncate":
                w = w.clamp(max=cap)
            else:
                w = torch.where(log_w > math.log(cap), torch.zeros_like(w), w)
        if mask is not None:
            w = torch.where(mask.bool(), w, torch.zeros_like(w))
    return w.detach()


# --------------------------------------------------------------------------------------------------
# mix-policy: an offline trajectory replaces one rollout of its group
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupRollouts:
    """The ``G`` sampled responses of each of ``B`` prompts (the prompt itself is shared per group).

    Fields (tensors on one device):
        response_ids: ``LongTensor[B, G, T]`` response token ids, right-padded.
        response_mask: ``[B, G, T]`` 1/True on real response tokens.
        behav_logp: optional ``[B, G, T]`` log-probs under the policy that produced each token.
        rewards: optional ``[B, G]`` scalar rewards.
        is_offline: optional ``BoolTensor[B, G]``; True where a slot holds an offline trajectory
            (``None`` means all on-policy).
    """

    response_ids: Tensor
    response_mask: Tensor
    behav_logp: Tensor | None = None
    rewards: Tensor | None = None
    is_offline: Tensor | None = None

    def __post_init__(self):
        if self.response_ids.dim() != 3:
            raise ValueError(f"response_ids must be [B, G, T], got {tuple(self.response_ids.shape)}")
        b, g, t = self.response_ids.shape
        if self.response_mask.shape != (b, g, t):
            raise ValueError(f"response_mask must be {(b, g, t)}, got {tuple(self.response_mask.shape)}")
        if self.behav_logp is not None and self.behav_logp.shape != (b, g, t):
            raise ValueError(f"behav_logp must be {(b, g, t)}, got {tuple(self.behav_logp.shape)}")
        if self.rewards is not None and self.rewards.shape != (b, g):
            raise ValueError(f"rewards must be {(b, g)}, got {tuple(self.rewards.shape)}")
        if self.is_offline is not None and self.is_offline.shape != (b, g):
            raise ValueError(f"is_offline must be {(b, g)}, got {tuple(self.is_offline.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.response_ids.shape)  # type: ignore[return-value]

    def flat(self, name: str) -> Tensor | None:
        """A field reshaped from ``[B, G, ...]`` to ``[B * G, ...]`` (group-major), or None."""
        value = getattr(self, name)
        return None if value is None else value.reshape(-1, *value.shape[2:])


@dataclass(frozen=True)
class OfflineTrajectories:
    """At most one offline (e.g. teacher or ground-truth reasoning) response per prompt.

    Fields:
        response_ids: ``LongTensor[B, T_off]`` right-padded.
        response_mask: ``[B, T_off]``.
        present: ``BoolTensor[B]``; False where the prompt carries no offline trajectory (its row
            is ignored).
        behav_logp: optional ``[B, T_off]`` log-probs under the policy that wrote it, if known.
            When absent, the substituted ``behav_logp`` is ``0.0`` (treated as sampled with
            probability 1, as mix-policy methods usually do); use ``is_offline`` to treat them apart.
        rewards: optional ``[B]``; required when the rollouts carry rewards.
    """

    response_ids: Tensor
    response_mask: Tensor
    present: Tensor
    behav_logp: Tensor | None = None
    rewards: Tensor | None = None

    def __post_init__(self):
        if self.response_ids.dim() != 2:
            raise ValueError(f"response_ids must be [B, T_off], got {tuple(self.response_ids.shape)}")
        b, t = self.response_ids.shape
        if self.response_mask.shape != (b, t):
            raise ValueError(f"response_mask must be {(b, t)}, got {tuple(self.response_mask.shape)}")
        if self.present.shape != (b,):
            raise ValueError(f"present must be [{b}], got {tuple(self.present.shape)}")
        if self.behav_logp is not None and self.behav_logp.shape != (b, t):
            raise ValueError(f"behav_logp must be {(b, t)}, got {tuple(self.behav_logp.shape)}")
        if self.rewards is not None and self.rewards.shape != (b,):
            raise ValueError(f"rewards must be [{b}], got {tuple(self.rewards.shape)}")


def _pad_last(x: Tensor, length: int, value) -> Tensor:
    if x.shape[-1] >= length:
        return x
    pad = x.new_full((*x.shape[:-1], length - x.shape[-1]), value)
    return torch.cat([x, pad], dim=-1)


def substitute_offline(
    rollouts: GroupRollouts, offline: OfflineTrajectories, slot: int = -1, pad_id: int = 0
) -> GroupRollouts:
    """Mix-policy GRPO: put each prompt's offline trajectory in place of one of its ``G`` rollouts.

    For every ``b`` with ``offline.present[b]``, rollout ``slot`` of group ``b`` is replaced by the
    offline response (ids, mask, behaviour log-probs, reward) and ``is_offline[b, slot]`` is set.
    Groups without an offline trajectory are returned unchanged. The time axis grows to
    ``max(T, T_off)`` when needed (new positions: ``pad_id``, mask 0, logp 0). Pure: inputs are
    not modified.

    Args:
        rollouts: ``GroupRollouts`` with ``[B, G, T]`` fields.
        offline: ``OfflineTrajectories`` with ``[B, T_off]`` fields and the same ``B``.
        slot: which rollout index ``g`` (negative counts from the end) to replace.
        pad_id: token id used for padding.
    Returns:
        a new ``GroupRollouts`` with ``[B, G, max(T, T_off)]`` fields and ``is_offline`` filled.
    """
    b, g, t = rollouts.shape
    if offline.response_ids.shape[0] != b:
        raise ValueError(f"offline batch has {offline.response_ids.shape[0]} rows, rollouts have {b}")
    if not -g <= slot < g:
        raise IndexError(f"slot {slot} out of range for a group of {g}")
    if rollouts.rewards is not None and offline.rewards is None:
        raise ValueError("rollouts carry rewards, so offline trajectories must carry rewards too")
    slot = slot % g
    t_new = max(t, offline.response_ids.shape[1])
    present = offline.present.bool().to(rollouts.response_ids.device)
    sel = present.view(b, 1) & (torch.arange(g, device=present.device) == slot).view(1, g)  # [B, G]

    def merge(on: Tensor, off: Tensor, fill) -> Tensor:
        on = _pad_last(on, t_new, fill)
        off = _pad_last(off.to(device=on.device, dtype=on.dtype), t_new, fill)
        return torch.where(sel.unsqueeze(-1), off.unsqueeze(1).expand(b, g, t_new), on)

    ids = merge(rollouts.response_ids, offline.response_ids, pad_id)
    mask = merge(rollouts.response_mask, offline.response_mask, 0)
    behav = None
    if rollouts.behav_logp is not None:
        off_logp = offline.behav_logp
        if off_logp is None:
            off_logp = torch.zeros(offline.response_ids.shape, dtype=rollouts.behav_logp.dtype)
        behav = merge(rollouts.behav_logp, off_logp, 0.0)
    rewards = None
    if rollouts.rewards is not None:
        off_r = offline.rewards.to(device=rollouts.rewards.device, dtype=rollouts.rewards.dtype)
        rewards = torch.where(sel, off_r.view(b, 1).expand(b, g), rollouts.rewards)
    was_offline = rollouts.is_offline if rollouts.is_offline is not None else torch.zeros_like(sel)
    return replace(
        rollouts,
        response_ids=ids,
        response_mask=mask,
        behav_logp=behav,
        rewards=rewards,
        is_offline=was_offline.bool() | sel,
    )
