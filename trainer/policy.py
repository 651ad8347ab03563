"""The policy: a transformers VLM + processor loaded from a local directory, and the tensor plumbing around it.

Video comes in as cached frames (uint8, already sampled and resized) + metadata, so the processor is called with
``do_sample_frames=False``: the trainer, the pass-rate filter and evaluation see the same ``video_grid_thw``.

The three entry points the GRPO/SFT loops use, each usable with precomputed video embeddings (the MR-SP hook):

``encode_prompt(processor, item, video_token_id=...) -> PromptInputs``
    chat template + processor; strict placeholder check (``VideoTokenMismatch`` names the sample).
``encode_video(model, prompt) -> VideoEmbeds``
    runs the vision tower once (``get_video_features``); checks one feature per placeholder token.
``sequence_logprobs(model, prompt, response_ids, response_mask, temperature, video_embeds=None) -> [N, T]``
    per-token log-probs of ``N`` responses to one prompt; the video is encoded once for all ``N`` (or not at all
    when ``video_embeds`` is given) and fed through ``mm_encoder_outputs``, so the vision tower never runs ``N``
    times. The prompt itself (video + question) also runs once and the ``N`` responses on top of its K/V cache
    (``share_prompt``, :func:`shared_prefix_logprobs`: one packed row on the cache's single copy under eager /
    sdpa attention, the cache repeated per response otherwise). With grad enabled and no ``video_embeds``,
    gradients reach the vision tower.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from longreel.engines.kv_cache import cache_kwargs, output_cache
from longreel.task.prompting import messages_for_qra
from longreel.trainer.chunked_logprobs import chunked_token_logprobs
from longreel.trainer.packed_responses import can_pack_responses, packed_response_logits, packed_row_logits
from longreel.trainer.packed_row_attention import PACKED_ROW_MODES, use_packed_row_attention
from longreel.trainer.vision_attention import VISION_ATTENTION, use_batched_vision_attention

__all__ = [
    "VideoTokenMismatch", "PromptInputs", "VideoEmbeds", "load_policy", "resolve_dtype", "resolve_device",
    "prompt_messages", "encode_prompt", "encode_video", "sequence_logprobs", "sft_inputs", "video_token_id",
    "shared_prefix_logprobs", "can_share_prompt", "token_logprobs", "first_and_rest_logprobs", "check_video_features",
]

log = logging.getLogger("longreel.trainer")


class VideoTokenMismatch(ValueError):
    """The number of video placeholder tokens differs from the number of visual features for a sample."""


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device=cuda but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that supports it, else fp32 (bf16 on this CPU is slow and imprecise)."""
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_policy(path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                attn_implementation: str | None = "sdpa", trust_remote_code: bool = False,
                vision_attention: str = "batched", packed_row_attention: str = "split"):
    """Load ``(model, processor)`` from a local ``save_pretrained`` directory (nothing is downloaded).

    ``vision_attention="batched"``: a Qwen2-VL-family tower on SDPA attends with one SDPA call per run of
    equal-length frames (:mod:`longreel.trainer.vision_attention`); ``"native"``: transformers' per-frame loop.
    ``packed_row_attention="split"``: a Qwen2-VL-family decoder on SDPA runs a packed row's prompt as causal
    attention and only its responses with a mask (:mod:`longreel.trainer.packed_row_attention`); ``"mask"``: one
    SDPA call with the row's ``[L, L]`` mask."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if not path or not os.path.isdir(path):
        raise FileNotFoundError(f"model.path {path!r} is not a local directory (hub ids are not downloaded here)")
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if vision_attention not in VISION_ATTENTION:
        raise ValueError(f"vision_attention {vision_attention!r}: expected one of {VISION_ATTENTION}")
    if packed_row_attention not in PACKED_ROW_MODES:
        raise ValueError(f"packed_row_attention {packed_row_attention!r}: expected one of {PACKED_ROW_MODES}")
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs).to(device)
    check_feature_injection(model)
    if vision_attention == "batched":
        use_batched_vision_attention(model)
    if packed_row_attention == "split":
        use_packed_row_attention(model)
    processor = AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    return model, processor


def check_feature_injection(model) -> None:
    """Raise unless ``model.forward`` takes ``mm_encoder_outputs``, the keyword every log-prob and rollout pass here
    hands the vision features through (transformers >= 5.18 for the Qwen-VL family).

    An older transformers, or a remote-code model without it, takes the keyword into ``**kwargs`` and drops it: the
    text decoder then reads the placeholder tokens' own embeddings, the log-probs ignore the video and the tower
    gets no gradient, with no error. transformers 5.17 on a GPU machine did exactly that."""
    import inspect

    import transformers

    if "mm_encoder_outputs" not in inspect.signature(type(model).forward).parameters:
        raise RuntimeError(
            f"{type(model).__name__}.forward (transformers {transformers.__version__}) takes no mm_encoder_outputs: "
            "it would drop the precomputed video features silently. Install the locked transformers "
            "(requirements/main.txt; >= 5.18 for Qwen-VL models).")


def video_token_id(model_or_config) -> int:
    config = getattr(model_or_config, "config", model_or_config)
    tid = getattr(config, "video_token_id", None)
    if tid is None:
        raise ValueError(f"{type(config).__name__} has no video_token_id: not a video-capable VLM config")
    return int(tid)


# --------------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------------


def prompt_messages(item: Mapping[str, Any]) -> list[dict]:
    """Chat messages for an item: one user turn with the video and the question (+ lettered options), rendered by
    the task layer's prompt builder, the one the pass-rate filter uses too."""
    return messages_for_qra(item)


