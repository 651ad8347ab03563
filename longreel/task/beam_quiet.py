"""Beam's import noise, dropped: importing ``apache_beam`` logs a warning on the root logger that optional GCP
client libraries are absent, which is true of every run that does not use GCP. Whatever imports Beam first (the
CLI, the zygote worker, the shard writer used by the trainer's benchmarks) installs this filter before it does."""
from __future__ import annotations

import logging

__all__ = ["DropBeamImportNoise", "quiet_beam_import"]


class DropBeamImportNoise(logging.Filter):
    """Drops the one 'apitools not found' record; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


def quiet_beam_import() -> None:
    """Installs :class:`DropBeamImportNoise` on the root logger, where Beam logs the warning (once per process)."""
    root = logging.getLogger()
    if not any(isinstance(f, DropBeamImportNoise) for f in root.filters):
        root.addFilter(DropBeamImportNoise())
