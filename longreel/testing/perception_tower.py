"""Pretrain a tiny model's vision tower to see what each cell of each frame holds, as a stand-in for a pretrained tower.

A real VLM's vision tower comes pretrained: what is where in a frame is a large-variance direction of its output. The
tiny test model's tower is random, and there the answer to a question about time explains a few percent of the
output variance at most (``benchmarks/results/learn_time_trials.json``, D18-D21), whatever the patch embedding. This
module gives the tower perception the generic way: dense per-cell, per-frame labels read from the pixels (which
colour, if any, is in the cell, and whether the disc is large), a linear head on each merged vision token, and
cross-entropy. The labels never use the question, the answer or the render facts, only the frames.

Cell layout: the synthetic time kinds draw on a ``GRID x GRID`` grid whose cells are exactly one merged Qwen2-VL token
at Qwen's 2x2 merge (28 px at 112 px frames); merged tokens come in ``(temporal patch, row, column)`` order, so token
``s * GRID**2 + c`` holds frames ``s * tp ... s * tp + tp - 1`` of cell ``c``, and the head predicts those ``tp``
frames' labels. A build with a larger ``spatial_merge_size`` ``m`` (4 or 8) has tokens of ``m/2 x m/2`` cells, and the
head predicts every cell of its token (with 8, one token holds a whole frame group: all ``GRID**2`` cells).

Everything is seeded: the same base, items and settings give byte-identical weights.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from longreel.testing.tiny_model import MARKER_FILE, install_build_dir
from longreel.trainer.synthetic_task import COLOURS, GRID

__all__ = ["N_CLASSES", "PERCEPTION_MARKER", "cell_labels", "cells_per_token_side", "pretrain_perception_tower"]

#: empty, then (colour, small) and (colour, large) for each of the four colours
N_CLASSES = 1 + 2 * len(COLOURS)
PERCEPTION_MARKER = "longreel_perception_tower.json"
_RGB = np.array(list(COLOURS.values()), dtype=np.int32)  # [4, 3]
# A disc of the task reaches this fraction of the cell side from the centre only when it is large (SIZES: small 0.24,
# large 0.46; the order kind's 0.38 counts as large).
_SIZE_PROBE = 0.35
# The canvas is at most 40 + 11 per channel; every colour has one channel of 200 or more.
_EMPTY_BELOW = 120


def cell_labels(frames: np.ndarray, grid: int = GRID) -> np.ndarray:
    """Per-frame, per-cell perception labels read from the pixels.

    ``frames``: ``[T, H, W, 3]`` uint8 (``H == W``). Returns ``[T, grid * grid]`` int64 in ``[0, N_CLASSES)``:
    ``0`` when the cell's centre pixel is background, else ``1 + 2 * colour + large`` with ``colour`` the nearest of
    ``COLOURS`` (in their order) and ``large`` whether the pixel ``0.35`` cell sides right of the centre has the
    same colour. Row-major cells, as the task's ``_cell_disc`` numbers them.

    Not ``synthetic_solvers.find_balls``: that sums each colour's pixels per frame into one centroid cell, while the
    head needs a label for every token's cell (a large ball covers several)."""
    t, h, w, _ = frames.shape
    if h != w:
        raise ValueError(f"cell_labels needs square frames, got {h}x{w}")
    side = h / grid
    centres = (np.arange(grid) + 0.5) * side
    cy = np.minimum(centres.astype(int), h - 1)
    cx = np.minimum(centres.astype(int), w - 1)
    px = np.minimum((centres + _SIZE_PROBE * side).astype(int), w - 1)
    centre = frames[:, cy[:, None], cx[None, :]].astype(np.int32)  # [T, grid, grid, 3]
    probe = frames[:, cy[:, None], px[None, :]].astype(np.int32)
    colour = np.argmin(((centre[..., None, :] - _RGB) ** 2).sum(-1), axis=-1)  # [T, grid, grid]
    present = centre.max(-1) >= _EMPTY_BELOW
    large = np.abs(probe - centre).sum(-1) < 30
    labels = np.where(present, 1 + 2 * colour + large.astype(np.int64), 0)
    return labels.reshape(t, grid * grid).astype(np.int64)


def _pixel_inputs(processor, items: list[dict]):
    """The video processor's ``(pixel_values_videos [P, D], video_grid_thw [N, 3])`` of the items' frames, and their
    labels ``[N, T, grid * grid]``."""
    import torch

    enc = processor.video_processor(videos=[it["frames"] for it in items], return_tensors="pt",
                                    do_sample_frames=False)
    labels = torch.from_numpy(np.stack([cell_labels(np.asarray(it["frames"])) for it in items]))
    return enc["pixel_values_videos"], enc["video_grid_thw"], labels


def cells_per_token_side(merge: int) -> int:
    """Cells along one side of a merged token: a cell is 2x2 patches, a token ``merge x merge`` patches."""
    if merge % 2 or (2 * GRID) % merge:
        raise ValueError(f"perception pretraining needs a spatial merge that tiles the {GRID}x{GRID} cells "
                         f"(2, 4 or 8 patches), got {merge}")
    return merge // 2


