"""Shared prompt prefix: the G responses of a group share one prompt (video + question), so the prompt is run
once and the responses run on top of its K/V cache (one packed row on its single copy under eager / sdpa
attention, the cache repeated per response otherwise). Log-probs and gradients (down to the vision tower) must
equal the per-sequence path within 1e-5 in fp32, for Qwen2-VL and Qwen2.5-VL, with right-padded responses of
different lengths; rollouts sampled from a once-prefilled prompt must equal the old path's under the same seed."""
from __future__ import annotations

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.trainer.activation_checkpointing import disable_checkpointing, enable_checkpointing  # noqa: E402
from longreel.trainer.mrsp.embed_cache import StepEmbedCache, encode_video_features  # noqa: E402
from longreel.trainer.positions import prompt_positions  # noqa: E402
from longreel.trainer import packed_responses  # noqa: E402
from longreel.trainer.mrsp.reuse import PromptGraph, generate_with_features, response_logprobs  # noqa: E402
from longreel.trainer.mrsp.sp_prefill import prefill_logprobs  # noqa: E402
from longreel.trainer.policy import can_share_prompt, encode_video, sequence_logprobs  # noqa: E402
from longreel.trainer.rollout import SamplingConfig, TransformersEngine  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

TOL = 1e-5
LENGTHS = [11, 6, 9, 1]  # right-padded responses of different lengths, one of a single token


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request, tmp_path_factory, shared_videos):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from conftest import ragged_responses, vtest_prompt

    torch.set_num_threads(1)
    family = request.param
    model_dir = build_tiny_qwen2vl(tmp_path_factory.mktemp(family) / "tiny", seed=0, family=family)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(model_dir)
    prompt = vtest_prompt(proc, shared_videos)
    resp, mask, weights = ragged_responses(LENGTHS)
    model.processor = proc  # the rollout tests need it; a plain attribute on the test's own model
    return family, model, prompt, resp, mask, weights


def masked_diff(a, b, mask) -> float:
    return float(((a - b) * mask).abs().max())


def grads(model) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def max_grad_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


class LanguageModelCalls:
    """Records the ``[batch, length]`` of every text-decoder forward, to see which path really ran."""

    def __init__(self, model):
        self.lm, self.shapes = model.model.language_model, []

    def __enter__(self):
        self.handle = self.lm.register_forward_pre_hook(
            lambda mod, args, kwargs: self.shapes.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ------------------------------------------------------------------------------------------------ log-probs
def _features_and_positions(model, prompt):
    """The prompt's video features (no graph) and its M-RoPE positions: what the log-prob passes take."""
    with torch.no_grad():
        f = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
    return f, prompt_positions(model, prompt.input_ids, prompt.video_grid_thw, prompt.mm_token_type_ids,
                               extra=prompt.extra)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logprobs_shared_prefix_equals_per_sequence(setup, temperature):
    _, model, prompt, resp, mask, _ = setup
    f, pos = _features_and_positions(model, prompt)
    with torch.no_grad():
        plain = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos,
                                  temperature=temperature, share_prompt=False)
        with LanguageModelCalls(model) as calls:
            shared = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos,
                                       temperature=temperature)
    n, t = resp.shape
    assert calls.shapes == [(1, prompt.length), (1, n * (t - 1))]  # the prompt once, then the responses packed
    assert masked_diff(shared, plain, mask) <= TOL
    assert bool(torch.isfinite(shared).all())
    # a single-token response batch needs no second pass: the prompt's last logits predict it
    with torch.no_grad():
        one = response_logprobs(model, prompt.input_ids, resp[:, :1], mask[:, :1], features=f, positions=pos,
                                temperature=temperature)
    assert masked_diff(one, plain[:, :1], mask[:, :1]) <= TOL


def test_update_gradients_reach_the_vision_tower_equally(setup):
    """With grad, the prompt's forward runs once and its K/V graph is shared by the responses: the backward
    still reaches the prefix and, through the features, every vision-tower parameter."""
    _, model, prompt, resp, mask, weights = setup
    pos = prompt_positions(model, prompt.input_ids, prompt.video_grid_thw, prompt.mm_token_type_ids,
                           extra=prompt.extra)
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        f = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
        lp = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos, share_prompt=share)
        (lp * weights * mask).sum().backward()
        out[share] = lp.detach(), grads(model)
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert max_grad_diff(out[True][1], out[False][1]) <= TOL
    vision = [k for k in out[True][1] if k.startswith("model.visual.")]
    assert vision and all(float(out[True][1][k].abs().max()) > 0 for k in vision)


