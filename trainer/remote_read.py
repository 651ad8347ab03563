"""Reading a remote shard straight from the network (``data.cache_remote=false``), again when the transfer breaks.

The disk cache retries its downloads (``shard_cache._download``); a shard read without it had one try, so one
dropped connection hours into a run stopped it. Here a read whose stream breaks (a reset, a timeout, a transfer cut
short, a 5xx when opening) starts the shard again from its first byte, up to ``retries`` times after 1, 2, 4, ...
seconds, and skips the samples already handled by their place in the tar: the samples and their order are those of
an unbroken read, and a bad sample met before the break is not reported twice. An HTTP 4xx when opening (missing,
forbidden) is not tried again.

A shard that is itself broken (a corrupt tar header in the served bytes) looks the same from here: it is read
``retries`` + 1 times before its error is reported.

Why by hand: webdataset's tar readers hand a broken stream to their error handler (``reraise_exception`` stops,
``warn_and_continue`` drops the rest of the shard) and do not read it again, and a byte-range resume would need every
store's range requests (http, ``gsutil``, ``aws``); a re-read from the start needs none and costs at most one
shard's bytes per retry.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterator

from longreel.task.shard_reader import LoaderStats, ShardError, ShardSpec, read_shard
from longreel.trainer.transfer_retry import backoff_s, pause, refused

log = logging.getLogger("longreel")

__all__ = ["read_remote_shard"]


def read_remote_shard(spec: ShardSpec, stats: LoaderStats, fail: Callable[[ShardError, bool], None], *,
                      retries: int, keep: Callable[[int], bool] | None = None, **read_kw) -> Iterator[dict]:
    """:func:`read_shard` of ``spec`` (same arguments), read again from the start when its stream breaks.

    ``fail`` gets what :func:`read_shard` would give it, except a broken stream that is read again; after the last
    try the break is its, as without retries."""
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

        for sample in read_shard(spec, stats, note, keep=keep_new, **read_kw):
            resume_at = current[0] + 1
            yield sample
        if not broken:
            return
        wait = backoff_s(attempt)
        log.warning("loader: reading %s broke (%s); reading it again in %.0f s from sample %d (%d of %d)",
                    spec.url, broken[0].detail, wait, resume_at, attempt + 1, retries)
        pause(wait)
