"""The zygote process's entry point (``python -m longreel.pipelines.zygote_main``, started by
:func:`longreel.pipelines.zygote.spawn`): quiet Beam's import noise, then serve requests
(:func:`longreel.pipelines.forked_workers._zygote`).

A module of its own so that the filter is set before anything imports Beam (the worker modules import it at the
top, so a filter set inside them would come too late), and so that :mod:`longreel.pipelines.zygote`, which the
worker modules import, does not import them back."""
import gc
import os
import signal
import time

from longreel.task.beam_quiet import quiet_beam_import


def _end_on_ctrl_c(signum, frame) -> None:
    """Ctrl-C in a terminal signals the whole process group: the launcher reports it in one line; the zygote and
    its workers (which inherit this handler through fork) only end, without Python's KeyboardInterrupt traceback
    from wherever they were (an import, a bundle), removing the scratch directories the process made, which its
    stages' teardown would have."""
    from longreel.pipelines.tmp_dirs import remove_made_here

    signal.signal(signum, signal.SIG_IGN)  # the terminal's SIGINT and the one the launcher passes on: end once
    # From here this process only ends. Its bundle threads run on (a handler runs in the main thread) and fail on
    # what ending removes under them (a decode's scratch files, the launcher's channels); what they would print is
    # noise after the launcher's one line.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    remove_made_here()
    # the launcher got the same signal: let it stop its runner first, so that the runner's threads do not fail on
    # connections this process closed
    time.sleep(0.5)
    os._exit(128 + signum)


signal.signal(signal.SIGINT, _end_on_ctrl_c)

# The zygote only imports, then forks: no collection in it can free anything worth the time (see _zygote)
gc.disable()

# Beam warns at import that optional GCP client libraries are absent: true of every local run, and a line that a
# quiet (-q) run of several workers printed each time
quiet_beam_import()

from longreel.pipelines.forked_workers import _zygote  # noqa: E402 - after the filter, on purpose

if __name__ == "__main__":
    _zygote()
