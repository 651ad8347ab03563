"""One training run per output directory at a time: ``RUN/.longreel-train.lock``, held by rank 0.

Two launches on one ``run.out_dir`` (a job restarted while the old one still runs, a copy-pasted command) would
write the same checkpoints, metrics and ``final/`` in turn and resume from each other's steps. The lock is a
``flock`` on a file in the directory, so the kernel drops it when its process dies, ``kill -9`` included: a dead
run never blocks the next. The file names its holder (host, pid, start time, command) for the message the second
launch prints. It is removed when the run ends; the inode is checked after locking, so a launch that opened the file
just before it was removed does not hold a lock on a file no one else can see. ``longreel train`` also looks at the
lock (:func:`check_free`) with its other checks, so that a second launch is refused before its model load.

Written here rather than shared with the curation side's lock (``longreel.pipelines.io.run_dir``, which also
covers object stores): the trainer's ``out_dir`` is always a local directory and the two sides never import each
other.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from longreel.trainer.preflight import InputCheckError

__all__ = ["RunLock", "LOCK_NAME", "check_free", "seen_as_rank_0_sees"]

LOCK_NAME = ".longreel-train.lock"


class RunLock:
    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._fd: int | None = None
        self.record = ""  # what the holder wrote into the file

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`InputCheckError` naming the run that holds it."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                problem = _in_use(self.out_dir, fd)
                os.close(fd)
                raise problem from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file its holder removed on release: try the current one
        os.ftruncate(fd, 0)
        self.record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)})
        os.write(fd, self.record.encode())
        os.fsync(fd)  # the other ranks read it (seen_as_rank_0_sees), on other hosts too (NFS flushes on fsync)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def seen_as_rank_0_sees(out_dir: str | os.PathLike, record: str, rank: int) -> str | None:
    """None when this rank reads rank 0's lock ``record`` in ``out_dir``, else the problem. Every rank writes there
    (checkpoint shards, its RNG state) and reads it back to resume: a directory on each node's own disk would split
    a checkpoint over the nodes and let the ranks resume from different steps."""
    try:
        seen = (Path(out_dir) / LOCK_NAME).read_text(encoding="utf-8")
    except OSError:
        seen = None
    if seen == record:
        return None
    what = "no run lock" if seen is None else "another run's lock"
    holder = json.loads(record)
    return (f"run.out_dir {str(out_dir)!r} is not the same directory for every rank: rank {rank} on "
            f"{socket.gethostname()} finds {what} there, not rank 0's (pid {holder['pid']} on {holder['host']}). "
            "Every rank writes checkpoints there and reads them to resume: give a directory every node mounts (an "
            "absolute path on a shared filesystem)")


def check_free(out_dir: str | os.PathLike) -> None:
    """Raise :class:`InputCheckError` naming the holder when another run holds ``out_dir``'s lock; create nothing.

    For the command's checks before the process group and the model load (minutes for a 7B model), which every
    rank runs: a shared ``flock``, so that the ranks of one launch checking together never see each other, while
    a run's exclusive lock is seen. Rank 0 takes the lock itself later, after every rank has joined the process
    group (hence after their checks); a run that starts in between is still refused then."""
    path = Path(out_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(out_dir, fd) from None
    finally:
        os.close(fd)


def _in_use(out_dir, fd: int) -> InputCheckError:
    return InputCheckError(f"run.out_dir {str(out_dir)!r} is in use by another longreel train run "
                           f"({_read_holder(fd)}); wait for it to end or give another run.out_dir")


def _read_holder(fd: int) -> str:
    try:
        doc = json.loads(os.pread(fd, 65536, 0) or b"{}")
    except (OSError, ValueError):
        return "holder unknown"
    if not doc:
        return "holder unknown"
    return f"pid {doc.get('pid')} on {doc.get('host')}, since {doc.get('started')}: {doc.get('command')}"
