"""``openai`` text backend: any OpenAI-compatible chat server, with the output JSON schema sent along.

Reuses the captioning stage's :class:`pipelines.inference.openai_client.OpenAIChatClient` (retries,
backoff, concurrency cap, failures as results) and adds the request's schema to the payload:

* ``guided_mode="response_format"``: ``response_format={"type": "json_schema", "json_schema": {"name",
  "schema", "strict": true}}`` (OpenAI's structured outputs; vLLM and SGLang servers accept it too);
* ``guided_mode="guided_json"``: vLLM's extra body field ``guided_json`` (older vLLM servers;
  newer ones read ``structured_outputs={"json": ...}``, sent alongside).

A server that ignores the schema still answers; the stage validates every output anyway.
"""
from __future__ import annotations

from pipelines.inference.base import GenerationParams, Request
from pipelines.inference.openai_client import OpenAIChatClient
from pipelines.inference.text_base import TextBackend, TextRequest, TextResult


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
        self.setup()
        out: list[TextResult] = []
        # one call per distinct sampling setting (the client takes one GenerationParams per batch)
        for req in requests:
            system = next((m["content"] for m in req.messages if m["role"] == "system"), None)
            user = "\n\n".join(m["content"] for m in req.messages if m["role"] == "user")
            extra = {}
            if req.repetition_penalty and req.repetition_penalty != 1.0:
                extra["repetition_penalty"] = req.repetition_penalty  # vLLM/SGLang extension
            r = Request(key=str(req.seed), text=user, system=system,
                        meta={"schema": req.schema, "seed": req.seed, "extra": extra})
            params = GenerationParams(max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                      top_p=req.top_p, seed=req.seed)
            g = self._client.generate([r], params)[0]
            if g.ok:
                out.append(TextResult(text=g.text or "", finish=g.finish_reason or "stop", latency_s=g.latency_s,
                                      guided=req.schema is not None))
            else:
                out.append(TextResult(text="", finish="error", latency_s=g.latency_s,
                                      error=f"{g.error_reason}: {g.error_message}"))
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
