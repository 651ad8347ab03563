"""The output-directory contract: one run at a time, a completion marker written last, and a rule for a directory
that already holds outputs (in the manner of Spark's save modes, Hadoop's ``_SUCCESS`` and Beam's temp-then-rename).

**Lock** (``OUT/.longreel.lock``), held from before the first read of the directory to after the marker is written.
Its content (host, pid, start time, command) is what a refused run prints.

* Local paths: ``fcntl.flock`` on the lock file, kept open for the run. The kernel drops a flock when its process
  ends, however it ends (``kill -9`` included), so a lock left by a killed run never blocks: a lock file nobody
  holds is taken over, with a warning naming the run that left it. Where a filesystem refuses flock (some network
  mounts answer ENOLCK), the exclusive-create protocol below runs on the local path with
  ``os.open(O_CREAT | O_EXCL)``.
* Other Beam filesystems (``gs://``, ``s3://``, ...): the lock object is created only if absent. On ``gs://`` that
  is atomic (a generation-match precondition through google-cloud-storage, which Beam's ``gcp`` extra installs);
  Beam's ``FileSystems`` has no conditional create, so elsewhere it is exists-then-create, and two runs started
  within one round trip of each other can both pass. The holder rewrites the lock's heartbeat every
  :data:`HEARTBEAT_S`; a lock is stale (taken over with a warning) when its holder is on this host and its pid is
  gone, or its heartbeat is older than :data:`STALE_AFTER_S`.

**Marker** (``OUT/_SUCCESS.json``, format and check in :mod:`longreel.schemas.run_marker`): written last, atomically, with
the config (hash and resolved values), the stages, a digest of the inputs and every file of the run with its size
and sha256. It is removed before a run writes anything into a directory, so a directory without one holds an
unfinished run. Stages run alone on a directory (``longreel caption/qra/filter/pack``) take the lock too, and
rewrite the marker (with their step and files) when they finish, if the directory had one.

**A directory that holds outputs** (``if_exists``):

* ``error`` (the CLI's default): an empty directory, or one holding a finished run with the same config and inputs
  (an idempotent re-run), is used; anything else is refused with :class:`RunDirConflict`, which says what differs.
* ``resume`` (``--resume``): also continues an unfinished run (no marker) whose ``config.yaml`` is this config and
  whose ``_INPUTS.json`` (the inputs digest, written before the first output) names these inputs.
* ``overwrite`` (``--overwrite``): the previous run's files are removed first.

"The run's files", the only ones ever removed: the files the old marker lists, plus longreel's own output names:
at the top level ``<table>-NNNNN-of-NNNNN.parquet``, ``stats.json``, ``config.yaml``, ``_INPUTS.json``,
``config_pack.yaml``, ``config_caption.yaml``,
``config_qra.yaml``, ``filter_config.yaml``, ``blind_config.yaml``, ``judge_config.yaml``, ``_SUCCESS.json`` and the
temporary names of their atomic writes; and
the directories ``clips/``, ``frame_cache/``, ``shards/`` and ``card/``, which belong to longreel whole. Any other
file is left alone (and named in the log). A directory that holds such names but no sign of a longreel run (no
marker, no longreel ``stats.json`` or ``config.yaml``) is refused even with ``overwrite``. A frame cache or
shards directory configured outside ``OUT`` (``pack.cache_dir``, ``pack.shards_dir``) is not part of the run's
files: it is neither listed nor removed.
"""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from apache_beam.io.filesystems import FileSystems

from longreel.schemas.atomic import TEMP_RE, write_atomic
from longreel.schemas.run_marker import (MARKER_KIND, MARKER_NAME, MARKER_VERSION, IncompleteRun,
                                safe_relpath, sha256_of)

log = logging.getLogger("longreel")

