"""Stage 2: GRPO on the policy (``longreel train grpo``).

One optimizer step, on each rank, for its share of the global batch of ``B`` prompts:

1. **rollout**: every prompt's video is encoded (with MR-SP: every *unique* video of the rank's prompts, once) and
   ``G`` responses are sampled under the prompt's own seed (``runtime.rollout_seed``: a function of the run seed,
   the step and the prompt's position in the global batch, so 1 rank and N ranks sample the same responses);
2. **reward**: ``longreel.task.rewards.score`` on each response (the same code as the pass-rate filter); with
   ``grpo.mix_policy`` an item's CoT target replaces the last rollout of its group (``substitute_offline``);
   group-normalised advantages (``group_advantages``); a tied group has zero advantage;
3. **log-prob**: old (= behaviour, for the transformers engine) log-probs and, when ``beta > 0``, the reference
   model's, reusing the step's video embeddings;
4. **update**: ``grpo.ppo_epochs`` passes of the clipped surrogate (``policy_loss``, asymmetric clip), plus
   ``beta * KL``; the loss of every group is divided by the *global* token (or sequence) count, so gradients summed
   over groups, micro-batches and ranks equal the full-batch gradient; clip, AdamW, schedule.

MR-SP (``mrsp.enabled``, the default; ``longreel.trainer.mrsp``): one ``StepEmbedCache`` per step holds each unique video's
features (keyed by the item's ``video_id``/``key``) and each prompt's M-RoPE positions; rollouts, old log-probs and
the update all use them, so the policy's vision tower runs once per unique video per step (the plain path: once
per prompt for the rollout, then again with grad in every micro-batch of every ppo epoch). Log-probs come from
``sp_prefill.prefill_logprobs`` (features + positions, no pixels). ``mrsp.vision`` says what the update does with
the tower: ``frozen`` (``model.freeze_vision``) reuses the cached features; ``deferred`` keeps the one encode's
graph, accumulates the features' gradient over the micro-batches and pushes it through the tower once
(``cache.backward_vision()``, before gradients are reduced and stepped); ``recompute`` re-encodes once with grad in
the update. With ``ppo_epochs > 1`` the tower changes between epochs, so ``deferred`` encodes afresh at the start
of every later epoch. The reference (``beta > 0``) uses the policy's features when the tower is frozen (the same
weights), else its own cache (``mrsp.frozen_cache.FrozenFeatureCache``: one reference tower pass per unique video per
step, or per run while the video's features stay in the cross-step store, ``mrsp.frozen_cache_mb``; with a frozen
policy tower the same store backs the policy's step cache); with ``mrsp.ref_prefix_cache_mb`` the reference's K/V of
each prompt's video prefix are kept across steps too (``mrsp.ref_prefix.PrefixKVStore``, one process). With
``beta == 0`` the reference is not loaded and no reference pass runs.

Sequence parallelism (``mrsp.sp_size = S > 1``, torchrun, under ``dist.strategy`` ddp or fsdp): groups of ``S`` consecutive ranks take the same prompts
(data-parallel size ``world / S``); each rank encodes its share of the frames (``make_sharded_encoder``; features
all-gathered), the group's ranks split each prompt's ``G`` rollouts (each samples its share from the identical
gathered features, rollout ``k`` under its own seed, so the samples are one process's; the token ids are then
all-gathered; the vLLM engine still samples all ``G`` on every rank), and every log-prob pass is split
over the group (``prefill_logprobs(..., group=)``: the sequence above ``mrsp.sp_min_tokens``, else the rows). Every
rank computes the same loss from the gathered log-probs and holds its share of the gradient, so the usual
world-wide gradient sum is the SP-group sum and the data-parallel sum at once. Per-replica counts (token
denominator, loss, metrics) are taken from each group's leader only.

``mrsp.enabled=false`` keeps the plain path (``encode_video`` + ``sequence_logprobs``) for comparison.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longreel.trainer import algorithms as A
from longreel.trainer.config import TrainConfig
from longreel.trainer.group_stats import group_metrics, has_signal, merge_tallies, tally_group
from longreel.trainer.preflight import InputCheckError
from longreel.trainer.policy import (PromptInputs, VideoEmbeds, VideoTokenMismatch, check_video_features, encode_prompt,
                            encode_video, sequence_logprobs, video_token_id)
from longreel.task.rewards import score
from longreel.trainer.rollout import RolloutGroup, SamplingConfig, make_engine, pad_responses
from longreel.trainer.runtime import DistInfo, TrainSession, all_gather_objects, all_reduce_sum, rollout_seed

__all__ = ["run_grpo", "GroupBatch", "grpo_group_loss", "sampled_nll_sums"]

log = logging.getLogger("longreel.trainer")


@dataclass
class GroupBatch:
    """Everything the update needs about one prompt's group (tensors ``[G, T]`` / ``[G]``)."""

    item_index: int
    prompt: PromptInputs
    response_ids: Tensor
    response_mask: Tensor
    advantages: Tensor
    rewards: Tensor
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    behav_weight: Tensor | None = None
    embeds: VideoEmbeds | None = None
    offline: bool = False  # the last row holds an offline trajectory (mix-policy)
    video_key: str | None = None  # MR-SP: the StepEmbedCache key of the prompt's video
    positions: Any = None         # MR-SP: the prompt's cached M-RoPE positions (trainer.mrsp.positions)
    old_from_rollout: bool = False  # MR-SP: old_logp are the rollout decode's own log-probs (no old pass)
    position: int = -1  # the prompt's position among the step's draws (what dynamic sampling keeps by)
    pad: bool = False  # FSDP lockstep only: its passes run at weight 0 and its tokens are not counted


