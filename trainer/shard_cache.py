"""Remote shards copied to a local disk cache before the trainer reads them.

By default the trainer holds every item of its data (``runtime.load_items``). From a local shard the frames are views
of a memory-mapped file: pages the kernel can drop and read again. From ``http(s)://``, ``gs://`` or ``s3://`` they
were read into anonymous memory, so a trainer pointed at remote shard URLs needed RAM for the whole dataset's frames,
and every restart downloaded it again. Here each remote shard is downloaded once into ``cache_dir``, checked against
the index's sha256 when the index gives one, renamed into place, and then read like a local shard (the same idea as
webdataset's ``wids`` cache). With ``data.stream`` the shards are fetched one at a time as the stream reaches them
(:class:`ShardFetcher`).

A shard with a known sha256 is stored as ``<sha256>.tar``: content-addressed, so a reused file is the verified one
(it is renamed into place only after its hash matched). One without is stored under a hash of its URL and is reused
as long as that file is there: the URL is then trusted to name fixed content, as a brace pattern or a URL list
does. Nothing checked such a copy but its length against the response's Content-Length, so one that turns out
unreadable (a truncated or corrupt tar) is removed when the loader meets the break (:func:`forget_unchecked_copy`):
the next run downloads it again rather than failing on the same bad copy for good. Ranks that share a machine take
a per-shard ``flock`` so that one of them downloads and the others wait.

Beyond such a copy, the cache never deletes on its own: a run that starts should not find its shards evicted by
another. Each reuse sets the file's mtime, so ``longreel cache prune`` (:func:`prune`) can remove the least recently
used shards first, the way pip's and the Hugging Face hub's caches are pruned by a command rather than behind the
user's back.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from longreel.engines.local_models import cache_dir as longreel_cache_dir
from longreel.task.shard_reader import ShardError, ShardSpec, copy_verified, local_path
from longreel.task.transfer_stop import StopSignal
from longreel.trainer.transfer_retry import backoff_s, pause, refused

log = logging.getLogger("longreel")

__all__ = ["default_cache_dir", "cache_remote_shards", "cached_name", "CachedShard", "scan", "choose_evictions",
           "prune", "ShardFetcher", "forget_unchecked_copy"]


def default_cache_dir() -> str:
    """``$LONGREEL_CACHE/shards``, else ``~/.cache/longreel/shards`` (beside the other caches of longreel)."""
    return os.path.join(longreel_cache_dir(), "shards")


def cached_name(spec: ShardSpec) -> str:
    if spec.sha256:
        return f"{spec.sha256}.tar"
    return f"url-{hashlib.sha256(spec.url.encode()).hexdigest()[:32]}.tar"


def cache_remote_shards(specs: list[ShardSpec], cache_dir: str, retries: int = 3) -> list[ShardSpec]:
    """``specs`` with every remote shard replaced by its local copy in ``cache_dir`` (downloaded when missing);
    local shards as they are. A download that fails in transport is tried again up to ``retries`` times (see
    :func:`_download`). Raises :class:`ShardError` naming the URL when a download fails or its sha256 differs."""
    out, fetched, nbytes, t0 = [], 0, 0, time.monotonic()
    root = Path(os.path.expanduser(cache_dir))
    for spec in specs:
        local, size = _local_copy(spec, root, retries)
        if size is not None:
            fetched, nbytes = fetched + 1, nbytes + size
        out.append(local)
    if fetched:
        log.info("shard cache: downloaded %d shard(s), %.1f MB, into %s in %.1f s", fetched, nbytes / 1e6, cache_dir,
                 time.monotonic() - t0)
    return out


class ShardFetcher:
    """Remote shards fetched into the cache when a streaming loader reaches them (``ShardDataset(fetch=...)``), with
    the next one downloading in a background thread meanwhile, so that a step rarely waits on the network and the
    cache holds only the shards read so far, not the whole dataset before the first step.

    The download ahead is a hint: when it fails, the shard is fetched again in the foreground when it is reached,
    and that failure is the one reported (naming the URL). Local shards pass through. :meth:`close` stops a download
    ahead that is still running (its partial file removed) instead of waiting for it, also one waiting on a stalled
    server (its socket is shut down, its ``gsutil``/``aws`` process killed): a run that ends, or is interrupted, does
    not wait on a shard it will not read.
    """

    def __init__(self, cache_dir: str, retries: int = 3):
        from concurrent.futures import ThreadPoolExecutor

        self.root = Path(os.path.expanduser(cache_dir))
        self.retries = retries
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="longreel-shard-prefetch")
        self._ahead: dict[str, object] = {}  # url -> Future of its fetch
        # set by close: the download ahead ends at once, also when it waits on a stalled server
        self._stop = StopSignal()
        self.downloaded = 0  # shards this fetcher downloaded (not found in the cache)

    def __call__(self, spec: ShardSpec, upcoming: ShardSpec | None = None) -> ShardSpec:
        local = self._get(spec)
        if upcoming is not None and local_path(upcoming.url) is None and upcoming.url not in self._ahead:
            self._ahead[upcoming.url] = self._pool.submit(_local_copy, upcoming, self.root, self.retries,
                                                          self._stop)
        return local

    def _get(self, spec: ShardSpec) -> ShardSpec:
        ahead = self._ahead.pop(spec.url, None)
        local = size = None
        if ahead is not None:
            try:
                local, size = ahead.result()
            except ShardError as e:
                log.info("shard cache: the download ahead of %s failed (%s); fetching it again", spec.url, e)
        if local is None:
            local, size = _local_copy(spec, self.root, self.retries)
        if size is not None:
            self.downloaded += 1
            log.info("shard cache: downloaded %s (%.1f MB)", spec.url, size / 1e6)
        return local

    def close(self) -> None:
        self._stop.set()
        for f in self._ahead.values():
            f.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True)


def _local_copy(spec: ShardSpec, root: Path, retries: int = 3,
                stop: threading.Event | None = None) -> tuple[ShardSpec, int | None]:
    """The spec to read for ``spec``: itself when local, else its cached copy (downloaded when missing); and the
    bytes downloaded (None when nothing was). ``stop``, once set, ends a download (or the wait for another rank's)
    with ``InterruptedError``."""
    if local_path(spec.url) is not None:
        return spec, None
    path, size = _fetch(spec, root, retries, stop)
    return ShardSpec(str(path), spec.sha256, spec.bytes, spec.nsamples), size


def _fetch(spec: ShardSpec, root: Path, retries: int = 3,
           stop: threading.Event | None = None) -> tuple[Path, int | None]:
    """The cached file of ``spec`` and the bytes downloaded (None when the file was already there)."""
    dest = root / cached_name(spec)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = _open_lock(dest)
    except OSError as e:
        raise ShardError(spec.url, None, f"cannot use the shard cache {root} ({e.strerror}): set data.cache_dir to a "
                                         "writable directory, or data.cache_remote=false") from e
    try:
        _lock(fd, stop)  # another rank on this machine may be downloading it: wait for that one
        if dest.is_file():
            try:
                os.utime(dest)  # the last use, which `longreel cache prune` evicts by
            except OSError:  # a cache another user owns, or read-only: readable all the same
                pass
            return dest, None
        return dest, _download(spec, dest, retries, stop)
    finally:
        os.close(fd)


def _lock(fd: int, stop: threading.Event | None) -> None:
    """``flock`` ``fd`` exclusively; with ``stop``, by polling, so that setting it ends the wait."""
    if stop is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop.wait(0.2):
                raise InterruptedError("stopped while another process downloads the shard") from None


def _lock_path(shard: Path) -> str:
    return f"{shard}.lock"


def _open_lock(shard: Path) -> int:
    """The descriptor of ``shard``'s download lock file (made if missing), for ``flock``."""
    return os.open(_lock_path(shard), os.O_RDWR | os.O_CREAT, 0o644)


def _download(spec: ShardSpec, dest: Path, retries: int = 3, stop: threading.Event | None = None) -> int:
    """Download ``spec`` into ``dest`` (verified, then renamed into place). A transport failure (a reset connection,
    a timeout, an HTTP 5xx, a truncated transfer, a failing ``gsutil``/``aws`` pipe) is tried again up to
    ``retries`` times after 1, 2, 4, ... seconds, as object stores ask of their clients; a refusal that another try
    would not change (an HTTP 4xx: missing or forbidden) and a verified copy that does not match the index are not."""
    for attempt in range(retries + 1):
        try:
            return _download_once(spec, dest, stop)
        except _Transient as e:
            cause = getattr(e.__cause__, "detail", e.__cause__)  # a ShardError's own text names the URL again
            if attempt == retries:
                raise ShardError(spec.url, None, f"cannot download into the shard cache: {cause} (after "
                                                 f"{retries + 1} tries)") from e.__cause__
            wait = backoff_s(attempt)
            log.warning("shard cache: download of %s failed (%s); trying again in %.0f s (%d of %d)", spec.url,
                        cause, wait, attempt + 1, retries)
            pause(wait, stop)
    raise AssertionError("unreachable")


class _Transient(Exception):
    """A download failure that another try may not meet (its cause is ``__cause__``)."""


def _download_once(spec: ShardSpec, dest: Path, stop: threading.Event | None = None) -> int:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                size = copy_verified(spec, out, stop)
            except InterruptedError:  # stopped, not failed: no retry
                raise
            except ShardError as e:
                # fewer bytes than the index gives: the transfer was cut short (urllib reads a connection closed
                # early as the end of the body), which another try may not meet; a full-size mismatch is the data's
                if spec.bytes is not None and out.tell() < spec.bytes:
                    raise _Transient() from e
                raise
            except Exception as e:  # noqa: BLE001 - any transport error is this shard's and may pass, but a refusal
                if refused(e):
                    raise ShardError(spec.url, None, f"cannot download into the shard cache: {e}") from e
                raise _Transient() from e
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache directory's shards from other users
        os.replace(tmp, dest)
        return size
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class CachedShard:
    path: Path
    bytes: int
    last_used: float  # the file's mtime: its download or its last reuse


def scan(cache_dir: str) -> list[CachedShard]:
    """The shards in ``cache_dir``, least recently used first (unfinished downloads and lock files left out)."""
    root = Path(os.path.expanduser(cache_dir))
    if not root.is_dir():
        return []
    out = []
    for path in root.glob("*.tar"):  # a download in progress is ``.<name>.<random>``: hidden, never matched
        st = path.stat()
        out.append(CachedShard(path, st.st_size, st.st_mtime))
    return sorted(out, key=lambda c: (c.last_used, c.path.name))


def choose_evictions(shards: list[CachedShard], *, max_bytes: int | None = None, older_than_s: float | None = None,
                     now: float | None = None) -> list[CachedShard]:
    """Which shards to remove: those unused for more than ``older_than_s`` seconds, then the least recently used
    until what is left fits in ``max_bytes``. ``shards`` is least recently used first (as :func:`scan` returns it)."""
    now = time.time() if now is None else now
    stale = {c.path for c in shards if older_than_s is not None and now - c.last_used > older_than_s}
    left = sum(c.bytes for c in shards if c.path not in stale)
    evict = []
    for c in shards:
        if c.path in stale:
            evict.append(c)
        elif max_bytes is not None and left > max_bytes:
            evict.append(c)
            left -= c.bytes
    return evict


def prune(victims: list[CachedShard]) -> list[CachedShard]:
    """Remove ``victims``, each under its download lock (one that a rank is fetching right now is kept); returns the
    ones removed. A trainer that has a shard open keeps reading it: the kernel frees the file when it is closed."""
    removed = []
    for c in victims:
        if _remove(c.path):
            removed.append(c)
        else:
            log.info("shard cache: %s is being downloaded, kept", c.path.name)
    return removed


def _remove(shard: Path) -> bool:
    """Remove a cached shard and its lock file under its download lock; False when a rank is downloading it now."""
    fd = _open_lock(shard)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shard.unlink(missing_ok=True)
        # A rank that opened this lock file just before the unlink may download the shard again beside one that
        # opens a new lock file: both rename a verified copy into place, so the worst case is one extra download.
        Path(_lock_path(shard)).unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def forget_unchecked_copy(spec: ShardSpec, copy: str) -> str:
    """The read of ``copy`` broke as a whole (a truncated or corrupt tar): when it is this cache's copy of the remote
    ``spec`` stored without a sha256 to check it against, remove it, so that the next fetch downloads the shard again
    (the copy may be a cut transfer, or the server may have been fixed since). Returns what was done, said for the
    error message ("" when ``copy`` is not such a copy: a verified copy holds what the index describes, and another
    download would bring the same bytes)."""
    path = Path(copy)
    if spec.sha256 or local_path(spec.url) is not None or path.name != cached_name(spec) or not path.is_file():
        return ""
    try:
        if _remove(path):
            return ("the cached copy, which had no sha256 to check it against, was removed: the next run downloads it "
                    "again")
    except OSError as e:
        return (f"the cached copy has no sha256 to check it against and could not be removed ({e.strerror}): delete "
                f"{copy}, or run `longreel cache prune --all --dir {path.parent}`, to download it again")
    return ("the cached copy has no sha256 to check it against and is being downloaded again by another process; "
            f"if it stays unreadable, delete {copy} or run `longreel cache prune --all --dir {path.parent}`")
