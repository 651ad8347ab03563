"""Ingest + probe: input items -> ``video`` records; duplicates by content are rejects.

Each input is hashed (sha256 of its bytes, read through Beam FileSystems) and probed by
PyAV inside a killable worker process. The content hash is the video's identity: the same
bytes under two names are one video, and every other name is a ``duplicate`` reject that
names the kept one (the kept one is the smallest uri, so the choice is deterministic). A uri the
inputs list twice is probed once: its later listings are ``duplicate_input`` rejects naming the first.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import stat
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.media.worker import IsolatedWorker, WorkerError
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, checked, rejected
from longreel.pipelines.tmp_dirs import make_tmpdir
from longreel.task.shard_reader import announced_length

STAGE = "ingest"
DEDUP_STAGE = "dedup"
CHUNK = 1 << 20


#: tries of a remote fetch that failed in a way that may pass (refused, reset, timed out, cut short, HTTP 5xx or
#: 429), and the waits before the second and third: a server restarting or overloaded for a moment cost its videos
#: for good, while a host that stays down costs each video a few seconds, not the run's time
FETCH_TRIES = 3
FETCH_DELAYS_S = (0.5, 1.5)


class NotRegularFile(OSError):
    pass


class FetchFailed(OSError):
    """A remote fetch that failed transiently on each of its ``tries``; ``cause`` is the last failure."""

    def __init__(self, uri: str, tries: int, waited_s: float, cause: BaseException):
        super().__init__(f"{uri}: {_describe(cause)}")
        self.tries, self.waited_s, self.cause = tries, waited_s, cause


def _open(uri: str):
    if uri.startswith(("http://", "https://")):
        return urllib.request.urlopen(uri, timeout=60)  # noqa: S310 - the user's own URL list
    return FileSystems.open(uri, compression_type="uncompressed")


def _describe(e: BaseException) -> str:
    """One line for a fetch failure: urllib wraps the socket's error (``<urlopen error [Errno 111] ...>``)."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return str(e) or type(e).__name__


