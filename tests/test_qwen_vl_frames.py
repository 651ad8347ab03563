"""Qwen2-VL's frame rules without transformers (pipelines/media/qwen_vl_frames.py) == the installed processor's own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from longreel.pipelines.media.qwen_vl_frames import Qwen2VLFrames, frame_count, sample_indices, smart_resize
from longreel.pipelines.pack.frame_cache import (CacheError, FrameParams, frame_processor, load_video_processor,
                                                 processor_params, processor_resize)
from longreel.pipelines.pack.frame_cache import sample_indices as cache_sample_indices


@pytest.fixture(scope="module")
def processor():
    return load_video_processor(None)


def test_defaults_and_cache_params_equal_the_processor_class():
    """Same processor_params (so the same cache keys) as transformers' Qwen2VLVideoProcessor, default and with the
    pixel budget overridden as the configs do."""
    for lo, hi in ((None, None), (100352, 200704), (28 * 28 * 4, 28 * 28 * 16)):
        light = frame_processor(None, min_pixels=lo, max_pixels=hi)
        assert isinstance(light, Qwen2VLFrames)
        assert processor_params(light) == processor_params(load_video_processor(None, min_pixels=lo, max_pixels=hi))


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as img_rule
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize as video_rule

    rng = np.random.default_rng(0)
    sizes = [(720, 1280), (1080, 1920), (1920, 1080), (240, 320), (29, 5000), (10, 10), (1, 150), (4000, 3000)]
    sizes += [tuple(int(x) for x in rng.integers(1, 4000, 2)) for _ in range(400)]
    budgets = [(56 * 56, 14 * 14 * 4 * 1280), (100352, 200704), (100352, 602112), (28 * 28 * 4, 28 * 28 * 16)]
    checked = 0
    for h, w in sizes:
        for factor in (28, 14, 2):
            for lo, hi in budgets:
                try:
                    want = video_rule(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
                except ValueError:
                    with pytest.raises(ValueError):
                        smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
                    continue
                assert smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi) == tuple(want), (h, w)
                assert tuple(img_rule(h, w, factor=factor, min_pixels=lo, max_pixels=hi)) == tuple(want)
                checked += 1
    assert checked > 4500


def test_sample_indices_equal_the_processor(processor):
    """Indices for every frame count up to 3,000 and a spread of long videos, at the fps and caps the configs use."""
    from transformers.video_utils import VideoMetadata

    totals = list(range(1, 3000, 7)) + list(range(3000, 250000, 4999))
    n = 0
    for total in totals:
        for video_fps in (23.976, 25.0, 30.0, 59.94):
            for fps, lo, hi in ((2.0, 4, 64), (1.0, 4, 768), (0.5, 8, 256), (4.0, 4, 32)):
                meta = VideoMetadata(total_num_frames=total, fps=video_fps, duration=total / video_fps)
                try:
                    want = processor.sample_frames(metadata=meta, fps=fps, num_frames=None, min_frames=lo,
                                                   max_frames=hi, temporal_patch_size=2).tolist()
                except ZeroDivisionError:
                    assert frame_count(total, video_fps, fps, lo, hi, 2) == 0
                    with pytest.raises(ZeroDivisionError):
                        sample_indices(total, video_fps, fps, lo, hi, 2)
                    continue
                assert sample_indices(total, video_fps, fps, lo, hi, 2) == want, (total, video_fps, fps, lo, hi)
                n += 1
    assert n > 5000


def test_cache_sampling_rejects_the_same_way(processor):
    """One frame: no even count to sample; the frame cache rejects it through either processor."""
    for vp in (processor, frame_processor(None)):
        with pytest.raises(CacheError, match="1 frames"):
            cache_sample_indices(vp, 1, 25.0, FrameParams())


@pytest.mark.parametrize("shape,max_pixels", [((5, 360, 640), None), ((3, 720, 1280), 200704),
                                              ((2, 1080, 608), 28 * 28 * 16), ((4, 224, 224), 224 * 224),
                                              ((1, 50, 3000), None), ((17, 240, 320), 100352)])
def test_resize_equals_the_processor(processor, shape, max_pixels):
    """Bitwise: the processor's own resize (torchvision) and the light rule, through processor_resize (which
    resizes in chunks of 16 frames), on random and smooth frames, upscaling and downscaling and the same size."""
    rng = np.random.default_rng(sum(shape))
    t, h, w = shape
    noise = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([((xx * 255) // max(w - 1, 1) + k * 7) % 256 for k in range(t)]).astype(np.uint8)
    smooth = np.repeat(smooth[..., None], 3, axis=-1)
    for frames in (noise, smooth):
        ref_vp = load_video_processor(None, max_pixels=max_pixels)
        light = frame_processor(None, max_pixels=max_pixels)
        want = processor_resize(ref_vp, frames)
        got = processor_resize(light, frames)
        assert got.dtype == np.uint8 and got.shape == want.shape
        assert np.array_equal(got, want)
        assert np.array_equal(processor_resize(light, frames, num_frames=64), processor_resize(ref_vp, frames,
                                                                                                num_frames=64))


def test_resize_keeps_a_frame_already_at_size():
    frames = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 3, 56, 84), dtype=np.uint8))
    out = Qwen2VLFrames(min_pixels=56 * 84, max_pixels=56 * 84).resize(frames, 56 * 84)
    assert out is frames


def test_the_pipeline_path_imports_neither_transformers_nor_torchvision():
    """What the change is for: sampling and resizing the frame cache's frames through the default processor in a
    fresh interpreter leaves transformers and torchvision unimported."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from longreel.pipelines.pack.frame_cache import frame_processor, sample_indices, processor_resize, "
        "FrameParams, processor_params\n"
        "vp = frame_processor(None, min_pixels=100352, max_pixels=200704)\n"
        "idx = sample_indices(vp, 300, 25.0, FrameParams())\n"
        "out = processor_resize(vp, np.zeros((4, 360, 640, 3), np.uint8))\n"
        "processor_params(vp)\n"
        "from longreel.pipelines.stages.passrate import frame_size\n"
        "from longreel.pipelines.inference.base import fit_pixels\n"
        "frame_size(640, 360, type('C', (), {'min_pixels': 100352, 'max_pixels': 200704})())\n"
        "fit_pixels(640, 360, 200704, 28)\n"
        "print(len(idx), out.shape, sorted(m for m in ('transformers', 'torchvision') if m in sys.modules))\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # 12 s at 2 fps: 24 frames; 640x360 fits the 200,704-pixel cap at 588x336 (multiples of 28)
    assert got.strip() == "24 (4, 336, 588, 3) []"


