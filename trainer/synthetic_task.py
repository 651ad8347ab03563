"""A procedurally generated, verifiable video question task, for showing that the trainer learns.

Each item is a tiny rendered video (uint8 frames, ``[T, H, W, 3]``) with one question whose answer follows from the
pixels, in the same shape as the per-question items of the shard loader::

    {"key", "video_id", "frames" (uint8 torch tensor [T, H, W, 3]), "video_metadata" (fps, frames_indices,
     total_num_frames, duration, width, height), "question", "options", "answer", "problem_type",
     "category", "target"}

``target`` is a CoT target ``<think>...</think><answer>X</answer>`` for the SFT stage; it is scored by
``longreel.task.rewards`` like any model output. With ``reasoning="trace"`` the time kinds' reasoning lists what each
frame shows (the ball's colour or column per frame, ...) before the answer.

Kinds (``KINDS``):

``colour``     a ball of one of four colours crosses the screen: "What colour is the ball?" (4 options)
``exit_side``  a white ball starts near the centre and leaves by the left or the right edge (2 options)
``count``      a square flashes in some of the frames: "How many times does the square flash?" (4 options, 1-4)

The kinds above can be answered, or nearly, from one frame. The *time kinds* (``TIME_KINDS``) cannot: every frame,
taken alone, has the same distribution whatever the answer (exactly, by construction; ``tests/test_synthetic_time.py``
checks it with a single-frame solver), so only a model that relates frames to each other beats chance:

``order``          two balls (two of the four colours) sit on a 4x4 grid of cells; each jumps once to a random free
                   cell, at different times: "Which ball moves first?" (2 options). Not "which colour *appears*
                   first": a frame showing one colour without the other would give that away.
``count_colours``  one ball per frame, in a random cell, its colour drawn so that the frames together show k
                   different colours: "How many different colours does the ball take?" (4 options, 1-4)
``direction``      a ball steps one cell left or right per frame, wrapping around at the edge (so its column is
                   uniform in every frame): "Which way does the ball move?" (2 options)
``change``         one ball; at some frame its colour, its cell or its size changes: "What changed?" (3 options)

Everything is a pure function of ``(seed, index)``: the same arguments give the same bytes.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from longreel.schemas.atomic import write_atomic
from longreel.task.rewards.extract import THINK_CLOSE, THINK_OPEN

__all__ = ["KINDS", "TIME_KINDS", "COLOURS", "GRID", "SIZES", "CHANGES", "REASONING", "make_item", "make_items",
           "render", "write_shards", "trace_words", "answer_from_trace"]

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 220, 40)}
TIME_KINDS = ("order", "count_colours", "direction", "change")
KINDS = ("colour", "exit_side", "count") + TIME_KINDS
LETTERS = "ABCD"
FPS = 2.0
GRID = 4  # the time kinds place balls on GRID x GRID cells (28 px at 112 px: one merged Qwen2-VL token each)
RADIUS = 0.38  # ball radius of the time kinds, as a fraction of the cell side
SIZES = {"small": 0.24, "large": 0.46}  # the ``change`` kind's two ball sizes (fraction of the cell side)
CHANGES = ("colour", "position", "size")


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
    if kind in TIME_KINDS:
        return _render_time(kind, rng, frames)
    raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")


def _cell_disc(frame: np.ndarray, cell: int, rgb, frac: float = RADIUS) -> None:
    side = frame.shape[0] / GRID
    row, col = divmod(cell, GRID)
    _disc(frame, (col + 0.5) * side, (row + 0.5) * side, frac * side, rgb)


def _render_time(kind: str, rng: np.random.Generator, frames: np.ndarray) -> tuple[np.ndarray, dict]:
    """The time kinds. Each is built so that the content of any one frame (colours, cells, sizes) is distributed
    the same whatever the answer: the answer lives only in how frames relate."""
    n = frames.shape[0]
    names = list(COLOURS)
    cells = GRID * GRID
    if kind == "order":
        if n < 3:
            raise ValueError("order needs at least 3 frames")
        pair = rng.choice(len(names), size=2, replace=False)
        pos = [int(c) for c in rng.choice(cells, size=2, replace=False)]
        times = [int(t) for t in rng.choice(np.arange(1, n), size=2, replace=False)]
        for t in range(n):
            for b in (0, 1):
                if t == times[b]:  # a uniform free cell: the pair of cells stays uniform over distinct pairs
                    free = [c for c in range(cells) if c not in pos]
                    pos[b] = int(free[int(rng.integers(len(free)))])
            for b in (0, 1):
                _cell_disc(frames[t], pos[b], COLOURS[names[pair[b]]])
        first = names[pair[0]] if times[0] < times[1] else names[pair[1]]
        return frames, {"colours": [names[i] for i in pair], "move_times": times, "first": first}
    if kind == "count_colours":
        k = int(rng.integers(1, min(len(names), n) + 1))
        chosen = [names[i] for i in rng.choice(len(names), size=k, replace=False)]
        # a uniform onto map frames -> chosen colours (redraw until every colour is used): by the symmetry of the
        # colour draw, each frame's colour is uniform over the four whatever k is
        while True:
            seq = rng.integers(k, size=n)
            if len(set(seq.tolist())) == k:
                break
        for t in range(n):
            _cell_disc(frames[t], int(rng.integers(cells)), COLOURS[chosen[int(seq[t])]])
        return frames, {"count": k, "sequence": [chosen[int(i)] for i in seq]}
    if kind == "direction":
        side = "left" if rng.random() < 0.5 else "right"
        step = -1 if side == "left" else 1
        row, col = int(rng.integers(GRID)), int(rng.integers(GRID))
        rgb = COLOURS[names[int(rng.integers(len(names)))]]
        for t in range(n):  # wrapping keeps the column uniform in every frame
            _cell_disc(frames[t], row * GRID + (col + step * t) % GRID, rgb)
        return frames, {"side": side, "columns": [(col + step * t) % GRID for t in range(n)]}
    if kind == "change":
        what = CHANGES[int(rng.integers(len(CHANGES)))]
        colour, cell = int(rng.integers(len(names))), int(rng.integers(cells))
        size = list(SIZES)[int(rng.integers(len(SIZES)))]
        at = int(rng.integers(1, n))
        first = (names[colour], cell, size)
        for t in range(n):
            if t == at:  # a different uniform value: every frame's (colour, cell, size) stays uniform
                if what == "colour":
                    colour = (colour + int(rng.integers(1, len(names)))) % len(names)
                elif what == "position":
                    cell = (cell + int(rng.integers(1, cells))) % cells
                else:
                    size = "large" if size == "small" else "small"
            _cell_disc(frames[t], cell, COLOURS[names[colour]], SIZES[size])
        return frames, {"change": what, "at": at, "first": first, "last": (names[colour], cell, size)}
    raise ValueError(f"unknown time kind {kind!r}")


def _question(kind: str, facts: dict, rng: np.random.Generator) -> tuple[str, list[str], str, str]:
    """(question, options, answer letter, reasoning) of one rendered item. The time kinds' reasoning is kept short:
    with the tiny test tokenizer every target fits in 16 new tokens (the learning benchmark's rollout budget)."""
    if kind == "colour":
        options = list(COLOURS)
        return "What colour is the ball?", options, LETTERS[options.index(facts["colour"])], \
            f"The ball is {facts['colour']}."
    if kind == "exit_side":
        options = ["left", "right"]
        return "Which side does the ball leave the screen?", options, LETTERS[options.index(facts["side"])], \
            f"The ball moves to the {facts['side']}."
    if kind == "count":
        options = ["1", "2", "3", "4"]
        return "How many times does the square flash?", options, LETTERS[options.index(str(facts["count"]))], \
            f"The square flashes {facts['count']} times."
    if kind == "order":
        options = list(facts["colours"])
        if rng.random() < 0.5:  # the answer's letter is uniform
            options.reverse()
        a, b = facts["colours"]
        other = b if facts["first"] == a else a
        return "Which ball moves first?", options, LETTERS[options.index(facts["first"])], \
            f"{facts['first'].capitalize()} moves before {other}."
    if kind == "count_colours":
        options = ["1", "2", "3", "4"]
        return "How many different colours does the ball take?", options, \
            LETTERS[options.index(str(facts["count"]))], f"{facts['count']} colour{'s' if facts['count'] > 1 else ''}."
    if kind == "direction":
        options = ["left", "right"]
        return "Which way does the ball move?", options, LETTERS[options.index(facts["side"])], \
            f"It steps {facts['side']}."
    if kind == "change":
        options = list(CHANGES)
        return "What changed about the ball?", options, LETTERS[options.index(facts["change"])], \
            {"colour": "New colour.", "position": "It jumps.", "size": "The size changes."}[facts["change"]]
    raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")


REASONING = ("short", "trace")


def _trace(kind: str, facts: dict, options: list[str]) -> str | None:
    """The time kinds' reasoning spelled out frame by frame: what the frames show, in the order a reader would note
    it, from which the answer follows by a fixed rule (distinct colours, sign of the column step, the attribute that
    differs, the earlier move). None for the other kinds (their short reasoning is already a reading).

    Every word must follow from the frames and the question alone, or SFT is taught to guess: ``order`` names its
    two balls in the options' order (the order the colours were drawn in is in no pixel)."""
    if kind == "order":
        times = dict(zip(facts["colours"], facts["move_times"]))
        return " ".join(f"{c} {times[c]}" for c in options) + "."
    if kind == "count_colours":
        return " ".join(facts["sequence"]) + "."
    if kind == "direction":
        return " ".join(str(c) for c in facts["columns"]) + "."
    if kind == "change":
        return " ".join(f"{c} {cell} {size}" for c, cell, size in (facts["first"], facts["last"])) + "."
    return None


def trace_words(text: str) -> list[str] | None:
    """The words of the reasoning in a ``<think>...</think>`` response (a target or a model's output), trailing full
    stop dropped; None when there is no closed think block."""
    if THINK_OPEN not in text or THINK_CLOSE not in text.split(THINK_OPEN, 1)[1]:
        return None
    return text.split(THINK_OPEN, 1)[1].split(THINK_CLOSE, 1)[0].strip().rstrip(".").split()


def answer_from_trace(kind: str, words: list[str], options: list[str]) -> str | None:
    """The answer letter a reader of a time kind's trace alone gives, by the rule :func:`_trace` is written for
    (order: the ball with the earlier move; count_colours: the distinct colours; direction: right when the second
    column is the first plus one, mod ``GRID``, left when minus one; change: the first attribute that differs
    between the first and the last frame). None when the words are not a trace of that kind that implies an answer
    (malformed, equal move times, a column step of 0 or 2, nothing changed), as a model's may not be: a diagnostic
    can then tell a wrong reading from a wrong rule."""
    try:
        if kind == "order" and len(words) == 4 and int(words[1]) != int(words[3]):
            first = words[0] if int(words[1]) < int(words[3]) else words[2]
            return LETTERS[options.index(first)]
        if kind == "count_colours" and len(words) == len([w for w in words if w in COLOURS]) > 0:
            return LETTERS[options.index(str(len(set(words))))]
        if kind == "direction" and len(words) >= 2:
            step = (int(words[1]) - int(words[0])) % GRID
            if step not in (1, GRID - 1):  # a ball that stays, or jumps two: no direction to read
                return None
            return LETTERS[options.index("right" if step == 1 else "left")]
        if kind == "change" and len(words) == 6:
            differs = [x != y for x, y in zip(words[:3], words[3:])]
            return LETTERS[options.index(CHANGES[differs.index(True)])] if any(differs) else None
    except ValueError:  # a number that is not one, an option the item does not have
        return None
    return None


def make_item(index: int, seed: int = 0, kinds: Iterable[str] = ("colour",), n_frames: int = 4,
              size: int = 56, radius: float = 0.25, reasoning: str = "short") -> dict:
    """Item ``index`` of the stream ``seed`` (kinds taken in turn).

    ``reasoning``: ``"short"`` (a one-phrase reason, the default) or ``"trace"`` (the time kinds' reasoning lists
    what each frame shows, :func:`_trace`; the same frames, question and answer)."""
    if reasoning not in REASONING:
        raise ValueError(f"reasoning must be one of {REASONING}, got {reasoning!r}")
    import torch

    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds must not be empty")
    kind = kinds[index % len(kinds)]
    rng = np.random.default_rng([seed, index])
    frames, facts = render(kind, rng, n_frames=n_frames, size=size, radius=radius)
    # the question's own draws (option order) come after the rendering's, from the same stream
    question, options, answer, think = _question(kind, facts, rng)
    if reasoning == "trace":
        think = _trace(kind, facts, options) or think
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
        "video_metadata": meta,
        "question": question,
        "options": options,
        "answer": answer,
        "problem_type": "multiple_choice",
        "category": kind,
        "target": f"<think>{think}</think><answer>{answer}</answer>",
    }


