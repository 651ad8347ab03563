"""Remote shards copied to a local disk cache before the trainer reads them.

By default the trainer holds every item of its data (``runtime.load_items``). From a local shard the frames are views
of a memory-mapped file: pages the kernel can drop and read again. From ``http(s)://``, ``gs://`` or ``s3://`` they
were read into anonymous memory, so a trainer pointed at remote shard URLs needed RAM for the whole dataset's frames,
and every restart downloaded it again. Here each remote shard is downloaded once into ``cache_dir``, checked against
the index's sha256 when the index gives one, renamed into place, and then read like a local shard (the same idea as
webdataset's ``wids`` cache). With ``data.stream`` the shards are fetched one at a time as the stream reaches them
(:class:`ShardFetcher`).

A shard with a known sha256 is stored as ``<sha256>.tar``: content-addressed, so a reused file is the verified one
(it is renamed into place only after its hash matched) and is reused without asking the server. One without (a bare
``http(s)`` URL, a brace pattern, a URL list) is stored under a hash of its URL, and the server's ``ETag``,
``Last-Modified`` and ``Content-Length`` at its download are recorded beside it (``<name>.http.json``). Before such
a copy is reused the server is asked again (a ``HEAD``, :func:`_revalidate`): when what it says differs (or, from a
server that gives neither ``ETag`` nor ``Last-Modified``, the size does), the shard is downloaded again; a server
that cannot be asked leaves the copy in use, with a warning that it could not be revalidated. A reused copy once
trusted the URL to name fixed content, and a shard changed on the server was trained and evaluated on from the old
copy without a word. (``gs://`` and ``s3://`` copies without a sha256 are still reused as they are.) Nothing checked
such a copy but its length against the response's Content-Length, so one that turns out unreadable (a truncated or
corrupt tar) is removed when the loader meets the break (:func:`forget_unchecked_copy`): the next run downloads it
again rather than failing on the same bad copy for good. Ranks that share a machine take a per-shard ``flock`` so
that one of them downloads and the others wait.

A download whose transfer completed (its Content-Length, or a clean end of the stream) but that does not match the
index's size or sha256 is the file's, not the network's: it is reported at once ("the server's file is N bytes, the
index says M: the shard or its index is out of date"), not tried again. URLs with credentials are refused before
anything is fetched (``remote_read.refuse_credentials``), and what this module prints has userinfo masked.

Beyond such a copy, the cache never deletes on its own: a run that starts should not find its shards evicted by
another. Each reuse sets the file's mtime, so ``longreel cache prune`` (:func:`prune`) can remove the least recently
used shards first, the way pip's and the Hugging Face hub's caches are pruned by a command rather than behind the
user's back.
"""
from __future__ import annotations