LOCK_NAME = ".longreel.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
IF_EXISTS = ("error", "resume", "overwrite")
OWNED_DIRS = ("clips", "frame_cache", "shards", "card")
INPUTS_NAME = "_INPUTS.json"
#: the resolved config a stage run alone records (its section of config.yaml as that run used it)
STAGE_CONFIG_FILES = {"caption": "config_caption.yaml", "qra": "config_qra.yaml", "filter": "filter_config.yaml",
                      "blind": "blind_config.yaml", "judge": "judge_config.yaml", "pack": "config_pack.yaml"}
OWNED_FILES = frozenset({"stats.json", "config.yaml", MARKER_NAME, INPUTS_NAME, *STAGE_CONFIG_FILES.values()})
_TABLE = re.compile(r"[a-z][a-z0-9_]*-\d{5}-of-\d{5}\.parquet")
# schemas.atomic's temporary names, and the ones older versions left (stats.json.tmp, _SUCCESS.json.tmp)
_TEMP = re.compile(rf"{TEMP_RE.pattern}|(stats\.json|_SUCCESS\.json)\.tmp")


class RunDirError(Exception):
    """The output directory cannot be used as asked: a problem for the user to solve (the CLI exits 2)."""


class RunDirBusy(RunDirError):
    """Another run holds the directory's lock."""


class RunDirConflict(RunDirError):
    """The directory holds outputs this run may not mix with."""


def _remote(path: str) -> bool:
    return "://" in path


def _join(base: str, *parts: str) -> str:
    return FileSystems.join(base, *parts) if _remote(base) else os.path.join(base, *parts)


def _open_read(path: str):
    if not _remote(path):
        return open(path, "rb")
    if not FileSystems.exists(path):
        raise FileNotFoundError(path)
    return FileSystems.open(path, compression_type="uncompressed")


def _delete_quiet(path: str) -> bool:
    try:
        if _remote(path):
            if not FileSystems.exists(path):
                return False
            FileSystems.delete([path])
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def describe_holder(doc: dict | None) -> str:
    if not doc or not doc.get("pid"):
        return "another run (it has not written its details yet)"
    return (f"host {doc.get('host')}, pid {doc.get('pid')}, started {doc.get('started')}, "
            f"command: {doc.get('command') or '(not recorded)'}")


