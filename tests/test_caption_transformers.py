"""The transformers backend: a tiny random Qwen2-VL built offline captions real clips inside a Beam pipeline."""
import hashlib
import json
import os

import pytest

from longreel.pipelines.cli_caption import run_caption
from longreel.pipelines.inference.base import processor_pixel_budget
from longreel.pipelines.prompts import load_template
from test_caption_common import SMALL, assert_caption_funnel, caption_cfg, copy_out, curate_dir, stage, tables


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from longreel.testing.tiny_model import build_tiny_qwen2vl
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2vl")


@pytest.fixture(scope="module")
def three_clips(shared_videos, tmp_path_factory):
    return curate_dir(shared_videos, SMALL, tmp_path_factory.mktemp("three"))


def _sha_of_weights(path):
    h = hashlib.sha256()
    for f in sorted(x for x in os.listdir(path) if x.endswith(".safetensors")):
        h.update(f.encode() + b"\0")
        with open(os.path.join(path, f), "rb") as fh:
            h.update(fh.read())
    return "sha256:" + h.hexdigest()


def test_pixel_budget_comes_from_the_processor_files(tiny_vlm):
    assert processor_pixel_budget(tiny_vlm) == (64 * 28 * 28, 28, 4 * 28 * 28)


def test_tiny_qwen2vl_captions_real_clips_with_full_provenance(tiny_vlm, three_clips, tmp_path):
    out = copy_out(three_clips, tmp_path / "out")
    cfg = caption_cfg(backend="transformers", **{"model.path": tiny_vlm, "model.temperature": 1.0,
                                                 "model.max_new_tokens": 24, "model.batch_size": 2,
                                                 "model.seed": 7})
    run_caption(str(out), cfg)
    caps, facts, rejects, stats = tables(out)
    assert_caption_funnel(stats, 3)
    # the model's wall-clock time is in stats.json, not in the captions table
    assert stats["run"]["caption"]["timed"] == 3 and stats["run"]["caption"]["latency_total_s"] > 0
    # a random model writes random tokens: with sampling they are not loops, so every clip gets its caption
    assert len(caps) == 3, rejects
    _, prompt_hash = load_template("caption")
    revision = _sha_of_weights(tiny_vlm)
    for c in caps:
        assert c["backend"] == "transformers" and c["model"] == tiny_vlm
        assert c["model_revision"] == revision
        assert c["prompt_hash"] == prompt_hash and c["prompt_name"] == "caption"
        s = json.loads(c["sampling"])
        assert s["temperature"] == 1.0 and s["max_new_tokens"] == 24 and s["seed"] == 7 and s["n_frames"] == 8
        assert s["max_pixels"] == 64 * 28 * 28
        assert len(c["frame_timestamps"]) == 8 and c["text"].strip() and "latency_s" not in c
        assert c["frame_width"] % 28 == 0 and c["frame_height"] % 28 == 0
        assert c["frame_width"] * c["frame_height"] <= 64 * 28 * 28
        assert c["finish_reason"] in ("stop", "length")
    # the frames were sized by the processor's rules: 640x272 bikes -> 336x140 within 50176 pixels
    by_w = sorted((c["frame_width"], c["frame_height"]) for c in caps)
    assert (336, 140) in by_w
    # the compute bill: each caption records its call's tokens (336x140 frames: 12x5 merged patches per 2 frames,
    # 8 frames -> 4 x 60 = 240 video tokens), and stats.json sums them per stage
    for c in caps:
        grid = (c["frame_height"] // 28) * (c["frame_width"] // 28)
        assert c["vision_tokens"] == 4 * grid and c["input_tokens"] > c["vision_tokens"]
        assert 0 < c["output_tokens"] <= 24
    compute = {k[len("compute."):]: v for k, v in stage(stats, "caption")["extra"].items() if k.startswith("compute.")}
    assert compute == {"calls": 3, "input_vision_tokens": sum(c["vision_tokens"] for c in caps),
                       "input_text_tokens": sum(c["input_tokens"] - c["vision_tokens"] for c in caps),
                       "output_tokens": sum(c["output_tokens"] for c in caps)}

    # seeds are per clip: a re-run with another batch size gives the same captions
    run_caption(str(out), caption_cfg(backend="transformers", **{
        "model.path": tiny_vlm, "model.temperature": 1.0, "model.max_new_tokens": 24, "model.batch_size": 1,
        "model.seed": 7}))
    again = {c["clip_id"]: c["text"] for c in tables(out)[0]}
    assert again == {c["clip_id"]: c["text"] for c in caps}


def test_greedy_loops_of_the_random_model_are_rejects_not_captions(tiny_vlm, three_clips, tmp_path):
    """Greedy decoding of a random model loops (seen: all three clips, e.g. 'ide whiteamowidide whiteamowidide
    ...'); such output is a repetitive_caption reject carrying the text, never a caption."""
    out = copy_out(three_clips, tmp_path / "out")
    run_caption(str(out), caption_cfg(backend="transformers", **{"model.path": tiny_vlm,
                                                                 "model.max_new_tokens": 32}))
    caps, _, rejects, stats = tables(out)
    assert_caption_funnel(stats, 3)
    cap = stage(stats, "caption")
    assert cap["out"] == len(caps) and cap["rejected"].get("repetitive_caption", 0) >= 1
    assert set(cap["rejected"]) <= {"repetitive_caption", "empty_caption", "prompt_echo"}
    for r in rejects:
        assert r["stage"] == "caption" and json.loads(r["details"])["text"] is not None
