"""Rule-based solvers of the synthetic task (:mod:`longreel.trainer.synthetic_task`) that read only pixels.

Two solvers, both pure functions of ``(frames, question, options)``: neither looks at the facts the generator drew.

* :func:`single_frame_answer` sees one frame (the middle one unless told) and answers as well as that frame allows:
  the baseline that shows which kinds need the video. On the time kinds every frame is distributed the same whatever
  the answer, so it is at chance there; on ``colour`` it is always right.
* :func:`oracle_answer` sees every frame and reads the answer off them: it shows the time kinds are answerable from
  the pixels (100 % on every kind it knows).

Both find balls by colour: a pixel belongs to a palette colour when it is within ``TOL`` (per channel) of it; the
background noise stays below 52 per channel, far from every palette colour and from white.
"""
from __future__ import annotations

import numpy as np

from longreel.trainer.synthetic_task import COLOURS, GRID, LETTERS, SIZES

__all__ = ["find_balls", "single_frame_answer", "oracle_answer", "chance_accuracy"]

TOL = 30
WHITE = (240, 240, 240)


def find_balls(frame: np.ndarray) -> dict[str, dict]:
    """Balls of each palette colour (and white) in one frame ``[H, W, 3]`` uint8 ->
    ``{name: {"pixels", "cx", "cy", "cell"}}`` (only colours present; cell on the ``GRID`` x ``GRID`` grid)."""
    h, w, _ = frame.shape
    f = frame.astype(np.int16)
    out = {}
    for name, rgb in list(COLOURS.items()) + [("white", WHITE)]:
        mask = (np.abs(f - np.array(rgb, dtype=np.int16)) <= TOL).all(-1)
        n = int(mask.sum())
        if n == 0:
            continue
        ys, xs = np.nonzero(mask)
        cx, cy = float(xs.mean()), float(ys.mean())
        cell = int(min(cy * GRID // h, GRID - 1) * GRID + min(cx * GRID // w, GRID - 1))
        out[name] = {"pixels": n, "cx": cx, "cy": cy, "cell": cell}
    return out


def _letter(options: list[str], value: str) -> str:
    return LETTERS[list(options).index(value)]


def _kind(question: str) -> str:
    """The kind of a synthetic question, from its wording (the solvers get no facts)."""
    table = {"What colour is the ball?": "colour", "Which side does the ball leave the screen?": "exit_side",
             "How many times does the square flash?": "count", "Which ball moves first?": "order",
             "How many different colours does the ball take?": "count_colours",
             "Which way does the ball move?": "direction", "What changed about the ball?": "change"}
    if question not in table:
        raise ValueError(f"not a synthetic question: {question!r}")
    return table[question]


def _size_name(pixels: int, frame: np.ndarray) -> str:
    side = frame.shape[0] / GRID
    area = {name: np.pi * (frac * side) ** 2 for name, frac in SIZES.items()}
    return min(area, key=lambda k: abs(area[k] - pixels))


def single_frame_answer(frames: np.ndarray, question: str, options: list[str], frame_index: int | None = None) -> str:
    """The answer letter a solver gives from frame ``frame_index`` alone (default: the middle frame).

    It uses what one frame shows: the ball's colour; for motion, which half of the screen the ball is in; for
    counting, how many balls or squares it sees; for ``order``, it bets on the ball nearer the top left (a frame
    carries no trace of which ball moved); for ``change``, which it cannot see, it guesses from the ball's size (a
    small ball: "size", else "position"). Each rule is the natural guess from one picture; on the time kinds no rule does better
    than chance, because the frame's distribution does not depend on the answer."""
    frames = np.asarray(frames)
    t = frames.shape[0] // 2 if frame_index is None else frame_index
    frame = frames[t]
    balls = find_balls(frame)
    kind = _kind(question)
    colours = {k: v for k, v in balls.items() if k != "white"}
    if kind == "colour":
        name = max(colours, key=lambda k: colours[k]["pixels"]) if colours else options[0]
        return _letter(options, name)
    if kind in ("exit_side", "direction"):
        ball = balls.get("white") if kind == "exit_side" else (max(colours.values(), key=lambda b: b["pixels"])
                                                                 if colours else None)
        if ball is None:
            return _letter(options, "left")
        return _letter(options, "left" if ball["cx"] < frame.shape[1] / 2 else "right")
    if kind == "count":
        return _letter(options, "1" if "white" not in balls else "2")  # a lit square suggests more flashes
    if kind == "count_colours":
        return _letter(options, str(min(max(len(colours), 1), 4)))
    if kind == "order":
        present = [c for c in options if c in colours]
        if not present:
            return LETTERS[0]
        return _letter(options, min(present, key=lambda c: colours[c]["cell"]))
    if kind == "change":
        if not colours:
            return LETTERS[0]
        ball = max(colours.values(), key=lambda b: b["pixels"])
        return _letter(options, "size" if _size_name(ball["pixels"], frame) == "small" else "position")
    raise AssertionError(kind)


def oracle_answer(frames: np.ndarray, question: str, options: list[str]) -> str:
    """The answer letter read off all frames ``[T, H, W, 3]``."""
    frames = np.asarray(frames)
    per = [find_balls(f) for f in frames]
    colours = [{k: v for k, v in b.items() if k != "white"} for b in per]
    kind = _kind(question)
    if kind == "colour":
        total: dict[str, int] = {}
        for c in colours:
            for k, v in c.items():
                total[k] = total.get(k, 0) + v["pixels"]
        return _letter(options, max(total, key=total.get))
    if kind == "exit_side":
        xs = [b["white"]["cx"] for b in per if "white" in b]
        return _letter(options, "left" if xs[-1] < xs[0] else "right")
    if kind == "count":
        return _letter(options, str(sum("white" in b for b in per)))
    if kind == "order":
        moved = {}
        for c in options:
            cells = [b[c]["cell"] for b in colours]
            moved[c] = next(t for t in range(1, len(cells)) if cells[t] != cells[t - 1])
        return _letter(options, min(moved, key=moved.get))
    if kind == "count_colours":
        seen = {max(c, key=lambda k: c[k]["pixels"]) for c in colours}
        return _letter(options, str(len(seen)))
    if kind == "direction":
        name = max(colours[0], key=lambda k: colours[0][k]["pixels"])
        cols = [c[name]["cell"] % GRID for c in colours]
        step = (cols[1] - cols[0]) % GRID
        return _letter(options, "right" if step == 1 else "left")
    if kind == "change":
        first, last = colours[0], colours[-1]
        c0, c1 = max(first, key=lambda k: first[k]["pixels"]), max(last, key=lambda k: last[k]["pixels"])
        if c0 != c1:
            return _letter(options, "colour")
        if first[c0]["cell"] != last[c1]["cell"]:
            return _letter(options, "position")
        return _letter(options, "size")
    raise AssertionError(kind)


def chance_accuracy(options: list[str]) -> float:
    """Accuracy of a uniform guess among ``options``."""
    return 1.0 / len(options)