@pytest.mark.parametrize("vision", ["frozen", "deferred"])
def test_prefill_logprobs_with_step_cache_equals_per_sequence(setup, vision):
    """The MR-SP one-rank dispatcher with StepEmbedCache leaves (the trainer-facing stage-1 path)."""
    _, model, prompt, resp, mask, weights = setup
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        cache = StepEmbedCache(model, vision=vision)
        cache.begin_step()
        with torch.no_grad():
            f = cache.features("vid", prompt.pixel_values_videos, prompt.video_grid_thw)
            pos = cache.positions("q", prompt.input_ids, prompt.video_grid_thw, prompt.mm_token_type_ids,
                                  extra=prompt.extra)
            old = prefill_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos,
                                   share_prompt=share)
        lp = prefill_logprobs(model, prompt.input_ids, resp, mask, features=cache.update_features("vid"),
                              positions=pos, share_prompt=share)
        (lp * weights * mask).sum().backward()
        cache.backward_vision()
        out[share] = old, lp.detach(), grads(model)
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert masked_diff(out[True][1], out[False][1], mask) <= TOL
    assert max_grad_diff(out[True][2], out[False][2]) <= TOL


def _sequence_logprobs_both_ways(model, prompt, resp, mask, weights) -> dict:
    """``{share_prompt: (log-probs, gradients, language-model call shapes)}`` of policy.sequence_logprobs."""
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        with LanguageModelCalls(model) as calls:
            lp = sequence_logprobs(model, prompt, resp, mask, temperature=0.9, share_prompt=share)
        (lp * weights * mask).sum().backward()
        out[share] = lp.detach(), grads(model), calls.shapes
    return out


def test_sequence_logprobs_shared_prefix_equals_per_sequence(setup):
    """The trainer's own path (policy.sequence_logprobs): values and gradients, the video encoded inside."""
    _, model, prompt, resp, mask, weights = setup
    out = _sequence_logprobs_both_ways(model, prompt, resp, mask, weights)
    n, t = resp.shape
    assert out[True][2] == [(1, prompt.length), (1, n * (t - 1))]
    assert out[False][2] == [(n, prompt.length + t)]
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert max_grad_diff(out[True][1], out[False][1]) <= TOL
    assert any(float(v.abs().max()) > 0 for k, v in out[True][1].items() if k.startswith("model.visual."))
    with torch.no_grad():  # precomputed embeddings (the MR-SP hook) take the same shared path
        emb = encode_video(model, prompt)
        reused = sequence_logprobs(model, prompt, resp, mask, temperature=0.9, video_embeds=emb)
    assert masked_diff(reused, out[False][0], mask) <= TOL


@pytest.fixture
def checkpointed(setup):
    """The setup's model with gradient checkpointing in training mode (no K/V cache in its layers)."""
    model = setup[1]
    enable_checkpointing(model)
    model.train()
    try:
        assert not can_share_prompt(model)
        yield setup
    finally:
        disable_checkpointing(model)
        model.eval()
    assert can_share_prompt(model)


def test_gradient_checkpointing_runs_prompt_and_responses_as_one_packed_row(checkpointed):
    """Checkpointed layers drop the K/V cache, so under checkpointing the prompt and the responses go through the
    decoder as ONE row (4D mask) instead of N full sequences: values and gradients (down to the vision tower)
    equal the per-sequence path's."""
    _, model, prompt, resp, mask, weights = checkpointed
    n, t = resp.shape
    out = _sequence_logprobs_both_ways(model, prompt, resp, mask, weights)
    assert out[True][2] == [(1, prompt.length + n * (t - 1))]
    assert out[False][2] == [(n, prompt.length + t)]
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert max_grad_diff(out[True][1], out[False][1]) <= TOL
    assert any(float(v.abs().max()) > 0 for k, v in out[True][1].items() if k.startswith("model.visual."))
    with torch.no_grad():  # a single-token batch: the prompt's last logits predict it
        one = sequence_logprobs(model, prompt, resp[:, :1], mask[:, :1], temperature=0.9)
    assert masked_diff(one, out[False][0][:, :1], mask[:, :1]) <= TOL


