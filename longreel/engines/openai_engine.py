"""The engine for any OpenAI-compatible chat-completions endpoint (vLLM or SGLang servers, hosted APIs), on the
``openai`` package (its retries, timeouts and typed errors): one implementation for captions and QRA.

One ``chat.completions`` call per request; a request's video travels as ``image_url`` parts holding
``data:image/jpeg;base64,...`` URLs, in time order, where its ``{"type": "video"}`` part stands. A JSON schema goes
as ``response_format={"type": "json_schema", ...}`` (OpenAI's structured outputs; vLLM and SGLang servers accept it
too) with ``guided_mode="response_format"``, or as vLLM's ``guided_json``/``structured_outputs`` body fields with
``guided_mode="guided_json"`` (older vLLM servers); a server that ignores it still answers, and callers validate
every output anyway. Fields the API does not define (``guided_json``, ``structured_outputs``,
``repetition_penalty``, ``top_k``, a config's ``extra_body``) go in the SDK's ``extra_body``.

Failure policy, per request (the SDK's): timeouts, connection errors and HTTP 408/409/429/5xx are retried up to
``max_retries`` times with exponential backoff (0.5 s doubling to 8 s, up to 25% jitter; a ``Retry-After`` header
is honoured up to two minutes); other HTTP errors (400, 401, 404...) are not retried. When the last attempt fails
the request comes back as a failed :class:`Completion` (``request_timeout``, ``request_failed`` or
``request_rejected``, with the status and the start of the server's message) and the batch carries on.

Concurrency: a batch's requests run on a thread pool, and a semaphore shared by every thread of the process caps
the requests in flight at ``concurrency`` (Beam shares one client per worker process, so the limit holds per
process).
"""
from __future__ import annotations

import base64
import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from longreel.engines.base import Completion, Engine, EngineRequest
from longreel.engines.secrets import resolve_api_key

log = logging.getLogger("longreel")

#: statuses the SDK retries (408, 409, 429 and every 5xx): their last failure is ``request_failed``
RETRY_STATUS = frozenset({408, 409, 429, *range(500, 600)})
#: the chat-completions parameters the SDK takes by name; anything else in a body goes in ``extra_body``
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "temperature", "top_p", "n", "seed", "response_format",
                         "stop", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"})