def ensure_dir(out_dir: str, create: bool = True) -> None:
    """Make sure ``out_dir`` is a usable directory; a path that names a file is a :class:`RunDirError`."""
    if _remote(out_dir):
        return  # object stores have no directories to create
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise RunDirError(f"{out_dir} exists and is not a directory: give a directory (new or a run's)")
    if os.path.isdir(out_dir):
        return
    if not create:
        raise RunDirError(f"{out_dir}: no such directory (run `longreel curate --out {out_dir}` first)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(f"cannot create {out_dir}: a part of that path is a file, not a directory") from None
    except PermissionError as e:
        raise RunDirError(f"cannot create {out_dir}: {e.strerror}") from None


# ---------------------------------------------------------------------------------------------------------------
# the lock
# ---------------------------------------------------------------------------------------------------------------

def _gcs_create_if_absent(path: str, data: bytes) -> bool | None:
    """Atomic create-if-absent on GCS (``ifGenerationMatch=0``); None when google-cloud-storage is not there."""
    try:
        from google.api_core.exceptions import PreconditionFailed
        from google.cloud import storage
    except ImportError:
        return None
    bucket, _, name = path[len("gs://"):].partition("/")
    try:
        storage.Client().bucket(bucket).blob(name).upload_from_string(data, if_generation_match=0)
    except PreconditionFailed:
        return False
    return True


def _create_if_absent(path: str, data: bytes) -> bool:
    if not _remote(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        return True
    if path.startswith("gs://"):
        done = _gcs_create_if_absent(path, data)
        if done is not None:
            return done
    # No conditional create in Beam's FileSystems: check, then create (a race window of one round trip).
    if FileSystems.exists(path):
        return False
    with FileSystems.create(path, mime_type="application/json") as fh:
        fh.write(data)
    return True


def _read_lock_doc(path: str) -> dict | None:
    """The holder's details; None when the lock is gone. A lock still being written reads as just created."""
    try:
        with _open_read(path) as fh:
            blob = fh.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(blob)
        if isinstance(doc, dict):
            return doc
    except ValueError:
        pass
    try:  # half-written: age it by its modification time, so that a holder that died mid-write still goes stale
        mtime = (os.stat(path).st_mtime if not _remote(path)
                 else FileSystems.match([path])[0].metadata_list[0].last_updated_in_seconds)
    except Exception:  # noqa: BLE001 - no better age to be had
        mtime = time.time()
    return {"heartbeat_epoch": mtime}


class _NoFlock(Exception):
    pass


class RunLock:
    """The lock of one run directory; a context manager. ``create``: make the directory when it is missing (a
    run's output) or refuse (a stage run alone needs an existing one). ``strategy``: ``flock`` (local default) or
    ``exclusive`` (other filesystems; local too where flock is not supported)."""

    def __init__(self, out_dir: str, command: str | None = None, *, create: bool = True, strategy: str | None = None,
                 stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S):
        self.out_dir, self.create = out_dir, create
        self.path = _join(out_dir, LOCK_NAME)
        self.strategy = strategy or ("exclusive" if _remote(out_dir) else "flock")
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self.doc = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now_iso(),
                    "started_epoch": time.time(), "command": command, "token": uuid.uuid4().hex}
        self.took_over: dict | None = None
        self.held = False
        self._fd: int | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _payload(self) -> bytes:
        return (json.dumps({**self.doc, "heartbeat_epoch": time.time()}, indent=1) + "\n").encode()

    def _busy(self, holder: dict | None, hint: str = "") -> RunDirBusy:
        return RunDirBusy(f"{self.out_dir} is in use by another longreel run ({describe_holder(holder)}); wait for it "
                          f"to finish or choose another --out{hint}")

    def acquire(self) -> "RunLock":
        ensure_dir(self.out_dir, self.create)
        if self.strategy == "flock":
            try:
                self._acquire_flock()
            except _NoFlock:
                log.warning("%s: the filesystem refuses flock; using an exclusive-create lock file", self.out_dir)
                self.strategy = "exclusive"
                self._acquire_exclusive()
        else:
            self._acquire_exclusive()
        self.held = True
        return self

    def _acquire_flock(self) -> None:
        import fcntl

        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError as e:
                raise RunDirError(f"cannot write into {self.out_dir}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                raise self._busy(holder) from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise _NoFlock() from None
                raise
            # A holder releasing unlinks the file before closing it: if we locked that unlinked file, start over.
            try:
                st, cur = os.fstat(fd), os.stat(self.path)
                same = (st.st_ino, st.st_dev) == (cur.st_ino, cur.st_dev)
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            old = os.pread(fd, 1 << 16, 0)
            if old:
                self.took_over = _parse(old) or {}
                log.warning("%s: taking over the lock left by a run that no longer holds it (%s): %s", self.out_dir,
                            describe_holder(self.took_over), self._why_stale(self.took_over))
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._payload(), 0)
            os.fsync(fd)
            self._fd = fd
            return
        raise self._busy(None)

    def _why_stale(self, old: dict) -> str:
        pid = old.get("pid")
        if old.get("host") == self.doc["host"] and isinstance(pid, int):
            return (f"pid {pid} is no longer running" if not pid_alive(pid) else
                    f"pid {pid} runs but does not hold the lock (a reused pid)")
        return "its process no longer holds the lock (ended or killed)"

    def _stale_reason(self, old: dict) -> str | None:
        pid = old.get("pid")
        if old.get("host") == self.doc["host"] and isinstance(pid, int):
            return None if pid_alive(pid) else f"pid {pid} is no longer running on this host"
        beat = old.get("heartbeat_epoch") or old.get("started_epoch") or 0
        age = time.time() - float(beat)
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f} s (stale after {self.stale_after_s:.0f} s)"
        return None

    def _acquire_exclusive(self) -> None:
        for _ in range(3):
            if _create_if_absent(self.path, self._payload()):
                break
            old = _read_lock_doc(self.path)
            if old is None:
                continue  # released between our two looks
            why = self._stale_reason(old)
            if why is None:
                raise self._busy(old, f" (if that run is gone, remove {self.path})")
            log.warning("%s: taking over a stale lock (%s): %s", self.out_dir, describe_holder(old), why)
            self.took_over = old
            _delete_quiet(self.path)
        else:
            raise self._busy(_read_lock_doc(self.path))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="longreel-lock-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                doc = _read_lock_doc(self.path)
                if not doc or doc.get("token") != self.doc["token"]:
                    log.error("%s: this run's lock was taken over by %s; outputs may be mixed", self.out_dir,
                              describe_holder(doc))
                    return
                write_atomic(self.path, self._payload(), fsync=True)
            except Exception as e:  # noqa: BLE001 - a missed beat is retried at the next one
                log.warning("%s: lock heartbeat failed: %s", self.out_dir, e)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self._fd is not None:
            try:
                os.unlink(self.path)  # before closing: see the inode check in _acquire_flock
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
            return
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=5)
        doc = _read_lock_doc(self.path)
        if doc and doc.get("token") == self.doc["token"]:
            _delete_quiet(self.path)