import fcntl
import hashlib
import http.client
import json
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
from longreel.trainer.remote_read import redact, refuse_credentials, server_headers
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
    :func:`_download`). Raises :class:`ShardError` naming the URL when a download fails or its sha256 differs, and
    :class:`~longreel.schemas.config.ConfigError` for a URL with credentials (before any download)."""
    out, fetched, nbytes, t0 = [], 0, 0, time.monotonic()
    root = Path(os.path.expanduser(cache_dir))
    for spec in specs:  # all of them before the first download: not one refused after an hour of downloading
        refuse_credentials(spec.url)
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
        refuse_credentials(spec.url)  # a ConfigError, not a ShardError: data.on_error=skip must not skip it
        local = self._get(spec)
        if (upcoming is not None and local_path(upcoming.url) is None and upcoming.url not in self._ahead
                and "@" not in upcoming.url):  # one with credentials is refused when it is reached, not fetched ahead
            self._ahead[upcoming.url] = self._pool.submit(_local_copy, upcoming, self.root, self.retries,
                                                          self._stop)
        return local

    def _get(self, spec: ShardSpec) -> ShardSpec:
        ahead = self._ahead.pop(spec.url, None)
        local = size = None
        if ahead is not None:
            try:
                local, size = ahead.result()
            except _ContentError:  # the server's whole file, not matching the index: another download brings it again
                raise
            except ShardError as e:
                log.info("shard cache: the download ahead of %s failed (%s); fetching it again", redact(spec.url),
                         redact(str(e)))
        if local is None:
            local, size = _local_copy(spec, self.root, self.retries)
        if size is not None:
            self.downloaded += 1
            log.info("shard cache: downloaded %s (%.1f MB)", redact(spec.url), size / 1e6)
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
    """The cached file of ``spec`` and the bytes downloaded (None when the file was already there and is reused: a
    copy without a sha256 only once the server confirmed it, or could not be asked; see :func:`_revalidate`)."""
    dest = root / cached_name(spec)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = _open_lock(dest)
    except OSError as e:
        raise ShardError(redact(spec.url), None, f"cannot use the shard cache {root} ({e.strerror}): set "
                                                 "data.cache_dir to a writable directory, or data.cache_remote=false"
                         ) from e
    try:
        _lock(fd, stop)  # another rank on this machine may be downloading it: wait for that one
        # asked before the download, not after: a file changed between the two leaves validators older than the copy,
        # so the next run downloads it again rather than keeping a stale copy under new validators
        server = None if spec.sha256 or not spec.url.startswith(("http://", "https://")) else _ask_server(spec.url)
        if dest.is_file() and _revalidate(spec, dest, server):
            try:
                os.utime(dest)  # the last use, which `longreel cache prune` evicts by
            except OSError:  # a cache another user owns, or read-only: readable all the same
                pass
            return dest, None
        record = Path(_record_path(dest))
        record.unlink(missing_ok=True)  # until the new copy is in place, no validators speak for the old one
        size = _download(spec, dest, retries, stop)
        if isinstance(server, dict):
            _write_record(record, server)
        return dest, size
    finally:
        os.close(fd)


def _record_path(shard: Path) -> str:
    """Where the server's validators at a URL-named copy's download are kept (not ``*.tar``: :func:`scan` skips it)."""
    return f"{shard}.http.json"


def _ask_server(url: str) -> dict | str:
    """The server's validators of ``url`` (:func:`~longreel.trainer.remote_read.server_headers`), or why it could
    not be asked."""
    try:
        return server_headers(url)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return redact(str(e)) or type(e).__name__


def _write_record(record: Path, server: dict) -> None:
    try:
        tmp = record.with_name(f".{record.name}.tmp")
        tmp.write_text(json.dumps(server, sort_keys=True))
        os.replace(tmp, record)
    except OSError as e:  # a cache another user owns: the next reuse downloads again rather than trust the copy
        log.warning("shard cache: cannot record the server's validators of %s (%s)", record.name, e.strerror)


def _revalidate(spec: ShardSpec, dest: Path, server: dict | str | None) -> bool:
    """Whether the cached ``dest`` of ``spec`` may be reused. A copy named by the index's sha256 is (it was verified),
    as is one the server cannot be asked about (``server`` is why: a warning says so) or that is not ``http(s)``
    (``server`` None). Otherwise the validators recorded at its download must be what the server gives now:
    ``ETag`` and ``Last-Modified`` where it gives them, and the size always."""
    if spec.sha256 or server is None:
        return True
    url = redact(spec.url)
    if isinstance(server, str):
        log.warning("shard cache: the cached copy of %s could not be revalidated with the server (%s): using it as "
                    "it is", url, server)
        return True
    try:
        recorded = json.loads(Path(_record_path(dest)).read_text())
    except (OSError, ValueError):
        recorded = None  # cached before validators were recorded, or the record was lost: only the size can tell
    size = dest.stat().st_size
    changed = None
    if server["length"] is not None and server["length"] != size:
        changed = f"the server's file is {server['length']} bytes, the cached copy {size}"
    else:
        for key, name in (("etag", "ETag"), ("last_modified", "Last-Modified")):
            if server[key] is not None and (recorded or {}).get(key) != server[key]:
                changed = (f"its {name} is now {server[key]!r}" + (f", was {recorded.get(key)!r}" if recorded else
                                                                    ", none recorded with the cached copy"))
                break
        else:
            if server["length"] is None and server["etag"] is None and server["last_modified"] is None:
                log.warning("shard cache: the cached copy of %s could not be revalidated with the server (it gives no "
                            "ETag, Last-Modified or Content-Length): using it as it is", url)
    if changed is None:
        return True
    log.info("shard cache: %s changed on the server since it was cached (%s): downloading it again", url, changed)
    return False


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
    would not change (an HTTP 4xx: missing or forbidden) and a complete transfer that does not match the index's size
    or sha256 (:class:`_ContentError`: the server's file is not the one the index describes) are not."""
    for attempt in range(retries + 1):
        try:
            return _download_once(spec, dest, stop)
        except _Transient as e:
            # a ShardError's own text names the URL again
            cause = redact(getattr(e.__cause__, "detail", e.__cause__))
            if attempt == retries:
                raise ShardError(redact(spec.url), None, f"cannot download into the shard cache: {cause} (after "
                                                         f"{retries + 1} tries)") from e.__cause__
            wait = backoff_s(attempt)
            log.warning("shard cache: download of %s failed (%s); trying again in %.0f s (%d of %d)",
                        redact(spec.url), cause, wait, attempt + 1, retries)
            pause(wait, stop)
    raise AssertionError("unreachable")


class _Transient(Exception):
    """A download failure that another try may not meet (its cause is ``__cause__``)."""


class _ContentError(ShardError):
    """A complete transfer that does not match the index: another try would bring the same bytes."""


def _download_once(spec: ShardSpec, dest: Path, stop: threading.Event | None = None) -> int:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                size = copy_verified(spec, out, stop)
            except InterruptedError:  # stopped, not failed: no retry
                raise
            except ShardError as e:
                # copy_verified raises a transfer cut short before its Content-Length as a ConnectionError (below:
                # tried again), so this is a whole file, or a stream that ended cleanly, that is not the index's:
                # the server's file itself, which another try would bring again (fewer bytes were once taken for a
                # cut transfer and tried 3 times, saying "trying again", over a shard whose index is out of date)
                out.flush()
                raise _content_error(spec, tmp, out.tell()) from e
            except Exception as e:  # noqa: BLE001 - any transport error is this shard's and may pass, but a refusal
                if refused(e):
                    raise ShardError(redact(spec.url), None, f"cannot download into the shard cache: {redact(e)}"
                                     ) from e
                raise _Transient() from e
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache directory's shards from other users
        os.replace(tmp, dest)
        return size
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _content_error(spec: ShardSpec, got: str, size: int) -> _ContentError:
    """The error of a complete download of ``spec`` (``size`` bytes, in the file ``got``) that the index refuses."""
    if spec.bytes is not None and size != spec.bytes:
        said = f"the server's file is {size} bytes, the index says {spec.bytes}"
    else:
        h = hashlib.sha256()
        with open(got, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        said = (f"the server's file ({size} bytes) has sha256 {h.hexdigest()}, which does not match the index's "
                f"{spec.sha256}")
    return _ContentError(redact(spec.url), None, f"{said}: the shard or its index is out of date")


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
        Path(_record_path(shard)).unlink(missing_ok=True)
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
