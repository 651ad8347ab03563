"""trainer.chunked_logprobs: the sampled tokens' log-probs a block of positions at a time, against the textbook
``log_softmax(logits.float() / T).gather(labels)`` and its autograd gradient; the block size changes no bit; autograd
keeps the logits as they came and no float32 copy of them."""
from __future__ import annotations

import pytest
import torch

from longreel.trainer.chunked_logprobs import chunked_token_logprobs
from longreel.trainer.policy import token_logprobs


def textbook(logits, labels, temperature):
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _values_and_grad(fn, base, labels, weights, temperature, **kw):
    logits = base.clone().requires_grad_(True)
    lp = fn(logits, labels, temperature, **kw)
    (lp * weights).sum().backward()
    return lp.detach(), logits.grad


def _case(dtype, n=3, t=9, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, t, vocab, generator=g) * 4).to(dtype)
    return base, torch.randint(0, vocab, (n, t), generator=g), torch.randn(n, t, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_are_the_textbooks(dtype, temperature):
    base, labels, weights = _case(dtype)
    want_lp, want_grad = _values_and_grad(textbook, base, labels, weights, temperature)
    lp, grad = _values_and_grad(chunked_token_logprobs, base, labels, weights, temperature)
    assert lp.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(grad.float(), want_grad.float(), atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("block_elements", [1, 50, 50 * 4, 50 * 9, 50 * 20, 1 << 26])
def test_the_block_size_changes_no_bit(block_elements):
    # one position a block, parts of a sequence, whole sequences, several sequences, everything at once
    base, labels, weights = _case(torch.float32)
    want = _values_and_grad(chunked_token_logprobs, base, labels, weights, 0.7, block_elements=1 << 26)
    got = _values_and_grad(chunked_token_logprobs, base, labels, weights, 0.7, block_elements=block_elements)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_views_with_any_strides_are_read_in_place():
    # the first response token's logits expanded over N rows (stride 0), and logits sliced off a longer output
    first = torch.randn(1, 1, 40, requires_grad=True)
    labels = torch.randint(0, 40, (5, 1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        lp = chunked_token_logprobs(first.expand(5, -1, -1), labels, block_elements=40)
    assert [x.untyped_storage().data_ptr() for x in saved if x.dim() == 3] == [first.untyped_storage().data_ptr()]
    lp.sum().backward()
    got = first.grad.clone()
    first.grad = None
    textbook(first.expand(5, -1, -1), labels, 1.0).sum().backward()
    torch.testing.assert_close(got, first.grad, atol=1e-6, rtol=0)

    out = torch.randn(2, 7, 40, requires_grad=True)
    labels = torch.randint(0, 40, (2, 6))
    lp = chunked_token_logprobs(out[:, :-1, :], labels, block_elements=80)
    torch.testing.assert_close(lp, textbook(out[:, :-1, :], labels, 1.0), atol=1e-6, rtol=0)
    lp.sum().backward()
    assert out.grad[:, -1].abs().sum() == 0 and out.grad[:, :-1].abs().sum() > 0


def test_autograd_keeps_the_logits_and_no_float32_copy():
    base, labels, _ = _case(torch.bfloat16, n=2, t=8, vocab=64)
    logits = base.clone().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        chunked_token_logprobs(logits, labels, 0.7)
    big = [x for x in saved if x.dim() == 3]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16
    assert big[0].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    # the textbook keeps a float32 [N, T, V] tensor (its log-softmax), twice the logits' bytes
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        textbook(logits, labels, 0.7)
    assert any(x.dim() == 3 and x.dtype == torch.float32 for x in saved)


def test_the_trainers_token_logprobs_is_the_chunked_one():
    base, labels, weights = _case(torch.float32)
    want = _values_and_grad(chunked_token_logprobs, base, labels, weights, 0.7)
    got = _values_and_grad(token_logprobs, base, labels, weights, 0.7)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"logits \[N, T, V\]"):
        chunked_token_logprobs(torch.randn(4, 10), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        chunked_token_logprobs(torch.randn(2, 3, 10), torch.zeros(2, 4, dtype=torch.long))
