"""The cross-step video-feature cache of frozen towers (``trainer.mrsp.frozen_cache.FrozenFeatureCache``): a video
seen in an earlier step gives the reference log-probs of a fresh encode bitwise, without a tower pass; other pixels
under the same name are never served the old features; the store is bounded (LRU); and a 2-step GRPO run with the
cache equals the run without it bitwise (metrics and weights) while the cached tower runs only in step 1."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.trainer.mrsp.embed_cache import StepEmbedCache, VisionCallCounter, encode_video_features  # noqa: E402
from longreel.trainer.mrsp.frozen_cache import FrozenFeatureCache, pixel_digest  # noqa: E402
from longreel.trainer.mrsp.reuse import response_logprobs  # noqa: E402
from longreel.trainer.positions import prompt_positions  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_videos):
    from conftest import tiny_reference_with_video

    ref, enc = tiny_reference_with_video(tmp_path_factory.mktemp("refcache"), shared_videos)
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 300, (3, 9), generator=g)
    mask = torch.ones_like(resp)
    mask[2, 4:] = 0
    return ref, enc, resp, mask


def _fresh(ref, pv, grid):
    with torch.no_grad():
        return encode_video_features(ref, pv, grid)


def _ref_logprobs(ref, enc, resp, mask, feats):
    pos = prompt_positions(ref, enc["input_ids"], enc["video_grid_thw"], enc.get("mm_token_type_ids"))
    with torch.no_grad():
        return response_logprobs(ref, enc["input_ids"], resp, mask, features=feats, positions=pos)


def test_a_later_step_reuses_the_features_bitwise_without_a_tower_pass(setup):
    ref, enc, resp, mask = setup
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    cache = FrozenFeatureCache(ref, max_bytes=1 << 30, offload=True)
    with VisionCallCounter(ref) as calls:
        cache.begin_step()
        cache.features("vtest", pv, grid)
        assert (calls.calls, cache.encodes) == (1, 1)
        cache.begin_step()  # next step: another item of the same video, under another name and a copied tensor
        cached = cache.features("vtest_q1", pv.clone(), grid)
        assert calls.calls == 1 and (cache.encodes, cache.store_hits) == (0, 1)
    fresh = _fresh(ref, pv, grid)
    assert cached.dtype == fresh.dtype and cached.device == fresh.device
    assert torch.equal(cached, fresh)
    # the reference log-probs a step computes from them: bitwise those of this step's own encode (the step cache)
    step = StepEmbedCache(ref, vision="frozen")
    step.begin_step()
    assert torch.equal(_ref_logprobs(ref, enc, resp, mask, cached),
                       _ref_logprobs(ref, enc, resp, mask, step.features("vtest", pv, grid)))


def test_other_pixels_under_a_seen_name_are_encoded_not_served(setup):
    ref, enc, _, _ = setup
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    other = pv.clone()
    other[0, 0] = torch.nextafter(other[0, 0], torch.tensor(float("inf")))  # one value, one ulp
    assert pixel_digest(other, grid) != pixel_digest(pv, grid)
    assert pixel_digest(pv.clone(), grid) == pixel_digest(pv, grid)
    cache = FrozenFeatureCache(ref, max_bytes=1 << 30)
    cache.begin_step()
    first = cache.features("vtest", pv, grid)
    cache.begin_step()
    with VisionCallCounter(ref) as calls:
        got = cache.features("vtest", other, grid)  # same name (e.g. another clip of one video_id), other pixels
    assert calls.calls == 1 and cache.store_hits == 0
    assert torch.equal(got, _fresh(ref, other, grid))
    assert not torch.equal(got, first)
    # within one step too: a name reused for other pixels is looked up afresh, not served the first video
    cache.begin_step()
    cache.features("clip", pv, grid)
    assert torch.equal(cache.features("clip", other, grid), got) and cache.hits == 0


def test_the_same_pixels_in_another_order_under_a_seen_name_are_not_served(setup):
    """Within a step a name key is checked by the cheap fingerprint: frames (or patches) in another order have the
    same plain sum, so the position-weighted sum is what tells them apart."""
    from longreel.trainer.mrsp.embed_cache import video_fingerprint

    ref, enc, _, _ = setup
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    flipped = pv.flip(0)
    assert float(flipped.double().sum()) == float(pv.double().sum())  # the plain sum alone would be fooled
    assert video_fingerprint(flipped, grid) != video_fingerprint(pv, grid)
    cache = FrozenFeatureCache(ref, max_bytes=0)
    cache.begin_step()
    cache.features("v", pv, grid)
    assert torch.equal(cache.features("v", flipped, grid), _fresh(ref, flipped, grid)) and cache.hits == 0
    step = StepEmbedCache(ref, vision="frozen")
    step.begin_step()
    step.features("v", pv, grid)
    with pytest.raises(ValueError, match="other pixels"):
        step.features("v", flipped, grid)


def test_the_store_is_bounded_least_recently_used_first(setup):
    ref, enc, _, _ = setup
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    other = pv.flip(0)
    one = _fresh(ref, pv, grid)
    size = one.numel() * one.element_size()
    cache = FrozenFeatureCache(ref, max_bytes=size, offload=True)  # room for exactly one video
    for video in (pv, other):
        cache.begin_step()
        cache.features("v", video, grid)
    assert len(cache) == 1 and cache.nbytes == size and cache.evictions == 1
    cache.begin_step()
    cache.features("v", pv, grid)  # evicted: encoded again
    assert (cache.encodes, cache.store_hits, cache.total_encodes) == (1, 0, 3)
    cache.begin_step()
    cache.features("v", pv, grid)
    assert (cache.encodes, cache.store_hits) == (0, 1)
    # max_bytes=0 keeps nothing across steps: the step cache's behaviour
    off = FrozenFeatureCache(ref, max_bytes=0)
    for _ in range(2):
        off.begin_step()
        off.features("v", pv, grid)
        off.features("v", pv, grid)
        assert (off.encodes, off.hits) == (1, 1)
    assert len(off) == 0 and off.total_encodes == 2


# ------------------------------------------------------------------------------------ in the GRPO trainer
def _two_steps(model: str, items, out: Path, cache_mb: float, vision: str, prefix_mb: float = 0,
               feature_dir: str = ""):
    import longreel.trainer.grpo as grpo
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig

    cfg = load_yaml(TrainConfig, None, [
        f"model.path={model}", f"run.out_dir={out}", "run.steps=2", "run.save_final=false", "run.progress=false",
        "run.tensorboard=false", "run.threads=1", "run.seed=11", "data.batch_size=3", "data.shuffle=false",
        "rollout.n=4", "rollout.max_new_tokens=8", "optim.grad_accum=2", "grpo.mix_policy=true", "grpo.beta=0.05",
        "optim.lr=1e-3", "mrsp.enabled=true", f"mrsp.vision={vision}", f"mrsp.frozen_cache_mb={cache_mb}",
        f"mrsp.ref_prefix_cache_mb={prefix_mb}", f"mrsp.frozen_feature_dir={feature_dir}",
        *(["model.freeze_vision=true"] if vision == "frozen" else [])])
    tr = grpo.GRPOTrainer(cfg, items=items)
    metrics, calls = [], []
    try:
        for _ in range(2):
            with VisionCallCounter(tr.sess.model) as pol, VisionCallCounter(tr.ref) as ref:
                metrics.append(tr.step())
            calls.append((pol.calls, ref.calls))
            if tr.ref_prefix is not None:  # (misses, hits) of the reference's prefix store so far
                calls.append((tr.ref_prefix.misses, tr.ref_prefix.hits))
        weights = {k: v.detach().clone() for k, v in tr.sess.model.state_dict().items()}
    finally:
        tr.engine.close()
        tr.sess.close()
    return metrics, calls, weights


@pytest.mark.parametrize("vision", ["deferred", "frozen"])
def test_grpo_with_the_cross_step_cache_equals_grpo_without_it(tmp_path, shared_videos, vision):
    from grpo_mrsp_worker import video_items

    tiny = build_tiny_qwen2vl(tmp_path / "tiny", seed=0)
    items = video_items(shared_videos)  # 3 prompts on 2 videos, batch 3: step 2 sees both videos again
    m_on, calls_on, w_on = _two_steps(tiny, items, tmp_path / "on", 64, vision)
    m_off, calls_off, w_off = _two_steps(tiny, items, tmp_path / "off", 0, vision)
    if vision == "deferred":  # (policy, reference) tower passes per step: the reference's only in step 1
        assert calls_off == [(2, 2), (2, 2)] and calls_on == [(2, 2), (2, 0)], (calls_off, calls_on)
    else:  # the reference uses the frozen policy's features; those come from the store in step 2
        assert calls_off == [(2, 0), (2, 0)] and calls_on == [(2, 0), (0, 0)], (calls_off, calls_on)
    for a, b in zip(m_on, m_off):
        for k in ("loss", "kl", "reward_mean", "grad_norm"):
            assert a[k] == b[k], (k, a[k], b[k])
    assert m_on[1]["kl"] != 0  # the policy moved in step 1: the KL term, which the reference feeds, is live
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_on)


def test_grpo_with_the_reference_prefix_store_matches_grpo_without_it(tmp_path, shared_videos):
    """The reference's video-prefix K/V from the store: the run's metrics and weights within fp32 rounding of the
    plain MR-SP run (two forwards for the prompt instead of one), the prefix computed once per video."""
    from grpo_mrsp_worker import video_items

    tiny = build_tiny_qwen2vl(tmp_path / "tiny", seed=0)
    items = video_items(shared_videos)
    m_on, calls_on, w_on = _two_steps(tiny, items, tmp_path / "on", 64, "deferred", prefix_mb=64)
    m_off, _, w_off = _two_steps(tiny, items, tmp_path / "off", 0, "deferred")
    # step 1: vtest's two questions share one prefix (1 miss, 1 hit), tree misses; step 2: all three hit
    assert calls_on == [(2, 2), (2, 1), (2, 0), (2, 4)], calls_on
    for a, b in zip(m_on, m_off):
        assert a["reward_mean"] == b["reward_mean"]
        for k in ("loss", "kl", "grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(b[k])), (k, a[k], b[k])
    assert m_on[1]["kl"] != 0
    worst = max(float((w_on[k] - w_off[k]).abs().max()) for k in w_on)
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("vision", ["deferred", "frozen"])
def test_grpo_reads_the_features_an_earlier_run_left_in_the_feature_directory(tmp_path, shared_videos, vision):
    """``mrsp.frozen_feature_dir`` with no memory store: run 1 writes each video's frozen-tower features at its
    first sight and reads them back in step 2, run 2 (a restart, or the next run of a sweep) encodes nothing with
    the frozen tower; both the same run as without the directory, bitwise."""
    from grpo_mrsp_worker import video_items

    tiny = build_tiny_qwen2vl(tmp_path / "tiny", seed=0)
    items = video_items(shared_videos)
    fdir = str(tmp_path / "features")
    m_off, calls_off, w_off = _two_steps(tiny, items, tmp_path / "off", 0, vision)
    m_1, calls_1, w_1 = _two_steps(tiny, items, tmp_path / "run1", 0, vision, feature_dir=fdir)
    m_2, calls_2, w_2 = _two_steps(tiny, items, tmp_path / "run2", 0, vision, feature_dir=fdir)
    if vision == "deferred":  # (policy, reference) tower passes per step: the trained policy's are never saved
        assert (calls_off, calls_1, calls_2) == ([(2, 2), (2, 2)], [(2, 2), (2, 0)], [(2, 0), (2, 0)])
    else:  # the frozen policy's features serve the reference too
        assert (calls_off, calls_1, calls_2) == ([(2, 0), (2, 0)], [(2, 0), (0, 0)], [(0, 0), (0, 0)])
    assert len(list(Path(fdir).rglob("*.safetensors"))) == 2  # one file per video
    for run_m, run_w in ((m_1, w_1), (m_2, w_2)):
        for a, b in zip(run_m, m_off):
            for k in ("loss", "kl", "reward_mean", "grad_norm"):
                assert a[k] == b[k], (k, a[k], b[k])
        assert all(torch.equal(run_w[k], w_off[k]) for k in w_off)
    assert m_2[1]["kl"] != 0