def _transient(e: BaseException) -> bool:
    """A failure another try may not meet: the server's (5xx), its rate limit (429) or the connection's (refused,
    reset, timed out, cut short)."""
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500 or e.code == 429
    if isinstance(e, urllib.error.URLError):
        e = e.reason
    return isinstance(e, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def _suffix(uri: str) -> str:
    """The extension of a remote name for its local copy (without a URL's query: ``a.mp4?sig=...``)."""
    path = urllib.parse.urlsplit(uri).path if "://" in uri else uri
    return os.path.splitext(path)[1][:8]


def _copy(uri: str, local: str) -> tuple[str, int]:
    """Copy ``uri`` to ``local`` (from the start, over what a failed try left): (sha256, size)."""
    h = hashlib.sha256()
    size = 0
    with open(local, "wb") as out, _open(uri) as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
            out.write(chunk)
        expected = announced_length(fh)
    if expected is not None and size < expected:  # http.client ends a cut transfer as if it were whole
        raise http.client.IncompleteRead(b"", expected - size)
    return h.hexdigest(), size


def _fetch(uri: str, local: str) -> tuple[str, int]:
    """:func:`_copy`, tried again after a transient failure (:data:`FETCH_TRIES`, :data:`FETCH_DELAYS_S`); the
    last one raises :class:`FetchFailed`, any other failure is raised at once (an http.client one as an OSError)."""
    waited = 0.0
    for attempt in range(1, max(1, FETCH_TRIES) + 1):
        try:
            return _copy(uri, local)
        except (OSError, http.client.HTTPException) as e:
            if not _transient(e):
                if isinstance(e, OSError):
                    raise
                raise OSError(_describe(e)) from e
            if attempt >= FETCH_TRIES:
                raise FetchFailed(uri, attempt, waited, e) from e
            if isinstance(e, urllib.error.HTTPError):
                e.close()
            delay = FETCH_DELAYS_S[min(attempt, len(FETCH_DELAYS_S)) - 1] if FETCH_DELAYS_S else 0.0
            time.sleep(delay)
            waited += delay
    raise AssertionError("not reached: the last try returns or raises")


def hash_and_localize(uri: str, tmpdir: str) -> tuple[str, str, int, bool]:
    """Return (local path, sha256, size, is_temp). Local files are read in place; remote ones copied once."""
    h = hashlib.sha256()
    size = 0
    if "://" not in uri:
        st = os.stat(uri)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(uri)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise NotRegularFile(uri)
        with open(uri, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        return uri, h.hexdigest(), size, False
    fd, local = tempfile.mkstemp(dir=tmpdir, suffix=_suffix(uri))
    os.close(fd)
    try:
        sha, size = _fetch(uri, local)
    except BaseException:
        os.unlink(local)  # a failed fetch is a reject: its partial copy would stay till the worker's teardown
        raise
    return local, sha, size, True


def _http_reject(uri: str, e: urllib.error.HTTPError):
    """An HTTP error status as the reject a local file would get: gone is ``not_found``, forbidden is
    ``permission_denied``; any other is ``unreadable``."""
    e.close()
    status = f"HTTP {e.code} {e.reason}"
    if e.code in (404, 410):
        return rejected(STAGE, uri, "not_found", f"no such file: {uri} ({status})")
    if e.code in (401, 403):
        return rejected(STAGE, uri, "permission_denied", f"cannot read {uri}: {status}")
    return rejected(STAGE, uri, "unreadable", f"cannot read {uri}: {status}")


def _retried_reject(uri: str, e: FetchFailed):
    """A transient failure that lasted through every try: a reject of this run (a later run may read it)."""
    return rejected(STAGE, uri, "unreadable",
                    f"cannot fetch {uri}: {_describe(e.cause)} (tried {e.tries} times over {e.waited_s:g} s; the "
                    "failure may be transient: a later run may read it)",
                    details=json.dumps({"tries": e.tries, "transient": True}))


class ProbeVideo(beam.DoFn):
    def __init__(self, probe_timeout_s: float = 120.0, signature_frames: int = 0):
        self.probe_timeout_s = probe_timeout_s
        self.signature_frames = signature_frames

    def setup(self):
        self.worker = IsolatedWorker(default_timeout=self.probe_timeout_s)
        self.tmpdir = make_tmpdir("ingest")
        self.progress = Progress(STAGE, "videos probed")

    def teardown(self):
        self.worker.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def process(self, item: dict):
        uri = item["uri"]
        if item.get("duplicate_of"):  # the same uri listed again (see pipelines.io.inputs.expand_inputs)
            yield rejected(STAGE, uri, "duplicate_input",
                           f"{item.get('source') or 'a later listing'} repeats {uri}, first listed at "
                           f"{item['duplicate_of']}: the first listing is the input",
                           details=json.dumps({"first": item["duplicate_of"], "again": item.get("source")}))
            return
        t0 = time.monotonic()
        try:
            local, sha, size, is_temp = hash_and_localize(uri, self.tmpdir)
        except FileNotFoundError:
            yield rejected(STAGE, uri, "not_found", f"no such file: {uri}")
            return
        except urllib.error.HTTPError as e:
            yield _http_reject(uri, e)
            return
        except FetchFailed as e:
            yield _retried_reject(uri, e)
            return
        except PermissionError as e:
            yield rejected(STAGE, uri, "permission_denied", f"cannot read {uri}: {e}")
            return
        except IsADirectoryError:
            yield rejected(STAGE, uri, "unreadable", f"{uri} is a directory, not a file")
            return
        except NotRegularFile:
            yield rejected(STAGE, uri, "unreadable", f"{uri} is not a regular file (FIFO, socket or device)")
            return
        except OSError as e:
            yield rejected(STAGE, uri, "unreadable", f"cannot read {uri}: {_describe(e)}")
            return
        try:
            if size == 0:
                yield rejected(STAGE, uri, "empty_file", f"{uri} is empty (0 bytes)")
                return
            try:
                info = self.worker.call("probe", path=local)
            except WorkerError as e:
                # the probe names the file it opened: a remote video's is a temporary copy, gone by now
                message = e.message.replace(local, uri) if is_temp else e.message
                yield rejected(STAGE, uri, e.reason, message, video_id=sha[:16])
                return
            # a few small frames while the file is local (the near-duplicate test of the dedup stage)
            sig = self._signature(local, info) if self.signature_frames else None
        finally:
            if is_temp:
                os.unlink(local)
        row = {"video_id": sha[:16], "sha256": sha, "uri": uri, "bytes": size,
               "license": item.get("license"), "attribution": item.get("attribution"), **info}
        self.progress.tick(f"{os.path.basename(uri)} ({time.monotonic() - t0:.2f} s)")
        out = checked(STAGE, "video", row, uri)
        # the signature rides along to the dedup stage, which drops it (not a column of the videos table)
        yield {**out, "signature": sig} if sig is not None and isinstance(out, dict) else out


    def _signature(self, local: str, info: dict) -> list[str] | None:
        try:
            return self.worker.call("signature", path=local, duration_s=info["duration_s"],
                                    n=self.signature_frames, rotation=info["rotation"])["signature"]
        except WorkerError:  # a video whose frames do not all decode is not compared, not rejected here
            return None


def _pick_canonical(element):
    sha, rows = element
    rows = sorted(rows, key=lambda r: r["uri"])
    yield rows[0]
    for dup in rows[1:]:
        yield rejected(DEDUP_STAGE, dup["uri"], "duplicate",
                       f"same content (sha256 {sha[:16]}…) as {rows[0]['uri']}", video_id=dup["video_id"])


class ProbeVideos(beam.PTransform):
    """Stage ``ingest``: items ``{"uri", "license", "attribution"}`` -> ``{"main": videos, "rejects"}``."""

    def __init__(self, probe_timeout_s: float = 120.0, signature_frames: int = 0):
        super().__init__()
        self.probe_timeout_s = probe_timeout_s
        self.signature_frames = signature_frames

    def expand(self, items):
        out = (items
               | "Reshuffle" >> beam.Reshuffle()  # spread the expensive probes over workers
               | "HashAndProbe" >> beam.ParDo(ProbeVideo(self.probe_timeout_s, self.signature_frames)).with_outputs(
                   REJECTS, main=MAIN))
        return {MAIN: out[MAIN], REJECTS: out[REJECTS]}


def _slim(row: dict) -> dict:
    return {k: row.get(k) for k in ("sha256", "uri", "width", "height", "duration_s", "bytes", "signature")}


def _near_duplicate_table(slim_rows: list[dict], max_mean_bits: float) -> dict:
    from longreel.pipelines.gates.videodup import near_duplicates

    found = near_duplicates(slim_rows, max_mean_bits)
    return {sha: (kept["uri"], kept["sha256"], d) for sha, (kept, d) in found.items()}


def _drop_near_duplicates(row: dict, table: dict):
    row = {k: v for k, v in row.items() if k != "signature"}  # carried from the probe, not a table column
    hit = table.get(row["sha256"])
    if hit is None:
        yield row
        return
    kept_uri, kept_sha, d = hit
    yield rejected(DEDUP_STAGE, row["uri"], "near_duplicate",
                   f"the same footage as {kept_uri} (mean dHash distance {d:.2f} bits)", video_id=row["video_id"],
                   details=json.dumps({"kept": kept_uri, "kept_sha256": kept_sha, "mean_bits": round(d, 3)},
                                      sort_keys=True))


class DedupVideos(beam.PTransform):
    """Stage ``dedup``: videos -> ``{"main": one video per content hash, "rejects": duplicates}``; with
    ``near_duplicates`` also one video per group of near-identical signatures
    (:mod:`longreel.pipelines.gates.videodup`): the others are ``near_duplicate`` rejects naming the kept one."""

    def __init__(self, near_duplicates: bool = False, max_mean_bits: float = 6.0):
        super().__init__()
        self.near, self.max_mean_bits = near_duplicates, max_mean_bits

    def expand(self, videos):
        out = (videos
               | "KeyBySha" >> beam.Map(lambda r: (r["sha256"], r))
               | "GroupBySha" >> beam.GroupByKey()
               | "PickCanonical" >> beam.FlatMap(_pick_canonical).with_outputs(REJECTS, main=MAIN))
        main, rejects = out[MAIN], out[REJECTS]
        if not self.near:
            return {MAIN: main | "NoSignature" >> beam.Map(lambda r: {k: v for k, v in r.items() if k != "signature"}),
                    REJECTS: rejects}
        # one small record per video meets the others in one place (signatures are n x 16 hex digits)
        table = (main
                 | "Slim" >> beam.Map(_slim)
                 | "AllSignatures" >> beam.combiners.ToList()
                 | "Group" >> beam.Map(_near_duplicate_table, self.max_mean_bits))
        near = main | "DropNear" >> beam.FlatMap(_drop_near_duplicates, beam.pvalue.AsSingleton(table)).with_outputs(
            REJECTS, main=MAIN)
        both = (rejects, near[REJECTS]) | "DedupRejects" >> beam.Flatten()
        return {MAIN: near[MAIN], REJECTS: both}
