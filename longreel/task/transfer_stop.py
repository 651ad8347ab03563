"""Stopping a transfer from another thread, even one blocked waiting for data.

A shard's download ahead runs in a worker thread, blocked in a socket read whenever the server is slow. A flag that
the copy loop looks at between reads is not enough: with a stalled server the next read does not return until the
socket's timeout (urllib's 120 s), and closing the response from another thread does not wake it either. Shutting
the socket down does: the blocked read returns at once (end of stream). :class:`StopSignal` is a
``threading.Event`` whose :meth:`~StopSignal.set` also runs the cut of every transfer registered with
:meth:`~StopSignal.cuts` at that moment.
"""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["StopSignal", "cut_transfer", "cut_on_stop"]


class StopSignal(threading.Event):
    """An event that, when set, also cuts the transfers registered with :meth:`cuts`."""

    def __init__(self):
        super().__init__()
        self._guard = threading.Lock()
        self._cuts: dict[object, Callable[[], None]] = {}

    def set(self) -> None:
        with self._guard:
            super().set()
            cuts = list(self._cuts.values())
        for cut in cuts:
            cut()

    @contextmanager
    def cuts(self, cut: Callable[[], None]) -> Iterator[None]:
        """Run ``cut`` when the signal is set while the block runs (at once if it is set already)."""
        key = object()
        with self._guard:
            now = self.is_set()
            if not now:
                self._cuts[key] = cut
        if now:
            cut()
        try:
            yield
        finally:
            with self._guard:
                self._cuts.pop(key, None)


def cut_transfer(src) -> None:
    """End ``src``'s transfer so that a read blocked on it returns: an ``http(s)`` response's socket is shut down (a
    response keeps its socket in ``fp.raw._sock``, the standard library's ``SocketIO``; there is no public handle),
    a webdataset ``Pipe``'s process (``gsutil``, ``aws``) killed. Anything else is left alone, to end at its next
    read."""
    sock = getattr(getattr(getattr(src, "fp", None), "raw", None), "_sock", None)
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed: the transfer ended on its own
            pass
        return
    proc = getattr(src, "proc", None)
    if proc is not None and hasattr(proc, "kill"):
        try:
            proc.kill()
        except OSError:
            pass


@contextmanager
def cut_on_stop(stop, src) -> Iterator[None]:
    """While the block runs, setting ``stop`` cuts ``src``'s transfer (when ``stop`` is a :class:`StopSignal`; a
    plain event is only looked at between reads)."""
    if not isinstance(stop, StopSignal):
        yield
        return
    with stop.cuts(lambda: cut_transfer(src)):
        yield
