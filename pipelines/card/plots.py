"""The card's plots, as deterministic PNGs (matplotlib Agg, fixed rcParams, no Software/date metadata).

Each plot is drawn from ``card.json`` alone: the funnel (in / out / rejected per stage), category balance
(released questions when there are shards, else generated ones), the pass-count histogram and the video
duration histogram, the released answer letters (with their chi-square against uniform) and the blind filter's
pass-count histogram. A plot with no data says so in its title instead of being left out, so the card always
links every image.
"""
from __future__ import annotations

import os

from longreel.schemas.atomic import atomic_open

FIGSIZE = (7.0, 3.6)
DPI = 100
RC = {"font.family": "DejaVu Sans", "font.size": 9, "axes.titlesize": 10, "svg.hashsalt": "longreel",
      "path.simplify": True, "figure.dpi": DPI, "savefig.dpi": DPI, "axes.spines.top": False,
      "axes.spines.right": False, "hatch.linewidth": 0.8}
COLORS = {"in": "#4C72B0", "out": "#55A868", "rejected": "#C44E52", "bar": "#4C72B0", "alt": "#DD8452"}


def compact(v: int) -> str:
    """A short bar label: 950, 4.7k, 16k, 1.2M (the card's tables carry the exact numbers)."""
    for div, unit in ((1_000_000, "M"), (1_000, "k")):
        if abs(v) >= div:
            x = v / div
            return (f"{x:.1f}".rstrip("0").rstrip(".") if x < 10 else f"{x:.0f}") + unit
    return str(v)


def _save(fig, path: str) -> str:
    with atomic_open(path) as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    return path


