"""The packed row's split attention (trainer/packed_row_attention.py): under gradient checkpointing a prompt and
its responses run as one row, the prompt's rows as causal SDPA and only the responses' rows with a mask. Values
and gradients (down to the vision tower and the cached-features leaf) must equal the one-call [L, L] mask path
within 1e-5 in fp32, for Qwen2-VL and Qwen2.5-VL; every other forward must be transformers' SDPA path, bit for
bit."""
from __future__ import annotations

import pytest
import torch

from longreel.testing.tiny_model import build_tiny_qwen2vl
from longreel.trainer.activation_checkpointing import disable_checkpointing, enable_checkpointing
from longreel.trainer.mrsp.embed_cache import encode_video_features
from longreel.trainer.mrsp.reuse import response_logprobs
from longreel.trainer.packed_row_attention import (PACKED_ROW_ATTENTION, _causal_prompt, packed_row_sdpa,
                                                   use_packed_row_attention)
from longreel.trainer.policy import load_policy, sequence_logprobs
from longreel.trainer.positions import prompt_positions

TOL = 1e-5
LENGTHS = [11, 6, 9, 1]  # right-padded responses of different lengths, one of a single token


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request, tmp_path_factory, shared_videos):
    from conftest import ragged_responses, vtest_prompt

    torch.set_num_threads(1)
    model_dir = build_tiny_qwen2vl(tmp_path_factory.mktemp(request.param) / "tiny", seed=0, family=request.param)
    split, proc = load_policy(model_dir)
    mask, _ = load_policy(model_dir, packed_row_attention="mask")
    prompt = vtest_prompt(proc, shared_videos)
    resp, key_mask, weights = ragged_responses(LENGTHS)
    return {"split": split, "mask": mask}, prompt, resp, key_mask, weights


@pytest.fixture
def checkpointed(setup):
    models = setup[0]
    for m in models.values():
        enable_checkpointing(m)
        m.train()
    yield setup
    for m in models.values():
        disable_checkpointing(m)
        m.eval()


class PackedCalls:
    """Counts the attention calls that took the split path (a packed_prompt_len keyword)."""

    def __init__(self, monkeypatch):
        from transformers import AttentionInterface

        self.count = 0

        def counting(*args, **kwargs):
            self.count += kwargs.get("packed_prompt_len") is not None
            return packed_row_sdpa(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_ROW_ATTENTION, counting)


def _grads(model) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_load_policy_switches_only_the_text_decoder(setup):
    models = setup[0]
    assert models["split"].config.text_config._attn_implementation == PACKED_ROW_ATTENTION
    assert models["mask"].config.text_config._attn_implementation == "sdpa"
    assert models["split"].config.vision_config._attn_implementation == models["mask"].config.vision_config._attn_implementation


def test_update_pass_split_equals_one_mask(checkpointed, monkeypatch):
    """policy.sequence_logprobs under checkpointing (the plain update): the packed row, both ways."""
    models, prompt, resp, key_mask, weights = checkpointed
    calls = PackedCalls(monkeypatch)
    out = {}
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(model, prompt, resp, key_mask, temperature=0.9)
        (lp * weights * key_mask).sum().backward()
        out[name] = lp.detach(), _grads(model)
    layers = models["split"].config.text_config.num_hidden_layers
    assert calls.count >= layers  # every decoder layer of the split model took the split path (plus recomputes)
    assert float(((out["split"][0] - out["mask"][0]) * key_mask).abs().max()) <= TOL
    assert _max_diff(out["split"][1], out["mask"][1]) <= TOL
    assert any(float(v.abs().max()) > 0 for k, v in out["split"][1].items() if k.startswith("model.visual."))