def sampled_nll_sums(batches: list[GroupBatch]) -> list[float]:
    """[sum of -old_logp, token count] over the sampled response tokens of ``batches`` (``old_logp`` and
    ``response_mask`` ``[G, T]``).

    The mean, ``-E[log p(x)]`` over tokens ``x`` the policy sampled, is a Monte Carlo estimate of the policy's
    per-token entropy at the sampling temperature: cheap (the old log-probs exist already, for every engine) where
    the exact entropy would need each pass's full ``[N, T, V]`` softmax. A falling entropy is how a GRPO run's
    collapse onto a few answers shows first. With ``rollout.top_p`` < 1 the samples come from the truncated
    distribution, and the mean is its cross-entropy against the policy (at least the truncated entropy). Offline
    rows (mix-policy targets: not sampled) and FSDP lockstep pads are left out; under dynamic sampling the batches
    are the groups the update kept."""
    total, tokens = 0.0, 0.0
    for b in batches:
        if b.pad or b.old_logp is None:
            continue
        on = b.response_mask.clone()
        if b.offline:
            on[-1] = 0
        total += float(-(b.old_logp * on).sum())
        tokens += float(on.sum())
    return [total, tokens]


def _replica_sum(value: float, info: DistInfo) -> float:
    """Sum of a per-replica quantity over the data-parallel replicas: the ranks of an SP group hold the same
    prompts, so only the group's leader contributes (exact, unlike dividing a sum by ``sp_size``)."""
    return all_reduce_sum(value if info.sp_leader else 0.0, info)


def _denominator(groups: list[GroupBatch], agg: str, info) -> float:
    """Global count the aggregated loss divides by: valid tokens (token_mean) or non-empty sequences."""
    groups = [g for g in groups if not g.pad]
    if agg == "token_mean":
        local = sum(float(g.response_mask.sum()) for g in groups)
    else:
        local = sum(float((g.response_mask.sum(-1) > 0).sum()) for g in groups)
    return _replica_sum(local, info)


def _pad_time(x: Tensor, t: int, value=0) -> Tensor:
    if x.shape[-1] >= t:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], t - x.shape[-1]), value)], dim=-1)


def _row_chunks(n: int, chunks: int) -> list[slice]:
    """The micro-batches of a group of ``n`` responses: ``chunks`` contiguous row ranges (fewer when n is small)."""
    size = math.ceil(n / chunks)
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


