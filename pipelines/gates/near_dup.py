"""Near-duplicates among embeddings: a greedy pass in a fixed order, each item compared with the items kept before it.

The first item of a group of near-identical ones is kept; every later item whose cosine similarity with some kept
item is >= ``threshold`` is a duplicate of the most similar kept item (ties: the earliest). A duplicate is not a
reference for later items, so "near" does not chain (a, b, c each 0.96 apart from the next, a and c 0.90 apart:
with threshold 0.95, b is a duplicate of a and c is kept). The order is the caller's (sorted by stable ids), so the
same rows give the same decisions whatever the runner or the worker count.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Decision:
    index: int                 # position in the input order
    kept_index: int | None     # the kept item it duplicates (None: kept itself)
    similarity: float | None   # cosine similarity with that item


def greedy_near_duplicates(emb: np.ndarray, threshold: float) -> list[Decision]:
    """``emb (n, d)`` unit rows in the decision order -> one :class:`Decision` per row."""
    emb = np.asarray(emb, dtype=np.float32)
    kept: list[int] = []
    out = []
    for i in range(len(emb)):
        if kept:
            sims = emb[kept] @ emb[i]
            j = int(np.argmax(sims))  # first maximum: the earliest kept item on a tie
            if float(sims[j]) >= threshold:
                out.append(Decision(i, kept[j], round(float(sims[j]), 6)))
                continue
        kept.append(i)
        out.append(Decision(i, None, None))
    return out


def mean_embedding(frames_emb: np.ndarray) -> np.ndarray:
    """``(n_frames, d)`` unit rows -> the unit ``(d,)`` direction of their mean (a clip's embedding)."""
    m = np.asarray(frames_emb, dtype=np.float32).mean(axis=0)
    return (m / max(float(np.linalg.norm(m)), 1e-12)).astype(np.float32)