def _check_grid(grid_thw, n_frames: int, tp: int) -> None:
    merged = {tuple(int(x) for x in row) for row in grid_thw.tolist()}
    want = (n_frames // tp, 2 * GRID, 2 * GRID)
    if merged != {want}:
        raise ValueError(f"perception pretraining needs {2 * GRID}x{2 * GRID} patches per frame group "
                         f"(video_grid_thw {want}), got {sorted(merged)}: use 112 px frames")


def _logits(model, head, pixels, grid_thw, tp: int, k: int):
    """``[N, T, cells, N_CLASSES]`` head logits of a batch of videos. Tokens come in (group, token row, token column)
    order, each holding ``tp`` frames of ``k x k`` cells; ``k`` is :func:`cells_per_token_side`."""
    import torch

    out = model.get_video_features(pixels, grid_thw, return_dict=True)
    feats = torch.stack(list(out.pooler_output))  # [N, groups * side * side, H]
    n, tokens, _ = feats.shape
    side = GRID // k  # tokens along a frame's side
    groups = tokens // (side * side)
    logits = head(feats).view(n, groups, side, side, tp, k, k, N_CLASSES)
    # to (group, frame in group, cell row = token row * k + row in token, cell column likewise)
    logits = logits.permute(0, 1, 4, 2, 5, 3, 6, 7)
    return logits.reshape(n, groups * tp, GRID * GRID, N_CLASSES)


def _accuracy(pred, labels) -> dict:
    hit = pred == labels
    obj = labels > 0
    return {"cell_accuracy": float(hit.float().mean()),
            "object_cell_accuracy": float(hit[obj].float().mean()) if bool(obj.any()) else None}


def _train(model, head, data, *, steps: int, batch: int, lr: float, seed: int, tp: int, k: int) -> list[float]:
    import torch

    pixels, grid_thw, labels = data
    per_video = int(grid_thw[0].prod())
    params = list(model.model.visual.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    losses = []
    n = labels.shape[0]
    for _ in range(steps):
        idx = np.sort(rng.choice(n, size=min(batch, n), replace=False))
        rows = torch.cat([torch.arange(i * per_video, (i + 1) * per_video) for i in idx.tolist()])
        logits = _logits(model, head, pixels[rows], grid_thw[idx], tp, k)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, N_CLASSES), labels[idx].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _evaluate(model, head, data, tp: int, k: int) -> dict:
    import torch

    pixels, grid_thw, labels = data
    with torch.no_grad():
        pred = _logits(model, head, pixels, grid_thw, tp, k).argmax(-1)
    return _accuracy(pred, labels)


def pretrain_perception_tower(base_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                              kinds: Iterable[str], steps: int = 300, batch: int = 16, lr: float = 1e-3,
                              train_items: int = 1024, eval_items: int = 256, seed: int = 0, n_frames: int = 4,
                              size: int = 112, radius: float = 0.25, threads: int = 1) -> dict:
    """Copy the tiny build in ``base_dir`` to ``out_dir`` with its vision tower (patch embedding, blocks, merger)
    trained on :func:`cell_labels` of synthetic videos of ``kinds``; return the report also written to
    ``out_dir/longreel_perception_tower.json`` (settings, held-out cell accuracy before/after, loss curve).

    Items come from ``make_items`` seeds ``20000 + seed`` (train) and ``30000 + seed`` (held out), apart from the
    learning benchmark's. The language model is untouched. ``threads``: torch threads while training (restored
    after); float sums may differ with the thread count, so it is one of the settings. ``out_dir`` holding a report
    of the same settings and base is reused; the copy is written in a sibling temp dir and renamed into place."""
    import torch

    from longreel.trainer.policy import load_policy

    base, target = Path(base_dir).absolute(), Path(out_dir).absolute()
    settings = {"base_build": json.loads((base / MARKER_FILE).read_text(encoding="utf-8")), "kinds": list(kinds),
                "steps": steps, "batch": batch, "lr": lr, "train_items": train_items, "eval_items": eval_items,
                "seed": seed, "n_frames": n_frames, "size": size, "radius": radius, "threads": threads}
    if _built_with(target, settings):
        return json.loads((target / PERCEPTION_MARKER).read_text(encoding="utf-8"))
    model, processor = load_policy(str(base), vision_attention="native")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = _pretrain(model, processor, settings)
    finally:
        torch.set_num_threads(threads_before)
    _install(model, base, target, report)
    return report


def _pretrain(model, processor, settings: dict) -> dict:
    """Train the tower in place and return the report."""
    import torch

    from longreel.trainer.synthetic_task import make_items

    seed, tp = settings["seed"], int(model.config.vision_config.temporal_patch_size)
    k = cells_per_token_side(int(model.config.vision_config.spatial_merge_size))
    shape = {name: settings[name] for name in ("kinds", "n_frames", "size", "radius")}
    train = _pixel_inputs(processor, make_items(settings["train_items"], seed=20000 + seed, **shape))
    held = _pixel_inputs(processor, make_items(settings["eval_items"], seed=30000 + seed, **shape))
    _check_grid(train[1], settings["n_frames"], tp)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(int(model.config.text_config.hidden_size), tp * k * k * N_CLASSES)
        model.train()
        before = _evaluate(model, head, held, tp, k)
        losses = _train(model, head, train, steps=settings["steps"], batch=settings["batch"], lr=settings["lr"],
                        seed=seed, tp=tp, k=k)
        model.eval()
        after = _evaluate(model, head, held, tp, k)
    return {"settings": settings, "held_out_before": before, "held_out_after": after,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
            "loss_50_step_means": [round(float(np.mean(losses[i:i + 50])), 4) for i in range(0, len(losses), 50)]}


def _built_with(directory: Path, settings: dict) -> bool:
    marker = directory / PERCEPTION_MARKER
    return marker.is_file() and json.loads(marker.read_text(encoding="utf-8")).get("settings") == settings


def _install(model, base: Path, target: Path, report: dict) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        work = tmp / "build"
        # the tokenizer, processor and configs are the base's; a tiny-build marker would claim random weights
        shutil.copytree(base, work, ignore=shutil.ignore_patterns(MARKER_FILE))
        model.save_pretrained(str(work))
        (work / PERCEPTION_MARKER).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        install_build_dir(work, target, lambda d: _built_with(d, report["settings"]), replace_old=target.exists())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
