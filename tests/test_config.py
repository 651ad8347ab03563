import pytest

from longreel.pipelines.config import CurateConfig
from longreel.schemas.config import ConfigError, config_hash, describe, load_yaml


def test_defaults_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("segment:\n  clip_s: 5\n  tail_policy: keep\n")
    cfg = load_yaml(CurateConfig, str(path), ["segment.mode=materialize", "ingest.probe_timeout_s=3"])
    assert cfg.segment.clip_s == 5.0 and isinstance(cfg.segment.clip_s, float)
    assert cfg.segment.tail_policy == "keep"
    assert cfg.segment.mode == "materialize"
    assert cfg.ingest.probe_timeout_s == 3.0
    assert config_hash(cfg) != config_hash(CurateConfig())
    assert config_hash(CurateConfig()) == config_hash(load_yaml(CurateConfig, None))


@pytest.mark.parametrize("overrides, message", [
    (["segment.clipp_s=3"], "unknown key"),
    (["segment.clip_s=abc"], "expected a number"),
    (["segment.tail_policy=squash"], "not one of"),
    (["segment.clip_s=-1"], "must be > 0"),
    (["segment=3"], "expected a mapping"),
    (["noequals"], "key.sub=value"),
])
def test_bad_config_is_a_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_yaml(CurateConfig, None, overrides)


def test_every_field_has_help():
    rows = describe(CurateConfig)
    assert rows and all(help_text for _, _, help_text in rows)


def test_a_stage_reads_its_section_of_a_whole_pipeline_file(tmp_path):
    """A stage run alone (``longreel caption --config curate.yaml``) takes its section of the curate file and the
    ``caption.``-prefixed overrides; a file of the stage's own shape still works."""
    from longreel.pipelines.caption_config import CaptionConfig

    whole = tmp_path / "curate.yaml"
    whole.write_text("stages: [caption]\ncaption:\n  prompt: mine\n  frames:\n    n: 3\n")
    cfg = load_yaml(CaptionConfig, str(whole), ["caption.frames.n=5"], section="caption")
    assert cfg.prompt == "mine" and cfg.frames.n == 5
    own = tmp_path / "caption.yaml"
    own.write_text("frames:\n  n: 2\n")
    assert load_yaml(CaptionConfig, str(own), [], section="caption").frames.n == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("caption: 3\n")
    with pytest.raises(ConfigError, match="'caption' must be a mapping"):
        load_yaml(CaptionConfig, str(bad), [], section="caption")