def make_items(n: int, seed: int = 0, kinds: Iterable[str] = ("colour",), **kw) -> list[dict]:
    return [make_item(i, seed=seed, kinds=kinds, **kw) for i in range(n)]


def write_shards(items: list[dict], out_dir: str, *, dataset: str = "synthetic", split: str = "rl",
                 per_shard: int = 64, temporal_patch_size: int = 2) -> str:
    """Write ``items`` as longreel WebDataset shards + wids index with the pack stage's own writer
    (``longreel.task.shard_format``), one sample per video; return the index path (``longreel.trainer.data`` reads it).

    Frames are staged as ``.npy`` files (``allow_pickle=False``) beside the shards, as the frame cache would hold
    them, then streamed into the tars with their sha256 checked. ``temporal_patch_size``: the policy processor's
    (frames per vision patch), for the cached ``video_grid_thw`` the loader checks against the processor."""
    import hashlib
    import json
    import os
    import tempfile

    from longreel.task.shard_format import SAMPLE_LAYOUT, build_index, index_name, shard_name, write_shard_atomic

    os.makedirs(out_dir, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".frames-", dir=out_dir)
    dumps = lambda o: json.dumps(o, sort_keys=True, separators=(",", ":"))  # noqa: E731
    samples = []
    try:
        for item in items:
            frames = item["frames"].numpy() if hasattr(item["frames"], "numpy") else np.asarray(item["frames"])
            key = item["video_id"]
            path = os.path.join(stage, f"{key}.npy")
            np.save(path, frames, allow_pickle=False)
            blob = open(path, "rb").read()
            t, h, w, _ = frames.shape
            meta = {"key": key, "split": split, "video_id": key, "video_metadata": item["video_metadata"],
                    "num_frames": int(t), "resized_height": int(h), "resized_width": int(w),
                    "video_grid_thw": [int(t) // temporal_patch_size, int(h) // 14, int(w) // 14], "license": "CC0-1.0",
                    "attribution": "procedurally generated (trainer.synthetic_task)", "nquestions": 1,
                    "sample_layout": SAMPLE_LAYOUT}
            qra = {k: item[k] for k in ("question", "options", "answer", "problem_type", "category", "target")}
            qra.update(qra_id=item["key"], video_id=key, split=split, pass_rate=None)
            texts = {"meta.json": dumps(meta), "qras.json": dumps([qra])}
            sums = {"frames.npy": {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
            sums.update({n: {"bytes": len(v.encode()), "sha256": hashlib.sha256(v.encode()).hexdigest()}
                         for n, v in texts.items()})
            files = [{"name": "frames.npy", "path": path, "size": len(blob), "sha256": sums["frames.npy"]["sha256"]}]
            files += [{"name": n, "text": v} for n, v in texts.items()] + [{"name": "sums.json", "text": dumps(sums)}]
            samples.append({"key": key, "files": files})
        samples.sort(key=lambda s: s["key"])
        infos = []
        for idx, start in enumerate(range(0, len(samples), per_shard)):
            chunk = samples[start:start + per_shard]
            name = shard_name(dataset, split, idx)
            nbytes, sha = write_shard_atomic(os.path.join(out_dir, name), chunk)
            infos.append({"index": idx, "url": name, "nsamples": len(chunk), "bytes": nbytes, "sha256": sha,
                          "nquestions": len(chunk)})
        index_path = os.path.join(out_dir, index_name(dataset, split))
        write_atomic(index_path, json.dumps(build_index(dataset, split, infos), indent=1) + "\n")
        return index_path
    finally:
        import shutil

        shutil.rmtree(stage, ignore_errors=True)
