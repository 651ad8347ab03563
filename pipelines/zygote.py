"""Starting the local workers' zygote (:mod:`longreel.pipelines.forked_workers`) before the launcher imports Beam.

The zygote spends about a second of CPU importing Beam's SDK harness and the stage modules; started when the pipeline
object is made, the launcher has already spent as long on its own imports, and the first bundle waits for the
zygote. :func:`prestart` (the CLI calls it first thing, when the run will use forked local workers) lets both
import at once on two cores; :class:`~longreel.pipelines.forked_workers.ForkedWorkerPool` then adopts that process
(:func:`take`) instead of starting one. A prestarted zygote nobody adopted is stopped when this process exits.

This module imports nothing heavy: it is imported before Beam.
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys

_prestarted: subprocess.Popen | None = None


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def fork_available() -> bool:
    return hasattr(os, "fork") and sys.platform != "win32"


def spawn() -> subprocess.Popen:
    """A new zygote: the same interpreter, environment and import path as this process (its sys.path, so a checkout
    run from source finds its own modules), reading its requests on stdin."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-m", "longreel.pipelines.zygote_main"], stdin=subprocess.PIPE,
                            env=env)


def prestart() -> None:
    """Start a zygote now for a run that will fork its local workers later in this process; idempotent."""
    global _prestarted
    if _prestarted is None and fork_available():
        _prestarted = spawn()


def take() -> subprocess.Popen | None:
    """The prestarted zygote, now owned by the caller (None if there is none, or it already exited)."""
    global _prestarted
    z, _prestarted = _prestarted, None
    if z is not None and z.poll() is not None:
        return None
    return z


@atexit.register
def discard() -> None:
    """Stop a prestarted zygote nobody adopted (a run that stopped before its pipeline: an input error, a busy
    output directory). It has forked no worker, so nothing is lost by not waiting for its imports to finish."""
    z = take()
    if z is not None:
        z.terminate()
        z.wait()
