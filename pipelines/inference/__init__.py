"""The caption stage's inference clients, over the engines of :mod:`longreel.engines`.

* :mod:`.base` - ``Request`` (text and a clip's frames), ``Generation``, ``GenerationParams``, ``ModelInfo``,
  per-item seeds, the processor's pixel budget and resize rule.
* :mod:`.captioner` - ``EngineCaptioner``: a caption client over any engine (transformers, openai, vllm);
  :mod:`.facts_captioner` - the weight-free captioner.
* :mod:`.handler` - ``ClientSpec`` + ``GenerationModelHandler``: a Beam ``ModelHandler`` for ``RunInference``.
* :mod:`.degenerate` - empty / looping / prompt-echo detection.

The QRA stage's text adapter is :mod:`longreel.pipelines.qra.text_backend`; the pass-rate filter's is
:mod:`longreel.pipelines.passrate.answerers`.
"""
from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, fit_pixels, item_seed
from longreel.pipelines.inference.handler import ClientSpec, GenerationModelHandler

__all__ = ["ClientSpec", "Generation", "GenerationModelHandler", "GenerationParams", "ModelInfo", "Request",
           "fit_pixels", "item_seed"]
