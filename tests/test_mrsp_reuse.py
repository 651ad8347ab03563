"""MR-SP stage 1 on one process: each video is encoded once per step and the cached features and M-RoPE
positions give the same log-probs, rollouts and gradients as the plain pixel path (fp32, within 1e-5)."""
from __future__ import annotations

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.trainer.activation_checkpointing import disable_checkpointing, enable_checkpointing  # noqa: E402
from longreel.trainer.mrsp.embed_cache import StepEmbedCache, VisionCallCounter, encode_video_features  # noqa: E402
from longreel.trainer.positions import prompt_positions  # noqa: E402
from longreel.trainer.mrsp.reuse import generate_with_features, response_logprobs, token_logprobs  # noqa: E402
from longreel.trainer.mrsp.sp_prefill import prefill_logprobs  # noqa: E402
from longreel.trainer.mrsp.vision_shard import plan_temporal_shards, sharded_video_features  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

TOL = 1e-5
G = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_videos):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from conftest import vtest_video_inputs

    model_dir = build_tiny_qwen2vl(tmp_path_factory.mktemp("mrsp") / "tiny", seed=0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(model_dir)
    enc = vtest_video_inputs(proc, shared_videos)
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 300, (G, 11), generator=g)
    mask = torch.ones_like(resp)
    mask[1, 6:] = 0
    mask[3, 2:] = 0
    weights = torch.randn(resp.shape, generator=g)
    return model, enc, resp, mask, weights


def plain_logprobs(model, enc, resp, mask):
    """The no-reuse path: every sequence carries its video's pixels; the model encodes and ropes itself."""
    n, t = resp.shape
    ids = torch.cat([enc["input_ids"].expand(n, -1), resp], dim=1)
    attn = torch.cat([enc["attention_mask"].expand(n, -1), mask], dim=1)
    mmt = torch.cat([enc["mm_token_type_ids"].expand(n, -1), torch.zeros_like(resp)], dim=1)
    out = model(input_ids=ids, attention_mask=attn, pixel_values_videos=enc["pixel_values_videos"].repeat(n, 1),
                video_grid_thw=enc["video_grid_thw"].repeat(n, 1), mm_token_type_ids=mmt, use_cache=False)
    return token_logprobs(out.logits[:, enc["input_ids"].shape[1] - 1:-1], resp)


def grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def maxdiff(a, b, keep=lambda name: True):
    return max(float((a[k] - b[k]).abs().max()) for k in a if keep(k))


def test_positions_match_the_models_own_rope_index(setup):
    model, enc, resp, mask, _ = setup
    pos = prompt_positions(model, enc["input_ids"], enc["video_grid_thw"], enc["mm_token_type_ids"])
    n, t = resp.shape
    ids = torch.cat([enc["input_ids"].expand(n, -1), resp], dim=1)
    mmt = torch.cat([enc["mm_token_type_ids"].expand(n, -1), torch.zeros_like(resp)], dim=1)
    full, _ = model.model.get_rope_index(ids, mm_token_type_ids=mmt, video_grid_thw=enc["video_grid_thw"].repeat(n, 1))
    assert torch.equal(pos.with_responses(n, t), full)
    assert pos.prompt[0].max() < pos.prompt.shape[-1] - 1  # video tokens really share positions (M-RoPE)


def test_reused_logprobs_equal_plain_path_and_encode_once(setup):
    model, enc, resp, mask, _ = setup
    with torch.no_grad():
        ref = plain_logprobs(model, enc, resp, mask)
    cache = StepEmbedCache(model, vision="frozen")
    cache.begin_step()
    with VisionCallCounter(model) as counter, torch.no_grad():
        for _ in range(3):  # old-policy, reference, and another consumer: one encode
            f = cache.features("vid", enc["pixel_values_videos"], enc["video_grid_thw"])
            pos = cache.positions("q", enc["input_ids"], enc["video_grid_thw"], enc["mm_token_type_ids"])
            lp = response_logprobs(model, enc["input_ids"], resp, mask, features=f, positions=pos)
            assert float(((lp - ref) * mask).abs().max()) <= TOL
        assert counter.calls == 1 and cache.encodes == 1 and cache.hits == 2
    # the one-rank dispatcher (SP off below the threshold, and with a single rank) is the same path
    with torch.no_grad():
        lp2 = prefill_logprobs(model, enc["input_ids"], resp, mask, features=f, positions=pos, sp_min_tokens=1)
    assert torch.equal(lp2, lp)


