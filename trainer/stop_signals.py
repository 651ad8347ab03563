"""A run stopped by a scheduler's signal ends its step, saves a checkpoint and exits; the same command resumes it.

Clusters take a job's machines back with a signal before they kill it: Slurm sends SIGTERM when it preempts or
cancels a job, and the signal ``--signal`` names (SIGUSR1, say) some time before the time limit; Kubernetes sends
SIGTERM and kills the pod after its grace period; torchrun forwards the SIGTERM it gets to every rank and kills them
``--shutdown_timeout`` seconds later (30 by default). Without a handler a run died in the middle of a step and lost
every step since its last scheduled checkpoint.

The handler only notes the signal (a handler runs between two bytecodes of the main thread, possibly inside the
step, where nothing may be saved); the training loop asks after each step, the ranks agree on it through an
all-reduce of one integer, and all of them stop after the same step. The first signal also puts the previous
handlers back, so that a second one (a user who insists, or a scheduler's next signal) acts at once as it would have
without longreel.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Sequence

log = logging.getLogger("longreel")

__all__ = ["StopSignals", "parse_signal", "UNCATCHABLE"]

#: signals a process cannot handle
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def parse_signal(name: str) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"`` or ``"15"`` -> ``signal.SIGTERM``; ValueError for a name this system does not have
    and for a signal no process can handle."""
    text = name.strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text if text.startswith("SIG")
                                                                             else "SIG" + text]
    except (KeyError, ValueError):
        raise ValueError(f"{name!r} is not a signal of this system (e.g. SIGTERM, SIGUSR1)") from None
    if sig.name in UNCATCHABLE:
        raise ValueError(f"{sig.name} cannot be handled by a process: it always stops the run at once")
    return sig


class StopSignals:
    """While entered (in the main thread), notes the first of ``names`` the process receives in :attr:`received`.

    Outside the main thread (a library caller's worker thread) Python cannot install handlers: it then notes
    nothing, says so once, and the signals keep their previous behaviour."""

    def __init__(self, names: Sequence[str]):
        self.signals = list(dict.fromkeys(parse_signal(n) for n in names))  # twice would save our own as previous
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> "StopSignals":
        if not self.signals:
            return self
        if threading.current_thread() is not threading.main_thread():
            log.info("run.stop_signals: not in the main thread, so %s keep their usual effect",
                     ", ".join(s.name for s in self.signals))
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
        self._restore()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            # None: a handler set outside Python (a C library), which Python cannot set again; the default is the
            # nearest it can give back
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()