def _metadata_dict(meta: Any) -> dict:
    if meta is None:
        raise ValueError("item has no video metadata (fps and frame indices are needed for the temporal rope)")
    if isinstance(meta, Mapping):
        d = dict(meta)
    else:  # transformers.video_utils.VideoMetadata or any object with attributes
        d = {k: getattr(meta, k) for k in ("total_num_frames", "fps", "frames_indices", "duration", "width",
                                           "height", "video_backend") if getattr(meta, k, None) is not None}
    try:  # keep only what transformers' VideoMetadata takes (the shard loader adds e.g. "timestamps")
        import dataclasses

        from transformers.video_utils import VideoMetadata

        known = {f.name for f in dataclasses.fields(VideoMetadata)}
        d = {k: v for k, v in d.items() if k in known}
    except (ImportError, TypeError):  # pragma: no cover - older transformers
        pass
    if "frames_indices" in d and d["frames_indices"] is not None:
        d["frames_indices"] = [int(i) for i in d["frames_indices"]]
    return d


def sample_name(item: Mapping[str, Any]) -> str:
    """How errors name an item: its key, plus the question id when the key is the video's (shard items)."""
    key, qid = item.get("key"), item.get("qra_id")
    if qid and key and str(qid) != str(key):
        return f"{key}/{qid}"
    return str(key or qid or "?")


def item_metadata(item: Mapping[str, Any]):
    """An item's video metadata: ``video_metadata`` (the shard loader's key) or ``metadata``."""
    meta = item.get("video_metadata")
    return meta if meta is not None else item.get("metadata")


def _frames(item: Mapping[str, Any]):
    frames = item["frames"]
    if isinstance(frames, Tensor):
        if frames.dtype != torch.uint8:
            raise ValueError(f"sample {item.get('key')!r}: frames must be uint8, got {frames.dtype}")
        return frames
    import numpy as np

    arr = np.asarray(frames)
    if arr.dtype != np.uint8:
        raise ValueError(f"sample {item.get('key')!r}: frames must be uint8, got {arr.dtype}")
    return torch.from_numpy(arr)


