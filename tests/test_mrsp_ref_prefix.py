"""The reference's video-prefix K/V store (``trainer.mrsp.ref_prefix.PrefixKVStore``): its log-probs equal the one-pass
prompt's within fp32 rounding; a later step (or another question on the same video) reuses the stored prefix and
gives the first step's log-probs bitwise without running the prefix; other videos or prefixes never share an
entry; the store is bounded."""
from __future__ import annotations

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.trainer.mrsp.embed_cache import encode_video_features  # noqa: E402
from longreel.trainer.mrsp.frozen_cache import pixel_digest  # noqa: E402
from longreel.trainer.mrsp.ref_prefix import PrefixKVStore, video_prefix_length  # noqa: E402
from longreel.trainer.mrsp.reuse import response_logprobs  # noqa: E402
from longreel.trainer.positions import prompt_positions  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_videos):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from conftest import vtest_video_inputs

    model_dir = build_tiny_qwen2vl(tmp_path_factory.mktemp("refprefix") / "tiny", seed=0)
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    proc = AutoProcessor.from_pretrained(model_dir)
    prompts = [vtest_video_inputs(proc, shared_videos, question=q)
               for q in ("How many people walk left?", "Is the floor tiled or carpeted?")]
    g = torch.Generator().manual_seed(0)
    resp = torch.randint(0, 300, (3, 9), generator=g)
    mask = torch.ones_like(resp)
    mask[2, 4:] = 0
    return ref, prompts, resp, mask


def _inputs(ref, enc):
    pv, grid = enc["pixel_values_videos"], enc["video_grid_thw"]
    with torch.no_grad():
        feats = encode_video_features(ref, pv, grid)
    pos = prompt_positions(ref, enc["input_ids"], grid, enc.get("mm_token_type_ids"))
    return pixel_digest(pv, grid), feats, pos


def _one_pass(ref, enc, resp, mask, feats, pos):
    with torch.no_grad():
        return response_logprobs(ref, enc["input_ids"], resp, mask, features=feats, positions=pos)


def test_stored_prefix_gives_the_one_pass_logprobs_and_is_reused_bitwise(setup):
    ref, prompts, resp, mask = setup
    store = PrefixKVStore(ref, max_bytes=1 << 30)
    seen = []
    for enc in prompts:  # two questions on one video: the second reuses the first's prefix
        cid, feats, pos = _inputs(ref, enc)
        lp = store.logprobs(cid, enc["input_ids"], resp, mask, features=feats, positions=pos)
        full = _one_pass(ref, enc, resp, mask, feats, pos)
        assert float(((lp - full).abs() * mask).max()) <= TOL
        seen.append(lp)
    assert (store.misses, store.hits, len(store)) == (1, 1, 1)
    assert 0 < video_prefix_length(ref, prompts[0]["input_ids"]) < prompts[0]["input_ids"].shape[1]
    # a later step asks for the first question again: the stored prefix, bitwise the first step's log-probs
    cid, feats, pos = _inputs(ref, prompts[0])
    again = store.logprobs(cid, prompts[0]["input_ids"], resp, mask, features=feats, positions=pos)
    assert store.hits == 2 and torch.equal(again, seen[0])


def test_other_videos_do_not_share_a_prefix_and_the_store_is_bounded(setup):
    ref, prompts, resp, mask = setup
    enc = prompts[0]
    cid, feats, pos = _inputs(ref, enc)
    other = dict(enc)
    other["pixel_values_videos"] = enc["pixel_values_videos"].flip(0)  # same shape and tokens, other pixels
    cid2, feats2, _ = _inputs(ref, other)
    assert cid2 != cid
    probe = PrefixKVStore(ref, max_bytes=1 << 30)
    probe.logprobs(cid, enc["input_ids"], resp, mask, features=feats, positions=pos)
    store = PrefixKVStore(ref, max_bytes=probe.nbytes)  # room for one prefix
    store.logprobs(cid, enc["input_ids"], resp, mask, features=feats, positions=pos)
    lp2 = store.logprobs(cid2, enc["input_ids"], resp, mask, features=feats2, positions=pos)
    assert (store.misses, store.hits, store.evictions, len(store)) == (2, 0, 1, 1)
    assert float(((lp2 - _one_pass(ref, other, resp, mask, feats2, pos)).abs() * mask).max()) <= TOL
    store.logprobs(cid, enc["input_ids"], resp, mask, features=feats, positions=pos)  # evicted: computed again
    assert (store.misses, store.hits) == (3, 0)
    none = PrefixKVStore(ref, max_bytes=0)
    for _ in range(2):
        none.logprobs(cid, enc["input_ids"], resp, mask, features=feats, positions=pos)
    assert (none.misses, none.hits, len(none)) == (2, 0, 0)