def grpo_group_loss(logp: Tensor, g: GroupBatch, rows: slice, cfg: TrainConfig, denominator: float,
                    norm_len: int) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of the responses ``rows`` of group ``g`` as their share of the global-batch loss."""
    mask = g.response_mask[rows]
    old = g.old_logp[rows] if g.old_logp is not None else logp.detach()
    bw = g.behav_weight[rows] if g.behav_weight is not None else None
    agg = cfg.grpo.loss_agg
    if agg == "seq_mean_token_sum_norm":  # Dr. GRPO divides by a constant length: pad to it
        logp, old, mask = _pad_time(logp, norm_len), _pad_time(old, norm_len), _pad_time(mask, norm_len)
        bw = _pad_time(bw, norm_len) if bw is not None else None
    loss, metrics = A.policy_loss(logp, old, g.advantages[rows], mask, clip_low=cfg.grpo.clip_low,
                                  clip_high=cfg.grpo.clip_high, agg=agg, behav_weight=bw, denominator=denominator)
    if cfg.grpo.beta > 0 and g.ref_logp is not None:
        ref = g.ref_logp[rows]
        if agg == "seq_mean_token_sum_norm":
            ref = _pad_time(ref, norm_len)
        kl = A.kl_penalty(logp, ref, kind=cfg.grpo.kl_estimator)
        kl_loss = A.agg_loss(kl, mask, agg, denominator)
        loss = loss + cfg.grpo.beta * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, items: list[dict] | None = None):
        self.cfg = cfg
        self.mrsp = cfg.mrsp.enabled
        self.sess = TrainSession(cfg, "grpo", items=items, sp_size=cfg.mrsp.sp_size if self.mrsp else None)
        s = self.sess
        self.video_token_id = video_token_id(s.model)
        self.engine = make_engine(cfg.rollout.engine, s.model, s.processor, model_path=cfg.model.path,
                                  rollout_cfg=cfg.rollout, seed=cfg.run.seed,
                                  dtype="bfloat16" if s.dtype == torch.bfloat16 else "float32",
                                  group=s.info.sp_group if self.mrsp and s.info.sp_size > 1 else None)
        if self.engine.name != "transformers" and s.step > 0:
            self.engine.sync_weights(s.model, s.weights_for_engine())
        self.ref = None
        if cfg.grpo.beta > 0:  # the reference is loaded only when the KL term is on
            from longreel.trainer.policy import load_policy

            self.ref, _ = load_policy(cfg.model.path, dtype=s.dtype, device=s.device,
                                      attn_implementation=cfg.model.attn_implementation,
                                      vision_attention=cfg.model.vision_attention,
                                      packed_row_attention=cfg.model.packed_row_attention,
                                      trust_remote_code=cfg.model.trust_remote_code)
            self.ref.eval().requires_grad_(False)
        self.cache = self.ref_cache = self.policy_store = self.ref_prefix = None
        self.vision_mode = cfg.mrsp.resolved_vision(cfg.model.freeze_vision)
        if self.mrsp:
            self._init_mrsp()
            if self.engine.name == "transformers":
                # the decode runs the policy's weights on the step's cached features: its log-probs are the old
                # log-probs, so the old pass is not run again (reuse, like the features')
                self.engine.report_logprobs = True
        self.sampling = SamplingConfig(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
        self.rejected = 0

    def _init_mrsp(self) -> None:
        from longreel.trainer.mrsp.embed_cache import StepEmbedCache
        from longreel.trainer.mrsp.frozen_cache import FrozenFeatureCache
        from longreel.trainer.mrsp.vision_shard import make_sharded_encoder

        s = self.sess
        vcfg = getattr(s.model.config, "vision_config", None)
        if getattr(vcfg, "deepstack_visual_indexes", None):
            # the cache keeps the merged features only; deepstack families feed per-layer features too
            raise InputCheckError("mrsp.enabled: this model family feeds deepstack vision features to the decoder, "
                                  "which the MR-SP cache does not carry yet; set mrsp.enabled=false")
        group = s.info.sp_group
        sharded = (lambda m: make_sharded_encoder(m, group=group)) if s.info.sp_size > 1 else (lambda m: None)
        budget = int(self.cfg.mrsp.frozen_cache_mb * 2 ** 20)
        offload = self.cfg.mrsp.frozen_cache_offload
        encoder = sharded(s.model)
        if self.vision_mode == "frozen" and (budget > 0 or self.cfg.mrsp.frozen_feature_dir):
            # a frozen policy tower gives a video the same features every step: keep them across steps too
            self.policy_store = FrozenFeatureCache(s.model, max_bytes=budget, offload=offload, encoder=encoder,
                                                   directory=self._feature_dir(s.model))
            encoder = self.policy_store.encode
        self.cache = StepEmbedCache(s.model, vision=self.vision_mode, encoder=encoder)
        if self.ref is not None and self.vision_mode != "frozen":
            # a trained policy tower drifts from the reference's: the reference encodes the video itself, once per
            # step, or once per run while its features stay in the cross-step store (mrsp.frozen_cache_mb), or
            # once for good in the feature directory (mrsp.frozen_feature_dir)
            self.ref_cache = FrozenFeatureCache(self.ref, max_bytes=budget, offload=offload,
                                                encoder=sharded(self.ref), directory=self._feature_dir(self.ref))
        prefix_budget = int(self.cfg.mrsp.ref_prefix_cache_mb * 2 ** 20)
        if self.ref is not None and prefix_budget > 0 and s.info.sp_size == 1:
            from longreel.trainer.mrsp.ref_prefix import PrefixKVStore

            self.ref_prefix = PrefixKVStore(self.ref, max_bytes=prefix_budget, offload=offload)

    def _feature_dir(self, model):
        """The frozen tower's feature directory (``mrsp.frozen_feature_dir``) under the digest of its weights, or
        None when off."""
        if not self.cfg.mrsp.frozen_feature_dir:
            return None
        import transformers

        from longreel.trainer.mrsp.feature_dir import FeatureDir, tower_digest

        c = self.cfg
        # what decides the features' bits besides the weights: features of another precision, kernel or library
        # version are not served
        context = "|".join(str(v) for v in (
            self.sess.device.type, self.sess.dtype, c.dist.strategy,
            c.dist.fsdp_param_dtype if c.dist.strategy == "fsdp" else "", c.model.attn_implementation,
            c.model.vision_attention, torch.__version__, transformers.__version__))
        return FeatureDir(c.mrsp.frozen_feature_dir, tower_digest(model, context))

    def _logprobs(self, model, b: GroupBatch, rows: slice, features: Tensor) -> Tensor:
        """MR-SP log-probs of rows ``rows`` of group ``b`` from cached features and positions (identical on every
        rank of the SP group; sequence-parallel above ``mrsp.sp_min_tokens``)."""
        from longreel.trainer.mrsp.sp_prefill import prefill_logprobs

        return prefill_logprobs(model, b.prompt.input_ids, b.response_ids[rows], b.response_mask[rows],
                                features=features, positions=b.positions, temperature=self.cfg.rollout.temperature,
                                group=self.sess.info.sp_group, sp_min_tokens=self.cfg.mrsp.sp_min_tokens)

    def _ref_logprobs(self, b: GroupBatch, rows: slice, features: Tensor) -> Tensor:
        """MR-SP reference log-probs; with ``mrsp.ref_prefix_cache_mb`` the prompt's video prefix K/V come from the
        cross-step store (``mrsp.ref_prefix.PrefixKVStore``), else the prompt is prefilled here."""
        from longreel.trainer.mrsp.frozen_cache import pixel_digest
        from longreel.trainer.mrsp.ref_prefix import video_prefix_length

        p = b.prompt
        if self.ref_prefix is None or not 0 < video_prefix_length(self.ref, p.input_ids) < p.input_ids.shape[1]:
            return self._logprobs(self.ref, b, rows, features)
        cid = (self.ref_cache.content_id(b.video_key, p.pixel_values_videos, p.video_grid_thw)
               if self.ref_cache is not None else pixel_digest(p.pixel_values_videos, p.video_grid_thw))
        return self.ref_prefix.logprobs(cid, p.input_ids, b.response_ids[rows], b.response_mask[rows],
                                        features=features, positions=b.positions,
                                        temperature=self.cfg.rollout.temperature)

    def _prompt_graph(self, b: GroupBatch):
        """MR-SP on one rank: the group's prompt run once with grad for all its micro-batches
        (``reuse.PromptGraph``), or ``None`` (plain path, an SP group of several ranks, checkpointed layers)."""
        from longreel.trainer.mrsp.dist_ops import world
        from longreel.trainer.mrsp.reuse import PromptGraph
        from longreel.trainer.policy import can_share_prompt

        model = self.sess.model
        if not self.mrsp or world(self.sess.info.sp_group)[1] > 1 or not can_share_prompt(model):
            return None
        feats = self.cache.update_features(b.video_key, b.prompt.pixel_values_videos, b.prompt.video_grid_thw)
        return PromptGraph(model, b.prompt.input_ids, feats, b.positions)

    def _encode_step_videos(self, local) -> tuple[list[VideoEmbeds], list[str], list]:
        """MR-SP: each unique video of this rank's prompts through the policy's tower once (the step's cache)."""
        embeds, keys, positions = [], [], []
        for j, _, item, p in local:
            key = str(item.get("video_id") or item.get("key") or f"@{j}")
            try:
                feats = self.cache.features(key, p.pixel_values_videos, p.video_grid_thw)
            except ValueError:  # the key names other pixels elsewhere in the batch: not one video, cache apart
                key = f"{key}@{j}"
                feats = self.cache.features(key, p.pixel_values_videos, p.video_grid_thw)
            check_video_features(p, feats, self.sess.model, what="the vision tower gave")
            embeds.append(VideoEmbeds(features=feats, grid_thw=p.video_grid_thw))
            keys.append(key)
            positions.append(self.cache.positions(f"@{j}", p.input_ids, p.video_grid_thw, p.mm_token_type_ids,
                                                  extra=p.extra))
        return embeds, keys, positions

    # ------------------------------------------------------------------ one step
    def _prompts(self, local):
        out = []
        for j, i, item in local:
            try:
                out.append((j, i, item, encode_prompt(self.sess.processor, item, video_token_id=self.video_token_id
                                                      ).to(self.sess.device)))
            except (VideoTokenMismatch, ValueError, KeyError) as e:
                self.rejected += 1
                log.warning("skipping item %s: %s", item.get("key"), e)
        return out

    def _score(self, texts: list[str], item: dict) -> tuple[list[float], list[float], list[float]]:
        w = self.cfg.grpo.reward_format_weight
        res = [score(t, item["problem_type"], item["answer"], item.get("options"), format_weight=w) for t in texts]
        return [r.reward for r in res], [r.format for r in res], [r.accuracy for r in res]

    def _offline(self, item: dict, g: RolloutGroup, pad_id: int, eos_id: int):
        tok = self.sess.processor.tokenizer
        ids = tok(item["target"], add_special_tokens=False)["input_ids"] + [eos_id]
        r, f, a = self._score([item["target"]], item)
        rollouts = A.GroupRollouts(g.response_ids[None], g.response_mask[None],
                                   behav_logp=g.behav_logp[None] if g.behav_logp is not None else None,
                                   rewards=None)
        off_ids, off_mask = pad_responses([ids], pad_id)
        off = A.OfflineTrajectories(off_ids.to(g.response_ids.device), off_mask.to(g.response_ids.device),
                                    present=torch.tensor([True]))
        mixed = A.substitute_offline(rollouts, off, slot=-1, pad_id=pad_id)
        return mixed, r[0], f[0], a[0]

    def step(self) -> dict[str, Any]:
        """One GRPO step: rollouts, rewards and advantages (with ``grpo.dynamic_sampling``, more draws until the
        step has its groups with signal), old/reference log-probs, the update, and the metrics (global over ranks)."""
        s = self.sess
        step = s.step + 1
        t0 = time.perf_counter()
        clock = {"time_rollout": 0.0, "time_reward": 0.0}
        with s.gathered():  # FSDP: the no-grad phases on gathered weights (ranks generate different lengths)
            batches, stats = self._draw_and_score(step, 0, clock)
            if self.cfg.grpo.dynamic_sampling:
                batches = self._fill_with_signal(step, batches, stats, clock)
            t_reward = time.perf_counter()
            self.engine.release()  # its GPU memory to the passes below until the sync wakes it
            sums_logp = self._old_and_ref_logprobs(batches)
            t_logprob = time.perf_counter()
        loss_total, sums, grad_norm, signal = self._update(step, batches)
        t_update = time.perf_counter()
        s.step = step
        times = {**clock, "time_logprob": t_logprob - t_reward, "time_update": t_update - t_logprob,
                 "time_step": t_update - t0}
        return self._metrics(stats, sums, sums_logp, loss_total, grad_norm, signal, times)

    def _draw_and_score(self, step: int, draw: int, clock: dict, stats: dict | None = None):
        """The next batch of prompts from the loader, its rollouts and its scored groups. ``draw`` > 0 (dynamic
        sampling's extra batches) shifts the prompts' positions past the earlier draws', so their rollout seeds and
        cache keys are new; draw 0 samples exactly what a step without dynamic sampling does."""
        t = time.perf_counter()
        offset = draw * self.cfg.data.batch_size
        local = [(offset + j, i, item, p) for j, i, item, p in self._prompts(self.sess.local_batch())]
        groups, embeds, vkeys, positions = self._rollout(step, local, fresh=draw == 0)
        t_rollout = time.perf_counter()
        batches, stats = self._score_groups(local, groups, embeds, vkeys, positions, stats=stats)
        clock["time_rollout"] += t_rollout - t
        clock["time_reward"] += time.perf_counter() - t_rollout
        return batches, stats

    def _fill_with_signal(self, step: int, batches: list[GroupBatch], stats: dict,
                          clock: dict) -> list[GroupBatch]:
        """DAPO's dynamic sampling: keep the groups whose rewards do not all tie, drawing more batches while the
        replicas together hold fewer than ``data.batch_size`` of them (at most ``grpo.max_draws`` batches in all),
        then keep the first ``data.batch_size`` by position. Every rank takes the same decisions (they are made on
        the gathered positions), so collectives stay in lockstep; the loader's extra draws are part of its
        checkpointed position, so a resumed run draws the same prompts."""
        cfg, info = self.cfg, self.sess.info
        want = cfg.data.batch_size
        kept = [b for b in batches if has_signal(b.rewards.tolist())]
        draws = 1
        while True:
            # an SP group's ranks hold the same prompts: the union of positions counts each prompt once
            signal_positions = sorted(set().union(*all_gather_objects([b.position for b in kept], info)))
            if len(signal_positions) >= want or draws >= cfg.grpo.max_draws:
                break
            more, _ = self._draw_and_score(step, draws, clock, stats=stats)
            kept += [b for b in more if has_signal(b.rewards.tolist())]
            draws += 1
        chosen = set(signal_positions[:want])
        stats["draws"] = draws
        stats["kept_groups"] = len(chosen)
        if not chosen:  # no group with signal in any draw: the first draw's step, as without dynamic sampling
            return batches
        out = [b for b in kept if b.position in chosen]
        if not out and self.sess.fsdp and batches:
            # every FSDP rank must run the update's passes (each runs the layers' collectives): a rank none of whose
            # groups was kept runs one of its own at weight 0
            batches[0].pad = True
            out = batches[:1]
        return out

    def _rollout(self, step: int, local: list, fresh: bool = True) -> tuple[list, list, list, list]:
        """G responses per prompt; each video is encoded once (with MR-SP once per unique video of the step) and
        its embeddings are reused by every later pass. ``fresh``: the step's first draw (MR-SP starts the step's
        cache; later draws add to it). Returns (groups, embeds, video keys, positions)."""
        cfg, model = self.cfg, self.sess.model
        model.eval()
        vkeys: list[str | None] = [None] * len(local)
        positions: list = [None] * len(local)
        if self.mrsp:
            if fresh:
                self.cache.begin_step()
                if self.ref_cache is not None:
                    self.ref_cache.begin_step()
            embeds, vkeys, positions = self._encode_step_videos(local)
        else:
            with torch.no_grad():
                embeds = [encode_video(model, p) for _, _, _, p in local]
        seeds = [rollout_seed(cfg.run.seed, step, j) for j, _, _, _ in local]
        groups = self.engine.generate([p for *_, p in local], self.sampling, seeds, video_embeds=embeds,
                                      items=[it for _, _, it, _ in local])
        return groups, embeds, vkeys, positions

    def _score_groups(self, local: list, groups: list, embeds: list, vkeys: list, positions: list,
                      stats: dict | None = None) -> tuple[list[GroupBatch], dict]:
        """Rewards and advantages per group (an item whose reference cannot be scored is skipped and counted);
        with ``grpo.mix_policy`` the last response of a group is the item's offline CoT target. ``stats``: an
        earlier draw's of this step, added to (the step's metrics cover every group sampled)."""
        s, cfg = self.sess, self.cfg
        pad_id = getattr(self.engine, "pad_id", 0)
        eos_id = s.processor.tokenizer.eos_token_id
        batches: list[GroupBatch] = []
        if stats is None:
            stats = {"reward": [], "format": [], "accuracy": [], "length": [], "truncated": 0, "offline": 0,
                     "groups": {}}
        for (j, i, item, prompt), g, emb, vkey, pos in zip(local, groups, embeds, vkeys, positions):
            try:
                rewards, fmts, accs = self._score(g.texts, item)
            except (ValueError, KeyError) as e:  # bad reference answer: a data error, the group is skipped
                self.rejected += 1
                log.warning("skipping item %s (cannot score): %s", item.get("key"), e)
                continue
            ids, mask, behav = g.response_ids, g.response_mask, g.behav_logp
            if cfg.grpo.mix_policy and item.get("target"):
                mixed, r_off, f_off, a_off = self._offline(item, g, pad_id, eos_id)
                ids, mask = mixed.response_ids[0], mixed.response_mask[0]
                behav = mixed.behav_logp[0] if mixed.behav_logp is not None else None
                rewards[-1], fmts[-1], accs[-1] = r_off, f_off, a_off
                stats["offline"] += 1
            r = torch.tensor(rewards, dtype=torch.float32)
            adv_fn = A.get_adv_estimator(cfg.grpo.adv_estimator)
            adv = adv_fn(r[None])[0].to(s.device)
            stats["reward"] += rewards
            stats["format"] += fmts
            stats["accuracy"] += accs
            stats["length"] += mask.sum(-1).tolist()
            stats["truncated"] += int((~g.finished).sum())
            tally_group(stats["groups"], rewards, item.get("category"))
            offline = bool(cfg.grpo.mix_policy and item.get("target"))
            batches.append(GroupBatch(i, prompt, ids, mask, adv, r, embeds=emb, old_logp=behav, offline=offline,
                                      video_key=vkey, positions=pos, position=j,
                                      old_from_rollout=bool(g.behav_is_policy and behav is not None and not offline)))
        return batches, stats

    def _old_and_ref_logprobs(self, batches: list[GroupBatch]) -> dict[str, list[float]]:
        """The proximal (old) and reference log-probs of every response, without gradients, from the step's
        video embeddings; returns ``behav``: [sum |old - engine|, tokens] over the engine-reported log-probs, and
        ``nll``: [sum -old, tokens] over the sampled responses (``sampled_nll_sums``)."""
        cfg, model = self.cfg, self.sess.model
        sums_behav = [0.0, 0.0]
        with torch.no_grad():
            for b in batches:
                behav = b.old_logp
                every = slice(0, b.response_ids.shape[0])
                if b.old_from_rollout:  # MR-SP: the decode's log-probs (policy weights, these features) are old
                    prox, behav = behav * b.response_mask, None
                elif self.mrsp:
                    prox = self._logprobs(model, b, every, b.embeds.features)
                else:
                    prox = sequence_logprobs(model, b.prompt, b.response_ids, b.response_mask,
                                             temperature=cfg.rollout.temperature, video_embeds=b.embeds)
                b.old_logp = prox
                if behav is not None:  # engine-reported log-probs: how far the engine's weights are from ours
                    on = b.response_mask.clone()
                    if b.offline:
                        on[-1] = 0
                    sums_behav[0] += float(((prox - behav).abs() * on).sum())
                    sums_behav[1] += float(on.sum())
                if behav is not None and cfg.grpo.behaviour_correction:
                    b.behav_weight = A.behaviour_weight(prox, behav, cap=cfg.grpo.behaviour_cap, mask=b.response_mask)
                if self.ref is not None and self.mrsp:
                    # frozen tower: the policy's features are the reference's (same weights, never trained)
                    ref_feats = b.embeds.features if self.ref_cache is None else self.ref_cache.features(
                        b.video_key, b.prompt.pixel_values_videos, b.prompt.video_grid_thw)
                    b.ref_logp = self._ref_logprobs(b, every, ref_feats)
                elif self.ref is not None:
                    ref_emb = encode_video(self.ref, b.prompt)
                    b.ref_logp = sequence_logprobs(self.ref, b.prompt, b.response_ids, b.response_mask,
                                                   temperature=cfg.rollout.temperature, video_embeds=ref_emb)
        return {"behav": sums_behav, "nll": sampled_nll_sums(batches)}

    def _update(self, step: int, batches: list[GroupBatch]) -> tuple[float, dict, float, bool]:
        """``grpo.ppo_epochs`` passes of the clipped loss over the groups in ``optim.grad_accum`` chunks, one
        optimizer step per epoch; returns (loss, metric sums, grad norm, whether any group carried signal)."""
        s, cfg, model = self.sess, self.cfg, self.sess.model
        model.train()
        denominator = _denominator(batches, cfg.grpo.loss_agg, s.info)
        # groups with a non-zero advantage (and KL, when on) are what moves the policy
        signal = cfg.grpo.beta > 0 or _replica_sum(sum(float(b.advantages.abs().sum() > 0) for b in batches),
                                                    s.info) > 0
        norm_len = max([cfg.rollout.max_new_tokens] + [int(b.response_ids.shape[1]) for b in batches])
        chunks = max(1, cfg.optim.grad_accum)
        loss_total, sums = 0.0, {"clip_frac": 0.0, "clip_frac_low": 0.0, "clip_frac_high": 0.0, "approx_kl": 0.0,
                                 "kl_loss": 0.0, "tokens": 0.0}
        grad_norm = 0.0
        passes = [(b, rows) for b in batches for rows in _row_chunks(b.response_ids.shape[0], chunks)]
        # FSDP: every rank runs as many passes as the busiest one (a rank that skipped an item repeats its last
        # pass at weight 0), since each pass runs the layers' collectives
        padded = passes + passes[-1:] * (s.lockstep_passes(len(passes)) - len(passes))
        for epoch in range(cfg.grpo.ppo_epochs):
            epoch_loss = 0.0
            s.hold_resident()  # FSDP: the tower and root stay gathered until the step (MR-SP calls them directly)
            if self.mrsp and epoch > 0 and self.vision_mode == "deferred":
                # the tower stepped: the next epoch's features come from one fresh (kept-graph) encode per video
                self.cache.begin_step()
            prompt_graph = None
            for pi, (b, rows) in enumerate(padded):
                pad = pi >= len(passes) or b.pad
                if not pad and (pi == 0 or padded[pi - 1][0] is not b) and not s.fsdp \
                        and len(_row_chunks(b.response_ids.shape[0], chunks)) > 1:
                    # a group's first micro-batch: its prompt runs once with grad for all of them (not under FSDP,
                    # whose lockstep passes each run the layers' collectives)
                    prompt_graph = self._prompt_graph(b)
                if prompt_graph is not None:
                    logp = prompt_graph.logprobs(model, b.response_ids[rows], b.response_mask[rows],
                                                 temperature=cfg.rollout.temperature)
                elif self.mrsp:
                    feats = self.cache.update_features(b.video_key, b.prompt.pixel_values_videos,
                                                       b.prompt.video_grid_thw)
                    logp = self._logprobs(model, b, rows, feats)
                else:
                    logp = sequence_logprobs(model, b.prompt, b.response_ids[rows], b.response_mask[rows],
                                             temperature=cfg.rollout.temperature)
                loss, m = grpo_group_loss(logp, b, rows, cfg, denominator, norm_len)
                if pad:  # a lockstep pad: the collectives run, the gradient gets nothing
                    (loss * 0.0).backward()
                    continue
                (loss * s.loss_scale).backward()
                epoch_loss += float(loss.detach())
                if epoch == cfg.grpo.ppo_epochs - 1:
                    ntok = float(b.response_mask[rows].sum())
                    sums["tokens"] += ntok
                    for k in ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl"):
                        sums[k] += float(m[k]) * ntok
                    sums["kl_loss"] += float(m.get("kl_loss", 0.0))
                if prompt_graph is not None and (pi + 1 >= len(passes) or padded[pi + 1][0] is not b):
                    prompt_graph.backward()  # the group's last micro-batch: one backward through its prompt
                    prompt_graph = None
            if self.mrsp:  # the features' accumulated gradient through the tower, once per video
                self.cache.backward_vision()
            s.reduce_gradients()
            if cfg.run.dump_grads and step == 1 and epoch == 0:
                s.dump_grads(cfg.run.dump_grads)
            if signal:
                grad_norm = s.clip_and_step()
            else:
                s.skip_step()
                grad_norm = 0.0
            loss_total = _replica_sum(epoch_loss, s.info)
        if self.engine.name != "transformers":
            self.engine.sync_weights(model, s.weights_for_engine())
        return loss_total, sums, grad_norm, signal

    def _metrics(self, stats: dict, sums: dict, sums_logp: dict[str, list[float]], loss_total: float,
                 grad_norm: float, signal: bool, times: dict) -> dict[str, Any]:
        """The step's metrics, global over ranks (an SP group's ranks saw the same prompts: counted once)."""
        s = self.sess
        gathered = all_gather_objects({"stats": stats, "sums": sums, "rejected": self.rejected,
                                       **sums_logp, "lead": s.info.sp_leader}, s.info)
        gathered = [gth for gth in gathered if gth["lead"]]  # an SP group's ranks saw the same prompts: count once
        allv = lambda k: [v for gth in gathered for v in gth["stats"][k]]  # noqa: E731
        total = lambda k: sum(gth["sums"][k] for gth in gathered)  # noqa: E731
        rewards = torch.tensor(allv("reward") or [0.0])
        lengths = allv("length")
        tokens = max(total("tokens"), 1.0)
        step_time = times["time_step"]
        metrics = {
            "loss": loss_total,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "format_rate": sum(allv("format")) / max(len(allv("format")), 1),
            "accuracy": sum(allv("accuracy")) / max(len(allv("accuracy")), 1),
            "response_len_mean": sum(lengths) / max(len(lengths), 1),
            "response_len_max": max(lengths) if lengths else 0,
            "truncated_frac": sum(gth["stats"]["truncated"] for gth in gathered) / max(len(lengths), 1),
            "clip_frac": total("clip_frac") / tokens,
            "clip_frac_low": total("clip_frac_low") / tokens,
            "clip_frac_high": total("clip_frac_high") / tokens,
            "approx_kl": total("approx_kl") / tokens,
            "kl": total("kl_loss"),
            "grad_norm": grad_norm,
            "lr": s.step_lr,
            "tokens_per_s": total("tokens") / max(step_time, 1e-9),
            **times,
            "rejected_items": sum(gth["rejected"] for gth in gathered),
            "skipped_update": 0.0 if signal else 1.0,
            "offline_groups": sum(gth["stats"]["offline"] for gth in gathered),
            **self._dynamic_metrics(gathered),
            **group_metrics(merge_tallies(gth["stats"]["groups"] for gth in gathered)),
        }
        nll_tokens = sum(gth["nll"][1] for gth in gathered)
        if nll_tokens:
            metrics["entropy_estimate"] = sum(gth["nll"][0] for gth in gathered) / nll_tokens
        behav_tokens = sum(gth["behav"][1] for gth in gathered)
        if behav_tokens:
            # mean |logp_trainer - logp_engine| on the sampled tokens: ~0 when the engine's weights are in sync
            metrics["behav_logp_absdiff"] = sum(gth["behav"][0] for gth in gathered) / behav_tokens
        return metrics

    def _dynamic_metrics(self, gathered: list[dict]) -> dict[str, float]:
        """Dynamic sampling's bill: batches drawn this step and the groups the update kept (every replica took the
        same number of draws; kept groups are global already)."""
        if not self.cfg.grpo.dynamic_sampling:
            return {}
        return {"dynamic_draws": float(gathered[0]["stats"]["draws"]),
                "dynamic_kept_groups": float(gathered[0]["stats"]["kept_groups"])}

    def train(self) -> dict[str, Any]:
        try:
            return self.sess.run_steps(self.step)
        finally:
            self.engine.close()
            self.sess.close()


def run_grpo(cfg: TrainConfig, items: list[dict] | None = None) -> dict[str, Any]:
    """Train ``cfg.run.steps`` GRPO steps (resuming when a checkpoint exists); return the last step's metrics."""
    return GRPOTrainer(cfg, items=items).train()
