"""The vision tower's batched attention (trainer/vision_attention.py) gives the per-frame path's features and
gradients, on one video, on videos of different sizes in one call, and through gradient checkpointing."""
from __future__ import annotations

import json

import pytest
import torch

from longreel.testing.tiny_model import build_tiny_qwen2vl
from longreel.trainer.activation_checkpointing import enable_checkpointing
from longreel.trainer.packed_row_attention import PACKED_ROW_ATTENTION
from longreel.trainer.policy import load_policy
from longreel.trainer.vision_attention import (BATCHED_VISION_ATTENTION, batched_varlen_sdpa,
                                              use_batched_vision_attention)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("va") / "tiny", seed=0)


def _video_inputs(config, grids: list[tuple[int, int, int]], seed: int = 0):
    v = config.vision_config
    dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    n = sum(t * h * w for t, h, w in grids)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, dim, generator=g), torch.tensor(grids)


def _features_and_grads(model, pixels, grid):
    model.zero_grad(set_to_none=True)
    out = model.get_video_features(pixels, grid, return_dict=True).pooler_output
    feats = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    (feats.float() ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.model.visual.named_parameters() if p.grad is not None}
    return feats.detach(), grads


def _assert_same(a, b):
    fa, ga = a
    fb, gb = b
    torch.testing.assert_close(fb, fa, rtol=1e-5, atol=1e-6)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("grids", [[(8, 4, 6)], [(4, 4, 6), (3, 6, 4), (2, 2, 2)]], ids=["one_video", "three_sizes"])
def test_batched_equals_per_frame(tiny, grids):
    native, _ = load_policy(tiny, vision_attention="native")
    batched, _ = load_policy(tiny)
    assert native.config.vision_config._attn_implementation == "sdpa"
    assert batched.config.vision_config._attn_implementation == BATCHED_VISION_ATTENTION
    # the decoder keeps its own attention: SDPA's (split for packed rows only, trainer/packed_row_attention.py)
    assert batched.config.text_config._attn_implementation == PACKED_ROW_ATTENTION
    pixels, grid = _video_inputs(native.config, grids)
    _assert_same(_features_and_grads(native, pixels, grid), _features_and_grads(batched, pixels, grid))


def test_batched_under_gradient_checkpointing(tiny):
    native, _ = load_policy(tiny, vision_attention="native")
    batched, _ = load_policy(tiny)
    for m in (native, batched):
        enable_checkpointing(m)
        m.train()
    pixels, grid = _video_inputs(native.config, [(6, 4, 4)], seed=1)
    _assert_same(_features_and_grads(native, pixels, grid), _features_and_grads(batched, pixels, grid))


def test_function_groups_runs_and_checks_its_input():
    torch.manual_seed(0)
    module = torch.nn.Module().eval()
    lengths = [4, 4, 4, 2, 2, 5]
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v = (torch.randn(1, 3, sum(lengths), 8) for _ in range(3))
    out, _ = batched_varlen_sdpa(module, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert out.shape == (1, sum(lengths), 3, 8)
    start = 0
    for n in lengths:  # each block attends to itself only
        s = slice(start, start + n)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], scale=0.3)
        torch.testing.assert_close(out[:, s], ref.transpose(1, 2))
        start += n
    with pytest.raises(ValueError, match="the sequence has 20"):
        batched_varlen_sdpa(module, q[:, :, :20], k[:, :, :20], v[:, :, :20], cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="unmasked"):
        batched_varlen_sdpa(module, q, k, v, attention_mask=torch.ones(1), cu_seq_lens_q=cu)


def test_not_applied_where_it_does_not_fit(tiny, tmp_path):
    eager, _ = load_policy(tiny, attn_implementation="eager")
    assert eager.config.vision_config._attn_implementation == "eager"
    assert not use_batched_vision_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="vision_attention"):
        load_policy(tiny, vision_attention="fast")
    batched, _ = load_policy(tiny)
    batched.save_pretrained(tmp_path / "saved")  # the switch is not written into the checkpoint's config
    assert BATCHED_VISION_ATTENTION not in json.dumps(json.loads((tmp_path / "saved" / "config.json").read_text()))
