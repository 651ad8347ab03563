"""Forward passes that take cached video features and cached M-RoPE positions instead of pixels.

* :func:`build_inputs_embeds` - token embeddings with the video features scattered into the placeholder rows
  (the same ``masked_scatter`` the model does), for ``N`` sequences that share one prompt's video.
* :func:`response_logprobs` - per-token log-probs ``[N, T]`` of ``N`` responses to one prompt (old-policy,
  reference, and the policy forward in the update), from cached features + positions: no vision tower, no
  ``get_rope_index``.
* :func:`generate_with_features` - rollouts with transformers ``generate`` fed the cached features through
  ``mm_encoder_outputs`` (the vision tower does not run; G rollouts share the one encode).

All three equal the plain pixel path numerically (tests/test_mrsp_reuse.py, fp32, within 1e-5). The G sequences
of a group share one prompt, so by default the prompt (video + question) is also run once per group and only
the responses G times on top of its K/V cache (``share_prompt``; tests/test_shared_prefix.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from longreel.engines.kv_cache import cache_kwargs, output_cache
from longreel.trainer.packed_responses import can_pack_responses, packed_response_logits, packed_row_logits
from longreel.trainer.positions import PromptPositions
# re-exported: one definition for every log-prob pass
from longreel.trainer.policy import first_and_rest_logprobs, token_logprobs  # noqa: F401

__all__ = ["build_inputs_embeds", "response_logprobs", "generate_with_features", "token_logprobs",
           "first_and_rest_logprobs", "PromptGraph",
           "mm_encoder_outputs", "policy_video_embeds"]


def _video_token_id(model) -> int:
    return int(model.config.video_token_id)


def build_inputs_embeds(model, input_ids: Tensor, features: Tensor) -> Tensor:
    """``[N, L, H]`` input embeddings: ``embed_tokens(input_ids)`` with ``features`` (``[n_tokens, H]``, one
    prompt's video) scattered into the video placeholders of every row. Differentiable w.r.t. ``features``.

    Raises ``ValueError`` when a row's placeholder count differs from ``n_tokens`` (never truncates or pads).
    """
    embeds = model.get_input_embeddings()(input_ids)
    mask = input_ids == _video_token_id(model)
    per_row = mask.sum(-1)
    if bool((per_row != features.shape[0]).any()):
        raise ValueError(f"video placeholders per row {per_row.tolist()} != {features.shape[0]} video features")
    feats = features.to(embeds.dtype).repeat(input_ids.shape[0], 1)
    return embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), feats)


def response_logprobs(model, prompt_ids: Tensor, response_ids: Tensor, response_mask: Tensor, *,
                      features: Tensor, positions: PromptPositions, temperature: float = 1.0,
                      share_prompt: bool = True) -> Tensor:
    """Per-token log-probs ``[N, T]`` of ``N`` right-padded responses to one prompt, from cached features.

    Args:
        prompt_ids: ``[1, Lp]``; response_ids / response_mask: ``[N, T]`` (mask 1 on real tokens).
        features: the prompt's video features ``[n_tokens, H]`` (detached for old/ref log-probs; with grad, or a
            ``StepEmbedCache.update_features`` leaf, in the update).
        positions: the prompt's cached M-RoPE positions.
        share_prompt: run the prompt (video + question) once and only the ``N`` responses on top of its K/V
            cache (``longreel.trainer.policy.shared_prefix_logprobs``), instead of ``N`` full sequences; equal within
            fp32 rounding. Under gradient checkpointing in training mode (no K/V cache) the prompt and the responses
            run as one packed row with a 4D mask instead (eager / sdpa attention); otherwise per sequence.
    Entries at padding positions are meaningless (mask them). Grad follows the caller's grad mode.
    """
    from longreel.trainer.policy import can_share_prompt, shared_prefix_logprobs

    n, t = response_ids.shape
    if share_prompt and can_share_prompt(model):
        prefix = dict(inputs_embeds=build_inputs_embeds(model, prompt_ids, features), position_ids=positions.prompt)
        resp_pos = positions.with_responses(n, t)[:, :, positions.length:]
        return shared_prefix_logprobs(model, prefix, response_ids, response_mask, resp_pos, temperature=temperature)
    if share_prompt and can_pack_responses(model):
        # checkpointed layers keep no K/V cache: the prompt and its responses as one packed row, the prompt once
        ids = torch.cat([prompt_ids, response_ids[:, :-1].reshape(1, -1)], dim=1)
        logits = packed_row_logits(model, dict(inputs_embeds=build_inputs_embeds(model, ids, features)),
                                   positions.length, response_mask, positions.prompt,
                                   positions.with_responses(n, t)[:, :, positions.length:])
        return token_logprobs(logits, response_ids, temperature)
    ids = torch.cat([prompt_ids.expand(n, -1), response_ids], dim=1)
    attn = torch.cat([torch.ones_like(prompt_ids).expand(n, -1), response_mask.to(prompt_ids.dtype)], dim=1)
    embeds = build_inputs_embeds(model, ids, features)
    out = model(inputs_embeds=embeds, attention_mask=attn, position_ids=positions.with_responses(n, t),
                logits_to_keep=t + 1, use_cache=False)
    return token_logprobs(out.logits[:, :-1, :], response_ids, temperature)


def mm_encoder_outputs(features: Tensor, copies: int = 1) -> dict:
    """``{"video": BaseModelOutputWithPooling(pooler_output=(features,) * copies)}`` for ``model(...)`` /
    ``generate(...)`` (transformers 5's precomputed-encoder hook)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"video": BaseModelOutputWithPooling(pooler_output=tuple([features] * copies))}


def generate_with_features(model, prompt_ids: Tensor, *, features: Tensor, video_grid_thw: Tensor,
                           mm_token_type_ids: Tensor | None = None, num_return_sequences: int = 1,
                           share_prompt: bool = True, **generate_kwargs: Any) -> Tensor:
    """``model.generate`` for one prompt with cached video features (the vision tower does not run).

    The (pixel-free) rope index is recomputed from ``video_grid_thw``. With ``share_prompt`` and several
    sequences the prompt is prefilled once and its K/V cache repeated for the ``num_return_sequences`` rows
    (``longreel.engines.shared_prefix.generate_shared_prefix``: same tokens under the same seed); otherwise transformers
    expands the prompt and ``mm_encoder_outputs`` itself. Returns the generated ids ``[G, Lp + new]``.
    """
    from longreel.trainer.positions import mm_token_types
    from longreel.engines.shared_prefix import generate_shared_prefix

    if mm_token_type_ids is None:
        mm_token_type_ids = mm_token_types(model, prompt_ids)
    inputs = dict(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                  mm_token_type_ids=mm_token_type_ids, video_grid_thw=video_grid_thw,
                  mm_encoder_outputs=mm_encoder_outputs(features.detach()))
    # tensors among the keywords are the prompt's other processor outputs (Qwen2.5-VL's second_per_grid_ts):
    # the prompt's prefill needs them for its rope index, generate's sampling options are never tensors
    inputs.update({k: generate_kwargs.pop(k) for k in list(generate_kwargs) if isinstance(generate_kwargs[k], Tensor)})
    with torch.no_grad():
        if share_prompt and num_return_sequences > 1:
            return generate_shared_prefix(model, inputs, num_return_sequences, **generate_kwargs)
        return model.generate(**inputs, num_return_sequences=num_return_sequences, **generate_kwargs)


def policy_video_embeds(features: Tensor, video_grid_thw: Tensor):
    """Wrap cached features as ``longreel.trainer.policy.VideoEmbeds`` for the trainer's ``sequence_logprobs`` /
    rollout engines (an update leaf from ``StepEmbedCache.update_features`` keeps its gradient path)."""
    from longreel.trainer.policy import VideoEmbeds

    return VideoEmbeds(features=features, grid_thw=video_grid_thw)


class PromptGraph:
    """One prompt's forward with grad, run once for all the micro-batches of its responses in an update.

    Without it every micro-batch of a group runs the prompt (video + question, the long part) again, forward and
    backward. Here the prompt runs once from the cached features and positions; each micro-batch runs only its
    responses on top of *leaf* copies of the prompt's K/V and last-position logits (their gradients accumulate
    over the micro-batches), and :meth:`backward` then pushes the accumulated gradient through the prompt's
    graph once (down to the features, and with ``StepEmbedCache(vision="deferred")`` on to the tower's once-per-
    video backward). Sum of the micro-batches' gradients = the per-micro-batch path's, within fp32 rounding
    (tests/test_grpo_mrsp.py). Needs ``policy.can_share_prompt(model)`` (no gradient checkpointing in training).
    With ``pack_responses`` (and eager / sdpa attention) a micro-batch's responses run as one packed row on the
    leaves' single K/V copy (``longreel.trainer.packed_responses``); otherwise the leaves are expanded to its rows
    and the cache's ``cat`` copies the prompt's K/V once per response.
    """

    def __init__(self, model, prompt_ids: Tensor, features: Tensor, positions: PromptPositions, *,
                 pack_responses: bool = True):
        self.pack_responses = pack_responses
        self.length = int(prompt_ids.shape[1])
        embeds = build_inputs_embeds(model, prompt_ids, features)
        out = model(inputs_embeds=embeds, position_ids=positions.prompt, use_cache=True, logits_to_keep=1)
        self._outputs = [out.logits[:, -1:]] + [x for layer in output_cache(out).layers
                                               for x in (layer.keys, layer.values)]
        self._leaves = [t.detach().requires_grad_(t.requires_grad) for t in self._outputs]
        self.positions = positions

    def logprobs(self, model, response_ids: Tensor, response_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[N, T]`` log-probs of ``N`` right-padded responses (one micro-batch) on the prompt's leaves."""
        from transformers import DynamicCache

        n, t = response_ids.shape
        first = self._leaves[0].expand(n, -1, -1)
        if t == 1:
            return token_logprobs(first, response_ids, temperature)
        pack = self.pack_responses and can_pack_responses(model)
        rows = 1 if pack else n  # packed: the responses append to the leaves' one copy (no n-row expand + cat)
        cache = DynamicCache()
        kv = self._leaves[1:]
        for i in range(0, len(kv), 2):
            cache.update(kv[i].expand(rows, -1, -1, -1), kv[i + 1].expand(rows, -1, -1, -1), i // 2)
        pos = self.positions.with_responses(n, t)[:, :, self.length:self.length + t - 1]
        if pack:
            rest = packed_response_logits(model, cache, response_ids[:, :-1], response_mask[:, :-1], pos)
        else:
            attn = torch.cat([response_mask.new_ones(n, self.length), response_mask[:, :-1]], dim=1)
            rest = model(input_ids=response_ids[:, :-1], attention_mask=attn, position_ids=pos,
                         use_cache=True, **cache_kwargs(cache)).logits
        return first_and_rest_logprobs(first, rest, response_ids, temperature)

    def backward(self) -> None:
        """The micro-batches' accumulated gradient through the prompt's forward, once."""
        pairs = [(o, leaf.grad) for o, leaf in zip(self._outputs, self._leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._outputs, self._leaves = [], []