def test_gradient_checkpointing_packed_row_from_cached_features(checkpointed):
    """The MR-SP update's path (reuse.response_logprobs on cached features) takes the packed row too; the
    gradient reaches the features leaf as in the per-sequence forward."""
    _, model, prompt, resp, mask, weights = checkpointed
    n, t = resp.shape
    f, pos = _features_and_positions(model, prompt)
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        leaf = f.clone().requires_grad_(True)
        with LanguageModelCalls(model) as calls:
            lp = response_logprobs(model, prompt.input_ids, resp, mask, features=leaf, positions=pos,
                                   temperature=0.7, share_prompt=share)
        (lp * weights * mask).sum().backward()
        out[share] = lp.detach(), grads(model), leaf.grad.clone(), calls.shapes
    assert out[True][3] == [(1, prompt.length + n * (t - 1))]
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert max_grad_diff(out[True][1], out[False][1]) <= TOL
    assert float((out[True][2] - out[False][2]).abs().max()) <= TOL and float(out[True][2].abs().max()) > 0


def test_gradient_checkpointing_without_a_4d_mask_attention_runs_per_sequence(checkpointed, monkeypatch):
    from longreel.trainer import policy

    _, model, prompt, resp, mask, _ = checkpointed
    monkeypatch.setattr(policy, "can_pack_responses", lambda m: False)
    with LanguageModelCalls(model) as calls, torch.no_grad():
        got = sequence_logprobs(model, prompt, resp, mask)
    assert calls.shapes == [(resp.shape[0], prompt.length + resp.shape[1])]
    with torch.no_grad():
        expected = sequence_logprobs(model, prompt, resp, mask, share_prompt=False)
    assert masked_diff(got, expected, mask) <= TOL


def test_packed_row_mask_is_causal_prompt_then_block_responses():
    key = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = packed_responses.packed_row_mask(2, key, torch.float32)[0, 0] == 0  # True = attend
    assert m.shape == (2 + 6, 2 + 6)
    assert m[:2].tolist() == [[True, False] + [False] * 6, [True, True] + [False] * 6]
    assert m[2:, :2].all()  # every response token sees the whole prompt
    assert m[2:, 2:].tolist() == [[True, False, False, False, False, False], [True, True, False, False, False, False],
                                  [True, True, False, False, False, False], [False, False, False, True, False, False],
                                  [False, False, False, True, False, False], [False, False, False, True, False, False]]


class SavedKVBytes:
    """Bytes of the distinct storages saved for backward that hold K/V rows of at least the prompt's length
    (``[..., L >= Lp, head_dim]`` or transposed), counted while the context is open: how many prompt K/V copies a pass keeps."""

    def __init__(self, prompt_len: int, head_dim: int):
        self.prompt_len, self.head_dim, self.storages = prompt_len, head_dim, {}

    def _pack(self, x):
        # eager's matmul saves K as a [B*H, D, L] / V as a [B*H, L, D] view, sdpa [B, H, L, D]
        if x.dim() >= 3 and self.head_dim in x.shape[-2:] and max(x.shape[-2:]) >= self.prompt_len:
            st = x.untyped_storage()
            self.storages[st.data_ptr()] = st.nbytes()
        return x

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prompt_graph_packed_responses_equal_repeated_cache_and_keep_one_prompt_copy(setup, attn):
    """PromptGraph's micro-batches run as one packed row (block-diagonal 4D mask) on the prompt's single K/V:
    log-probs and gradients (decoder and the features) equal the repeated-cache path's, and the K/V saved for
    the backward hold the prompt once instead of once per response."""
    _, model, prompt, resp, mask, weights = setup
    text_cfg = model.model.language_model.config
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    pos = prompt_positions(model, prompt.input_ids, prompt.video_grid_thw, prompt.mm_token_type_ids,
                           extra=prompt.extra)
    with torch.no_grad():
        f0 = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
    before = text_cfg._attn_implementation
    model.set_attn_implementation(attn)
    try:
        assert text_cfg._attn_implementation == attn and packed_responses.can_pack_responses(model)
        out = {}
        for pack in (False, True):
            model.zero_grad(set_to_none=True)
            f = f0.clone().requires_grad_()
            graph = PromptGraph(model, prompt.input_ids, f, pos, pack_responses=pack)
            lps = []
            with LanguageModelCalls(model) as calls:
                for sl in (slice(0, 3), slice(3, 4)):  # two micro-batches: accumulation on the leaves
                    with SavedKVBytes(prompt.length, head_dim) as saved:
                        lp = graph.logprobs(model, resp[sl], mask[sl], temperature=0.8)
                    (lp * weights[sl] * mask[sl]).sum().backward()
                    lps.append(lp.detach())
                    if sl.start == 0:
                        kv_bytes = saved.total
            graph.backward()
            out[pack] = torch.cat(lps), f.grad.clone(), grads(model), calls.shapes, kv_bytes
    finally:
        model.set_attn_implementation(before)
    t = resp.shape[1]
    assert out[True][3] == [(1, 3 * (t - 1)), (1, t - 1)]  # really packed
    assert out[False][3] == [(3, t - 1), (1, t - 1)]
    assert masked_diff(out[True][0], out[False][0], mask) <= TOL
    assert float((out[True][1] - out[False][1]).abs().max()) <= TOL
    assert float(out[True][1].abs().max()) > 0
    assert max_grad_diff(out[True][2], out[False][2]) <= TOL
    # one copy of (prompt + the packed responses) per K and V per layer, after GQA's head repeat at most
    one_copy = 2 * text_cfg.num_hidden_layers * text_cfg.num_attention_heads * head_dim * 4 \
        * (prompt.length + 3 * (t - 1))
    assert out[True][4] <= one_copy
    assert out[False][4] >= 2.5 * one_copy  # the repeated cache: three prompt copies per K and V (the check bites)