def _parse(blob: bytes) -> dict | None:
    try:
        doc = json.loads(blob)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


# ---------------------------------------------------------------------------------------------------------------
# the run's files and the marker
# ---------------------------------------------------------------------------------------------------------------

def _owned_top(name: str) -> bool:
    return name in OWNED_FILES or bool(_TABLE.fullmatch(name)) or bool(_TEMP.fullmatch(name))


def owned_files(out_dir: str) -> list[str]:
    """Relative (``/``-separated) paths of the files in ``out_dir`` that belong to longreel's output layout."""
    out: list[str] = []
    if _remote(out_dir):
        base = out_dir.rstrip("/") + "/"
        for r in FileSystems.match([base + "**"]):
            for m in r.metadata_list:
                rel = m.path[len(base):] if m.path.startswith(base) else None
                if not rel or rel == LOCK_NAME:
                    continue
                head, _, rest = rel.partition("/")
                if (rest and head in OWNED_DIRS) or (not rest and _owned_top(head)):
                    out.append(rel)
        return sorted(set(out))
    if not os.path.isdir(out_dir):
        return []
    for name in sorted(os.listdir(out_dir)):
        p = os.path.join(out_dir, name)
        if name in OWNED_DIRS and os.path.isdir(p) and not os.path.islink(p):
            for root, dirs, files in os.walk(p):
                dirs.sort()
                rel_root = os.path.relpath(root, out_dir).replace(os.sep, "/")
                out.extend(f"{rel_root}/{f}" for f in sorted(files))
        elif _owned_top(name) and not os.path.isdir(p):
            out.append(name)
    return sorted(out)


def other_files(out_dir: str) -> list[str]:
    """Top-level names in a local ``out_dir`` that are not longreel's (left alone by ``overwrite``)."""
    if _remote(out_dir) or not os.path.isdir(out_dir):
        return []
    def ours(n: str) -> bool:
        return n == LOCK_NAME or _owned_top(n) or (n in OWNED_DIRS and os.path.isdir(os.path.join(out_dir, n)))
    return sorted(n for n in os.listdir(out_dir) if not ours(n))


@dataclass
class RunIdentity:
    """What makes two runs the same run: the resolved config and the inputs."""
    config: dict
    config_hash: str
    stages: list[str]
    inputs_digest: str | None = None
    n_inputs: int | None = None


def digest_inputs(items: list[dict]) -> str:
    rows = sorted(json.dumps([it.get("uri"), it.get("license"), it.get("attribution")], ensure_ascii=False)
                  for it in items)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def read_marker(out_dir: str) -> dict | None:
    from longreel.schemas.run_marker import read_marker as _read
    return _read(out_dir, open_file=_open_read)


def _marker_listed(rel: str) -> bool:
    return rel != MARKER_NAME and not _TEMP.fullmatch(rel.rsplit("/", 1)[-1])