@dataclass
class PromptInputs:
    """One tokenized prompt with its video. All tensors have a leading batch dim of 1.

    ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids``: ``[1, L]``; ``pixel_values_videos``:
    ``[P, D]`` flattened patches; ``video_grid_thw``: ``[1, 3]``; ``extra``: other per-sample processor outputs
    the model needs (e.g. Qwen2.5-VL's ``second_per_grid_ts``), each ``[1, ...]``.
    """

    key: str
    input_ids: Tensor
    attention_mask: Tensor
    pixel_values_videos: Tensor
    video_grid_thw: Tensor
    mm_token_type_ids: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device) -> "PromptInputs":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PromptInputs(self.key, mv(self.input_ids), mv(self.attention_mask), mv(self.pixel_values_videos),
                            mv(self.video_grid_thw), mv(self.mm_token_type_ids),
                            {k: mv(v) for k, v in self.extra.items()})

    @classmethod
    def from_encoding(cls, key: str, enc: Mapping[str, Any]) -> "PromptInputs":
        """From a processor's output for one prompt (``return_tensors="pt"``): the named fields, and every other
        tensor it returned as ``extra`` (the family's own, e.g. ``second_per_grid_ts``)."""
        extra = {k: v for k, v in enc.items() if k not in _KNOWN_KEYS and isinstance(v, Tensor)}
        return cls(key=key, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                   pixel_values_videos=enc["pixel_values_videos"], video_grid_thw=enc["video_grid_thw"],
                   mm_token_type_ids=enc.get("mm_token_type_ids"), extra=extra)


_KNOWN_KEYS = {"input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"}


def encode_prompt(processor, item: Mapping[str, Any], *, video_token_id: int, merge_size: int | None = None,
                  messages: list[dict] | None = None) -> PromptInputs:
    """Tokenize an item's prompt with its cached frames; raise ``VideoTokenMismatch`` unless the prompt holds
    exactly one ``<|video_pad|>`` per merged visual patch of the video."""
    key = sample_name(item)
    msgs = messages if messages is not None else prompt_messages(item)
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    cached_grid = item.get("video_grid_thw")
    # frames from the frame cache are already resized by this processor's rules: do not resize them again
    resize = {"do_resize": False} if cached_grid is not None else {}
    try:
        enc = processor(text=[text], videos=[_frames(item)], video_metadata=[_metadata_dict(item_metadata(item))],
                        do_sample_frames=False, return_tensors="pt", **resize)
    except ValueError as e:  # e.g. a question containing placeholder text: the processor's count check
        if "video" in str(e).lower() or "token" in str(e).lower():
            raise VideoTokenMismatch(f"sample {key!r}: {e}") from e
        raise ValueError(f"sample {key!r}: {e}") from e
    grid = enc["video_grid_thw"]
    if cached_grid is not None and [int(x) for x in grid.reshape(-1).tolist()] != [int(x) for x in cached_grid]:
        raise VideoTokenMismatch(
            f"sample {key!r}: the frame cache says video_grid_thw={list(cached_grid)} but this processor gives "
            f"{grid.reshape(-1).tolist()}: the cache was built for another processor configuration")
    merge = merge_size or int(getattr(processor.video_processor, "merge_size", 2))
    n_placeholders = int((enc["input_ids"] == video_token_id).sum())
    n_features = int(grid.prod(-1).sum()) // (merge * merge)
    if n_placeholders != n_features:
        raise VideoTokenMismatch(
            f"sample {key!r}: the prompt has {n_placeholders} video placeholder tokens but the video gives "
            f"{n_features} visual features (video_grid_thw={grid.tolist()}, merge {merge}); a question or option "
            f"containing placeholder text, or a truncated prompt, causes this")
    return PromptInputs.from_encoding(key, enc)


# --------------------------------------------------------------------------------------------------
# video embeddings (the MR-SP hook)
# --------------------------------------------------------------------------------------------------


