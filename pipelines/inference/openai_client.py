"""A client for any OpenAI-compatible chat-completions endpoint (vLLM or SGLang servers, hosted APIs), on the
``openai`` package (its retries, timeouts and typed errors).

One ``chat.completions`` call per request; video frames travel as ``image_url`` parts holding
``data:image/jpeg;base64,...`` URLs, in time order, followed by the text part. Text-only requests
(``frames=None``) send a plain string. Fields the API does not define (``guided_json``, ``structured_outputs``,
``repetition_penalty``, a config's ``extra_body``) go in the SDK's ``extra_body``.

Failure policy, per request (the SDK's): timeouts, connection errors and HTTP 408/409/429/5xx are retried up to
``max_retries`` times with exponential backoff (0.5 s doubling to 8 s, up to 25% jitter; a ``Retry-After`` header
is honoured up to two minutes); other HTTP errors (400, 401, 404...) are not retried. When the last attempt fails
the request comes back as a failed :class:`Generation` (``request_timeout``, ``request_failed`` or
``request_rejected``, with the status and the start of the server's message) and the batch carries on.

Concurrency: a batch's requests run on a thread pool, and a semaphore shared by every thread of the process caps
the requests in flight at ``concurrency`` (Beam shares one client per worker process, so the limit holds per
process).
"""
from __future__ import annotations

import base64
import io
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, item_seed

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


def build_messages(req: Request, jpeg_quality: int = 90, image_detail: str | None = None) -> list[dict]:
    """The ``messages`` of one request: optional system message, then the user turn (images first)."""
    messages = []
    if req.system:
        messages.append({"role": "system", "content": req.system})
    if req.frames is None:
        messages.append({"role": "user", "content": req.text})
        return messages
    parts = []
    for frame in req.frames:
        url = "data:image/jpeg;base64," + base64.b64encode(encode_jpeg(frame, jpeg_quality)).decode("ascii")
        image = {"url": url}
        if image_detail:
            image["detail"] = image_detail
        parts.append({"type": "image_url", "image_url": image})
    parts.append({"type": "text", "text": req.text})
    messages.append({"role": "user", "content": parts})
    return messages


class OpenAIChatClient:
    def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 max_retries: int = 4, concurrency: int = 8, jpeg_quality: int = 90,
                 image_detail: str | None = None, revision: str | None = None, extra_body: dict | None = None):
        import openai

        self.model = model
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.jpeg_quality, self.image_detail = jpeg_quality, image_detail
        self.extra_body = dict(extra_body or {})
        self.info = ModelInfo("openai", model, revision)
        # Local servers take any key; the SDK refuses to start without one.
        key = (os.environ.get(api_key_env) if api_key_env else None) or "none"
        self._client = openai.OpenAI(base_url=base_url.rstrip("/"), api_key=key, timeout=timeout_s,
                                     max_retries=max_retries)
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="openai")

    def payload(self, req: Request, params: GenerationParams) -> dict:
        body = {"model": self.model, "messages": build_messages(req, self.jpeg_quality, self.image_detail),
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "n": 1,
                "seed": item_seed(params.seed, req.key)}
        if not params.greedy:
            body["top_p"] = params.top_p
        body.update(self.extra_body)
        return body

    def _one(self, req: Request, params: GenerationParams) -> Generation:
        import openai

        body = self.payload(req, params)
        known = {k: body.pop(k) for k in list(body) if k in CHAT_FIELDS}
        t0 = time.monotonic()
        attempts = self.max_retries + 1
        try:
            with self._slots:
                raw = self._client.chat.completions.with_raw_response.create(**known, extra_body=body or None)
        except openai.APITimeoutError:
            return Generation.failed("request_timeout", f"no answer within {self.timeout_s:g} s (after {attempts} "
                                     f"attempts)", time.monotonic() - t0, attempts)
        except openai.APIConnectionError as e:
            return Generation.failed("request_failed", f"connection error: {e} (after {attempts} attempts)",
                                     time.monotonic() - t0, attempts)
        except openai.APIStatusError as e:
            snippet = e.response.text[:300].replace("\n", " ")
            message = f"HTTP {e.status_code}: {snippet}"
            if e.status_code in RETRY_STATUS:
                return Generation.failed("request_failed", f"{message} (after {attempts} attempts)",
                                         time.monotonic() - t0, attempts)
            return Generation.failed("request_rejected", message, time.monotonic() - t0, 1)
        return self._parse(raw, t0, raw.retries_taken + 1)

    def _parse(self, raw, t0: float, attempts: int) -> Generation:
        latency = time.monotonic() - t0
        try:
            doc = raw.http_response.json()
            choice = doc["choices"][0]
            content = choice["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return Generation.failed("bad_response", f"unreadable response ({type(e).__name__}: {e}): "
                                     f"{raw.http_response.text[:200]}", latency, attempts)
        if isinstance(content, list):  # some servers answer with parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return Generation(text=content or "", latency_s=latency, finish_reason=choice.get("finish_reason"),
                          attempts=attempts)

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        return self.generate_each([(r, params) for r in requests])

    def generate_each(self, items: list[tuple[Request, GenerationParams]]) -> list[Generation]:
        """Each request with its own parameters (seeds, schemas), all in flight at once up to ``concurrency``;
        results in input order."""
        if len(items) == 1:
            return [self._one(*items[0])]
        futures = [self._pool.submit(self._one, r, p) for r, p in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()
