"""``longreel cost``: the projection's arithmetic, measured tokens per call from a run's stats.json, the levers,
and the command's errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from longreel.pipelines import cost
from longreel.schemas.config import ConfigError


def small() -> dict:
    """A config whose hours are easy to compute by hand: 1-GPU models at 1,000 tok/s prefill, 100 tok/s decode."""
    cfg = cost.load()
    for m in cfg["models"].values():
        m.update(gpus=1, prefill_tokens_per_s=1000, decode_tokens_per_s=100, single_stream_decode_tokens_per_s=10)
    cfg["scale"].update(videos=2, mean_duration_s=25, clip_s=10, questions_generated=6, questions_released=3)
    cfg["workload"]["caption"].update(frames=2, vision_tokens_per_frame=100, text_tokens=50, output_tokens=20)
    cfg["workload"]["qra"].update(calls_per_video=2, prompt_tokens=100, tokens_per_clip=10, output_tokens=50)
    cfg["workload"]["refine"].update(prompt_tokens=40, tokens_per_clip=10, output_tokens=10)
    cfg["workload"]["passrate"].update(k=4, frames=2, vision_tokens_per_frame=100, text_tokens=100,
                                       output_tokens_per_sample=5)
    cfg["workload"]["blind"].update(k=4, text_tokens=100, output_tokens_per_sample=5, text_answerable_share=0.5)
    cost.check(cfg)
    return cfg


def test_stage_hours_by_hand():
    rows = {r["stage"]: r for r in cost.stage_rows(small())}
    # 2 videos x ceil(25/10)=3 clips; a caption call: 250 in (2.5 s... /1000 = 0.25 s) + 20 out (0.2 s)
    assert rows["caption"]["calls"] == 6 and rows["caption"]["input_tokens"] == 6 * 250
    assert rows["caption"]["gpu_hours"] == pytest.approx(6 * (0.25 + 0.2) / 3600)
    # QRA: 4 calls of 100 + 3 clips x 10 context tokens, 50 out
    assert rows["qra"]["input_tokens"] == 4 * 130 and rows["qra"]["gpu_hours"] == pytest.approx(4 * (0.13 + 0.5) / 3600)
    # pass-rate: one prefill of 300 tokens per question for its k=4 samples of 5 tokens
    assert rows["passrate"]["input_tokens"] == 6 * 300 and rows["passrate"]["output_tokens"] == 6 * 20
    assert set(rows) == {"caption", "qra", "refine", "passrate"}


def test_levers_change_what_they_say():
    cfg = small()
    base = {r["stage"]: r for r in cost.stage_rows(cfg)}
    unbatched = {r["stage"]: r for r in cost.stage_rows(cfg, batched_k=False)}
    assert unbatched["passrate"]["input_tokens"] == 4 * base["passrate"]["input_tokens"]
    cached = {r["stage"]: r for r in cost.stage_rows(cfg, prefix_cache=True)}
    assert cached["qra"]["input_tokens"] == 4 * 100 + 2 * 30  # the context once per video
    blind = {r["stage"]: r for r in cost.stage_rows(cfg, blind_filter=True)}
    assert blind["blind"]["calls"] == 6 and blind["passrate"]["calls"] == 3  # half were text-answerable
    slow = {r["stage"]: r for r in cost.stage_rows(cfg, single_stream=True)}
    assert slow["caption"]["gpu_hours"] == pytest.approx(6 * (0.25 + 2.0) / 3600)  # 20 tokens at 10 tok/s
    names = [lv["lever"] for lv in cost.levers(cfg)]
    assert names[0] == "as configured" and len(names) == len(cost.LEVERS)


def test_a_runs_measured_tokens_replace_the_assumptions():
    stats = {"stages": [
        {"stage": "caption", "extra": {"compute.calls": 4, "compute.input_text_tokens": 400,
                                       "compute.input_vision_tokens": 1200, "compute.output_tokens": 80}},
        {"stage": "qra", "extra": {"compute.calls": 2, "compute.input_text_tokens": 3000,
                                   "compute.input_vision_tokens": 0, "compute.output_tokens": 1000}},
        {"stage": "passrate", "extra": {}},  # no model call: the assumption stays
        {"stage": "blind", "extra": {"compute.calls": 8, "compute.input_text_tokens": 960,
                                     "compute.input_vision_tokens": 0, "compute.output_tokens": 24}},
    ]}
    cfg, measured = cost.workload_from_stats(small(), stats)
    assert measured == ["caption", "qra", "blind"]
    # the blind filter's calls are one sample each: 120 prompt tokens and 3 new tokens a sample
    blind = {r["stage"]: r for r in cost.stage_rows(cfg, blind_filter=True)}["blind"]
    assert blind["input_tokens"] == 6 * 120 and blind["output_tokens"] == 6 * 4 * 3
    rows = {r["stage"]: r for r in cost.stage_rows(cfg)}
    assert rows["caption"]["input_tokens"] == 6 * (300 + 100) and rows["caption"]["output_tokens"] == 6 * 20
    assert rows["qra"]["input_tokens"] == 4 * 1500 and rows["qra"]["output_tokens"] == 4 * 500
    assert rows["passrate"]["input_tokens"] == 6 * 300


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="models.generator.decode_tokens_per_s must be a number > 0"):
        cost.load(overrides=["models.generator.decode_tokens_per_s=0"])
    with pytest.raises(ConfigError, match="unknown key"):
        cost.load(overrides=["scale.vidoes=3"])
    with pytest.raises(ConfigError, match="text_answerable_share must be in"):
        cost.load(overrides=["workload.blind.text_answerable_share=2"])


def test_the_command(tmp_path):
    run = [sys.executable, "-m", "longreel", "cost"]
    out = subprocess.run(run + ["--json", "--videos", "100", "--questions", "800"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["scale"]["videos"] == 100 and doc["total_gpu_hours"] == pytest.approx(
        sum(r["gpu_hours"] for r in doc["stages"]))
    (tmp_path / "stats.json").write_text(json.dumps({"stages": [{"stage": "caption", "extra": {
        "compute.calls": 1, "compute.input_text_tokens": 10, "compute.input_vision_tokens": 20,
        "compute.output_tokens": 5}}]}))
    text = subprocess.run(run + ["--stats", str(tmp_path)], capture_output=True, text=True)
    assert text.returncode == 0 and "measured by the run for caption" in text.stdout
    bad = subprocess.run(run + ["--set", "scale.videos=-1"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "scale.videos" in bad.stderr


def test_the_corpus_size_flags_keep_the_configs_ratios():
    """``--videos 500`` made 4,000 QRA calls refine the config's 208,000 questions, and ``--questions 4000`` said
    "(104,000 released)": each flag set one number of a scale the others still described."""
    base = cost.load()["scale"]
    per_video = base["questions_generated"] / base["videos"]
    share = base["questions_released"] / base["questions_generated"]
    s = cost.rescale(cost.load(), videos=500)["scale"]
    assert s["videos"] == 500 and s["questions_generated"] == round(500 * per_video)
    assert s["questions_released"] == round(500 * per_video * share)
    s = cost.rescale(cost.load(), questions=4000)["scale"]
    assert (s["videos"], s["questions_generated"], s["questions_released"]) == (base["videos"], 4000,
                                                                               round(4000 * share))
    s = cost.rescale(cost.load(), videos=500, questions=4000)["scale"]
    assert (s["videos"], s["questions_generated"], s["questions_released"]) == (500, 4000, round(4000 * share))
    rows = {r["stage"]: r for r in cost.stage_rows(cost.rescale(cost.load(), videos=500))}
    assert rows["refine"]["calls"] == round(500 * per_video)


def test_set_scale_videos_keeps_the_ratios_as_videos_does():
    """`cost --help`'s own example, `--set scale.videos=1000`, projected 1,000 videos' QRA calls refining the default
    scale's 208,000 questions (349.7 GPU-hours against 37.9 with --videos 1000)."""
    from longreel.pipelines.cli_cost import _scale_overrides

    assert _scale_overrides(["scale.videos=1000", "gpu=H100"], None, None) == (["gpu=H100"], 1000, None)
    assert _scale_overrides(["scale.questions_generated=800"], None, None) == ([], None, 800)
    kept = ["scale.videos=1000", "scale.questions_released=10"]  # every scale number given: taken as given
    assert _scale_overrides(kept, None, None) == (kept, None, None)
    run = [sys.executable, "-m", "longreel", "cost", "--json"]
    by_set = json.loads(subprocess.run(run + ["--set", "scale.videos=1000"], capture_output=True, text=True).stdout)
    by_flag = json.loads(subprocess.run(run + ["--videos", "1000"], capture_output=True, text=True).stdout)
    assert by_set["scale"] == by_flag["scale"] and by_set["total_gpu_hours"] == by_flag["total_gpu_hours"]
