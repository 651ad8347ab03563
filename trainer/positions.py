"""M-RoPE position ids for a prompt, computed once from ``video_grid_thw`` and reused.

Qwen2-VL-family models give video tokens 3-axis (temporal, height, width) rotary positions; the text after
the video continues from ``max(position) + 1``. The positions depend only on the prompt's token ids and the
video grid, never on pixels, so they are computed once per prompt with the model's own ``get_rope_index``
and extended for any number of responses of any length:

    pos = prompt_positions(model, input_ids, video_grid_thw, mm_token_type_ids)   # once per prompt
    position_ids = pos.with_responses(n=G, t=T)                                    # [3, G, Lp + T]

A right-padded response's padding gets positions too; they only touch padding rows (masked keys come after
every real query under the causal mask) so they never change a real token's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

__all__ = ["PromptPositions", "prompt_positions", "base_model", "mm_token_types"]


def base_model(model):
    """The ``Qwen2VLModel``-like module that owns ``get_rope_index`` / ``visual`` / ``language_model``."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "get_rope_index"):
        return inner
    if hasattr(model, "get_rope_index"):
        return model
    raise TypeError(f"{type(model).__name__} has no get_rope_index: not a Qwen2-VL-family model")


def mm_token_types(model, input_ids: Tensor) -> Tensor:
    """``mm_token_type_ids`` as the processor builds them: 0 text, 1 image placeholder, 2 video placeholder."""
    cfg = model.config
    types = torch.zeros_like(input_ids)
    types[input_ids == int(cfg.image_token_id)] = 1
    types[input_ids == int(cfg.video_token_id)] = 2
    return types


@dataclass
class PromptPositions:
    """Positions of one prompt: ``prompt`` ``[3, 1, Lp]`` (long); ``next_position``: first text position after it."""

    prompt: Tensor
    next_position: int

    @property
    def length(self) -> int:
        return int(self.prompt.shape[-1])

    def with_responses(self, n: int, t: int) -> Tensor:
        """``[3, n, Lp + t]``: the prompt positions followed by ``t`` text positions, for ``n`` sequences."""
        dev = self.prompt.device
        resp = torch.arange(self.next_position, self.next_position + t, device=dev, dtype=self.prompt.dtype)
        full = torch.cat([self.prompt[:, 0], resp.view(1, -1).expand(3, -1)], dim=1)  # [3, Lp + t]
        return full.unsqueeze(1).expand(3, n, -1)

    def to(self, device) -> "PromptPositions":
        return PromptPositions(self.prompt.to(device), self.next_position)


def prompt_positions(model, input_ids: Tensor, video_grid_thw: Tensor | None, mm_token_type_ids: Tensor | None = None,
                     *, extra: Mapping[str, Any] | None = None) -> PromptPositions:
    """M-RoPE positions of one prompt (batch 1, no padding) from the model's own ``get_rope_index``.

    ``extra``: other processor outputs the family's ``get_rope_index`` takes (Qwen2.5-VL:
    ``second_per_grid_ts``); unknown keys are ignored by the model.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"prompt_positions takes one prompt [1, L], got {tuple(input_ids.shape)}")
    base = base_model(model)
    if mm_token_type_ids is None:
        mm_token_type_ids = mm_token_types(model, input_ids)
    kwargs = dict(extra or {})
    with torch.no_grad():
        pos, _ = base.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=None,
                                     video_grid_thw=video_grid_thw, attention_mask=None, **kwargs)
    return PromptPositions(prompt=pos.long(), next_position=int(pos.max()) + 1)