class FileDigests:
    """The sha256 of a local run's files, hashed in background threads from :meth:`start` on.

    Why: the marker hashes every file of the run (a frame cache and its shards are hundreds of MB), and that ran on
    one core after the card, at the very end of every run. Started when the pipeline is done, the hashing (hashlib
    releases the GIL) runs on the other cores while the card is built. :meth:`get` hands :func:`write_marker` a
    digest only if the file's size, times and inode are what they were before it was hashed; anything else (a file
    written since, one the threads did not reach) is hashed again there, so the marker says what is on disk.
    Remote directories are not pre-hashed (their reads are the slow part, and they stay in the marker's loop)."""

    def __init__(self, out_dir: str, threads: int = 1):
        self.out_dir, self.threads = out_dir, threads
        self._pool = None
        self._futures: dict = {}

    def start(self) -> None:
        if _remote(self.out_dir) or self._pool is not None:
            return
        from concurrent.futures import ThreadPoolExecutor
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="marker-digest")
        self._futures = {rel: self._pool.submit(self._hash, rel) for rel in owned_files(self.out_dir)
                         if _marker_listed(rel)}

    def _path(self, rel: str) -> str:
        return _join(self.out_dir, *rel.split("/"))

    @staticmethod
    def _identity(st: os.stat_result) -> tuple:
        # ctime and the inode too: an atomic rewrite (a new inode renamed over the name) or a write within the
        # filesystem's timestamp tick that keeps the size still changes one of them
        return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino

    def _hash(self, rel: str) -> tuple:
        st = os.stat(self._path(rel))
        with open(self._path(rel), "rb") as fh:
            n, digest = sha256_of(fh)
        return self._identity(st), n, digest

    def get(self, rel: str) -> tuple[int, str] | None:
        """``(bytes, sha256)`` of ``rel`` if it was hashed and has not changed since; else None."""
        fut = self._futures.get(rel)
        if fut is None:
            return None
        try:
            before, n, digest = fut.result()
            st = os.stat(self._path(rel))
        except OSError:
            return None
        return (n, digest) if self._identity(st) == before and n == before[0] else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "FileDigests":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_marker(out_dir: str, ident: RunIdentity, steps: list[dict], digests: FileDigests | None = None) -> dict:
    """Hash every file of the run (or take ``digests``' hash of a file unchanged since) and write
    ``_SUCCESS.json`` last (atomically); return the document."""
    files = []
    for rel in owned_files(out_dir):
        if not _marker_listed(rel):
            continue
        known = digests.get(rel) if digests is not None else None
        if known is None:
            with _open_read(_join(out_dir, *rel.split("/"))) as fh:
                known = sha256_of(fh)
        n, digest = known
        files.append({"path": rel, "bytes": n, "sha256": digest})
    doc = {"kind": MARKER_KIND, "schema_version": MARKER_VERSION, "config_hash": ident.config_hash,
           "stages": list(ident.stages), "inputs": {"count": ident.n_inputs, "sha256": ident.inputs_digest},
           "steps": steps, "config": ident.config, "files": files}
    write_atomic(_join(out_dir, MARKER_NAME), json.dumps(doc, indent=1, default=str) + "\n", fsync=True)
    log.info("%s: %s written (%d files)", out_dir, MARKER_NAME, len(files))
    return doc


def write_inputs(out_dir: str, ident: RunIdentity) -> None:
    """Record the run's inputs digest before its first output: an unfinished run has no marker to hold it, and
    without it ``--resume`` continued a crashed run with other inputs, mixing two input sets in one directory."""
    doc = {"sha256": ident.inputs_digest, "count": ident.n_inputs}
    write_atomic(_join(out_dir, INPUTS_NAME), json.dumps(doc, indent=1) + "\n")


def remove_stage_configs(out_dir: str, stages) -> None:
    """A ``curate`` run re-runs ``stages`` with config.yaml's sections: what a stage run alone recorded of them
    before would describe outputs that are gone (and the card would state it)."""
    for stage in stages:
        if stage in STAGE_CONFIG_FILES:
            _delete_quiet(_join(out_dir, STAGE_CONFIG_FILES[stage]))


