"""The garbage collector around a run: off while the launcher starts, and kept off what start-up left alive.

Starting a run imports Beam, PyAV, torch and the stages: hundreds of thousands of long-lived objects and almost no
garbage, while the collector's full passes over them grow with every module. A run then makes its own objects on top,
and each full collection scans the start-up's as well (140-210 ms per pass in a forked worker of a 14-video run, where
the runner waited for it; see :mod:`longreel.pipelines.forked_workers`, whose zygote does the same for its workers).

:func:`paused` turns the collector off for the start; :func:`frozen` moves what is alive when the run starts to the
permanent generation (``gc.freeze``) and turns it on for the run, so that the run's collections cover what the run
made; both restore the collector as they found it, and :func:`frozen` puts the objects back under collection at its
end, so that a process that runs several pipelines (a test session) holds nothing longer than it would have.

Measured with the zygote's half (14 sample videos, 2 workers, demo config, 6 alternating pairs with both halves
switched off and on): median 15.41 -> 14.47 s, every pair faster; one worker (3 pairs) and 56 videos on 2 workers
(3 pairs) within noise."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off inside (start-up: imports, config, the graph); restored on exit."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def frozen():
    """What is alive now out of every collection inside, and the collector on for what is made inside; restored
    on exit (the frozen objects collectable again, the collector as it was)."""
    was = gc.isenabled()
    gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        gc.unfreeze()
        if not was:
            gc.disable()
