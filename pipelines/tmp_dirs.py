"""Scratch directories of the pipeline's processes, named for their owner, and the sweep of those a dead run left.

The stages keep decoded frames (the media worker's ``.npy`` replies: up to ~100 MB a directory), local copies of
remote videos and cut clips in local scratch directories, and remove them in their teardown. A run that does not end
normally -- Ctrl-C, which ends the worker processes where they are, a SIGKILL, the out-of-memory killer, a machine
that reboots into a kept ``/tmp`` -- never reaches that teardown: before this module, each such run left its
directories behind (on one development machine, 230 of them, 2.5 GB).

So each directory is named ``longreel-<kind>-<host>-<pid>-<random>`` for the process that made it, and every
pipeline run first removes the directories of this host's processes that no longer exist (:func:`sweep_stale`). A
live process's directories are never touched, whoever runs it (another run on the same machine, at the same time);
nor are other hosts' (a ``/tmp`` shared by containers) or other users'. A dead process's pid that the system has
given to a new process since keeps its directory until that process ends too: the sweep errs on the side of keeping.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import socket
import stat
import tempfile

log = logging.getLogger("longreel")

__all__ = ["make_tmpdir", "remove_made_here", "sweep_stale"]

#: the directories this process made (a forked worker starts with its parent's, which are not its own to remove)
_made: dict[int, list[str]] = {}

_NAME = re.compile(r"^longreel-(?P<kind>[a-z]+)-(?P<host>[A-Za-z0-9.]+)-(?P<pid>\d+)-[A-Za-z0-9_]+$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", ".", socket.gethostname()) or "host"


def make_tmpdir(kind: str) -> str:
    """A new scratch directory for ``kind`` (lower-case letters: ``worker``, ``ingest``, ...) of this process, in
    the system's temporary directory (``$TMPDIR``)."""
    if not re.fullmatch(r"[a-z]+", kind):
        raise ValueError(f"kind must be lower-case letters, not {kind!r}")
    path = tempfile.mkdtemp(prefix=f"longreel-{kind}-{_host()}-{os.getpid()}-")
    if os.getpid() not in _made:
        # a process that ends without its stages' teardown (a run failing or interrupted in the launcher, one
        # worker) removes them on its way out; forked workers end with os._exit and do it themselves
        atexit.register(remove_made_here)
    _made.setdefault(os.getpid(), []).append(path)
    return path


def remove_made_here() -> None:
    """Remove the scratch directories this process made that still exist: for a process that is ending without
    its stages' teardown (see :mod:`longreel.pipelines.zygote_main`)."""
    for path in _made.pop(os.getpid(), []):
        shutil.rmtree(path, ignore_errors=True)


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def sweep_stale(tmp: str | None = None) -> list[str]:
    """Remove the scratch directories in ``tmp`` (default: the system's) that this host's dead processes left; return
    their paths. Logs one line when there were any."""
    from longreel.pipelines.io.run_dir import pid_alive  # the launcher's: Beam is loaded there already

    tmp = tmp or tempfile.gettempdir()
    host, uid = _host(), os.getuid()
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    removed, freed = [], 0
    for name in sorted(names):
        m = _NAME.match(name)
        if m is None or m["host"] != host or pid_alive(int(m["pid"])):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):  # lstat: a link to a directory is not one
            continue
        freed += _size(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d scratch director%s (%.1f MB) in %s that runs which did not end normally left behind",
                 len(removed), "y" if len(removed) == 1 else "ies", freed / 1e6, tmp)
    return removed
