"""MR-SP (Multi-modal Reinforcement Sequence Parallelism) for Qwen2-VL-family policies.

Wired into the GRPO trainer (:mod:`longreel.trainer.grpo`, config section ``mrsp``: ``enabled``, ``vision``, ``sp_size``,
``sp_min_tokens``) exactly as sketched at the end of this docstring; ``tests/test_grpo_mrsp.py`` checks that a
trainer step with MR-SP equals the plain step (log-probs, loss, gradients within 1e-5), that each unique video goes
through the policy's tower once per step, and that ``torchrun`` with ``mrsp.sp_size=2`` gives the gradients of one
process.

Stage 1 (embedding reuse): each unique video of a GRPO step goes through the vision tower once
(:class:`~longreel.trainer.mrsp.embed_cache.StepEmbedCache`), optionally sharded across ranks
(:func:`~longreel.trainer.mrsp.vision_shard.sharded_video_features`); the features and the M-RoPE position ids
(:mod:`~longreel.trainer.positions`) are reused by every rollout, the old-policy and reference log-probs and the
update (:mod:`~longreel.trainer.mrsp.reuse`).

Across steps (opt-in, for data that asks several questions per video): a frozen tower's features (the reference's;
the policy's when frozen) are kept by :class:`~longreel.trainer.mrsp.frozen_cache.FrozenFeatureCache` keyed by pixel
digest, and the reference's K/V of a prompt's video prefix by :class:`~longreel.trainer.mrsp.ref_prefix.PrefixKVStore`.

Stage 2 (sequence-parallel prefill): :func:`~longreel.trainer.mrsp.sp_prefill.sp_response_logprobs` splits the gathered
input embeddings along the sequence across ranks, with exact causal attention over all-gathered K/V;
:func:`~longreel.trainer.mrsp.sp_prefill.prefill_logprobs` switches it on above a length threshold, by default as
:func:`~longreel.trainer.mrsp.sp_prefill.sp_shared_prompt_logprobs` (the prompt split along the sequence and run once; the
G response rows split over the ranks, attending to each layer's gathered prompt K/V).

Under FSDP2 (``dist.strategy=fsdp``) the SP prefill's hand-run decoder layers go through
:func:`~longreel.trainer.mrsp.fsdp_calls.run_as_forward`, so each layer is gathered and its gradient reduce-scattered
around them as around the layer's own forward.

GPU rollouts with cached embeddings through vLLM: :mod:`~longreel.trainer.mrsp.vllm_embeds` (lazy import).

A GRPO step with MR-SP (one prompt ``p`` with video key ``k``; ``group`` = the SP group, ``None`` for one rank)::

    cache = StepEmbedCache(model, vision="deferred",                 # or "frozen" / "recompute"
                           encoder=make_sharded_encoder(model, group=group) if sp > 1 else None)
    cache.begin_step()
    with torch.no_grad():
        f = cache.features(k, p.pixel_values_videos, p.video_grid_thw)          # the one tower pass
        pos = cache.positions(p.key, p.input_ids, p.video_grid_thw, p.mm_token_type_ids)
        rollouts = generate_with_features(model, p.input_ids, features=f, video_grid_thw=p.video_grid_thw, ...)
        old = prefill_logprobs(model, p.input_ids, resp, mask, features=f, positions=pos, group=group)
        ref = prefill_logprobs(ref_model, p.input_ids, resp, mask, features=f_ref, positions=pos, group=group)
    for rows in micro_batches:
        lp = prefill_logprobs(model, p.input_ids, resp[rows], mask[rows], features=cache.update_features(k),
                              positions=pos, group=group)
        loss(lp, ...).backward()                                     # same loss on every rank of the group
    cache.backward_vision()                                          # before optimizer.step()
    allreduce_grads_(model.parameters(), group)                      # sum over the SP group (if sp > 1)

``f_ref``: ``f`` itself when the vision tower is frozen (policy and reference towers are the same weights);
otherwise a second ``StepEmbedCache(ref_model, vision="frozen")`` (one more tower pass per step).

In the trainer the parameter-gradient sum over the SP group is the one world-wide ``runtime.sum_gradients``
(it is the SP-group sum and the data-parallel sum at once); with ``ppo_epochs > 1`` and ``vision="deferred"`` the
cache is re-begun at each later epoch (the tower stepped), so those epochs encode once more per video.
"""