def _inputs_diff(out_dir: str, ident: RunIdentity) -> list[str]:
    """The identity line for an unfinished run's recorded inputs against this run's; none when it recorded none
    (a run written before :data:`INPUTS_NAME` existed) or this run's are unknown."""
    try:
        with _open_read(_join(out_dir, INPUTS_NAME)) as fh:
            old = json.loads(fh.read())
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return []
    return identity_diff({"config": ident.config, "inputs": old}, ident) if isinstance(old, dict) else []


def remove_marker(out_dir: str) -> None:
    """Before a run's first write: from here until its new marker the directory reads as unfinished."""
    _delete_quiet(_join(out_dir, MARKER_NAME))


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def config_diff(old: dict, new: dict, limit: int = 8) -> list[str]:
    """``key: there -> this run`` lines for the keys whose values differ."""
    a, b = _flatten(json.loads(json.dumps(old, default=str))), _flatten(json.loads(json.dumps(new, default=str)))
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k, "(absent)") != b.get(k, "(absent)")]
    lines = [f"{k}: {json.dumps(a.get(k, '(absent)'))} there, {json.dumps(b.get(k, '(absent)'))} in this run"
             for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f"... and {len(keys) - limit} more keys")
    return lines


def identity_diff(marker: dict, ident: RunIdentity) -> list[str]:
    lines = config_diff(marker.get("config") or {}, ident.config)
    old_inputs = marker.get("inputs") or {}
    if ident.inputs_digest is not None and old_inputs.get("sha256") not in (None, ident.inputs_digest):
        there = "the inputs named" if old_inputs.get("count") is None else f"{old_inputs['count']} inputs"
        lines.append(f"inputs: {there} (sha256 {str(old_inputs.get('sha256'))[:12]}) there, "
                     f"{'the inputs named' if ident.n_inputs is None else ident.n_inputs} "
                     f"(sha256 {ident.inputs_digest[:12]}) in this run")
    return lines


def _read_yaml(path: str):
    import yaml
    try:
        with _open_read(path) as fh:
            return yaml.safe_load(fh.read())
    except (FileNotFoundError, yaml.YAMLError, UnicodeDecodeError):
        return None


def run_settings(out_dir: str, section: str) -> dict | None:
    """The ``section`` mapping of ``out_dir``'s ``config.yaml`` (the settings its ``curate`` ran with), or None when
    the directory holds no readable one or it has no such section (the stage then says what is wrong with it)."""
    try:
        cfg = _read_yaml(_join(out_dir, "config.yaml"))
    except OSError:  # OUT is a file, unreadable...: the stage's own checks report it in its words
        return None
    data = cfg.get(section) if isinstance(cfg, dict) else None
    return data if isinstance(data, dict) else None


def looks_like_run(out_dir: str) -> bool:
    try:
        with _open_read(_join(out_dir, "stats.json")) as fh:
            if json.loads(fh.read()).get("kind") == "longreel-funnel":
                return True
    except (FileNotFoundError, ValueError, AttributeError):
        pass
    cfg = _read_yaml(_join(out_dir, "config.yaml"))
    return isinstance(cfg, dict) and {"ingest", "segment", "stages"} <= set(cfg)


def remove_outputs(out_dir: str, marker: dict | None) -> list[str]:
    """Remove the previous run's files (see the module doc); return what was removed."""
    targets = set(owned_files(out_dir))
    if marker:
        targets |= {e["path"] for e in marker.get("files", []) if isinstance(e, dict) and safe_relpath(e.get("path"))}
    targets.discard(LOCK_NAME)
    # The marker goes first: from then on an interrupted removal leaves a directory that reads as unfinished.
    ordered = ([MARKER_NAME] if MARKER_NAME in targets else []) + sorted(targets - {MARKER_NAME})
    removed = [rel for rel in ordered if _delete_quiet(_join(out_dir, *rel.split("/")))]
    if not _remote(out_dir):
        for d in OWNED_DIRS:
            top = os.path.join(out_dir, d)
            if os.path.isdir(top) and not os.path.islink(top):
                for root, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
                    try:
                        os.rmdir(root)
                    except OSError:
                        pass  # not empty: something longreel did not write and the marker does not list
    return removed