def _bars(ax, labels, values, color, title, xlabel, ylabel, rotate=False):
    xs = list(range(len(labels)))
    ax.bar(xs, values, color=color, width=0.7)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=30 if rotate else 0, ha="right" if rotate else "center")
    for x, v in zip(xs, values):
        ax.annotate(compact(v), (x, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    top = max(values) if values else 0
    ax.set_ylim(0, max(1, top) * 1.15)
    ax.yaxis.get_major_locator().set_params(integer=True)


def write_plots(card: dict, out_dir: str) -> list[str]:
    """The card's plots (``PLOTS``) as PNG files in ``out_dir``; returns their paths."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from longreel.pipelines.card.claims import claims_by_id

    cl = claims_by_id(card)
    dist = {s: cl[f"dist/{s}"] for s in cl["dist/sections"]}
    paths = []
    with matplotlib.rc_context(RC):
        for name, draw, size in (("funnel.png", _funnel, (max(FIGSIZE[0], 1.15 * len(cl["funnel/stages"])),
                                                          FIGSIZE[1])),
                                 ("category_balance.png", _category_balance, FIGSIZE),
                                 ("pass_count.png", _pass_counts, FIGSIZE),
                                 ("duration.png", _durations, FIGSIZE),
                                 ("answer_letters.png", _answer_letters, FIGSIZE),
                                 ("blind_pass_count.png", _blind_pass_counts, FIGSIZE)):
            fig, ax = plt.subplots(figsize=size)
            draw(ax, cl, dist)
            fig.tight_layout()
            paths.append(_save(fig, os.path.join(out_dir, name)))
            plt.close(fig)
    return paths


def _funnel(ax, cl: dict, dist: dict) -> None:
    """In / out / rejected per stage (stages count different units: a log scale when they differ by orders of
    magnitude)."""
    stages = [cl[f"funnel/{s}"] | {"stage": s} for s in cl["funnel/stages"]]
    xs = list(range(len(stages)))
    w = 0.27
    for i, (what, vals) in enumerate((("in", [s["in"] for s in stages]), ("out", [s["out"] for s in stages]),
                                      ("rejected", [s["rejected_total"] for s in stages]))):
        bx = [x + (i - 1) * w for x in xs]
        ax.bar(bx, vals, width=w, color=COLORS[what], label=what)
        for x, v in zip(bx, vals):
            ax.annotate(compact(v), (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{s['stage']}\n({s['unit']})" for s in stages])
    top = max([s["in"] for s in stages] + [1])
    low = min([s["in"] for s in stages if s["in"]] + [top])
    if top / low > 50:
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(0, top * 6)
        ax.set_title("Filter funnel: in / out / rejected per stage (log scale)")
    else:
        ax.set_ylim(0, top * 1.18)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title("Filter funnel: in / out / rejected per stage")
    ax.set_ylabel("count (in the stage's unit)")
    ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _category_balance(ax, cl: dict, dist: dict) -> None:
    sect = "released_category" if sum(dist.get("released_category", {}).values()) else "qra_category"
    counts = dist.get(sect, {})
    if counts:
        _bars(ax, list(counts), list(counts.values()), COLORS["bar"],
              f"Category balance ({'released' if sect.startswith('released') else 'generated'} questions)",
              "category", "questions")
    else:
        ax.set_axis_off()
        ax.set_title("Category balance: no questions in this run")


def _pass_counts(ax, cl: dict, dist: dict) -> None:
    """The pass-count histogram: every scored question, and the released ones beside them."""
    scored = dist.get("pass_count", {})
    released = dist.get("released_pass_count", {})
    if sum(scored.values()) or sum(released.values()):
        ks = sorted(int(k) for k, n in dist.get("pass_k", {}).items() if n)
        seen = [int(x) for x, n in list(scored.items()) + list(released.items()) if n]
        k = max(ks + seen)
        xs = list(range(k + 1))
        series = [("scored", scored, COLORS["in"]), ("released", released, COLORS["out"])]
        series = [s for s in series if sum(s[1].values())]
        w = 0.8 / len(series)
        for i, (what, counts, color) in enumerate(series):
            bx = [x + (i - (len(series) - 1) / 2) * w for x in xs]
            vals = [int(counts.get(str(x), 0)) for x in xs]
            ax.bar(bx, vals, width=w, color=color, label=what)
            for x, v in zip(bx, vals):
                ax.annotate(compact(v), (x, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                            textcoords="offset points")
        top = max([int(v) for _, c, _ in series for v in c.values()] + [1])
        ax.set_ylim(0, top * 1.18)
        ax.set_xticks(xs)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_title(f"Pass-count histogram (k = {', '.join(map(str, ks)) if ks else k})")
        ax.set_xlabel("samples answered correctly out of k")
        ax.set_ylabel("questions")
        ax.legend(frameon=False, loc="upper right")
    else:
        ax.set_axis_off()
        ax.set_title("Pass-count histogram: no pass-rate filter in this run")


def _durations(ax, cl: dict, dist: dict) -> None:
    counts = dist.get("video_duration_s", {})
    if counts:
        _bars(ax, list(counts), list(counts.values()), COLORS["alt"], "Source videos by duration",
              "duration (s)", "videos", rotate=True)
    else:
        ax.set_axis_off()
        ax.set_title("Video durations: no videos")


def _answer_letters(ax, cl: dict, dist: dict) -> None:
    """Released multiple-choice questions per answer letter; the chi-square test against uniform in the title."""
    al = cl.get("quality/answer_letters")
    if not al:
        ax.set_axis_off()
        ax.set_title("Answer letters: no multiple-choice question released")
        return
    _bars(ax, list(al["counts"]), [int(v) for v in al["counts"].values()], COLORS["bar"],
          f"Released answer letters (chi-square {al['chi2']:.2f}, df {al['df']}, p = {al['p_value']:.3f})",
          "answer letter", "questions")


def _blind_pass_counts(ax, cl: dict, dist: dict) -> None:
    """The blind filter's pass counts: every scored question, and the released ones (from the shards)."""
    bl = cl.get("quality/blind")
    if not bl:
        ax.set_axis_off()
        ax.set_title("Blind pass-count histogram: no blind filter in this run")
        return
    hist = [int(n) for n in bl["pass_count_histogram"]]
    released = dist.get("released_blind_pass_count", {})
    xs = list(range(len(hist)))
    rel = [int(released.get(str(x), 0)) for x in xs]
    series = [("scored", hist, COLORS["in"])] + ([("released", rel, COLORS["out"])] if sum(rel) else [])
    w = 0.8 / len(series)
    for i, (what, vals, color) in enumerate(series):
        bx = [x + (i - (len(series) - 1) / 2) * w for x in xs]
        ax.bar(bx, vals, width=w, color=color, label=what)
        for x, v in zip(bx, vals):
            ax.annotate(compact(v), (x, v), ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                        textcoords="offset points")
    ax.set_ylim(0, max(hist + rel + [1]) * 1.18)
    ax.set_xticks(xs)
    ax.yaxis.get_major_locator().set_params(integer=True)
    rate = (bl.get("answerer") or {}).get("max_pass_rate")
    cut = f"; text_answerable at >= {rate:g} x k" if rate is not None else ""
    ax.set_title(f"Blind pass-count histogram (k = {bl['k']}{cut})")
    ax.set_xlabel("samples answered correctly without the video, out of k")
    ax.set_ylabel("questions")
    ax.legend(frameon=False, loc="upper right")