def test_rollouts_with_cached_features_equal_pixel_rollouts(setup):
    model, enc, *_ = setup
    cache = StepEmbedCache(model)
    f = cache.features("vid", enc["pixel_values_videos"], enc["video_grid_thw"])
    greedy = model.generate(**enc, max_new_tokens=8, do_sample=False)
    torch.manual_seed(7)
    sampled = model.generate(**enc, max_new_tokens=8, do_sample=True, num_return_sequences=G)
    with VisionCallCounter(model) as counter:
        got = generate_with_features(model, enc["input_ids"], features=f, video_grid_thw=enc["video_grid_thw"],
                                     max_new_tokens=8, do_sample=False)
        torch.manual_seed(7)
        got_s = generate_with_features(model, enc["input_ids"], features=f, video_grid_thw=enc["video_grid_thw"],
                                       max_new_tokens=8, do_sample=True, num_return_sequences=G)
        assert counter.calls == 0
    assert torch.equal(got, greedy) and torch.equal(got_s, sampled)


@pytest.mark.parametrize("vision", ["frozen", "recompute", "deferred"])
def test_update_gradients_equal_plain_path(setup, vision):
    model, enc, resp, mask, weights = setup
    model.zero_grad(set_to_none=True)
    (plain_logprobs(model, enc, resp, mask) * weights * mask).sum().backward()
    g_plain = grads(model)
    model.zero_grad(set_to_none=True)

    cache = StepEmbedCache(model, vision=vision)
    cache.begin_step()
    with VisionCallCounter(model) as counter:
        pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
        with torch.no_grad():  # the rollout / old / ref consumers of the step
            cache.features("vid", pv, grid)
        pos = cache.positions("q", enc["input_ids"], grid, enc["mm_token_type_ids"])
        for rows in (slice(0, 2), slice(2, 4)):  # two micro-batches of the update
            lp = response_logprobs(model, enc["input_ids"], resp[rows], mask[rows],
                                   features=cache.update_features("vid"), positions=pos)
            (lp * weights[rows] * mask[rows]).sum().backward()
        cache.backward_vision()
    g = grads(model)
    is_visual = lambda name: name.startswith("model.visual.")  # noqa: E731
    assert maxdiff(g, g_plain, lambda k: not is_visual(k)) <= TOL
    assert max(float(v.abs().max()) for k, v in g_plain.items() if is_visual(k)) > 1e-3
    if vision == "frozen":
        assert all(float(v.abs().max()) == 0.0 for k, v in g.items() if is_visual(k))
        assert counter.calls == 1
    else:
        assert maxdiff(g, g_plain, is_visual) <= TOL
        assert counter.calls == (2 if vision == "recompute" else 1)
        assert counter.grad_calls == 1
    model.zero_grad(set_to_none=True)


