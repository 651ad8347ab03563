"""Beam resource hints (``caption.resources``, ``qra.resources``, ``filter.resources``) land on the model steps and
nowhere else, so Dataflow's right fitting runs only those steps on accelerator workers; none by default.

Checked on the portable pipeline proto that every runner receives (a hinted transform's environment carries the
hints); ``tests/test_dataflow_job.py`` checks the Dataflow job itself.
"""
from __future__ import annotations

import apache_beam as beam
import pytest

from longreel.pipelines.cli_curate import DEMO_CONFIG
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import build_curate
from longreel.schemas.config import ConfigError, load_yaml
from longreel.testing.answerers import ScriptedAnswerer

ACCELERATOR = "beam:resources:accelerator:v1"
MIN_RAM = "beam:resources:min_ram_bytes:v1"
GPU = "type:nvidia-l4;count:1;install-nvidia-driver"
#: the model step of each stage (transform name prefixes in the curate graph)
MODEL_STEPS = {"caption": "CaptionClips/Caption/", "qra": "QRA/WriteQRAs/", "filter": "PassRate/Answer/"}
ALL_STAGES = ["stages=[caption, qra, filter, pack]", "filter.model=scripted"]


def leaf_hints(overrides: list[str]) -> dict[str, dict[str, bytes]]:
    """unique name -> resource hints of every leaf transform of the curate graph built with ``overrides``."""
    cfg = load_yaml(CurateConfig, DEMO_CONFIG, ALL_STAGES + overrides)
    p = beam.Pipeline()
    build_curate(p, [{"uri": "/videos/a.mp4"}], "/out", cfg, handlers={"filter": ScriptedAnswerer(cfg.filter, {})})
    proto = p.to_runner_api()
    envs = proto.components.environments
    return {t.unique_name: dict(envs[t.environment_id].resource_hints) if t.environment_id else {}
            for t in proto.components.transforms.values() if not t.subtransforms}


def test_hints_go_on_the_model_steps_only():
    leaves = leaf_hints([f"caption.resources.accelerator={GPU}", "caption.resources.min_ram=16GiB",
                         "qra.resources.accelerator=type:nvidia-tesla-t4;count:1", "filter.resources.min_ram=8GB"])
    hinted = {name: h for name, h in leaves.items() if h}
    expected = {"caption": {ACCELERATOR: GPU.encode(), MIN_RAM: str(16 << 30).encode()},
                "qra": {ACCELERATOR: b"type:nvidia-tesla-t4;count:1"},
                "filter": {MIN_RAM: str(8 * 10**9).encode()}}
    for stage, prefix in MODEL_STEPS.items():
        steps = {name: h for name, h in hinted.items() if name.startswith(prefix)}
        assert steps, f"no hinted step under {prefix}: {sorted(hinted)}"
        assert all(h == expected[stage] for h in steps.values()), steps
    assert not [n for n in hinted if not n.startswith(tuple(MODEL_STEPS.values()))], \
        "hints leaked past the model steps (decoding, joins and writes belong on CPU workers)"
    for cpu_step in ("CaptionClips/DecodeAndMeasure", "PassRate/FramesAndPrompts", "WriteTables"):
        assert any(n.startswith(cpu_step) for n in leaves) and not any(
            h for n, h in leaves.items() if n.startswith(cpu_step)), cpu_step


def test_no_hint_by_default():
    assert not {name: h for name, h in leaf_hints([]).items() if h}


def test_a_bad_hint_is_a_config_error():
    with pytest.raises(ConfigError, match="min_ram"):
        load_yaml(CurateConfig, DEMO_CONFIG, ["caption.resources.min_ram=lots"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_yaml(CurateConfig, DEMO_CONFIG, ["qra.resources.gpus=1"])


def _hinted_leaves(p) -> dict[str, dict[str, bytes]]:
    proto = p.to_runner_api()
    envs = proto.components.environments
    return {t.unique_name: dict(envs[t.environment_id].resource_hints) for t in proto.components.transforms.values()
            if not t.subtransforms and t.environment_id and envs[t.environment_id].resource_hints}


def test_the_blind_and_judge_steps_take_their_hints():
    from test_blind import ScriptedEngine
    from test_judge import ScriptedJudge

    from longreel.pipelines.blind_config import BlindConfig
    from longreel.pipelines.judge_config import JudgeConfig
    from longreel.pipelines.stages.blind import BlindFilter
    from longreel.pipelines.stages.judge import JudgeQRAs

    p = beam.Pipeline()
    qras = p | "Q" >> beam.Create([{"qra_id": "q"}])
    qras | "Blind" >> BlindFilter(load_yaml(BlindConfig, None, [f"resources.accelerator={GPU}"]),
                                  lambda: ScriptedEngine(lambda opts: "A"))
    {"qras": qras, "captions": p | "C" >> beam.Create([])} | "Judge" >> JudgeQRAs(
        load_yaml(JudgeConfig, None, ["resources.min_ram=8GB"]), lambda: ScriptedJudge({}))
    hinted = _hinted_leaves(p)
    assert hinted and set(hinted) == {n for n in hinted if n.startswith(("Blind/AnswerBlind", "Judge/Judge/"))}
    assert all(h == {ACCELERATOR: GPU.encode()} for n, h in hinted.items() if n.startswith("Blind/"))
    assert any(n.startswith("Judge/") for n in hinted)
    assert all(h == {MIN_RAM: str(8 * 10**9).encode()} for n, h in hinted.items() if n.startswith("Judge/"))
