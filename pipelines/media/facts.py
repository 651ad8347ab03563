"""Clip facts: cheap, weight-free measurements of a clip's sampled frames (pure numpy).

Every function takes ``frames``: ``uint8 [N, H, W, 3]`` RGB (the frames sampled from one
clip, in time order) and returns plain Python numbers, so the results go straight into a
``clip_facts`` row. They feed the static/black clip filter, the data card and the ``facts``
captioner.

* :func:`luma`            ``[N, H, W, 3] uint8 -> [N, H, W] float32``  (BT.601 Y', 0..255)
* :func:`frame_diffs`     ``-> [N-1]``  mean |Y'(t+1) - Y'(t)| per consecutive pair
* :func:`motion_score`    ``-> float``  mean of :func:`frame_diffs` (0 for a single frame)
* :func:`blank_frames`    ``-> [N] bool``  black (dark) or blank (uniform) frames
* :func:`brightness`      ``-> float``  mean luma over all frames
* :func:`histograms`      ``-> [N, 3 * bins]``  per-channel colour histograms, each channel sums to 1
* :func:`cut_flags`       ``-> [N-1] bool``  a shot cut between consecutive sampled frames
* :func:`gray_world`      ``-> [N, H, W, 3] uint8``  exposure / white balance normalised frames
* :func:`dominant_color`  ``-> str``  the colour name covering most pixels
* :func:`clip_facts`      all of the above as one dict (``FACTS_VERSION`` names the rules)

Sampled frames are ~1 s apart, so "motion" here is the change between samples (camera and
object motion plus cuts), not optical flow, and a cut is counted when the colour
distributions of two neighbouring samples differ by more than ``cut_threshold`` (total
variation distance, 0..1): two cuts between the same pair of samples count once.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

FACTS_VERSION = "facts-v1"

#: defaults, also used as the config defaults
BLACK_LUMA = 32.0       # a pixel darker than this (luma 0..255) is a black pixel
BLACK_SHARE = 0.6       # a frame with at least this share of black pixels is black (black credits with text: ~0.7)
BLANK_STD = 4.0         # a frame whose luma standard deviation is below this is blank (uniform: a card, a fade)
CUT_THRESHOLD = 0.3     # total-variation distance between colour histograms above which a cut is counted
                        # (Big Buck Bunny, 8 frames per 10 s clip: 86 pairs over 0.3, 36 over 0.5; pairs
                        # between 0.3 and 0.45 checked by eye were cuts; ~119 real cuts in the film)
HIST_BINS = 16

_Y = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def _check(frames: np.ndarray) -> np.ndarray:
    if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be [N, H, W, 3] with N >= 1, got {getattr(frames, 'shape', type(frames))}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    return frames


def luma(frames: np.ndarray) -> np.ndarray:
    """``[N, H, W, 3] uint8 -> [N, H, W] float32``: BT.601 luma (Y'), 0..255."""
    return _check(frames).astype(np.float32) @ _Y


def frame_diffs(frames: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
    """``[N, H, W, 3] -> [N-1] float64``: mean absolute luma difference of each consecutive pair."""
    y = luma(frames) if y is None else y
    if len(y) < 2:
        return np.zeros(0, dtype=np.float64)
    return np.abs(np.diff(y, axis=0)).mean(axis=(1, 2)).astype(np.float64)


def motion_score(frames: np.ndarray, y: np.ndarray | None = None) -> float:
    """``[N, H, W, 3] -> float`` in 0..255: mean absolute difference of consecutive frames (0 for N == 1)."""
    d = frame_diffs(frames, y)
    return float(d.mean()) if len(d) else 0.0


def blank_frames(frames: np.ndarray, black_luma: float = BLACK_LUMA, black_share: float = BLACK_SHARE,
                 blank_std: float = BLANK_STD, y: np.ndarray | None = None) -> np.ndarray:
    """``[N, H, W, 3] -> [N] bool``: the frame is black (at least ``black_share`` of its pixels have luma below
    ``black_luma``: a black screen, also with text on it) or blank (luma std < ``blank_std``: one flat colour,
    e.g. a white card or the middle of a fade)."""
    y = luma(frames) if y is None else y
    flat = y.reshape(len(y), -1)
    return ((flat < black_luma).mean(axis=1) >= black_share) | (flat.std(axis=1) < blank_std)


def brightness(frames: np.ndarray, y: np.ndarray | None = None) -> float:
    """``[N, H, W, 3] -> float``: mean luma, 0..255."""
    y = luma(frames) if y is None else y
    return float(y.mean())


def histograms(frames: np.ndarray, bins: int = HIST_BINS) -> np.ndarray:
    """``[N, H, W, 3] -> [N, 3 * bins] float64``: R, G, B histograms of each frame, each channel summing to 1."""
    frames = _check(frames)
    if not 1 <= bins <= 256:
        raise ValueError(f"bins must be in 1..256, got {bins}")
    n = frames.shape[0]
    # uint16 holds 255 * 256; one small bincount per frame and channel beats one over int64 offsets (5x here)
    q = (frames.reshape(n, -1, 3).astype(np.uint16) * bins) >> 8          # [N, P, 3] bin index 0..bins-1
    counts = np.empty((n, 3 * bins), dtype=np.float64)
    for i in range(n):
        for c in range(3):
            counts[i, c * bins:(c + 1) * bins] = np.bincount(q[i, :, c], minlength=bins)
    return counts / (frames.shape[1] * frames.shape[2])


def gray_world(frames: np.ndarray) -> np.ndarray:
    """``[N, H, W, 3] uint8 -> [N, H, W, 3] uint8``: each frame's channels scaled to a mean of 128 (removes a
    global exposure or white-balance change, which is not a cut)."""
    f = _check(frames).astype(np.float32)
    mean = f.reshape(len(f), -1, 3).mean(axis=1)[:, None, None, :]
    return np.clip(f * (128.0 / np.maximum(mean, 1.0)), 0, 255).astype(np.uint8)


def _tv(h: np.ndarray, bins: int) -> np.ndarray:
    return 0.5 * np.abs(np.diff(h, axis=0)).reshape(len(h) - 1, 3, bins).sum(axis=2).mean(axis=1)


def cut_flags(frames: np.ndarray, threshold: float = CUT_THRESHOLD, bins: int = HIST_BINS) -> np.ndarray:
    """``[N, H, W, 3] -> [N-1] bool``: True where the colour distribution changes by more than ``threshold``
    (total variation distance of the RGB histograms, averaged over channels, 0..1) between consecutive frames,
    and still by more than ``0.8 * threshold`` after :func:`gray_world` normalisation (so that an exposure or
    white-balance shift inside one shot is not a cut)."""
    _check(frames)
    if len(frames) < 2:
        return np.zeros(0, dtype=bool)
    raw = _tv(histograms(frames, bins), bins)
    norm = _tv(histograms(gray_world(frames), bins), bins)
    return (raw > threshold) & (norm > 0.8 * threshold)


# Colour naming: achromatic pixels by value, chromatic ones by hue sector (degrees, upper bound exclusive).
_HUES = ((15, "red"), (40, "orange"), (70, "yellow"), (165, "green"), (200, "cyan"), (255, "blue"),
         (290, "purple"), (340, "pink"), (361, "red"))
#: :func:`color_table`'s file, shipped with the package
COLOR_TABLE_FILE = Path(__file__).with_name("color_names.npz")
COLOR_NAMES = ("black", "grey", "white", "red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink",
               "brown")


def pixel_color_names(frames: np.ndarray) -> np.ndarray:
    """``[N, H, W, 3] -> [N, H, W] int``: index into :data:`COLOR_NAMES` of each pixel's colour name."""
    f = _check(frames).astype(np.float32) / 255.0
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    mx = f.max(axis=-1)
    mn = f.min(axis=-1)
    delta = mx - mn
    sat = np.where(mx > 0, delta / np.maximum(mx, 1e-6), 0.0)
    safe = np.maximum(delta, 1e-6)
    hue = np.where(mx == r, ((g - b) / safe) % 6.0, np.where(mx == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    hue = hue * 60.0
    idx = np.full(f.shape[:-1], COLOR_NAMES.index("grey"), dtype=np.int64)
    chroma_idx = np.zeros_like(idx)
    lo = 0
    for hi, name in _HUES:
        chroma_idx[(hue >= lo) & (hue < hi)] = COLOR_NAMES.index(name)
        lo = hi
    # a dark orange reads as brown
    chroma_idx[(chroma_idx == COLOR_NAMES.index("orange")) & (mx < 0.6)] = COLOR_NAMES.index("brown")
    chromatic = (sat >= 0.25) & (mx >= 0.2)
    idx = np.where(chromatic, chroma_idx, idx)
    achro = ~chromatic
    idx[achro & (mx < 0.2)] = COLOR_NAMES.index("black")
    idx[achro & (mx >= 0.8) & (sat < 0.15)] = COLOR_NAMES.index("white")
    return idx


def build_color_table(chunk: int = 1 << 22) -> np.ndarray:
    """``[2**24] uint8``: :func:`pixel_color_names` of every 24-bit colour, at index ``(r << 16) | (g << 8) | b``
    (a few seconds; built in chunks to bound memory)."""
    table = np.empty(1 << 24, dtype=np.uint8)
    for lo in range(0, 1 << 24, chunk):
        c = np.arange(lo, min(lo + chunk, 1 << 24), dtype=np.uint32)
        rgb = np.stack([(c >> 16) & 255, (c >> 8) & 255, c & 255], axis=-1).astype(np.uint8)
        table[lo:lo + len(c)] = pixel_color_names(rgb[None, None])[0, 0]
    return table


def write_color_table(path: str | os.PathLike = COLOR_TABLE_FILE) -> None:
    """Regenerate the shipped table (after a change to the colour rules, which also needs a new
    :data:`FACTS_VERSION`); ``tests/test_facts.py`` checks that the file matches :func:`pixel_color_names`."""
    np.savez_compressed(path, names=build_color_table())


@functools.lru_cache(maxsize=1)
def color_table() -> np.ndarray:
    """The shipped :func:`build_color_table` (16 MiB in memory, 0.3 MB on disk, loaded once per process).

    Naming colours through a table is 12x faster than the float arithmetic of :func:`pixel_color_names` (which
    stays the definition) and was most of the clip facts' CPU time; building the table costs ~5 s, too much for
    every worker process, so it ships with the package."""
    try:
        with np.load(COLOR_TABLE_FILE, allow_pickle=False) as z:
            table = z["names"]
    except (OSError, KeyError, ValueError) as e:
        raise RuntimeError(f"the colour-name table {COLOR_TABLE_FILE} is missing or unreadable ({e}): the longreel "
                           "install is incomplete; reinstall it, or regenerate the file with "
                           "longreel.pipelines.media.facts.write_color_table()") from None
    if table.shape != (1 << 24,) or table.dtype != np.uint8:
        raise RuntimeError(f"the colour-name table {COLOR_TABLE_FILE} has shape {table.shape} and dtype "
                           f"{table.dtype}, not ({1 << 24},) uint8")
    return table


def dominant_color(frames: np.ndarray) -> str:
    """``[N, H, W, 3] -> str``: the name (from :data:`COLOR_NAMES`) that covers the most pixels over all frames."""
    f = _check(frames)
    packed = (f[..., 0].astype(np.uint32) << 16) | (f[..., 1].astype(np.uint32) << 8) | f[..., 2]
    counts = np.bincount(color_table()[packed].ravel(), minlength=len(COLOR_NAMES))
    return COLOR_NAMES[int(counts.argmax())]


def clip_facts(frames: np.ndarray, *, black_luma: float = BLACK_LUMA, black_share: float = BLACK_SHARE,
               blank_std: float = BLANK_STD, cut_threshold: float = CUT_THRESHOLD) -> dict:
    """All facts of one clip's frames ``[N, H, W, 3] uint8`` as a dict of Python scalars:
    ``motion`` (0..255), ``black_ratio`` (0..1), ``brightness`` (0..255), ``n_cuts``, ``dominant_color``,
    plus per-pair ``diffs`` and per-frame ``blank`` for inspection."""
    y = luma(frames)
    blank = blank_frames(frames, black_luma, black_share, blank_std, y=y)
    diffs = frame_diffs(frames, y)
    cuts = cut_flags(frames, cut_threshold)
    return {
        "motion": round(float(diffs.mean()) if len(diffs) else 0.0, 4),
        "black_ratio": round(float(blank.mean()), 4),
        "brightness": round(float(y.mean()), 4),
        "n_cuts": int(cuts.sum()),
        "dominant_color": dominant_color(frames),
        "diffs": [round(float(d), 4) for d in diffs],
        "blank": [bool(b) for b in blank],
    }


def classify_clip(facts: dict, *, black_ratio_min: float, static_motion_max: float) -> tuple[str, str] | None:
    """The static/black filter: ``None`` to keep, else ``(reason, message)``.

    ``black_clip``: at least ``black_ratio_min`` of the sampled frames are black or blank.
    ``static_clip``: no cut and a motion score below ``static_motion_max`` (a still image, a frozen frame).
    """
    if facts["black_ratio"] >= black_ratio_min:
        return ("black_clip", f"{facts['black_ratio']:.0%} of the sampled frames are black or blank "
                              f"(brightness {facts['brightness']:.1f}; limit {black_ratio_min:.0%})")
    if facts["n_cuts"] == 0 and facts["motion"] < static_motion_max:
        return ("static_clip", f"motion {facts['motion']:.2f} < {static_motion_max} with no shot cut")
    return None
