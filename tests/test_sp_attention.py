"""The sequence-parallel path's attention of G responses over their shared prompt
(:func:`longreel.trainer.mrsp.sp_prefill.shared_prefix_attention`): exact against SDPA over per-row copies of the
prompt's keys, and without those copies."""
import pytest
import torch
import torch.nn.functional as F

from longreel.trainer.mrsp import sp_prefill
from longreel.trainer.mrsp.sp_prefill import shared_prefix_attention

ROWS, HEADS, PREFIX, OWN, DIM = 3, 4, 40, 6, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(ROWS, HEADS, OWN, DIM), (1, HEADS, PREFIX, DIM), (1, HEADS, PREFIX, DIM),
              (ROWS, HEADS, OWN, DIM), (ROWS, HEADS, OWN, DIM)]
    return [torch.randn(s, generator=g, dtype=torch.float32).requires_grad_() for s in shapes]


def _reference(q, kp, vp, kd, vd, scale):
    """Every row gets its own copy of the prefix, then one masked SDPA: row i of a response sees the whole prefix
    and its own keys 0..i."""
    keys = torch.cat([kp.expand(ROWS, -1, -1, -1), kd], dim=2)
    vals = torch.cat([vp.expand(ROWS, -1, -1, -1), vd], dim=2)
    mask = torch.arange(PREFIX + OWN).view(1, -1) <= torch.arange(PREFIX, PREFIX + OWN).view(-1, 1)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale)


@pytest.mark.skipif(sp_prefill._FLASH_CPU is None, reason="this torch has no CPU flash-attention op")
def test_shared_prefix_attention_equals_per_row_copies_forward_and_backward():
    scale = DIM ** -0.5
    ours, ref = _inputs(), _inputs()
    out = shared_prefix_attention(*ours, scale)
    expect = _reference(*ref, scale)
    assert torch.allclose(out, expect, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    (expect * w).sum().backward()
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    assert float(ours[1].grad.abs().max()) > 0  # the shared prefix gets the rows' gradients, summed


@pytest.mark.skipif(sp_prefill._FLASH_CPU is None, reason="this torch has no CPU flash-attention op")
def test_shared_prefix_attention_saves_no_per_row_copy_of_the_prefix():
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    q, kp, vp, kd, vd = _inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = shared_prefix_attention(q, kp, vp, kd, vd, DIM ** -0.5)
    out.sum().backward()
    long = [s for s in saved if len(s) == 4 and s[2] >= PREFIX]
    assert long and all(s[0] == 1 for s in long), saved  # the prefix, once, with batch 1
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        saved.clear()
        _reference(*_inputs(), DIM ** -0.5)
    assert any(s[0] == ROWS and s[2] >= PREFIX for s in saved if len(s) == 4)  # what the check would catch
