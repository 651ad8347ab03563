"""A procedurally generated, verifiable video question task, for showing that the trainer learns.

Each item is a tiny rendered video (uint8 frames, ``[T, H, W, 3]``) with one question whose answer follows from the
pixels, in the same shape as the per-question items of the shard loader::

    {"key", "video_id", "frames" (uint8 torch tensor [T, H, W, 3]), "metadata" (fps, frames_indices,
     total_num_frames, duration, width, height), "question", "options", "answer", "problem_type",
     "category", "target"}

``target`` is a CoT target ``<think>...</think><answer>X</answer>`` for the SFT stage; it is scored by
``trainer.rewards`` like any model output.

Kinds (``KINDS``):

``colour``     a ball of one of four colours crosses the screen: "What colour is the ball?" (4 options)
``exit_side``  a white ball starts near the centre and leaves by the left or the right edge (2 options)
``count``      a square flashes in some of the frames: "How many times does the square flash?" (4 options, 1-4)

Everything is a pure function of ``(seed, index)``: the same arguments give the same bytes.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = ["KINDS", "COLOURS", "make_item", "make_items", "render"]

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 220, 40)}
KINDS = ("colour", "exit_side", "count")
LETTERS = "ABCD"
FPS = 2.0


def _canvas(rng: np.random.Generator, n_frames: int, size: int) -> np.ndarray:
    base = rng.integers(10, 40, size=(1, 1, 1, 3))
    noise = rng.integers(0, 12, size=(n_frames, size, size, 3))
    return (base + noise).astype(np.uint8)


def _disc(frame: np.ndarray, cx: float, cy: float, r: float, rgb) -> None:
    h, w, _ = frame.shape
    yy, xx = np.mgrid[0:h, 0:w]
    inside = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    frame[inside] = rgb


def render(kind: str, rng: np.random.Generator, n_frames: int = 4, size: int = 56,
           radius: float = 0.25) -> tuple[np.ndarray, dict]:
    """Render one video of ``kind``; return ``(frames [T, H, W, 3] uint8, facts)`` (facts: what the answer needs).

    ``radius``: the ball's radius as a fraction of the frame size."""
    frames = _canvas(rng, n_frames, size)
    r = size * radius
    if kind == "colour":
        name = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        y = rng.uniform(r, size - r)
        x0, x1 = (r, size - r) if rng.random() < 0.5 else (size - r, r)
        for t in range(n_frames):
            _disc(frames[t], x0 + (x1 - x0) * t / max(n_frames - 1, 1), y, r, COLOURS[name])
        return frames, {"colour": name}
    if kind == "exit_side":
        side = "left" if rng.random() < 0.5 else "right"
        y = rng.uniform(r, size - r)
        start = size / 2 + rng.uniform(-r, r)
        end = -r if side == "left" else size + r
        for t in range(n_frames):
            _disc(frames[t], start + (end - start) * t / max(n_frames - 1, 1), y, r, (240, 240, 240))
        return frames, {"side": side}
    if kind == "count":
        count = int(rng.integers(1, min(4, n_frames) + 1))
        lit = sorted(rng.choice(n_frames, size=count, replace=False).tolist())
        half = int(size / 4)
        for t in lit:
            frames[t, size // 2 - half:size // 2 + half, size // 2 - half:size // 2 + half] = (240, 240, 240)
        return frames, {"count": count, "lit": lit}
    raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")


def make_item(index: int, seed: int = 0, kinds: Iterable[str] = ("colour",), n_frames: int = 4,
              size: int = 56, radius: float = 0.25) -> dict:
    """Item ``index`` of the stream ``seed`` (kinds taken in turn)."""
    import torch

    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds must not be empty")
    kind = kinds[index % len(kinds)]
    rng = np.random.default_rng([seed, index])
    frames, facts = render(kind, rng, n_frames=n_frames, size=size, radius=radius)
    if kind == "colour":
        options = list(COLOURS)
        answer = LETTERS[options.index(facts["colour"])]
        question = "What colour is the ball?"
        think = f"The ball is {facts['colour']}."
    elif kind == "exit_side":
        options = ["left", "right"]
        answer = LETTERS[options.index(facts["side"])]
        question = "Which side does the ball leave the screen?"
        think = f"The ball moves to the {facts['side']}."
    else:
        options = ["1", "2", "3", "4"]
        answer = LETTERS[options.index(str(facts["count"]))]
        question = "How many times does the square flash?"
        think = f"The square flashes {facts['count']} times."
    video_id = f"synth{seed}_{index:06d}"
    meta = {
        "fps": FPS,
        "total_num_frames": n_frames,
        "frames_indices": list(range(n_frames)),
        "duration": n_frames / FPS,
        "width": size,
        "height": size,
    }
    return {
        "key": f"{video_id}_q0",
        "video_id": video_id,
        "frames": torch.from_numpy(frames),
        "metadata": meta,
        "question": question,
        "options": options,
        "answer": answer,
        "problem_type": "multiple_choice",
        "category": kind,
        "target": f"<think>{think}</think><answer>{answer}</answer>",
    }


def make_items(n: int, seed: int = 0, kinds: Iterable[str] = ("colour",), **kw) -> list[dict]:
    return [make_item(i, seed=seed, kinds=kinds, **kw) for i in range(n)]
