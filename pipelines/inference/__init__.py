"""Inference backends shared by the model stages (captioning now, QRA generation next).

* :mod:`.base` - ``Request`` (text, optional video frames), ``Generation``, ``GenerationParams``,
  ``ModelInfo``, per-item seeds, weight revisions, the pixel-budget rounding.
* clients, one per backend, all with ``generate(requests, params) -> [Generation]``:
  :mod:`.hf_client` (transformers, vision or text-only), :mod:`.openai_client` (any
  OpenAI-compatible server), :mod:`.vllm_client` (in-process vLLM, GPU), :mod:`.facts_captioner`
  (weight-free).
* :mod:`.handler` - ``ClientSpec`` + ``GenerationModelHandler``: a Beam ``ModelHandler`` for
  ``RunInference`` over any client.
* :mod:`.degenerate` - empty / looping / prompt-echo detection.

A text-only stage builds ``Request(key, text)`` (no frames) and a ``ClientSpec("openai" |
"transformers" | "vllm", {...})`` with ``kind="text"`` for transformers; everything else is shared.
"""
from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, fit_pixels, item_seed
from longreel.pipelines.inference.handler import ClientSpec, GenerationModelHandler

__all__ = ["ClientSpec", "Generation", "GenerationModelHandler", "GenerationParams", "ModelInfo", "Request",
           "fit_pixels", "item_seed"]