def test_packing_falls_back_without_a_4d_mask_attention(setup, monkeypatch):
    """An attention implementation that does not take the additive 4D mask (flash, flex) keeps the repeated-
    cache path: one row per response."""
    _, model, prompt, resp, mask, _ = setup
    f, pos = _features_and_positions(model, prompt)
    with torch.no_grad():
        packed = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos)
    monkeypatch.setattr(packed_responses, "PACKABLE_ATTENTION", ())
    assert not packed_responses.can_pack_responses(model)
    with LanguageModelCalls(model) as calls, torch.no_grad():
        repeated = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos)
    n, t = resp.shape
    assert calls.shapes == [(1, prompt.length), (n, t - 1)]
    assert masked_diff(packed, repeated, mask) <= TOL


# ------------------------------------------------------------------------------------------------ rollouts
def test_engine_rollouts_with_one_prefill_equal_per_row_prefill(setup):
    """TransformersEngine under the same per-prompt seeds: the prompt is prefilled once (its K/V kept as one
    copy that the G rows' decode steps attend to, outside the text model's forward) instead of G times by
    ``generate``, and the sampled rollouts are the same tokens."""
    _, model, prompt, *_ = setup
    sampling = SamplingConfig(n=4, temperature=1.0, top_p=1.0, max_new_tokens=10)
    seeds = [3, 11]
    runs = {}
    for share in (False, True):
        engine = TransformersEngine(model, model.processor, share_prompt=share)
        with LanguageModelCalls(model) as calls:
            runs[share] = engine.generate([prompt, prompt], sampling, seeds), calls.shapes
    (old, old_calls), (new, new_calls) = runs[False], runs[True]
    assert old_calls[0] == (sampling.n, prompt.length)  # generate prefilled every row
    assert new_calls == [(1, prompt.length)] * 2  # one forward per prompt: its prefill, batch 1
    for a, b in zip(old, new):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        assert a.texts == b.texts and torch.equal(a.finished, b.finished)
    # the two prompts' seeds differ, so must their groups (the seed really is per prompt)
    assert not torch.equal(new[0].response_ids, new[1].response_ids)


def test_engine_greedy_rollouts_equal_per_row_prefill(setup):
    """Greedy: transformers 5 refuses ``num_return_sequences > 1`` without sampling, so the per-row path can
    only be run with n=1; the shared prefill gives n identical rows equal to it."""
    _, model, prompt, *_ = setup
    one = TransformersEngine(model, model.processor, share_prompt=False).generate(
        [prompt], SamplingConfig(n=1, max_new_tokens=10, greedy=True), [0])[0]
    many = TransformersEngine(model, model.processor).generate(
        [prompt], SamplingConfig(n=3, max_new_tokens=10, greedy=True), [0])[0]
    assert torch.equal(many.response_ids, one.response_ids.expand(3, -1))
    assert many.texts == one.texts * 3


