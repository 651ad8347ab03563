"""Reading a remote shard straight from the network (``data.cache_remote=false``), again when the transfer breaks.

The disk cache retries its downloads (``shard_cache._download``); a shard read without it had one try, so one
dropped connection hours into a run stopped it. Here a read whose stream breaks (a reset, a timeout, a transfer cut
short, a 5xx when opening) starts the shard again from its first byte, up to ``retries`` times after 1, 2, 4, ...
seconds, and skips the samples already handled by their place in the tar: the samples and their order are those of
an unbroken read, and a bad sample met before the break is not reported twice. An HTTP 4xx when opening (missing,
forbidden) is not tried again.

A shard that is itself broken (a file shorter than its index says, a corrupt tar header in the served bytes) looks
like a cut transfer from the tar parser: urllib ends a body that the server closes early without an error. So when
an ``http(s)`` read breaks, the server is asked for the file's size (a ``HEAD``): when this read got all of it, the
break is in the bytes themselves and another read would meet it again, so it is reported at once (with the index's
size when that differs: the shard or its index is out of date). Only a read that got less than the whole file, or
whose size the server does not tell, is read again. With ``verify="shard"`` the shard is staged whole before it is
read, and a staged copy that does not match the index (the stage checked the Content-Length) is not read again.

Why by hand: webdataset's tar readers hand a broken stream to their error handler (``reraise_exception`` stops,
``warn_and_continue`` drops the rest of the shard) and do not read it again, and a byte-range resume would need every
store's range requests (http, ``gsutil``, ``aws``); a re-read from the start needs none and costs at most one
shard's bytes per retry.

URLs with credentials (``http://user:pass@host/...``) are refused before anything is read (:func:`refuse_credentials`):
urllib takes ``user:pass@host`` for a host name, fails with "Name or service not known", and every retry's message
echoed the password. Whatever these modules print passes through :func:`redact`.
"""
from __future__ import annotations

import http.client
import logging
import re
import urllib.parse
import urllib.request
from typing import Callable, Iterator

from longreel.schemas.config import ConfigError
from longreel.task.shard_reader import LoaderStats, ShardError, ShardSpec, is_url, read_shard
from longreel.trainer.transfer_retry import backoff_s, pause, refused

log = logging.getLogger("longreel")

__all__ = ["read_remote_shard", "redact", "refuse_credentials", "server_headers"]

#: seconds a HEAD waits for the server: it only decides whether to read again or reuse a copy, so it gives up sooner
#: than a transfer (urllib's 120 s in ``open_url``)
HEAD_TIMEOUT_S = 10.0