@dataclass
class VideoEmbeds:
    """Vision-tower output for one prompt's video, ready to be fed to the language model.

    ``features``: ``[n_tokens, hidden]``, one row per video placeholder token (after the merger), in the
    order the placeholders appear. ``grid_thw``: ``[1, 3]``. ``extra``: other per-video encoder outputs a family
    needs (e.g. Qwen3-VL deepstack features, ``[n_tokens, hidden]`` each), repeated with ``features``.
    Produced by ``encode_video`` or by any other encoder (sharded across ranks, cached) with the same shapes.
    """

    features: Tensor
    grid_thw: Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    def as_mm_encoder_outputs(self, copies: int = 1) -> dict:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        out = BaseModelOutputWithPooling(pooler_output=tuple([self.features] * copies))
        for k, v in self.extra.items():
            out[k] = [v] * copies if not isinstance(v, (list, tuple)) else [x for _ in range(copies) for x in v]
        return {"video": out}


def encode_video(model, prompt: PromptInputs) -> VideoEmbeds:
    """Run the vision tower once on a prompt's video (grad follows the caller's grad mode)."""
    out = model.get_video_features(prompt.pixel_values_videos, prompt.video_grid_thw, return_dict=True)
    pooled = out.pooler_output
    feats = torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled
    check_video_features(prompt, feats, model, what="the vision tower gave")
    extra = {}
    for name in ("deepstack_features", "deepstack_feature_lists"):
        if getattr(out, name, None) is not None:
            extra[name] = getattr(out, name)
    return VideoEmbeds(features=feats, grid_thw=prompt.video_grid_thw, extra=extra)


def check_video_features(prompt: PromptInputs, features: Tensor, model, *,
                         what: str = "precomputed video features:") -> None:
    """Raise ``VideoTokenMismatch`` naming the sample unless ``features`` ``[n, H]`` has one row per video
    placeholder token of the prompt (never truncate or pad silently)."""
    n_placeholders = int((prompt.input_ids == video_token_id(model)).sum())
    if features.shape[0] != n_placeholders:
        raise VideoTokenMismatch(
            f"sample {prompt.key!r}: {what} {features.shape[0]} features for {n_placeholders} video placeholder "
            f"tokens (video_grid_thw={prompt.video_grid_thw.tolist()})")


