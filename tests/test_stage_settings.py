"""A stage command run alone on a curate run starts from that run's settings (its config.yaml), not the defaults.

Starting from the defaults made ``longreel pack OUT`` on the demo write a second dataset (``longreel-train-*``
beside ``longreel_demo-train-*``, at another frame rate): re-running one stage changed what the user never named.
"""
from __future__ import annotations

import pytest

from longreel.pipelines.config import CurateConfig
from longreel.schemas.config import dump_yaml, load_yaml


def _capture(monkeypatch, module, name):
    seen = {}

    def fake(out_dir, cfg, *a, **k):
        seen["cfg"] = cfg
        raise SystemExit(42)  # past the CLI's catch-all: the run itself is not what is tested

    monkeypatch.setattr(module, name, fake)
    return seen


def _run_dir(tmp_path, overrides):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(dump_yaml(load_yaml(CurateConfig, None, overrides)))
    return out


def _main(argv):
    from longreel.cli import main

    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 42


def test_pack_alone_keeps_the_runs_pack_settings_under_the_users(tmp_path, monkeypatch):
    import longreel.pipelines.stages.pack as pack_stage

    seen = _capture(monkeypatch, pack_stage, "run_pack")
    out = _run_dir(tmp_path, ["pack.dataset=mine", "pack.fps=1.0", "pack.max_frames=16"])
    _main(["pack", str(out)])
    assert (seen["cfg"].dataset, seen["cfg"].fps, seen["cfg"].max_frames) == ("mine", 1.0, 16)
    user = tmp_path / "user.yaml"
    user.write_text("pack:\n  fps: 0.5\n")
    _main(["pack", str(out), "--config", str(user), "--set", "max_frames=8"])
    assert (seen["cfg"].dataset, seen["cfg"].fps, seen["cfg"].max_frames) == ("mine", 0.5, 8)


def test_a_directory_no_curate_wrote_starts_from_the_defaults(tmp_path, monkeypatch):
    import longreel.pipelines.stages.pack as pack_stage
    from longreel.pipelines.pack.config import PackConfig

    seen = _capture(monkeypatch, pack_stage, "run_pack")
    out = tmp_path / "plain"
    out.mkdir()
    (out / "config.yaml").write_text("not: a curate config\n")  # no pack section: nothing to start from
    _main(["pack", str(out), "--set", "max_frames=8"])
    assert seen["cfg"] == PackConfig(max_frames=8)


@pytest.mark.parametrize("command, module, func, key, value", [
    (["qra", "--out"], "longreel.pipelines.cli_qra", "run_qra", "per_category", 3),
    (["caption", "--clips-dir"], "longreel.pipelines.cli_caption", "run_caption", "frames.n", 3),
    (["blind", "--out"], "longreel.pipelines.cli_blind", "run_blind", "k", 3),
    (["filter", "--out"], "longreel.pipelines.cli_filter", "run_filter", "k", 3),
    (["judge", "--out"], "longreel.pipelines.cli_judge", "run_judge", "max_new_tokens", 77),
])
def test_every_stage_command_starts_from_the_runs_section(tmp_path, monkeypatch, command, module, func, key, value):
    """The run's file sets one key of the section away from its default; the stage alone must see it."""
    import importlib

    import longreel.pipelines.model_paths as model_paths

    monkeypatch.setattr(model_paths, "check_model_paths", lambda *a, **k: None)
    mod = importlib.import_module(module)
    if hasattr(mod, "check_model_paths"):
        monkeypatch.setattr(mod, "check_model_paths", lambda *a, **k: None)
    seen = _capture(monkeypatch, mod, func)
    section = command[0]
    out = _run_dir(tmp_path, [f"{section}.{key}={value}"] + (["filter.model=/m"] if section == "filter" else []))
    _main(command + [str(out)])
    got = seen["cfg"]
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value


def test_a_stage_commands_config_errors_name_the_section_the_user_typed(tmp_path, capsys):
    """They named the class (``PackConfig: unknown key(s)``, ``fps: expected a number``) for ``--set pack.fpss``."""
    from longreel.cli import main

    out = _run_dir(tmp_path, [])
    assert main(["pack", str(out), "--set", "pack.fpss=2"]) == 2
    assert "bad config: pack: unknown key(s) ['fpss'] (did you mean 'fps'?)" in capsys.readouterr().err
    assert main(["pack", str(out), "--set", "fps=abc"]) == 2
    assert "bad config: pack.fps: expected a number, got 'abc'" in capsys.readouterr().err


def test_judge_alone_judges_with_the_model_the_runs_judge_followed(tmp_path, monkeypatch):
    """In curate the judge's null backend and model are the question writer's; alone on the run it must use the
    same, not JudgeConfig's defaults (SmolLM2 through transformers)."""
    import longreel.pipelines.cli_judge as cli_judge

    monkeypatch.setattr(cli_judge, "check_model_paths", lambda *a, **k: None)
    seen = _capture(monkeypatch, cli_judge, "run_judge")
    out = _run_dir(tmp_path, ["qra.backend=openai", "qra.model=writer-llm", "qra.base_url=http://llm:8000/v1"])
    _main(["judge", "--out", str(out)])
    assert (seen["cfg"].backend, seen["cfg"].model, seen["cfg"].base_url) == ("openai", "writer-llm",
                                                                             "http://llm:8000/v1")
    _main(["judge", "--out", str(out), "--model", "judge-llm"])
    assert (seen["cfg"].backend, seen["cfg"].model) == ("openai", "judge-llm")


def test_caption_says_when_its_model_goes_unused(tmp_path, monkeypatch, caplog):
    """``longreel caption --model DIR`` with the facts backend was accepted silently: the model is never read."""
    import longreel.pipelines.cli_caption as cli_caption

    _capture(monkeypatch, cli_caption, "run_caption")
    monkeypatch.setattr(cli_caption, "check_model_paths", lambda *a, **k: None)
    out = _run_dir(tmp_path, [])
    with caplog.at_level("WARNING", logger="longreel"):
        _main(["caption", "--clips-dir", str(out), "--model", "/models/vlm"])
    assert "--model /models/vlm is not used by the facts backend" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="longreel"):
        _main(["caption", "--clips-dir", str(out), "--model", "/models/vlm", "--backend", "transformers"])
    assert "is not used" not in caplog.text