def test_cached_features_update_split_equals_one_mask(checkpointed, monkeypatch):
    """The MR-SP update (reuse.response_logprobs on cached features): the gradient reaching the features leaf too."""
    models, prompt, resp, key_mask, weights = checkpointed
    calls = PackedCalls(monkeypatch)
    out = {}
    for name, model in models.items():
        with torch.no_grad():
            f = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
        pos = prompt_positions(model, prompt.input_ids, prompt.video_grid_thw, prompt.mm_token_type_ids,
                               extra=prompt.extra)
        model.zero_grad(set_to_none=True)
        leaf = f.clone().requires_grad_(True)
        lp = response_logprobs(model, prompt.input_ids, resp, key_mask, features=leaf, positions=pos,
                               temperature=0.7, share_prompt=True)
        (lp * weights * key_mask).sum().backward()
        out[name] = lp.detach(), _grads(model), leaf.grad.clone()
    assert calls.count >= models["split"].config.text_config.num_hidden_layers
    assert float(((out["split"][0] - out["mask"][0]) * key_mask).abs().max()) <= TOL
    assert _max_diff(out["split"][1], out["mask"][1]) <= TOL
    assert float((out["split"][2] - out["mask"][2]).abs().max()) <= TOL and float(out["split"][2].abs().max()) > 0


def test_other_passes_are_sdpa_bit_for_bit(setup, monkeypatch):
    """Without the keyword the function is transformers' SDPA: the shared-prefix (cached) log-probs and a plain
    forward are identical to the unswitched model's."""
    models, prompt, resp, key_mask, _ = setup
    calls = PackedCalls(monkeypatch)
    with torch.no_grad():
        got = {name: sequence_logprobs(m, prompt, resp, key_mask) for name, m in models.items()}
        logits = {name: m(input_ids=prompt.input_ids[:, :8]).logits for name, m in models.items()}
    assert calls.count == 0
    assert torch.equal(got["split"], got["mask"])
    assert torch.equal(logits["split"], logits["mask"])


def test_split_rejects_a_mask_of_the_wrong_rows(setup):
    model = setup[0]["split"]
    attn = model.model.language_model.layers[0].self_attn
    q = torch.randn(1, model.config.text_config.num_attention_heads, 10, attn.head_dim)
    k = torch.randn(1, model.config.text_config.num_key_value_heads, 10, attn.head_dim)
    with pytest.raises(ValueError, match="mask must cover the 4 response rows"):
        packed_row_sdpa(attn, q, k, k, torch.zeros(1, 1, 10, 10), packed_prompt_len=6)
    with pytest.raises(ValueError, match="uncached row"):
        packed_row_sdpa(attn, q, k[:, :, :8], k[:, :, :8], torch.zeros(1, 1, 4, 8), packed_prompt_len=6)
    out, _ = packed_row_sdpa(attn, q, k, k, torch.zeros(1, 1, 4, 10), packed_prompt_len=6)
    assert out.shape == (1, 10, q.shape[1], attn.head_dim)


def test_causal_prompt_with_repeated_heads_equals_grouped_query():
    """The fp32-on-CUDA branch (K/V heads repeated for the memory-efficient kernel) is the same attention as the
    grouped-query call, values and gradients."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    outs = []
    for repeat in (False, True):
        out = _causal_prompt(q, k, v, 0.0, None, repeat_kv=repeat)
        grads = torch.autograd.grad((out ** 2).sum(), (q, k, v))
        outs.append((out.detach(), grads))
    assert outs[0][0].shape == (1, 12, 4, 8)
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(b, a)


def test_only_sdpa_qwen_decoders_switch(tmp_path):
    assert not use_packed_row_attention(torch.nn.Linear(2, 2))
    path = build_tiny_qwen2vl(tmp_path / "tiny", seed=0)
    eager, _ = load_policy(path, attn_implementation="eager")
    assert eager.config.text_config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="packed_row_attention"):
        load_policy(path, packed_row_attention="fast")
    split, _ = load_policy(path)
    split.save_pretrained(tmp_path / "saved")
    assert PACKED_ROW_ATTENTION not in (tmp_path / "saved" / "config.json").read_text()
