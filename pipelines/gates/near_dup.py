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


def greedy_near_duplicates(emb: np.ndarray, threshold: float, block: int = 256) -> list[Decision]:
    """``emb (n, d)`` unit rows in the decision order -> one :class:`Decision` per row.

    Computed a ``block`` of rows at a time: one matrix product of the block against every row kept before it (a
    GEMM rather than one matrix-vector product per row), then the block's rows in order against the block's own
    kept rows. The decisions are those of the one-row-at-a-time pass: a row kept before the block is earlier than
    one kept inside it, so it wins a tie."""
    emb = np.asarray(emb, dtype=np.float32)
    n = len(emb)
    kept: list[int] = []
    bank = np.empty_like(emb)  # the kept rows, contiguous
    out = []
    for s in range(0, n, block):
        rows = emb[s:s + block]
        n_before = len(kept)
        before = rows @ bank[:n_before].T if n_before else None      # (b, kept before the block)
        inner = rows @ rows.T                                         # (b, b)
        kept_in_block: list[int] = []                                 # positions in the block
        for r in range(len(rows)):
            best_sim, best = -np.inf, None
            if before is not None:
                j = int(np.argmax(before[r]))  # first maximum: the earliest kept row on a tie
                best_sim, best = float(before[r, j]), kept[j]
            if kept_in_block:
                sims = inner[r, kept_in_block]
                j = int(np.argmax(sims))
                if float(sims[j]) > best_sim:
                    best_sim, best = float(sims[j]), s + kept_in_block[j]
            if best is not None and best_sim >= threshold:
                out.append(Decision(s + r, best, round(best_sim, 6)))
                continue
            kept_in_block.append(r)
            out.append(Decision(s + r, None, None))
        for r in kept_in_block:
            bank[len(kept)] = rows[r]
            kept.append(s + r)
    return out


def mean_embedding(frames_emb: np.ndarray) -> np.ndarray:
    """``(n_frames, d)`` unit rows -> the unit ``(d,)`` direction of their mean (a clip's embedding)."""
    m = np.asarray(frames_emb, dtype=np.float32).mean(axis=0)
    return (m / max(float(np.linalg.norm(m)), 1e-12)).astype(np.float32)
