"""One rule for a remote shard transfer that failed, shared by the cache's downloads (``shard_cache``) and the reads
without the cache (``remote_read``): which failures another try cannot change, and how long to wait before the next.
"""
from __future__ import annotations

import threading
import time
import urllib.error

__all__ = ["RETRY_BASE_S", "refused", "backoff_s", "pause"]

#: seconds before the first retry; doubled for each next one (1, 2, 4, ... as object stores ask of their clients)
RETRY_BASE_S = 1.0


def refused(exc: BaseException | None) -> bool:
    """An HTTP 4xx other than 408/429 (missing, forbidden): another try would meet it again."""
    return isinstance(exc, urllib.error.HTTPError) and 400 <= exc.code < 500 and exc.code not in (408, 429)


def backoff_s(attempt: int) -> float:
    """Seconds to wait after failed try ``attempt`` (0-based)."""
    return RETRY_BASE_S * 2 ** attempt


def pause(seconds: float, stop: threading.Event | None = None) -> None:
    """Sleep ``seconds``; with ``stop``, end early with ``InterruptedError`` once it is set."""
    if stop is None:
        time.sleep(seconds)
    elif stop.wait(seconds):
        raise InterruptedError("stopped while waiting to try again")