def _repeat_extra(extra: Mapping[str, Tensor], n: int) -> dict[str, Tensor]:
    return {k: v.repeat_interleave(n, dim=0) if v.dim() >= 1 and v.shape[0] == 1 else v for k, v in extra.items()}


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` ``[N, T, V]`` gathered at ``labels`` ``[N, T]``; fp32. A block of
    positions at a time, keeping the logits as they came for the backward and no float32 copy of them
    (``trainer.chunked_logprobs``)."""
    return chunked_token_logprobs(logits, labels, temperature)


def first_and_rest_logprobs(first: Tensor, rest: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``token_logprobs(torch.cat([first, rest], dim=1), labels)`` without concatenating the logits: ``first``
    ``[N, 1, V]`` (the last prompt position's logits, often one row expanded), ``rest`` ``[N, T-1, V]``, ``labels``
    ``[N, T]``. The same numbers, since each position's log-prob depends on its own logits only, and no copy of
    ``[N, T, V]`` logits."""
    return torch.cat([token_logprobs(first, labels[:, :1], temperature),
                      token_logprobs(rest, labels[:, 1:], temperature)], dim=1)


def can_share_prompt(model) -> bool:
    """Whether a prompt's K/V cache survives the text decoder's forward. transformers' gradient-checkpointed
    layers drop ``past_key_values`` in training mode (a cache cannot be recomputed in the backward), so the
    shared-prefix path would silently lose the prompt there; callers then use the per-sequence path."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    inner = getattr(model, "model", model)
    text = getattr(inner, "language_model", inner)
    return not any(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and m.training
                   for m in text.modules())


def shared_prefix_logprobs(model, prefix_inputs: Mapping[str, Any], response_ids: Tensor, response_mask: Tensor,
                           response_position_ids: Tensor, *, temperature: float = 1.0,
                           pack_responses: bool = True) -> Tensor:
    """Per-token log-probs ``[N, T]`` of ``N`` right-padded responses that share one prompt, the prompt run once.

    The prompt (``prefix_inputs``: ``model(**prefix_inputs)`` keyword arguments for batch 1, length ``Lp``, no
    padding, with its own ``position_ids``) is prefilled once; its K/V cache (a transformers ``DynamicCache``)
    is repeated to ``N`` rows and only ``response_ids[:, :-1]`` run on top of it. The last prompt position's
    logits predict every row's first response token. Under grad the prompt's forward graph is built once and
    shared by the ``N`` rows, so the backward reaches the prompt's inputs (e.g. video features) exactly as in
    the per-sequence path; the repeat's backward sums the rows' K/V gradients. With ``pack_responses`` (eager /
    sdpa attention) the ``N`` responses instead run as one packed row on the prompt's single K/V copy
    (``longreel.trainer.packed_responses``: no ``N`` copies of the prompt's K/V per layer).

    Args:
        response_ids / response_mask: ``[N, T]`` (mask 1 on real tokens, right padding).
        response_position_ids: the responses' position ids, ``[3, N, T]`` (M-RoPE) or ``[N, T]``.
    Returns ``[N, T]`` float32 (entries at padding positions are meaningless).
    """
    n, t = response_ids.shape
    out = model(**prefix_inputs, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1:].expand(n, -1, -1)
    if t == 1:
        return token_logprobs(first, response_ids, temperature)
    cache = output_cache(out)
    if pack_responses and can_pack_responses(model):
        rest = packed_response_logits(model, cache, response_ids[:, :-1], response_mask[:, :-1],
                                      response_position_ids[..., :-1])
        return first_and_rest_logprobs(first, rest, response_ids, temperature)
    prefix_len = cache.get_seq_length()
    cache.batch_repeat_interleave(n)
    attn = torch.cat([response_mask.new_ones(n, prefix_len), response_mask[:, :-1]], dim=1)
    rest = model(input_ids=response_ids[:, :-1], attention_mask=attn, position_ids=response_position_ids[..., :-1],
                 use_cache=True, **cache_kwargs(cache)).logits
    return first_and_rest_logprobs(first, rest, response_ids, temperature)


def _packed_row_logprobs(model, prompt: PromptInputs, video_embeds: VideoEmbeds, prompt_positions: Tensor,
                         response_ids: Tensor, response_mask: Tensor, response_positions: Tensor,
                         temperature: float) -> Tensor:
    """:func:`sequence_logprobs` with the prompt run once under gradient checkpointing: the prompt and the ``N``
    responses as one packed row (``packed_responses.packed_row_logits``). ``prompt_positions`` ``[3, 1, Lp]``;
    ``response_positions`` ``[3, N, T]``. Returns ``[N, T]`` float32."""
    dev = prompt.input_ids.device
    rest = response_ids[:, :-1].to(dev).reshape(1, -1)
    row: dict[str, Any] = dict(input_ids=torch.cat([prompt.input_ids, rest], dim=1),
                               video_grid_thw=prompt.video_grid_thw,
                               mm_encoder_outputs=video_embeds.as_mm_encoder_outputs(1), **prompt.extra)
    if prompt.mm_token_type_ids is not None:
        row["mm_token_type_ids"] = torch.cat([prompt.mm_token_type_ids, torch.zeros_like(rest)], dim=1)
    logits = packed_row_logits(model, row, prompt.input_ids.shape[1], response_mask, prompt_positions.to(dev),
                               response_positions)
    return token_logprobs(logits, response_ids, temperature)


def _mrope_positions(model, prompt: PromptInputs):
    """The prompt's M-RoPE positions (``longreel.trainer.positions.PromptPositions``), or ``None`` for a model
    without ``get_rope_index``."""
    from longreel.trainer.positions import base_model, prompt_positions

    try:
        base_model(model)
    except TypeError:
        return None
    mmt = prompt.mm_token_type_ids
    return prompt_positions(model, prompt.input_ids, prompt.video_grid_thw, mmt, extra=prompt.extra)


def sequence_logprobs(model, prompt: PromptInputs, response_ids: Tensor, response_mask: Tensor, *,
                      temperature: float = 1.0, video_embeds: VideoEmbeds | None = None,
                      share_prompt: bool = True) -> Tensor:
    """Per-token log-probs ``[N, T]`` of ``N`` right-padded responses to one prompt (``logits / temperature``).

    Args:
        prompt: the tokenized prompt (batch 1).
        response_ids: ``LongTensor[N, T]``; response_mask: ``[N, T]`` (1 on real tokens).
        temperature: the sampling temperature, so ratios compare like with like.
        video_embeds: precomputed vision features for this prompt (see ``VideoEmbeds``); when ``None`` the
            video is encoded here, once for all ``N`` sequences.
        share_prompt: run the prompt once and only the responses ``N`` times (:func:`shared_prefix_logprobs`;
            equal to the per-sequence forward within fp32 rounding, tests/test_shared_prefix.py). Under
            gradient-checkpointed layers in training mode (:func:`can_share_prompt`: no K/V cache) the prompt and
            the responses run as one packed row instead (eager / sdpa attention). Ignored (the per-sequence
            forward runs) for a left-padded prompt or a model without M-RoPE ``get_rope_index``.
    Returns:
        ``[N, T]`` float32 log-probs; entries at padding positions are meaningless (mask them).
    """
    n, t = response_ids.shape
    if video_embeds is None:
        video_embeds = encode_video(model, prompt)
    else:
        check_video_features(prompt, video_embeds.features, model)
    positions = None
    cached = can_share_prompt(model)
    if share_prompt and bool(prompt.attention_mask.all()) and (cached or can_pack_responses(model)):
        positions = _mrope_positions(model, prompt)
    if positions is not None:
        resp_pos = positions.with_responses(n, t)[:, :, positions.length:].to(response_ids.device)
        if not cached:  # checkpointed layers keep no cache: the prompt and its responses as one packed row
            return _packed_row_logprobs(model, prompt, video_embeds, positions.prompt, response_ids, response_mask,
                                        resp_pos, temperature)
        prefix: dict[str, Any] = dict(input_ids=prompt.input_ids, video_grid_thw=prompt.video_grid_thw,
                                      mm_encoder_outputs=video_embeds.as_mm_encoder_outputs(1),
                                      position_ids=positions.prompt.to(prompt.input_ids.device), **prompt.extra)
        if prompt.mm_token_type_ids is not None:
            prefix["mm_token_type_ids"] = prompt.mm_token_type_ids
        return shared_prefix_logprobs(model, prefix, response_ids, response_mask, resp_pos, temperature=temperature)
    ids = torch.cat([prompt.input_ids.expand(n, -1), response_ids], dim=1)
    attn = torch.cat([prompt.attention_mask.expand(n, -1), response_mask.to(prompt.attention_mask.dtype)], dim=1)
    kwargs: dict[str, Any] = {}
    if prompt.mm_token_type_ids is not None:
        kwargs["mm_token_type_ids"] = torch.cat(
            [prompt.mm_token_type_ids.expand(n, -1), prompt.mm_token_type_ids.new_zeros(n, t)], dim=1)
    kwargs.update(_repeat_extra(prompt.extra, n))
    out = model(input_ids=ids, attention_mask=attn, video_grid_thw=prompt.video_grid_thw.repeat(n, 1),
                mm_encoder_outputs=video_embeds.as_mm_encoder_outputs(n), logits_to_keep=t + 1, use_cache=False,
                **kwargs)
    return token_logprobs(out.logits[:, :-1, :], response_ids, temperature)


def sft_inputs(processor, prompt: PromptInputs, target: str, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """Tokenize an SFT target as a response: ``(response_ids [1, T], mask [1, T])``, ending with ``eos``."""
    ids = processor.tokenizer(target, add_special_tokens=False)["input_ids"] + [int(eos_token_id)]
    resp = torch.tensor([ids], dtype=torch.long)
    return resp, torch.ones_like(resp)
