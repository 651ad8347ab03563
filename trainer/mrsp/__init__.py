"""MR-SP (Multi-modal Reinforcement Sequence Parallelism) for Qwen2-VL-family policies.

Stage 1 (embedding reuse): each unique video of a GRPO step goes through the vision tower once
(:class:`~trainer.mrsp.embed_cache.StepEmbedCache`), optionally sharded across ranks
(:func:`~trainer.mrsp.vision_shard.sharded_video_features`); the features and the M-RoPE position ids
(:mod:`~trainer.mrsp.positions`) are reused by every rollout, the old-policy and reference log-probs and the
update (:mod:`~trainer.mrsp.reuse`).

Stage 2 (sequence-parallel prefill): :func:`~trainer.mrsp.sp_prefill.sp_response_logprobs` splits the gathered
input embeddings along the sequence across ranks, with exact causal attention over all-gathered K/V.

GPU rollouts with cached embeddings through vLLM: :mod:`~trainer.mrsp.vllm_embeds` (lazy import).
"""
