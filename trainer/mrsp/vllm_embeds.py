"""GPU rollouts through vLLM from the step's cached video embeddings (vLLM does not re-encode the frames).

vLLM accepts precomputed multi-modal embeddings when the engine is built with ``enable_mm_embeds=True``; for
Qwen2-VL-family models a video item is ``{"video_embeds": [n_tokens, hidden], "video_grid_thw": [1, 3]}``
(Qwen2.5-VL also takes ``second_per_grid_ts``). The prompt keeps the single ``<|video_pad|>`` the chat template
renders; vLLM's processor expands it to ``n_tokens`` placeholders from the grid and computes the M-RoPE
positions from the same grid (``get_mrope_input_positions``), so positions match ``get_rope_index`` /
:mod:`longreel.trainer.positions` as long as the grid is the one the features were encoded with.

Nothing here imports vLLM at module import time (the shared engine imports it inside :func:`make_llm`); the request
builders only need torch. ``scripts/gpu_check_mrsp_vllm.py`` checks on a GPU that (a) the vLLM vision tower is
never called on the embeds path, (b) greedy outputs equal the frames path, and (c) vLLM's prompt log-probs
of a fixed response equal the trainer's (:func:`longreel.trainer.mrsp.reuse.response_logprobs`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["video_embeds_item", "embeds_request", "make_llm", "count_vllm_vision_calls"]


def video_embeds_item(features: Tensor, video_grid_thw: Tensor, *, second_per_grid_ts: Tensor | None = None,
                      dtype: torch.dtype | None = None) -> dict:
    """The ``multi_modal_data["video"]`` value for one video from cached features.

    ``features`` ``[n_tokens, hidden]`` (detached; moved to CPU: vLLM serialises request inputs),
    ``video_grid_thw`` ``[1, 3]``. Raises ``ValueError`` unless ``n_tokens == t*h*w / 4`` (merge 2x2).
    """
    grid = video_grid_thw.reshape(-1, 3).to("cpu", torch.long)
    if grid.shape[0] != 1:
        raise ValueError(f"one video per item, got grid {grid.tolist()}")
    expected = int(grid.prod()) // 4
    if features.dim() != 2 or features.shape[0] != expected:
        raise ValueError(f"video features {tuple(features.shape)} do not match grid {grid.tolist()[0]} "
                         f"({expected} merged tokens)")
    feats = features.detach().to("cpu")
    if dtype is not None:
        feats = feats.to(dtype)
    item: dict[str, Any] = {"video_embeds": feats, "video_grid_thw": grid}
    if second_per_grid_ts is not None:
        item["second_per_grid_ts"] = second_per_grid_ts.reshape(-1).to("cpu")
    return item


def embeds_request(prompt_text: str, features: Tensor, video_grid_thw: Tensor, **kwargs: Any) -> dict:
    """A vLLM prompt dict: the chat-templated text (one ``<|video_pad|>``) + the cached video embeddings."""
    if prompt_text.count("<|video_pad|>") != 1:
        raise ValueError("the prompt text must hold exactly one <|video_pad|> (vLLM expands it from the grid)")
    return {"prompt": prompt_text, "multi_modal_data": {"video": video_embeds_item(features, video_grid_thw,
                                                                                   **kwargs)}}


def make_llm(model_path: str, *, dtype: str = "bfloat16", gpu_memory_utilization: float = 0.3,
             max_model_len: int = 8192, seed: int = 0, **kwargs: Any):
    """``vllm.LLM`` in-process (so ``apply_model`` reaches the weights) with ``enable_mm_embeds=True``: the shared
    engine's (:class:`longreel.engines.vllm_engine.VLLMEngine`), built the way the rollout engine builds it."""
    from longreel.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                        max_model_len=max_model_len, seed=seed, enable_mm_embeds=True, in_process=True,
                        enable_prefix_caching=False, **kwargs)
    return engine.llm


def count_vllm_vision_calls(llm) -> list[int]:
    """Register a forward hook on the vLLM model's vision tower; returns a one-element list counting calls.

    Works with the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where ``apply_model`` runs here.
    """
    counter = [0]

    def _install(model) -> int:
        tower = getattr(model, "visual", None) or getattr(getattr(model, "model", None), "visual", None)
        if tower is None:
            raise RuntimeError(f"{type(model).__name__} has no .visual")
        tower.register_forward_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
        return 1

    installed: Sequence[int] = llm.apply_model(_install)
    if not installed:
        raise RuntimeError("could not reach the vLLM model")
    return counter
