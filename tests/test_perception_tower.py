"""The perception pretraining of the tiny model's vision tower: labels read from pixels agree with what was drawn,
training makes them readable from the tower, the result is reproducible and touches only the tower."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from longreel.testing.perception_tower import N_CLASSES, PERCEPTION_MARKER, cell_labels, pretrain_perception_tower
from longreel.testing.tiny_model import MARKER_FILE, build_tiny_qwen2vl
from longreel.trainer.synthetic_task import COLOURS, GRID, render


def _objects(labels_t):
    """{cell: (colour index, large)} of one frame's labels."""
    return {c: ((int(v) - 1) // 2, (int(v) - 1) % 2) for c, v in enumerate(labels_t) if v}


@pytest.mark.parametrize("size", [112, 56])
def test_the_change_kind_labels_change_in_what_the_facts_say(size):
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(60):
        frames, facts = render("change", rng, n_frames=4, size=size)
        labels = cell_labels(frames)
        assert labels.shape == (4, GRID * GRID) and labels.max() < N_CLASSES
        per_frame = [_objects(row) for row in labels]
        assert all(len(o) == 1 for o in per_frame), per_frame
        at = facts["at"]
        (c0, (col0, big0)), = per_frame[at - 1].items()
        (c1, (col1, big1)), = per_frame[at].items()
        differs = {"position": c0 != c1, "colour": col0 != col1, "size": big0 != big1}
        assert [k for k, v in differs.items() if v] == [facts["change"]]
        seen.add(facts["change"])
    assert seen == {"position", "colour", "size"}


def test_the_order_and_direction_kinds_labels_follow_the_balls():
    rng = np.random.default_rng(1)
    names = list(COLOURS)
    for _ in range(20):
        frames, facts = render("order", rng, n_frames=4, size=112)
        per_frame = [_objects(row) for row in cell_labels(frames)]
        assert all(sorted(names[col] for col, _ in o.values()) == sorted(facts["colours"]) for o in per_frame)
        frames, facts = render("direction", rng, n_frames=4, size=112)
        cells = [next(iter(_objects(row))) for row in cell_labels(frames)]
        step = (cells[1] % GRID - cells[0] % GRID) % GRID
        assert step == (1 if facts["side"] == "right" else GRID - 1)


def test_background_only_frames_are_empty():
    frames = np.full((2, 112, 112, 3), 51, dtype=np.uint8)
    assert not cell_labels(frames).any()
    with pytest.raises(ValueError, match="square"):
        cell_labels(np.zeros((1, 112, 56, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("perc") / "base", seed=0, temporal_patch_size=4)


def _pretrain(base, out):
    return pretrain_perception_tower(base, out, kinds=["change", "direction"], steps=40, batch=8, lr=3e-3,
                                     train_items=64, eval_items=32, seed=0)


def test_pretraining_makes_cells_readable_and_leaves_the_language_model(base, tmp_path):
    report = _pretrain(base, tmp_path / "a")
    assert report["held_out_after"]["cell_accuracy"] > report["held_out_before"]["cell_accuracy"] + 0.3
    assert report["loss_last"] < report["loss_first"]
    out = tmp_path / "a"
    assert not (out / MARKER_FILE).exists()  # not a random tiny build any more
    assert json.loads((out / PERCEPTION_MARKER).read_text())["settings"]["steps"] == 40
    before, after = load_file(f"{base}/model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".visual." in k or k.startswith("visual.") for k in changed), sorted(changed)[:5]
    assert any("patch_embed" in k for k in changed) and any("merger" in k for k in changed)


def test_pretraining_is_reproducible_and_reused(base, tmp_path):
    _pretrain(base, tmp_path / "a")
    _pretrain(base, tmp_path / "b")
    a, b = (tmp_path / "a" / "model.safetensors").read_bytes(), (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a == b
    stamp = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    _pretrain(base, tmp_path / "a")  # same settings: nothing is retrained
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == stamp
    pretrain_perception_tower(base, tmp_path / "a", kinds=["change"], steps=5, batch=4, train_items=16,
                              eval_items=8, seed=0)  # other settings: rebuilt in place
    assert json.loads((tmp_path / "a" / PERCEPTION_MARKER).read_text())["settings"]["steps"] == 5


def test_frames_that_are_not_one_token_per_cell_are_refused(tmp_path):
    base = build_tiny_qwen2vl(tmp_path / "base", seed=0)
    with pytest.raises(ValueError, match="112 px"):
        pretrain_perception_tower(base, tmp_path / "p", kinds=["change"], steps=1, train_items=4, eval_items=4,
                                  size=56)


class _OneHotTower:
    """Stands in for a model whose merged token ``i`` has the one-hot feature ``e_i``."""

    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens

    def get_video_features(self, pixels, grid_thw, return_dict=True):
        from types import SimpleNamespace

        return SimpleNamespace(pooler_output=[torch.eye(self.n_tokens)])


@pytest.mark.parametrize("merge", [2, 4, 8])
def test_each_cells_logits_come_from_the_token_that_covers_it(merge):
    # a head whose output o on token i reads 1000 * i + o: every cell of every frame must show the token over that
    # cell and the head slot of that cell's place within the token
    from longreel.testing.perception_tower import _logits, cells_per_token_side

    tp, groups = 2, 2
    k = cells_per_token_side(merge)
    side = GRID // k
    n_tokens = groups * side * side
    head = torch.nn.Linear(n_tokens, tp * k * k * N_CLASSES, bias=False)
    with torch.no_grad():
        head.weight.copy_(1000.0 * torch.arange(n_tokens)[None, :] + torch.arange(head.out_features)[:, None])
    out = _logits(_OneHotTower(n_tokens), head, None, None, tp, k)
    assert out.shape == (1, groups * tp, GRID * GRID, N_CLASSES)
    for frame in range(groups * tp):
        g, f = divmod(frame, tp)
        for cell in range(GRID * GRID):
            row, col = divmod(cell, GRID)
            token = g * side * side + (row // k) * side + col // k
            slot = ((f * k + row % k) * k + col % k) * N_CLASSES
            want = 1000.0 * token + slot + torch.arange(N_CLASSES, dtype=torch.float32)
            assert torch.equal(out[0, frame, cell], want), (merge, frame, cell)
    with pytest.raises(ValueError, match="tiles"):
        cells_per_token_side(3)


def test_pretraining_reads_every_cell_from_one_token_per_frame(tmp_path):
    # spatial merge 8 at 112 px: one merged token holds all 16 cells of its frame
    base = build_tiny_qwen2vl(tmp_path / "base", seed=0, temporal_patch_size=1, spatial_merge_size=8)
    report = pretrain_perception_tower(base, tmp_path / "p", kinds=["change", "direction"], steps=40, batch=8,
                                       lr=3e-3, train_items=64, eval_items=32, seed=0)
    assert report["held_out_after"]["cell_accuracy"] > report["held_out_before"]["cell_accuracy"] + 0.3
