"""The QRA stage's view of an engine: text requests in (chat messages, a JSON schema, sampling), raw texts out.

:class:`TextBackend` wraps any engine of :mod:`longreel.engines` (transformers, vLLM, an OpenAI-compatible server;
:func:`longreel.pipelines.stages.qra.build_backend` picks it from the config). It is built once per worker
(``setup``) and asked for a batch of :class:`TextRequest`; it returns one :class:`TextResult` per request, in
order. A failed request is a result with ``error`` set (the stage turns it into rejects), never an exception that
takes the run down. ``schema`` (a JSON schema of the keyword subset of :mod:`longreel.pipelines.qra.json_schema`)
asks for constrained decoding where the engine does it; the stage validates every output anyway.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from longreel.engines.base import Engine, EngineRequest, Sampling


@dataclass
class TextRequest:
    messages: list[dict]                 # chat messages: {"role": ..., "content": ...}
    schema: dict | None = None           # JSON schema for guided decoding, or None
    max_new_tokens: int = 1024
    temperature: float = 0.0             # 0: greedy
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    max_string_chars: int = 360          # constrained decoding: longest JSON string

    def engine_request(self, key: str) -> EngineRequest:
        sampling = Sampling(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                            top_k=0, repetition_penalty=self.repetition_penalty, seed=self.seed)
        return EngineRequest(key=key, messages=self.messages, sampling=sampling, schema=self.schema,
                             max_string_chars=self.max_string_chars)


@dataclass
class TextResult:
    text: str
    finish: str = "stop"                 # stop | length | dead_end | error
    prompt_tokens: int = 0
    new_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None
    guided: bool = False                 # whether decoding was constrained to the schema
    extra: dict = field(default_factory=dict)


def sampling_json(req: TextRequest, **more) -> str:
    """The sampling parameters of a request as canonical JSON (recorded in provenance)."""
    d = {k: v for k, v in asdict(req).items() if k not in ("messages", "schema")}
    d.update(more)
    return json.dumps(d, sort_keys=True)


class TextBackend:
    """``backend``, ``model``, ``revision`` name what wrote a text (provenance); ``supports_pattern``: whether the
    engine's constrained decoding takes a JSON-schema ``pattern`` (``qra.reasoning_prefix``)."""

    def __init__(self, engine: Engine | None = None):
        self.engine = engine

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def revision(self) -> str:
        return self.engine.revision or ""

    @property
    def supports_pattern(self) -> bool:
        return self.engine.supports_pattern

    def setup(self) -> None:
        """Load the model or open the client (called once per worker)."""
        self.engine.setup()

    def generate(self, requests: list[TextRequest]) -> list[TextResult]:
        completions = self.engine.generate([r.engine_request(f"qra:{i}") for i, r in enumerate(requests)])
        return [self.result(c) for c in completions]

    @staticmethod
    def result(c) -> TextResult:
        if not c.ok:
            return TextResult(text="", finish="error", latency_s=c.latency_s,
                              error=f"{c.error_reason}: {c.error_message}")
        return TextResult(text=c.text, finish=c.finish[0] if c.finish else "stop", prompt_tokens=c.prompt_tokens,
                          new_tokens=c.new_tokens, latency_s=c.latency_s, guided=c.guided)

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt tokens of ``messages`` with the model's own tokenizer and chat template, if known."""
        return self.engine.count_tokens(messages)

    def close(self) -> None:
        self.engine.close()