def test_grpo_step_encodes_each_video_once_not_g_plus_3(setup):
    """A GRPO-step-shaped sequence of consumers: G rollouts, old-policy, reference, update."""
    model, enc, resp, mask, weights = setup
    pv, grid, ids = enc["pixel_values_videos"], enc["video_grid_thw"], enc["input_ids"]
    with VisionCallCounter(model) as counter:  # without reuse
        with torch.no_grad():
            for _ in range(G):
                model.generate(**enc, max_new_tokens=2, do_sample=False)
            plain_logprobs(model, enc, resp[:1], mask[:1])  # old
            plain_logprobs(model, enc, resp[:1], mask[:1])  # ref
        plain_logprobs(model, enc, resp[:1], mask[:1]).sum().backward()  # update
        assert counter.calls == G + 3
    model.zero_grad(set_to_none=True)
    cache = StepEmbedCache(model, vision="deferred")
    with VisionCallCounter(model) as counter:
        for step in range(2):
            cache.begin_step()
            with torch.no_grad():
                f = cache.features("vid", pv, grid)
                for _ in range(G):
                    generate_with_features(model, ids, features=f, video_grid_thw=grid, max_new_tokens=2,
                                           do_sample=False)
                pos = cache.positions("q", ids, grid, enc["mm_token_type_ids"])
                response_logprobs(model, ids, resp, mask, features=f, positions=pos)  # old
                response_logprobs(model, ids, resp, mask, features=cache.features("vid", pv, grid),
                                  positions=pos)  # ref (frozen-vision reference shares the features)
            lp = response_logprobs(model, ids, resp, mask, features=cache.update_features("vid"), positions=pos)
            (lp * weights * mask).sum().backward()
            assert cache.backward_vision() == 1
            assert counter.calls == step + 1 and cache.encodes == 1
    model.zero_grad(set_to_none=True)


def test_cache_guards(setup):
    model, enc, resp, mask, weights = setup
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    cache = StepEmbedCache(model, vision="deferred")
    cache.begin_step()
    cache.features("vid", pv, grid)
    with pytest.raises(ValueError, match="other pixels"):
        cache.features("vid", pv + 1.0, grid)
    pos = cache.positions("q", enc["input_ids"], grid, enc["mm_token_type_ids"])
    lp = response_logprobs(model, enc["input_ids"], resp, mask, features=cache.update_features("vid"), positions=pos)
    lp.sum().backward()
    with pytest.raises(RuntimeError, match="backward_vision"):
        cache.begin_step()  # un-pushed vision gradients
    with torch.no_grad():
        next(model.model.visual.parameters()).add_(0.0)  # an optimizer step bumps the version
    with pytest.raises(RuntimeError, match="weights changed"):
        cache.backward_vision()
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="vision must be"):
        StepEmbedCache(model, vision="sometimes")


def test_shard_plan_is_contiguous_and_balanced():
    grid = torch.tensor([[5, 4, 6], [3, 2, 4]])  # groups of 24 patches (x5), then 8 patches (x3)
    total = 5 * 24 + 3 * 8
    for n in (1, 2, 3, 4, 9, 12):
        plan = plan_temporal_shards(grid, n, 2)
        assert sum(plan.patches) == total
        assert plan.rows[0][0] == 0 and plan.rows[-1][1] == total
        assert all(plan.rows[r][1] == plan.rows[r + 1][0] for r in range(n - 1))  # contiguous, in order
        assert sum(plan.out_sizes) == total // 4
        for r in range(n):
            sub = torch.tensor(plan.grids[r]).reshape(-1, 3)
            assert int(sub.prod(-1).sum()) == plan.patches[r]
    two = plan_temporal_shards(grid, 2, 2)
    assert two.patches == (72, 72)
    assert two.grids == (((3, 4, 6),), ((2, 4, 6), (3, 2, 4)))  # a rank may hold parts of two videos
    # the busiest rank carries the least possible patches (brute force over all contiguous cuts)
    import itertools

    weights = [24] * 5 + [8] * 3
    for n in (2, 3, 4, 5, 12):
        best = min(max(sum(weights[a:b]) for a, b in zip((0, *c), (*c, len(weights))))
                   for c in itertools.combinations_with_replacement(range(len(weights) + 1), n - 1))
        assert max(plan_temporal_shards(grid, n, 2).patches) == best, n


