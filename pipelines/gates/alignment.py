"""Caption-frame alignment: how well a caption's text matches its clip's frames in CLIP's joint embedding space.

``clip_score`` = the mean over the clip's sampled frames of cos(text embedding, frame embedding), in [-1, 1] (the
raw cosine; CLIPScore's 2.5 * max(cos, 0) rescaling is left out so that the threshold reads on the model's own
scale: for ViT-B-32 matching image-text pairs sit around 0.25-0.35, unrelated ones around 0.1-0.15). The card shows
the distribution as a histogram over :data:`BINS` bins of width 0.05 on [-1, 1].
"""
from __future__ import annotations

import numpy as np

STAGE = "align"
MISALIGNED = "caption_misaligned"
BIN_WIDTH = 0.05
BINS = int(round(2 / BIN_WIDTH))


def clip_score(text_emb: np.ndarray, frames_emb: np.ndarray) -> float:
    """``text_emb (d,)`` and ``frames_emb (n, d)``, unit rows -> mean cosine similarity (6 decimals)."""
    return round(float(np.mean(np.asarray(frames_emb, np.float32) @ np.asarray(text_emb, np.float32))), 6)


def score_bin(score: float) -> int:
    """The histogram bin of ``score``: ``[-1 + i * w, -1 + (i + 1) * w)``, the last bin closed at 1."""
    return min(BINS - 1, max(0, int(np.floor((score + 1) / BIN_WIDTH + 1e-9))))


def bin_range(i: int) -> tuple[float, float]:
    return round(-1 + i * BIN_WIDTH, 4), round(-1 + (i + 1) * BIN_WIDTH, 4)


def summarise(histogram: list[int]) -> dict:
    """Count, non-empty bins and the bin holding the median of a :data:`BINS`-bin histogram."""
    n = sum(histogram)
    bins = [{"from": bin_range(i)[0], "to": bin_range(i)[1], "captions": c} for i, c in enumerate(histogram) if c]
    median_bin = None
    if n:
        acc = 0
        for i, c in enumerate(histogram):
            acc += c
            if acc * 2 >= n:
                median_bin = list(bin_range(i))
                break
    return {"scored": n, "bins": bins, "median_bin": median_bin}
