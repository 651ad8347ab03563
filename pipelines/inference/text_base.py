"""The shape every text-LLM backend of the QRA stage shares: requests in, raw texts out.

A backend is built once per worker (``setup``) and asked for a batch of :class:`TextRequest`; it returns
one :class:`TextResult` per request, in order. A failed request is a result with ``error`` set (the
stage turns it into rejects), never an exception that takes the run down. ``schema`` (a JSON schema of
the keyword subset of :mod:`longreel.pipelines.qra.json_schema`) asks for guided decoding where the backend can
do it; the stage validates every output anyway.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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


@dataclass
class TextResult:
    text: str
    finish: str = "stop"                 # stop | length | error
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
    """Base class: ``backend``, ``model``, ``revision`` name what wrote a text (provenance)."""

    backend = "none"
    supports_guided = False
    supports_pattern = False  # whether guided decoding takes a JSON-schema ``pattern`` (qra.reasoning_prefix)

    def __init__(self, model: str, revision: str = ""):
        self.model = model
        self.revision = revision

    def setup(self) -> None:
        """Load the model or open the client (called once per worker)."""

    def generate(self, requests: list[TextRequest]) -> list[TextResult]:
        raise NotImplementedError

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt tokens of ``messages`` with the model's own tokenizer and chat template, if known."""
        return None

    def close(self) -> None:
        pass
