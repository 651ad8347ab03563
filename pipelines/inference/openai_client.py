"""A client for any OpenAI-compatible chat-completions endpoint (vLLM or SGLang servers, hosted APIs).

Plain ``requests`` (no ``openai`` package). One POST per request to ``{base_url}/chat/completions``;
video frames travel as ``image_url`` parts holding ``data:image/jpeg;base64,...`` URLs, in time
order, followed by the text part. Text-only requests (``frames=None``) send a plain string.

Failure policy, per request:

* timeouts, connection errors and HTTP 408/409/429/5xx are retried up to ``max_retries`` times
  with exponential backoff (``backoff_s * 2**k``, full jitter, capped at 60 s; a ``Retry-After``
  header is honoured within the cap);
* other HTTP errors (400, 401, 404...) are not retried;
* when the last attempt fails the request comes back as a failed :class:`Generation`
  (``request_timeout``, ``request_failed`` or ``request_rejected``, with the status and the start of
  the server's message) and the batch carries on.

Concurrency: a batch's requests run on a thread pool, and a semaphore shared by every thread
of the process caps the requests in flight at ``concurrency`` (Beam shares one client per
worker process, so the limit holds per process).
"""
from __future__ import annotations

import base64
import io
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from longreel.pipelines.inference.base import Generation, GenerationParams, ModelInfo, Request, item_seed

log = logging.getLogger("longreel")

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
MAX_BACKOFF_S = 60.0


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
                 max_retries: int = 4, backoff_s: float = 1.0, concurrency: int = 8, jpeg_quality: int = 90,
                 image_detail: str | None = None, revision: str | None = None, extra_body: dict | None = None):
        import requests

        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.jpeg_quality, self.image_detail = jpeg_quality, image_detail
        self.extra_body = dict(extra_body or {})
        self.info = ModelInfo("openai", model, revision)
        self._session = requests.Session()
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Content-Type": "application/json"}
        if key:
            self._headers["Authorization"] = f"Bearer {key}"
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="openai")
        self._rng = random.Random(0)

    def payload(self, req: Request, params: GenerationParams) -> dict:
        body = {"model": self.model, "messages": build_messages(req, self.jpeg_quality, self.image_detail),
                "max_tokens": params.max_new_tokens, "temperature": params.temperature, "n": 1,
                "seed": item_seed(params.seed, req.key)}
        if not params.greedy:
            body["top_p"] = params.top_p
        body.update(self.extra_body)
        return body

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        cap = min(MAX_BACKOFF_S, self.backoff_s * (2 ** attempt))
        delay = self._rng.uniform(0, cap) if cap > 0 else 0.0
        if retry_after:
            try:
                delay = max(delay, min(float(retry_after), MAX_BACKOFF_S))
            except ValueError:
                pass
        return delay

    def _one(self, req: Request, params: GenerationParams) -> Generation:
        import requests

        body = self.payload(req, params)
        t0 = time.monotonic()
        last_reason, last_msg = "request_failed", "no attempt made"
        for attempt in range(self.max_retries + 1):
            retry_after = None
            with self._slots:
                try:
                    resp = self._session.post(self.url, json=body, headers=self._headers, timeout=self.timeout_s)
                except requests.Timeout:
                    last_reason, last_msg = "request_timeout", f"no answer within {self.timeout_s:g} s"
                    resp = None
                except requests.ConnectionError as e:
                    last_reason, last_msg = "request_failed", f"connection error: {e}"
                    resp = None
            if resp is not None:
                if resp.status_code == 200:
                    return self._parse(resp, t0, attempt + 1)
                snippet = resp.text[:300].replace("\n", " ")
                last_msg = f"HTTP {resp.status_code}: {snippet}"
                if resp.status_code not in RETRY_STATUS:
                    return Generation.failed("request_rejected", last_msg, time.monotonic() - t0, attempt + 1)
                last_reason = "request_failed"
                retry_after = resp.headers.get("Retry-After")
            if attempt < self.max_retries:
                d = self._delay(attempt, retry_after)
                log.warning("openai: %s attempt %d failed (%s); retrying in %.2f s", req.key, attempt + 1,
                            last_msg[:120], d)
                time.sleep(d)
        return Generation.failed(last_reason, f"{last_msg} (after {self.max_retries + 1} attempts)",
                                 time.monotonic() - t0, self.max_retries + 1)

    def _parse(self, resp, t0: float, attempts: int) -> Generation:
        latency = time.monotonic() - t0
        try:
            doc = resp.json()
            choice = doc["choices"][0]
            content = choice["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            return Generation.failed("bad_response", f"unreadable response ({type(e).__name__}: {e}): "
                                     f"{resp.text[:200]}", latency, attempts)
        if isinstance(content, list):  # some servers answer with parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return Generation(text=content or "", latency_s=latency, finish_reason=choice.get("finish_reason"),
                          attempts=attempts)

    def generate(self, requests: list[Request], params: GenerationParams) -> list[Generation]:
        if len(requests) == 1:
            return [self._one(requests[0], params)]
        futures = [self._pool.submit(self._one, r, params) for r in requests]
        return [f.result() for f in futures]

    def generate_each(self, items: list[tuple[Request, GenerationParams]]) -> list[Generation]:
        """Each request with its own parameters (seeds, schemas), all in flight at once up to ``concurrency``;
        results in input order."""
        if len(items) == 1:
            return [self._one(*items[0])]
        futures = [self._pool.submit(self._one, r, p) for r, p in items]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._session.close()