def encode_jpeg(frame: np.ndarray, quality: int = 90) -> bytes:
    """``[H, W, 3] uint8 -> JPEG bytes``."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame), "RGB").save(buf, format="JPEG", quality=int(quality))
    return buf.getvalue()


def image_part(frame: np.ndarray, jpeg_quality: int = 90, image_detail: str | None = None) -> dict:
    url = "data:image/jpeg;base64," + base64.b64encode(encode_jpeg(frame, jpeg_quality)).decode("ascii")
    image = {"url": url}
    if image_detail:
        image["detail"] = image_detail
    return {"type": "image_url", "image_url": image}


def build_messages(req: EngineRequest, jpeg_quality: int = 90, image_detail: str | None = None) -> list[dict]:
    """The API's ``messages`` of one request: each ``{"type": "video"}`` part becomes the video's frames as JPEG
    image parts, in time order; plain-string contents are sent as they are."""
    out = []
    for m in req.messages:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") == "video":
                    if req.video is None or req.video.frames is None:
                        raise ValueError(f"{req.key}: a video part without frames")
                    parts.extend(image_part(f, jpeg_quality, image_detail) for f in req.video.frames)
                else:
                    parts.append(part)
            content = parts
        out.append({**m, "content": content})
    return out


class OpenAIEngine(Engine):
    backend = "openai"
    supports_schema = True
    supports_pattern = True  # structured outputs with patterns (OpenAI strict mode, vLLM/SGLang servers)

    def __init__(self, base_url: str, model: str, *, revision: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 timeout_s: float = 120.0, max_retries: int = 4, concurrency: int = 8, jpeg_quality: int = 90,
                 image_detail: str | None = None, extra_body: dict | None = None,
                 guided_mode: str = "response_format"):
        super().__init__(model, revision)
        if guided_mode not in ("response_format", "guided_json"):
            raise ValueError(f"guided_mode must be response_format or guided_json, got {guided_mode!r}")
        self.base_url, self.api_key_env = base_url, api_key_env
        self.timeout_s, self.max_retries, self.concurrency = timeout_s, max_retries, concurrency
        self.jpeg_quality, self.image_detail = jpeg_quality, image_detail
        self.extra_body = dict(extra_body or {})
        self.guided_mode = guided_mode
        self._client = None

    def setup(self) -> None:
        if self._client is not None:
            return
        import openai

        # Local servers take any key; the SDK refuses to start without one.
        key = resolve_api_key(self.api_key_env) or "none"  # an environment variable or a Secret Manager version
        self._client = openai.OpenAI(base_url=self.base_url.rstrip("/"), api_key=key, timeout=self.timeout_s,
                                     max_retries=self.max_retries)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="openai")

    def payload(self, req: EngineRequest) -> dict:
        s = req.sampling
        body = {"model": self.model, "messages": build_messages(req, self.jpeg_quality, self.image_detail),
                "max_tokens": s.max_new_tokens, "temperature": s.temperature, "n": s.n, "seed": int(s.seed)}
        if not s.greedy:
            body["top_p"] = s.top_p
        if s.top_k:
            body["top_k"] = s.top_k  # vLLM/SGLang extension
        if s.repetition_penalty and s.repetition_penalty != 1.0:
            body["repetition_penalty"] = s.repetition_penalty  # vLLM/SGLang extension
        body.update(self.extra_body)
        body.update(req.extra)
        if req.schema is not None:
            if self.guided_mode == "response_format":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": req.schema.get("title", "output"), "schema": req.schema, "strict": True}}
            else:
                body["guided_json"] = req.schema
                body["structured_outputs"] = {"json": req.schema}
        return body

    def _one(self, req: EngineRequest) -> Completion:
        import openai

        body = self.payload(req)
        known = {k: body.pop(k) for k in list(body) if k in CHAT_FIELDS}
        t0 = time.monotonic()
        attempts = self.max_retries + 1
        try:
            with self._slots:
                raw = self._client.chat.completions.with_raw_response.create(**known, extra_body=body or None)
        except openai.APITimeoutError:
            return Completion.failed("request_timeout", f"no answer within {self.timeout_s:g} s (after {attempts} "
                                     f"attempts)", time.monotonic() - t0, attempts)
        except openai.APIConnectionError as e:
            return Completion.failed("request_failed", f"connection error: {e} (after {attempts} attempts)",
                                     time.monotonic() - t0, attempts)
        except openai.APIStatusError as e:
            snippet = e.response.text[:300].replace("\n", " ")
            message = f"HTTP {e.status_code}: {snippet}"
            if e.status_code in RETRY_STATUS:
                return Completion.failed("request_failed", f"{message} (after {attempts} attempts)",
                                         time.monotonic() - t0, attempts)
            return Completion.failed("request_rejected", message, time.monotonic() - t0, 1)
        return self._parse(req, raw, t0, raw.retries_taken + 1)

    def _parse(self, req: EngineRequest, raw, t0: float, attempts: int) -> Completion:
        latency = time.monotonic() - t0
        try:
            doc = raw.http_response.json()
            choices = sorted(doc["choices"], key=lambda c: c.get("index", 0))
            contents = [c["message"].get("content") for c in choices]
            if not contents:
                raise IndexError("no choices")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return Completion.failed("bad_response", f"unreadable response ({type(e).__name__}: {e}): "
                                     f"{raw.http_response.text[:200]}", latency, attempts)
        texts = ["".join(p.get("text", "") for p in c if isinstance(p, dict)) if isinstance(c, list) else (c or "")
                 for c in contents]  # some servers answer with parts
        usage = doc.get("usage") or {}
        # the server counts image tokens inside prompt_tokens and does not say how many: vision_tokens unknown
        return Completion(texts=texts, finish=[c.get("finish_reason") or "stop" for c in choices],
                          prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          vision_tokens=None if req.video is not None else 0,
                          new_tokens=int(usage.get("completion_tokens") or 0), latency_s=latency, attempts=attempts,
                          guided=req.schema is not None)

    def generate(self, requests: list[EngineRequest]) -> list[Completion]:
        """All of ``requests`` in flight at once, up to ``concurrency`` (a semaphore shared by every thread of the
        process); each keeps its own seed and schema; results in input order."""
        self.setup()
        if len(requests) == 1:
            return [self._one(requests[0])]
        futures = [self._pool.submit(self._one, r) for r in requests]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._client is not None:
            self._pool.shutdown(wait=False)
            self._client.close()
            self._client = None
