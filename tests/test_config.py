import pytest

from pipelines.config import CurateConfig
from schemas.config import ConfigError, config_hash, describe, load_yaml


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
