"""The frozen reference model's K/V of a prompt's video prefix, kept across GRPO steps.

A prompt is ``[system text, video, question, generation prompt]`` (the Qwen2-VL chat template puts the video before
the question). Everything up to the video's last token depends only on the video and the fixed template, and a
causal decoder's K/V for those positions depend only on those tokens, so a frozen model (the reference) computes
the same prefix K/V for every question about that video, at every step. With the video's features already reused
(``frozen_cache.FrozenFeatureCache``) the reference's prompt prefill is the largest reference cost left in an MR-SP
step; :class:`PrefixKVStore` keeps the prefix K/V per (video content id, prefix tokens) and runs only the question,
the generation prompt and the responses on top of it.

Numerics: the prefix and the rest of the prompt run as two forwards instead of one, so log-probs equal the one-pass
prompt's within fp32 rounding (tests/test_mrsp_ref_prefix.py, 1e-5), and a later step's log-probs from stored K/V
equal the first step's bitwise (the same two forwards on the same tensors). Memory: ``layers x 2 x kv_heads x
head_dim`` values per prefix token (a 7B Qwen2-VL: 56 KiB per token in bf16), bounded by ``max_bytes``, least
recently used evicted first, in host memory with ``offload``. One process (an SP group keeps the plain path).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch
from torch import Tensor

from longreel.engines.kv_cache import cache_kwargs, output_cache
from longreel.trainer.packed_responses import can_pack_responses, packed_response_logits
from longreel.trainer.positions import PromptPositions

__all__ = ["PrefixKVStore", "video_prefix_length"]


def video_prefix_length(model, prompt_ids: Tensor) -> int:
    """Tokens up to and including the prompt's last video token (0 when the prompt has no video)."""
    where = (prompt_ids[0] == int(model.config.video_token_id)).nonzero()
    return int(where.max()) + 1 if len(where) else 0


class PrefixKVStore:
    """Reference log-probs with the prompt's video prefix K/V computed once per (video, prefix) for the run.

    Args:
        model: the frozen model (never trained while entries live).
        max_bytes: bytes of K/V kept (entries larger than this are used for their step and not kept).
        offload: keep the store in host memory (copied back to the model's device on a hit).

    Counters: ``hits``, ``misses``, ``evictions``, ``nbytes``.
    """

    def __init__(self, model, *, max_bytes: int, offload: bool = True):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.model = model
        self.max_bytes = int(max_bytes)
        self.offload = offload
        self._store: OrderedDict[str, list[tuple[Tensor, Tensor]]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._store)

    def logprobs(self, content_id: str, prompt_ids: Tensor, response_ids: Tensor, response_mask: Tensor, *,
                 features: Tensor, positions: PromptPositions, temperature: float = 1.0) -> Tensor:
        """``[N, T]`` log-probs of ``N`` right-padded responses to one prompt (batch 1, no padding).

        ``content_id``: the video's content digest (``frozen_cache.pixel_digest``); ``features``: its video features
        for this model. No grad (the reference)."""
        from transformers import DynamicCache

        from longreel.trainer.mrsp.reuse import build_inputs_embeds, first_and_rest_logprobs, token_logprobs

        model = self.model
        split = video_prefix_length(model, prompt_ids)
        if not 0 < split < prompt_ids.shape[1]:
            raise ValueError(f"the prompt needs a video prefix and text after it (split {split} of "
                             f"{prompt_ids.shape[1]})")
        h = hashlib.blake2b(content_id.encode(), digest_size=16)
        h.update(prompt_ids[0, :split].to("cpu", torch.int64).numpy().tobytes())
        key = h.hexdigest()
        dev = prompt_ids.device
        with torch.no_grad():
            layers = self._store.get(key)
            if layers is not None:
                self._store.move_to_end(key)
                self.hits += 1
                layers = [(k.to(dev), v.to(dev)) for k, v in layers]
            else:
                self.misses += 1
                out = model(inputs_embeds=build_inputs_embeds(model, prompt_ids[:, :split], features),
                            position_ids=positions.prompt[..., :split], use_cache=True, logits_to_keep=1)
                layers = [(layer.keys, layer.values) for layer in output_cache(out).layers]
                self._put(key, layers)
            cache = DynamicCache()
            for i, (k, v) in enumerate(layers):  # update() keeps these tensors; appending later makes new ones
                cache.update(k, v, i)
            length = prompt_ids.shape[1]
            rest = model(input_ids=prompt_ids[:, split:], position_ids=positions.prompt[..., split:],
                         use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
            n, t = response_ids.shape
            first = rest.logits[:, -1:].expand(n, -1, -1)
            if t == 1:
                return token_logprobs(first, response_ids, temperature)
            pos = positions.with_responses(n, t)[..., length:length + t - 1]
            if can_pack_responses(model):  # one packed row on the prompt's one K/V copy
                logits = packed_response_logits(model, cache, response_ids[:, :-1], response_mask[:, :-1], pos)
            else:
                cache.batch_repeat_interleave(n)
                attn = torch.cat([response_mask.new_ones(n, length), response_mask[:, :-1]], dim=1)
                logits = model(input_ids=response_ids[:, :-1], attention_mask=attn, position_ids=pos,
                               use_cache=True, **cache_kwargs(cache)).logits
            return first_and_rest_logprobs(first, logits, response_ids, temperature)

    def _put(self, key: str, layers: list[tuple[Tensor, Tensor]]) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if size > self.max_bytes:
            return
        while self._store and self.nbytes + size > self.max_bytes:
            _, old = self._store.popitem(last=False)
            self.nbytes -= sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in old)
            self.evictions += 1
        # clone: the step's cache appends to new tensors, but a stored entry must never alias a live one
        where = "cpu" if self.offload else None
        self._store[key] = [(k.to(where or k.device).clone(), v.to(where or v.device).clone()) for k, v in layers]
        self.nbytes += size
