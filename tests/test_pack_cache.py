"""Frame cache: cached uint8 frames == what the transformers processor path makes from the source video."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from longreel.pipelines.media.decode import decode_frames, decode_in_worker
from longreel.pipelines.media.worker import IsolatedWorker
from longreel.pipelines.pack.frame_cache import (FrameCache, FrameParams, effective_max_pixels, load_video_processor,
                                        processor_resize)
from longreel.testing.pack_tables import video_rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from longreel.testing.tiny_model import build_tiny_qwen2vl
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2vl")


@pytest.fixture(scope="module")
def cup(shared_videos):
    return video_rows([str(shared_videos / "opencv__cup.mp4")])[0]


def _all_frames(path: str) -> np.ndarray:
    """Every frame of the file, full resolution, decoded independently of the cache code (plain PyAV)."""
    import av
    with av.open(path) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


@pytest.mark.parametrize("fps,max_video_tokens", [(2.0, None), (4.0, 200)])
def test_cache_equals_the_processor_path(tmp_path, tiny_dir, cup, fps, max_video_tokens):
    """The processor, given the whole decoded video and its metadata, samples (fps, max_frames) and resizes
    itself; the cache's frames, passed with do_sample_frames=False, do_resize=False, give identical
    pixel values and video_grid_thw. The second case makes the per-frame pixel cap bind (32 frames,
    small token budget) and resizes in more than one chunk."""
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    vp = load_video_processor(tiny_dir, max_pixels=None)
    if max_video_tokens:
        vp.max_video_tokens = max_video_tokens
        assert effective_max_pixels(vp, 32) < vp.size["longest_edge"]
    params = FrameParams(fps=fps, max_frames=64)
    cache = FrameCache(str(tmp_path / "cache"), params, vp)
    with IsolatedWorker() as w:
        entry = cache.build(cup, cup["uri"], lambda p, ts, **kw: decode_in_worker(w, p, ts, **kw))
    cached = entry.load()
    assert isinstance(cached, np.memmap) and cached.dtype == np.uint8

    full = _all_frames(cup["uri"])
    assert full.shape[0] == cup["n_frames"]
    meta = VideoMetadata(total_num_frames=cup["n_frames"], fps=cup["fps_avg"], duration=cup["duration_s"])
    ref = vp(videos=[full], video_metadata=[meta], do_sample_frames=True, fps=fps, max_frames=64,
             return_tensors="pt", return_metadata=True)
    assert ref["video_metadata"][0].frames_indices.tolist() == entry.meta["frames_indices"]
    # the uint8 frames themselves: the processor's resize of its own sampled frames, in one call
    sampled = torch.from_numpy(full[ref["video_metadata"][0].frames_indices.numpy()]).permute(0, 3, 1, 2)
    from transformers.image_utils import SizeDict
    resized = vp.resize(videos=sampled[None], size=SizeDict(**vp.size), resample=vp.resample,
                        factor=vp.patch_size * vp.merge_size, temporal_factor=vp.temporal_patch_size,
                        cap_pixels_per_frame=vp.cap_pixels_per_frame)[0].permute(0, 2, 3, 1).numpy()
    assert resized.dtype == np.uint8 and np.array_equal(resized, np.asarray(cached))

    got = vp(videos=[np.array(cached)], do_sample_frames=False, do_resize=False, return_tensors="pt")
    assert torch.equal(got["video_grid_thw"], ref["video_grid_thw"])
    assert got["video_grid_thw"].tolist() == [entry.meta["video_grid_thw"]]
    assert torch.equal(got["pixel_values_videos"], ref["pixel_values_videos"])

    # and through the full processor (text + video) with the chat template, as the trainer calls it
    proc = AutoProcessor.from_pretrained(tiny_dir)
    proc.video_processor = vp
    text = "<|vision_start|><|video_pad|><|vision_end|>What happens?"
    a = proc(text=[text], videos=[np.array(cached)], do_sample_frames=False, do_resize=False, return_tensors="pt")
    assert torch.equal(a["video_grid_thw"], ref["video_grid_thw"])
    assert torch.equal(a["pixel_values_videos"], ref["pixel_values_videos"])


def test_processor_resize_matches_in_one_call_and_rejects_bad_input(tiny_dir):
    vp = load_video_processor(tiny_dir, max_pixels=None)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(40, 97, 203, 3), dtype=np.uint8)  # odd sizes, 3 chunks
    from transformers.image_utils import SizeDict
    one = vp.resize(videos=torch.from_numpy(frames).permute(0, 3, 1, 2)[None], size=SizeDict(**vp.size),
                    resample=vp.resample, factor=28, temporal_factor=2, cap_pixels_per_frame=True)
    assert np.array_equal(processor_resize(vp, frames), one[0].permute(0, 2, 3, 1).numpy())
    with pytest.raises(ValueError, match="uint8"):
        processor_resize(vp, frames.astype(np.float32))


def test_key_depends_on_content_and_parameters_only(tmp_path, tiny_dir, cup, shared_videos):
    vp = load_video_processor(tiny_dir, max_pixels=None)
    a = FrameCache(str(tmp_path / "a"), FrameParams(2.0, 64), vp)
    b = FrameCache(str(tmp_path / "b"), FrameParams(2.0, 64), vp)
    assert a.key(cup["sha256"]) == b.key(cup["sha256"])  # same content, anywhere: one entry
    assert a.key(cup["sha256"]) != FrameCache(str(tmp_path), FrameParams(1.0, 64), vp).key(cup["sha256"])
    assert a.key(cup["sha256"]) != FrameCache(str(tmp_path), FrameParams(2.0, 32), vp).key(cup["sha256"])
    vp2 = load_video_processor(tiny_dir, max_pixels=28 * 28 * 32)
    assert a.key(cup["sha256"]) != FrameCache(str(tmp_path), FrameParams(2.0, 64), vp2).key(cup["sha256"])
    # the same bytes under another name decode once: the renamed copy hits the entry
    copy = tmp_path / "renamed.mp4"
    shutil.copyfile(cup["uri"], copy)
    calls = []

    def decode(p, ts, **kw):
        calls.append(p)
        return decode_frames(p, ts, **kw)

    a.build(cup, cup["uri"], decode)
    entry, state = a.lookup(video_rows([str(copy)])[0]["sha256"])
    assert state == "hit" and entry.meta["video_id"] == cup["video_id"] and len(calls) == 1


def test_truncated_or_flipped_entry_is_detected(tmp_path, tiny_dir, cup):
    vp = load_video_processor(tiny_dir, max_pixels=None)
    cache = FrameCache(str(tmp_path / "c"), FrameParams(2.0, 16), vp)
    entry = cache.build(cup, cup["uri"], lambda p, ts, **kw: decode_frames(p, ts, **kw))
    good = open(entry.npy_path, "rb").read()
    assert cache.lookup(cup["sha256"])[1] == "hit"

    with open(entry.npy_path, "r+b") as fh:  # truncated
        fh.truncate(len(good) - 100)
    e, state = cache.lookup(cup["sha256"])
    assert e is None and state.startswith("corrupt:") and "bytes" in state

    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    open(entry.npy_path, "wb").write(bytes(flipped))
    assert cache.lookup(cup["sha256"], verify="size")[1] == "hit"  # a size check alone cannot see it
    e, state = cache.lookup(cup["sha256"])
    assert e is None and state == "corrupt:frames sha256 mismatch"

    open(entry.meta_path, "w").write("{not json")
    assert cache.lookup(cup["sha256"])[1].startswith("corrupt:meta")
    os.unlink(entry.meta_path)
    assert cache.lookup(cup["sha256"])[1] == "missing"

    rebuilt = cache.build(cup, cup["uri"], lambda p, ts, **kw: decode_frames(p, ts, **kw))
    assert open(rebuilt.npy_path, "rb").read() == good
    meta = json.loads(open(rebuilt.meta_path).read())
    assert meta["frames_file"]["sha256"] == rebuilt.frames_sha256 and meta["num_frames"] == 16
    # no pickle anywhere: the entry loads with allow_pickle=False, the metadata is JSON
    assert np.load(rebuilt.npy_path, allow_pickle=False).dtype == np.uint8


def test_display_rotated_video_is_cached_upright(tmp_path, tiny_dir, shared_videos, ffmpeg):
    """Phone footage (a display-rotation side datum) is cached as displayed: portrait frames whose pixels are the
    coded frames turned by the rotation, with the displayed size in the metadata, the way the captioner saw it."""
    from conftest import display_rotated_copy

    rotated = display_rotated_copy(ffmpeg, shared_videos / "opencv__cup.mp4", tmp_path / "cup_rot90.mp4")
    row = video_rows([str(rotated)])[0]
    assert row["rotation"] == 90 and row["width"] > row["height"]  # coded landscape, displayed portrait
    vp = load_video_processor(tiny_dir, max_pixels=None)
    cache = FrameCache(str(tmp_path / "cache"), FrameParams(fps=2.0, max_frames=64), vp)
    with IsolatedWorker() as w:
        entry = cache.build(row, row["uri"], lambda p, ts, **kw: decode_in_worker(w, p, ts, **kw))
    frames = entry.load()
    t, h, w, _ = frames.shape
    assert h > w and (entry.meta["width"], entry.meta["height"]) == (row["height"], row["width"])
    assert entry.meta["rotation_applied"] == 90
    coded = decode_frames(row["uri"], entry.meta["requested_timestamps"]).frames
    want = processor_resize(vp, np.ascontiguousarray(np.rot90(coded, 1, axes=(1, 2))))
    np.testing.assert_array_equal(np.asarray(frames), want)
    assert not np.array_equal(np.asarray(frames), processor_resize(vp, np.ascontiguousarray(
        np.rot90(coded, -1, axes=(1, 2)))))  # and not turned the wrong way