def prepare(out_dir: str, ident: RunIdentity, if_exists: str = "error") -> tuple[str, dict | None]:
    """Decide whether this run may write into ``out_dir`` (whose lock the caller holds) and make it ready.

    Returns ``(action, old_marker)``: ``fresh`` (nothing of a run there), ``resume`` (same run: its marker, if
    any, is removed until this run writes its own) or ``overwrite`` (the old run's files were removed). Raises
    :class:`RunDirConflict` when the directory holds what this run may not mix with."""
    if if_exists not in IF_EXISTS:
        raise ValueError(f"if_exists must be one of {IF_EXISTS}, not {if_exists!r}")
    try:
        old, bad_marker = read_marker(out_dir), None
    except IncompleteRun as e:
        old, bad_marker = None, str(e)
    present = owned_files(out_dir)
    if old is None and not present:
        return "fresh", None
    how = (f"Re-run with --overwrite to remove that run's files first (those its {MARKER_NAME} lists and longreel's "
           f"own output names, nothing else), or choose another --out.")
    if old is None and bad_marker is None and not looks_like_run(out_dir):
        shown = ", ".join(present[:5]) + (" ..." if len(present) > 5 else "")
        raise RunDirConflict(f"{out_dir} holds files with the names a run writes ({shown}) but no sign of a longreel "
                             f"run (no {MARKER_NAME}, no longreel stats.json or config.yaml); longreel will not touch "
                             "them: choose an empty or new --out")
    if if_exists == "overwrite":
        removed = remove_outputs(out_dir, old)
        others = other_files(out_dir)
        log.warning("%s: --overwrite removed %d files of the previous run%s", out_dir, len(removed),
                    f"; left {len(others)} other files alone: {', '.join(others[:5])}" if others else "")
        return "overwrite", old
    if old is not None:
        diff = identity_diff(old, ident)
        if not diff:
            remove_marker(out_dir)
            return "resume", old
        cfg_differs = any(not d.startswith("inputs:") for d in diff)
        inputs_differ = any(d.startswith("inputs:") for d in diff)
        what = " and ".join(w for w, on in (("a different configuration", cfg_differs),
                                             ("different inputs", inputs_differ)) if on)
        lead = ("--resume continues a run only with its own configuration and inputs; " if if_exists == "resume"
                else "")
        raise RunDirConflict(f"{out_dir} holds a finished run with {what}:\n  " + "\n  ".join(diff)
                             + f"\n{lead}{how}")
    old_cfg = _read_yaml(_join(out_dir, "config.yaml"))
    diff = config_diff(old_cfg, ident.config) if isinstance(old_cfg, dict) else ["config.yaml: missing or unreadable"]
    diff += _inputs_diff(out_dir, ident)
    state = (f"an unfinished run (no {MARKER_NAME}: it failed, was killed, or was written before markers)"
             if bad_marker is None else f"a run with a damaged marker ({bad_marker})")
    if not diff and if_exists == "resume":
        return "resume", None
    if not diff:
        raise RunDirConflict(f"{out_dir} holds {state} with this configuration and inputs. Re-run with --resume to "
                             "continue it, or --overwrite to remove its files first, or choose another --out.")
    what = " and ".join(w for w, on in (("another configuration", any(not d.startswith("inputs:") for d in diff)),
                                        ("other inputs", any(d.startswith("inputs:") for d in diff))) if on)
    raise RunDirConflict(f"{out_dir} holds {state} with {what}:\n  " + "\n  ".join(diff)
                         + ("\n--resume continues a run only with its own configuration and inputs; "
                            if if_exists == "resume" else "\n") + how)