def test_a_budget_below_the_processors_minimum_is_kept():
    """pack.max_pixels under Qwen2-VL's default minimum (100,352) with no min_pixels: smart-resize scaled a small
    frame up to the minimum, so the demo's 50,176 budget gave 176x144 frames at 364x308 (112,112 pixels)."""
    from longreel.pipelines.media.qwen_vl_frames import pixel_budget

    assert pixel_budget({"shortest_edge": 100352, "longest_edge": 602112}, None, 50176, 28) == \
        {"shortest_edge": 784, "longest_edge": 50176}
    assert pixel_budget({"shortest_edge": 100352, "longest_edge": 602112}, 3136, 50176, 28)["shortest_edge"] == 3136
    assert pixel_budget({"shortest_edge": 3136, "longest_edge": 602112}, None, 50176, 28)["shortest_edge"] == 3136
    frames = np.zeros((2, 144, 176, 3), dtype=np.uint8)
    for vp in (frame_processor(None, max_pixels=50176), load_video_processor(None, max_pixels=50176)):
        out = processor_resize(vp, frames)
        assert out.shape[1] * out.shape[2] <= 50176, out.shape
    assert processor_params(frame_processor(None, max_pixels=50176)) == \
        processor_params(load_video_processor(None, max_pixels=50176))
