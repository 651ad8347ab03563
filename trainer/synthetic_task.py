"""A procedurally generated, verifiable video question task, for showing that the trainer learns.

Each item is a tiny rendered video (uint8 frames, ``[T, H, W, 3]``) with one question whose answer follows from the
pixels, in the same shape as the per-question items of the shard loader::

    {"key", "video_id", "frames" (uint8 torch tensor [T, H, W, 3]), "video_metadata" (fps, frames_indices,
     total_num_frames, duration, width, height), "question", "options", "answer", "problem_type",
     "category", "target"}

``target`` is a CoT target ``<think>...</think><answer>X</answer>`` for the SFT stage; it is scored by
``longreel.task.rewards`` like any model output.

Kinds (``KINDS``):

``colour``     a ball of one of four colours crosses the screen: "What colour is the ball?" (4 options)
``exit_side``  a white ball starts near the centre and leaves by the left or the right edge (2 options)
``count``      a square flashes in some of the frames: "How many times does the square flash?" (4 options, 1-4)

Everything is a pure function of ``(seed, index)``: the same arguments give the same bytes.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from longreel.schemas.atomic import write_atomic

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
                 per_shard: int = 64) -> str:
    """Write ``items`` as longreel WebDataset shards + wids index with the pack stage's own writer
    (``longreel.task.shard_format``), one sample per video; return the index path (``longreel.trainer.data`` reads it).

    Frames are staged as ``.npy`` files (``allow_pickle=False``) beside the shards, as the frame cache would hold
    them, then streamed into the tars with their sha256 checked."""
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
                    "video_grid_thw": [int(t) // 2, int(h) // 14, int(w) // 14], "license": "CC0-1.0",
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
