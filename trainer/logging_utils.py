"""Per-step metrics: JSONL (the record of a run), TensorBoard event files, and a tqdm progress bar.

Only rank 0 writes. ``metrics.jsonl`` has one JSON object per logged step (``{"step": N, "stage": ..., name:
value, ...}``); when a run resumes from step ``S`` the lines after ``S`` (written after the checkpoint by a run that
then died) are dropped first, so the file always describes one continuous run, and so are lines that are not whole
JSON (a run killed while it wrote one), with a warning.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping

from longreel.schemas.atomic import write_atomic

__all__ = ["MetricsLogger", "read_metrics"]

log = logging.getLogger("longreel.trainer")


def _clean(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``metrics.jsonl``. A last line cut short (a run killed, or a machine that went down, while it
    wrote the line: part of it, or NUL bytes) is left out with a warning; a line in the middle that is not JSON is an
    error (``ValueError``) naming it."""
    rows, bad, last = _parse_lines(path)
    inside = [(n, err) for n, err in bad if n != last]
    if inside:
        raise ValueError(f"{path}:{inside[0][0]}: not a JSON line ({inside[0][1]})")
    if bad:
        log.warning("%s: its last line (line %d) is cut short, as a run killed while writing it leaves it: left out",
                    path, last)
    return rows


def _parse_lines(path) -> tuple[list[dict], list[tuple[int, str]], int]:
    """Rows, ``(line number, error)`` of the non-blank lines that are not a JSON object, and the number of non-blank
    lines."""
    rows, bad, number = [], [], 0
    with open(path, "rb") as fh:
        for number, raw in enumerate((r for r in fh if r.strip(b" \t\r\n\0")), start=1):
            try:
                row = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as err:
                bad.append((number, str(err)))
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad.append((number, "not a JSON object"))
    return rows, bad, number


class MetricsLogger:
    def __init__(self, out_dir: str | os.PathLike, *, stage: str, enabled: bool = True, tensorboard: bool = True,
                 progress: bool = True, total_steps: int = 0, start_step: int = 0):
        self.enabled = enabled
        self.stage = stage
        self.path = Path(out_dir) / "metrics.jsonl"
        self._tb = None
        self._bar = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            rows, bad, _ = _parse_lines(self.path)
            if bad:  # a run killed mid-line (or a disk that filled up): the record goes on without the torn line
                log.warning("%s: left out %d line(s) that are not whole JSON (line %s), as a run killed while writing "
                            "leaves them", self.path, len(bad), ", ".join(str(n) for n, _ in bad))
            kept = [r for r in rows if int(r.get("step", 0)) <= start_step]
            write_atomic(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        self._fh = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # pragma: no cover - tensorboard is a dependency
                log.warning("tensorboard is not installed: metrics go to %s only", self.path)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=stage, dynamic_ncols=True)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "stage": self.stage}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(f"{self.stage}/{k}", v, step)
        if self._bar is not None:
            shown = {k: row[k] for k in ("loss", "reward_mean", "accuracy", "grad_norm") if row.get(k) is not None}
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if not self.enabled or getattr(self, "_closed", False):
            return
        self._closed = True
        self._fh.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._bar is not None:
            self._bar.close()