# scheme://userinfo@ (anywhere in a text: a URL inside an error's message too)
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)([^/?#@\s]+)@")


def redact(text: str) -> str:
    """``text`` with the userinfo of every URL in it masked: ``http://user:pass@host`` -> ``http://user:***@host``; a
    lone name (often a token itself) -> ``***``."""
    def mask(m: re.Match) -> str:
        user, sep, _ = m.group(2).partition(":")
        return f"{m.group(1)}{user + ':***' if sep else '***'}@"

    return _USERINFO.sub(mask, str(text))


def refuse_credentials(url: str) -> None:
    """Raise :class:`ConfigError` (one line, the credentials masked) when the URL ``url`` carries a user or a
    password: neither urllib nor ``gsutil``/``aws`` takes them from there, and they would end up in logs. A
    ConfigError, not a :class:`ShardError`: ``data.on_error=skip`` must not skip it, and the CLI reports it as the
    user's mistake (one line, exit 2); not preflight's InputCheckError, which would make an import cycle."""
    if is_url(url) and "@" in urllib.parse.urlsplit(url).netloc:
        raise ConfigError(f"credentials in shard URLs are not supported ({redact(url)}): use a token-free URL or "
                              "a local mirror")


def server_headers(url: str, timeout: float = HEAD_TIMEOUT_S) -> dict:
    """What an ``http(s)`` server says of the file at ``url`` without sending it (a ``HEAD``): ``etag``,
    ``last_modified`` (strings) and ``length`` (bytes), each None when not given. Raises what urllib raises
    (``OSError``, ``http.client.HTTPException``) when it cannot be asked."""
    req = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the trainer's own shard URLs
        length = r.headers.get("Content-Length")
        return {"etag": r.headers.get("ETag"), "last_modified": r.headers.get("Last-Modified"),
                "length": int(length) if length is not None and length.strip().isdigit() else None}


def read_remote_shard(spec: ShardSpec, stats: LoaderStats, fail: Callable[[ShardError, bool], None], *,
                      retries: int, keep: Callable[[int], bool] | None = None, **read_kw) -> Iterator[dict]:
    """:func:`read_shard` of ``spec`` (same arguments), read again from the start when its stream breaks.

    ``fail`` gets what :func:`read_shard` would give it, except a broken stream that is read again; after the last
    try the break is its, as without retries. A break in the served bytes themselves (the whole file was read) is
    not read again. Raises :class:`ConfigError` for a URL with credentials."""
    refuse_credentials(spec.url)
    resume_at = 0  # the tar position of the first sample not yet handled (given, or reported bad)
    for attempt in range(retries + 1):
        broken: list[ShardError] = []
        current = [-1]  # the tar position of the sample being decoded

        def keep_new(i: int) -> bool:
            if i < resume_at or (keep is not None and not keep(i)):
                return False
            current[0] = i
            return True

        def note(err: ShardError, whole_shard: bool, last: bool = attempt == retries) -> None:
            nonlocal resume_at
            if whole_shard and not last and not refused(err.__cause__):
                broken.append(err)
                return
            if not whole_shard:
                resume_at = current[0] + 1
            fail(err, whole_shard)

        read_from = stats.bytes  # read_shard adds what it read once it ends
        for sample in read_shard(spec, stats, note, keep=keep_new, **read_kw):
            resume_at = current[0] + 1
            yield sample
        if not broken:
            return
        same_again = _in_the_bytes(spec, broken[0], stats.bytes - read_from, read_kw.get("verify", "none"))
        if same_again is not None:  # another read gets the same bytes: the shard's error now, as on the last try
            fail(same_again, True)
            return
        wait = backoff_s(attempt)
        log.warning("loader: reading %s broke (%s); reading it again in %.0f s from sample %d (%d of %d)",
                    redact(spec.url), redact(broken[0].detail), wait, resume_at, attempt + 1, retries)
        pause(wait)


def _in_the_bytes(spec: ShardSpec, err: ShardError, nread: int, verify: str) -> ShardError | None:
    """``err`` (a break of one read of ``spec``, ``nread`` bytes read) as the shard's own error when it is in the
    served bytes, not in their transfer: with ``verify="shard"`` a staged copy's mismatch or damage (a transfer cut
    short fails the stage with an ``OSError``, the error's cause), else a read that got the server's whole file. None
    when another read may not meet it."""
    staged = verify == "shard" and not isinstance(err.__cause__, (OSError, http.client.HTTPException))
    if not staged and not spec.url.startswith(("http://", "https://")):
        return None  # gsutil / aws: no size to compare the read with
    try:
        size = server_headers(spec.url)["length"]
    except (OSError, http.client.HTTPException, ValueError):
        size = None  # the server cannot say now: the break may be the transport's, as before
    if not staged and (size is None or size != nread):
        return None
    if size is not None and spec.bytes is not None and size != spec.bytes:
        detail = (f"the server's file is {size} bytes, the index says {spec.bytes}: the shard or its index is out of "
                  f"date ({err.detail})")
    else:
        detail = f"{err.detail} (in the server's file itself: reading it again would give the same bytes)"
    out = type(err)(redact(err.shard), err.key, detail)
    out.__cause__ = err
    out.lost, out.lost_note = err.lost, err.lost_note
    return out
