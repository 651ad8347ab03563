"""Beam ``ModelHandler`` over the inference clients, for ``RunInference``.

``GenerationModelHandler`` takes a picklable :class:`ClientSpec` (backend name + constructor
arguments); ``load_model`` builds the client in the worker. RunInference loads it once per
worker process and shares it across the process's threads (Beam's ``shared.Shared``), or once
per machine across processes when ``share_across_processes`` is set (Beam's
``multi_process_shared``; the client then lives in its own process and batches are sent to it).

``run_inference`` maps a batch of :class:`Request` to ``PredictionResult(request, Generation)``.
Expected failures come back as failed Generations. An exception from a batch of several
requests is retried request by request, so that one poisonous request does not sink its
neighbours; an exception from a single request propagates, and
``RunInference(...).with_exception_handling()`` routes it to the dead-letter output, which the
stage turns into ``model_error`` rejects carrying the exception message.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from longreel.pipelines.inference.base import Generation, GenerationParams, Request
from longreel.pipelines.inference.beam_ml import ModelHandler, PredictionResult

log = logging.getLogger("longreel")


@dataclass(frozen=True)
class ClientSpec:
    """A picklable recipe for a caption client: ``facts`` (weight-free), or an engine of :mod:`longreel.engines`
    (``transformers``, ``openai``, ``vllm``) built from ``kwargs`` (its constructor's keywords; ``path`` names the
    model of the in-process engines)."""

    backend: str                  # facts | transformers | openai | vllm
    kwargs: dict = field(default_factory=dict)

    def build(self):
        if self.backend == "facts":
            from longreel.pipelines.inference.facts_captioner import FactsCaptioner
            return FactsCaptioner(**self.kwargs)
        from longreel.pipelines.inference.captioner import EngineCaptioner

        kw = dict(self.kwargs)
        if self.backend == "transformers":
            from longreel.engines.transformers_engine import TransformersEngine
            engine = TransformersEngine(kw.pop("path"), kw.pop("revision", None), **kw)
        elif self.backend == "openai":
            from longreel.engines.openai_engine import OpenAIEngine
            engine = OpenAIEngine(**kw)
        elif self.backend == "vllm":
            from longreel.engines.vllm_engine import VLLMEngine
            engine = VLLMEngine(kw.pop("path"), kw.pop("revision", None), **kw)
        else:
            raise ValueError(f"unknown inference backend {self.backend!r}")
        engine.setup()  # load_model's job: a model that cannot load fails here, once per worker
        return EngineCaptioner(engine)


class GenerationModelHandler(ModelHandler[Request, PredictionResult, Any]):
    def __init__(self, spec: ClientSpec, params: GenerationParams, *, batch_size: int = 4,
                 share_across_processes: bool = False, namespace: str = "longreel_inference"):
        super().__init__(min_batch_size=1, max_batch_size=batch_size, large_model=share_across_processes)
        self.spec, self.params, self.namespace = spec, params, namespace

    def load_model(self):
        return self.spec.build()

    def run_inference(self, batch: Sequence[Request], model, inference_args: dict | None = None
                      ) -> Iterable[PredictionResult]:
        batch = list(batch)
        try:
            gens = model.generate(batch, self.params)
        except Exception as e:
            if len(batch) == 1:
                raise
            log.warning("%s: a batch of %d failed (%s: %s); retrying one by one", self.spec.backend, len(batch),
                        type(e).__name__, e)
            gens = []
            for r in batch:
                try:
                    gens.extend(model.generate([r], self.params))
                except Exception as e1:  # noqa: BLE001 - becomes this request's reject
                    gens.append(Generation.failed("model_error", f"{type(e1).__name__}: {e1}"))
        if len(gens) != len(batch):
            raise RuntimeError(f"{self.spec.backend} returned {len(gens)} generations for {len(batch)} requests")
        return [PredictionResult(r, g, self.spec.backend) for r, g in zip(batch, gens)]

    def get_num_bytes(self, batch: Sequence[Request]) -> int:
        return sum(r.nbytes() for r in batch)  # the default pickles the batch (frames) only to measure it

    def get_metrics_namespace(self) -> str:
        return self.namespace
