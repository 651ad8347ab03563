"""Draw a run's metric curves (``metrics.jsonl``) to a PNG (``longreel train plot``)."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from longreel.trainer.logging_utils import read_metrics

__all__ = ["plot_metrics", "DEFAULT_KEYS"]

# eval_accuracy: held-out accuracy, logged every eval.every steps (drawn when the run evaluated)
DEFAULT_KEYS = {
    "grpo": ("reward_mean", "accuracy", "eval_accuracy", "format_rate", "groups_with_signal", "response_len_mean",
             "entropy_estimate", "loss", "clip_frac", "kl", "grad_norm", "tokens_per_s", "time_step"),
    "sft": ("loss", "eval_accuracy", "grad_norm", "lr", "tokens_per_s"),
}


def plot_metrics(runs: Sequence[str | os.PathLike], out_png: str | os.PathLike, keys: Sequence[str] | None = None,
                 smooth: int = 1) -> list[str]:
    """Plot ``keys`` (default: by the stage of the first run) of each run dir / metrics.jsonl; return the keys drawn.

    ``smooth``: moving-average window (steps) drawn over the raw curve.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for run in runs:
        path = Path(run)
        if path.is_dir():
            path = path / "metrics.jsonl"
            if not path.is_file():
                raise ValueError(f"{run} holds no metrics.jsonl: not a training run's directory (run.out_dir)")
        elif not path.is_file():
            raise ValueError(f"{run}: no such run directory or metrics.jsonl")
        rows = read_metrics(path)
        if not rows:
            raise ValueError(f"{path} has no metrics")
        series.append((str(run), rows))
    stage = series[0][1][0].get("stage", "grpo")
    wanted = list(keys) if keys else list(DEFAULT_KEYS.get(stage, DEFAULT_KEYS["grpo"]))
    logged = {k for _, rows in series for r in rows for k, v in r.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    missing = [k for k in wanted if k not in logged]
    if keys and missing:  # asked for by name: a misspelt key would otherwise just not be drawn
        from longreel.schemas.config import closest

        named = [k + (f" (did you mean {near}?)" if (near := closest(k, logged, cutoff=0.6)) else "") for k in missing]
        raise ValueError(f"--keys: {', '.join(named)} not in the runs' metrics; they hold {', '.join(sorted(logged))}")
    present = [k for k in wanted if k in logged]
    if not present:
        raise ValueError(f"none of {wanted} are in the metrics")
    cols = min(3, len(present))
    nrows = math.ceil(len(present) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        for name, rows in series:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            color = _draw_curve(ax, [p[0] for p in pts], [p[1] for p in pts], Path(name).name or name, smooth)
            band = [(r["step"], r[key], r[f"{key}_ci95_low"], r[f"{key}_ci95_high"]) for r in rows
                    if isinstance(r.get(key), (int, float)) and isinstance(r.get(f"{key}_ci95_low"), (int, float))]
            if band:  # the held-out accuracy's 95% interval: how much of a step-to-step change is the sample
                _draw_interval(ax, band, color)
        ax.set_title(key)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if len(series) > 1:
        axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return present


def _draw_curve(ax, xs: list, ys: list, label: str, smooth: int) -> str:
    """One run's curve of a key (with its moving average when ``smooth`` > 1); return its colour. A single point
    (an eval.every run that evaluated once) is a marker: a line through one point draws nothing."""
    if len(ys) == 1:
        (line,) = ax.plot(xs, ys, label=label, marker="o", linestyle="none")
    elif smooth > 1 and len(ys) >= smooth:
        (raw,) = ax.plot(xs, ys, alpha=0.25)
        avg = [sum(ys[max(0, i - smooth + 1):i + 1]) / len(ys[max(0, i - smooth + 1):i + 1]) for i in range(len(ys))]
        (line,) = ax.plot(xs, avg, label=label, color=raw.get_color())
    else:
        (line,) = ax.plot(xs, ys, label=label)
    return line.get_color()


def _draw_interval(ax, band: list[tuple], color: str) -> None:
    """``band``'s ``(step, value, low, high)`` intervals shaded between the steps, or as an error bar at a lone step
    (a shaded area one step wide has no width)."""
    steps, values, lows, highs = zip(*band)
    if len(band) == 1:
        below, above = max(0.0, values[0] - lows[0]), max(0.0, highs[0] - values[0])
        ax.errorbar(steps, values, yerr=[[below], [above]], fmt="none", ecolor=color, alpha=0.6, capsize=4)
    else:
        ax.fill_between(steps, lows, highs, alpha=0.15, color=color, linewidth=0)
