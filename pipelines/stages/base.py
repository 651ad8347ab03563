"""What every stage shares: the main/rejects output tags, output validation, progress logging.

A stage is a composite ``PTransform`` whose ``expand`` returns ``{"main": pcoll, "rejects": pcoll}``.
DoFns yield main rows plainly and rejects as ``TaggedOutput(REJECTS, row)``; :func:`checked`
validates a main row against its record kind and turns a violation into a reject instead of
letting a malformed row reach Parquet (or crash the run).
"""
from __future__ import annotations

import logging
import threading
import time

from apache_beam.pvalue import TaggedOutput

from longreel.schemas import SchemaError, reject, validate_row

MAIN = "main"
REJECTS = "rejects"

log = logging.getLogger("longreel")


class WorkerModel:
    """A model or engine loaded once per worker process: ``apache_beam.utils.shared.Shared`` keeps only a weak
    reference to what it hands out, and plain tuples, dicts and most engines cannot be weakly referenced."""

    def __init__(self, value):
        self.value = value


def rejected(stage: str, key: str, reason: str, message: str, **kw) -> TaggedOutput:
    return TaggedOutput(REJECTS, reject(stage, key, reason, message, **kw))


def checked(stage: str, kind: str, row: dict, key: str):
    """Yield ``row`` if valid for ``kind``, else a ``schema_violation`` reject naming the problem."""
    try:
        validate_row(kind, row)
    except SchemaError as e:
        return rejected(stage, key, "schema_violation", str(e), video_id=row.get("video_id"))
    return row


class Progress:
    """Throttled progress lines for long stages (one per process; logs go to worker logs on Dataflow)."""

    def __init__(self, stage: str, unit: str, every_s: float = 5.0):
        self.stage, self.unit, self.every_s = stage, unit, every_s
        self.n = 0
        self.t0 = time.monotonic()
        self.last = self.t0
        self._lock = threading.Lock()

    def tick(self, what: str = "") -> None:
        with self._lock:
            self.n += 1
            now = time.monotonic()
            if now - self.last >= self.every_s or self.n == 1:
                rate = self.n / max(now - self.t0, 1e-9)
                log.info("%s: %d %s (%.2f/s)%s", self.stage, self.n, self.unit, rate,
                         f" last: {what}" if what else "")
                self.last = now
