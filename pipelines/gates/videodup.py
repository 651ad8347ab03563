"""Near-duplicate videos: the same footage re-encoded or resized has other bytes, so the content hash keeps both.

A video's perceptual signature is ``n`` difference hashes (dHash, 64 bits each) of grayscale frames shown at fixed
relative times ``(i + 0.5) / n`` of its duration: each frame is reduced to 9x8 block means and bit ``(r, c)`` says
whether cell ``(r, c)`` is brighter than ``(r, c + 1)``. Re-encoding and resizing move a few bits; other footage
moves about half of them. Two signatures are near-identical when the mean Hamming distance over the frames both
find informative is at most ``max_mean_bits`` (a flat frame, e.g. black, hashes to almost no set bits and says
nothing: such frames are left out, and a pair needs at least half of its frames informative to count).

Cuts or trims shift the relative times, so a differently cut copy is not caught by this signature.

Candidates come from banding (each 64-bit hash split into four 16-bit bands; two hashes at most 3 bits apart share a
band, by pigeonhole), so the comparison is not all pairs; every candidate pair is then checked in full.
"""
from __future__ import annotations

import numpy as np

#: decode size of a signature frame (columns, rows): 8x8 pixel blocks of a 9x8 grid
DECODE_W, DECODE_H = 72, 64
BANDS = 4
MIN_INFORMATIVE_BITS = 3


def signature_times(duration_s: float, n: int) -> list[float]:
    """``n`` times at fixed relative positions ``(i + 0.5) / n`` of ``duration_s``."""
    return [round(duration_s * (i + 0.5) / n, 6) for i in range(n)]


def dhash(rgb: np.ndarray) -> int:
    """64-bit difference hash of one ``(H, W, 3)`` uint8 frame (any size with H % 8 == 0 and W % 9 == 0 is block
    averaged exactly; other sizes by index bins)."""
    gray = rgb.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
    h, w = gray.shape
    rows = np.array_split(np.arange(h), 8)
    cols = np.array_split(np.arange(w), 9)
    cells = np.array([[gray[np.ix_(r, c)].mean() for c in cols] for r in rows])  # (8, 9)
    bits = (cells[:, :-1] > cells[:, 1:]).ravel()
    return int(sum(1 << i for i, b in enumerate(bits) if b))


def signature(frames: np.ndarray) -> list[str]:
    """``(n, H, W, 3)`` frames -> ``n`` hashes as 16-digit hex strings."""
    return [f"{dhash(f):016x}" for f in frames]


def _informative(h: int) -> bool:
    ones = bin(h).count("1")
    return MIN_INFORMATIVE_BITS <= ones <= 64 - MIN_INFORMATIVE_BITS


def distance(a: list[str], b: list[str]) -> float | None:
    """Mean Hamming distance (bits) over the frames where both hashes are informative; None when the signatures
    differ in length or fewer than half of the frames are informative in both."""
    if not a or len(a) != len(b):
        return None
    pairs = [(int(x, 16), int(y, 16)) for x, y in zip(a, b)]
    used = [(x, y) for x, y in pairs if _informative(x) and _informative(y)]
    if 2 * len(used) < len(pairs):
        return None
    return sum(bin(x ^ y).count("1") for x, y in used) / len(used)


def _bands(sig: list[str]):
    for i, h in enumerate(sig):
        v = int(h, 16)
        if _informative(v):
            for b in range(BANDS):
                yield i, b, (v >> (16 * b)) & 0xFFFF


def preference(v: dict) -> tuple:
    """Which of a group is kept: the most pixels, then the longest, then the most bytes, then the smallest sha256
    (the original rather than a downscaled or re-encoded copy, and a deterministic choice)."""
    return (-(int(v.get("width") or 0) * int(v.get("height") or 0)), -float(v.get("duration_s") or 0.0),
            -int(v.get("bytes") or 0), v["sha256"])


def near_duplicates(videos: list[dict], max_mean_bits: float) -> dict[str, tuple[dict, float]]:
    """``videos``: dicts with ``sha256``, ``signature`` (or None) and the :func:`preference` fields. Returns
    ``{sha256 of a rejected video: (the kept video of its group, distance to it)}``. Groups are the connected
    components of the near-identical pairs; each keeps its preferred video."""
    vs = sorted((v for v in videos if v.get("signature")), key=preference)
    buckets: dict[tuple, list[int]] = {}
    for idx, v in enumerate(vs):
        for key in set(_bands(v["signature"])):
            buckets.setdefault(key, []).append(idx)
    parent = list(range(len(vs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    checked = set()
    for members in buckets.values():
        for x in range(len(members)):
            for y in range(x + 1, len(members)):
                i, j = members[x], members[y]
                if (i, j) in checked:
                    continue
                checked.add((i, j))
                d = distance(vs[i]["signature"], vs[j]["signature"])
                if d is not None and d <= max_mean_bits:
                    ri, rj = find(i), find(j)
                    if ri != rj:
                        parent[max(ri, rj)] = min(ri, rj)  # the root is the group's preferred video
    out = {}
    for idx, v in enumerate(vs):
        root = find(idx)
        if root != idx:
            d = distance(v["signature"], vs[root]["signature"])
            out[v["sha256"]] = (vs[root], d if d is not None else float("nan"))
    return out