def test_sharded_encoder_single_process_is_the_plain_encode(setup):
    model, enc, *_ = setup
    with torch.no_grad():
        a = sharded_video_features(model, enc["pixel_values_videos"], enc["video_grid_thw"])
        b = encode_video_features(model, enc["pixel_values_videos"], enc["video_grid_thw"])
    assert torch.equal(a, b)


def test_cache_plugs_into_the_trainers_policy_functions(setup):
    """longreel.trainer.policy.sequence_logprobs fed StepEmbedCache features: same values, and in deferred mode the
    vision gradients arrive through backward_vision() with one tower pass for the whole step."""
    from longreel.trainer.mrsp.reuse import policy_video_embeds
    from longreel.trainer.policy import PromptInputs, sequence_logprobs

    model, enc, resp, mask, weights = setup
    prompt = PromptInputs.from_encoding("k", enc)
    model.zero_grad(set_to_none=True)
    (plain_logprobs(model, enc, resp, mask) * weights * mask).sum().backward()
    g_plain = grads(model)
    model.zero_grad(set_to_none=True)
    cache = StepEmbedCache(model, vision="deferred")
    cache.begin_step()
    with VisionCallCounter(model) as counter:
        with torch.no_grad():
            emb = policy_video_embeds(cache.features("k", prompt.pixel_values_videos, prompt.video_grid_thw),
                                      prompt.video_grid_thw)
            old = sequence_logprobs(model, prompt, resp, mask, video_embeds=emb)
        leaf = policy_video_embeds(cache.update_features("k"), prompt.video_grid_thw)
        lp = sequence_logprobs(model, prompt, resp, mask, video_embeds=leaf)
        (lp * weights * mask).sum().backward()
        cache.backward_vision()
        assert counter.calls == 1
    with torch.no_grad():
        ref = plain_logprobs(model, enc, resp, mask)
    assert float(((old - ref) * mask).abs().max()) <= TOL
    assert maxdiff(grads(model), g_plain) <= TOL
    model.zero_grad(set_to_none=True)


def _saved_bytes_of_deferred_encode(model, enc) -> tuple[int, dict]:
    """Bytes autograd saves for the deferred encode (the graph MR-SP keeps from rollout to update), and the
    tower's gradients after pushing a fixed upstream gradient through it."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    model.eval()  # rollouts run in eval mode: this is where the deferred encode happens
    model.zero_grad(set_to_none=True)
    cache = StepEmbedCache(model, vision="deferred")
    cache.begin_step()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cache.video("v", enc["pixel_values_videos"], enc["video_grid_thw"])
    leaf = cache.update_features("v")
    g = torch.Generator().manual_seed(1)
    (leaf * torch.randn(leaf.shape, generator=g)).sum().backward()
    cache.backward_vision()
    tower = {n: p.grad.clone() for n, p in model.named_parameters() if "visual" in n and p.grad is not None}
    return sum(saved), tower


def test_deferred_encode_follows_gradient_checkpointing(setup):
    """With gradient checkpointing on, the deferred graph keeps only block inputs (the tower runs checkpointed
    although the model is in eval mode for rollouts), and the tower's gradients are unchanged."""
    model, enc, *_ = setup
    full_bytes, full_grads = _saved_bytes_of_deferred_encode(model, enc)
    enable_checkpointing(model)
    try:
        ckpt_bytes, ckpt_grads = _saved_bytes_of_deferred_encode(model, enc)
        assert not base_tower_training(model)  # the tower is back in the caller's mode
    finally:
        disable_checkpointing(model)
        model.zero_grad(set_to_none=True)
    assert ckpt_bytes < 0.6 * full_bytes, (ckpt_bytes, full_bytes)
    assert full_grads and full_grads.keys() == ckpt_grads.keys()
    assert maxdiff(full_grads, ckpt_grads) < TOL


def base_tower_training(model) -> bool:
    from longreel.trainer.positions import base_model

    return base_model(model).visual.training
