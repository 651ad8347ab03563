"""``openai`` text backend: any OpenAI-compatible chat server, with the output JSON schema sent along.

Reuses the captioning stage's :class:`longreel.pipelines.inference.openai_client.OpenAIChatClient` (retries,
backoff, concurrency cap, failures as results) and adds the request's schema to the payload:

* ``guided_mode="response_format"``: ``response_format={"type": "json_schema", "json_schema": {"name",
  "schema", "strict": true}}`` (OpenAI's structured outputs; vLLM and SGLang servers accept it too);
* ``guided_mode="guided_json"``: vLLM's extra body field ``guided_json`` (older vLLM servers;
  newer ones read ``structured_outputs={"json": ...}``, sent alongside).

A server that ignores the schema still answers; the stage validates every output anyway.
"""
from __future__ import annotations

from longreel.pipelines.inference.base import GenerationParams, Request
from longreel.pipelines.inference.openai_client import OpenAIChatClient
from longreel.pipelines.inference.text_base import TextBackend, TextRequest, TextResult


class _SchemaClient(OpenAIChatClient):
    def __init__(self, *args, guided_mode: str = "response_format", **kw):
        super().__init__(*args, **kw)
        self.guided_mode = guided_mode

    def payload(self, req: Request, params: GenerationParams) -> dict:
        body = super().payload(req, params)
        body["seed"] = int(req.meta.get("seed", body.get("seed", 0)))
        extra = req.meta.get("extra") or {}
        body.update(extra)
        schema = req.meta.get("schema")
        if schema is not None:
            if self.guided_mode == "response_format":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": schema.get("title", "output"), "schema": schema, "strict": True}}
            else:
                body["guided_json"] = schema
                body["structured_outputs"] = {"json": schema}
        return body


class OpenAITextBackend(TextBackend):
    backend = "openai"
    supports_guided = True
    supports_pattern = True  # structured outputs with patterns (OpenAI strict mode, vLLM/SGLang servers)

    def __init__(self, base_url: str, model: str, *, revision: str = "", api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 600.0, guided_mode: str = "response_format", concurrency: int = 4,
                 max_retries: int = 4):
        super().__init__(model, revision)
        self.base_url, self.api_key_env, self.timeout_s = base_url, api_key_env, timeout_s
        self.guided_mode, self.concurrency, self.max_retries = guided_mode, concurrency, max_retries
        self._client = None

    def setup(self) -> None:
        if self._client is None:
            self._client = _SchemaClient(self.base_url, self.model, api_key_env=self.api_key_env,
                                         timeout_s=self.timeout_s, concurrency=self.concurrency,
                                         max_retries=self.max_retries, revision=self.revision or None,
                                         guided_mode=self.guided_mode)

    def generate(self, requests: list[TextRequest]) -> list[TextResult]:
        """All of ``requests`` (a video's generation calls, or its refinements) in flight at once, up to
        ``concurrency``; each keeps its own seed and schema."""
        self.setup()
        items = [self._as_request(req) for req in requests]
        out: list[TextResult] = []
        for req, g in zip(requests, self._client.generate_each(items)):
            if g.ok:
                out.append(TextResult(text=g.text or "", finish=g.finish_reason or "stop", latency_s=g.latency_s,
                                      guided=req.schema is not None))
            else:
                out.append(TextResult(text="", finish="error", latency_s=g.latency_s,
                                      error=f"{g.error_reason}: {g.error_message}"))
        return out

    @staticmethod
    def _as_request(req: TextRequest) -> tuple[Request, GenerationParams]:
        system = next((m["content"] for m in req.messages if m["role"] == "system"), None)
        user = "\n\n".join(m["content"] for m in req.messages if m["role"] == "user")
        extra = {}
        if req.repetition_penalty and req.repetition_penalty != 1.0:
            extra["repetition_penalty"] = req.repetition_penalty  # vLLM/SGLang extension
        r = Request(key=str(req.seed), text=user, system=system,
                    meta={"schema": req.schema, "seed": req.seed, "extra": extra})
        params = GenerationParams(max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                  top_p=req.top_p, seed=req.seed)
        return r, params

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