def test_generate_with_features_shared_prefix_same_tokens_and_step_logits(setup):
    """generate_with_features: same tokens under the same seed, and every decoding step's logits within 1e-5 of
    the per-row prefill's (so the M-RoPE positions of the new tokens, from the prefill's rope_deltas, are right)."""
    _, model, prompt, *_ = setup
    with torch.no_grad():
        f = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
    out = {}
    for share in (False, True):
        torch.manual_seed(5)
        out[share] = generate_with_features(
            model, prompt.input_ids, features=f, video_grid_thw=prompt.video_grid_thw,
            mm_token_type_ids=prompt.mm_token_type_ids, num_return_sequences=4, share_prompt=share,
            max_new_tokens=8, do_sample=True, top_k=0, return_dict_in_generate=True, output_logits=True,
            **prompt.extra)
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert len(out[True].logits) == len(out[False].logits) == 8
    assert max(float((a - b).abs().max()) for a, b in zip(out[True].logits, out[False].logits)) <= TOL


def test_text_only_prompt_after_a_video_prompt(setup):
    """A prompt without video sets no rope_deltas in its prefill: the previous (video) prompt's must not leak
    into the new tokens' positions."""
    from longreel.engines.shared_prefix import generate_shared_prefix

    _, model, prompt, *_ = setup
    with torch.no_grad():
        f = encode_video_features(model, prompt.pixel_values_videos, prompt.video_grid_thw)
        generate_with_features(model, prompt.input_ids, features=f, video_grid_thw=prompt.video_grid_thw,
                               mm_token_type_ids=prompt.mm_token_type_ids, num_return_sequences=2, max_new_tokens=2,
                               do_sample=True, **prompt.extra)  # leaves this video prompt's rope_deltas behind
    ids = prompt.input_ids[:, -12:]  # the question's text tokens
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    kw = dict(max_new_tokens=6, do_sample=True, top_k=0, return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(1)
    shared = generate_shared_prefix(model, inputs, 3, **kw)  # first: plain generate would reset rope_deltas
    torch.manual_seed(1)
    plain = model.generate(**inputs, num_return_sequences=3, **kw)
    assert torch.equal(shared.sequences, plain.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(shared.logits, plain.logits)) <= TOL


def test_sp_shared_prompt_logprobs_keeps_one_prompt_copy(setup, monkeypatch):
    """The sequence-parallel path (here on one rank) runs the prompt once for the G responses; the responses'
    attention reads the prompt's K/V without a copy per response, so the backward keeps G-1 fewer copies than
    with per-row copies (what it did before), with the same log-probs."""
    from longreel.trainer.mrsp import sp_prefill

    _, model, prompt, resp, mask, _ = setup
    text_cfg = model.model.language_model.config
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    f, pos = _features_and_positions(model, prompt)
    with torch.no_grad():
        plain = response_logprobs(model, prompt.input_ids, resp, mask, features=f, positions=pos,
                                  share_prompt=False)

    def per_row_copies(q, kp, vp, kd, vd, scale):
        rows = q.shape[0]
        return sp_prefill._PrefixCausalAttention.apply(q, kp.expand(rows, -1, -1, -1).contiguous(),
                                                       vp.expand(rows, -1, -1, -1).contiguous(), kd, vd, scale)

    out = {}
    for copies in (False, True):
        if copies:
            monkeypatch.setattr(sp_prefill, "shared_prefix_attention", per_row_copies)
        with SavedKVBytes(prompt.length, head_dim) as saved:
            lp = sp_prefill.sp_shared_prompt_logprobs(model, prompt.input_ids, resp, features=f, positions=pos)
        out[copies] = lp.detach(), saved.total
    assert masked_diff(out[False][0], plain, mask) <= TOL
    assert masked_diff(out[True][0], plain, mask) <= TOL
    rows = resp.shape[0]
    kv_copy = 2 * text_cfg.num_hidden_layers * text_cfg.num_attention_heads * head_dim * 4 * prompt.length
    assert rows >= 3 and out[True][1] - out[False][1] >= (rows - 1) * kv_copy * 0.99, (out, kv_copy)
