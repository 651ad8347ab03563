"""A GGUF text model is read once into a float32 directory in the longreel cache and loaded from there after
(:func:`longreel.engines.local_models.dequantized`): the same weights as transformers' own GGUF load, written by one
process, reused by the rest, and the GGUF itself where the cache cannot be written."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import longreel.engines.local_models as lm


def _fake_dequantize(calls: list):
    def write(name: str, out_dir: str) -> str:
        calls.append(out_dir)
        os.makedirs(out_dir)
        Path(out_dir, "config.json").write_text(json.dumps({"written_by": os.path.basename(out_dir)}))
        return out_dir
    return write


def test_written_once_then_reused_and_keyed_by_the_readers(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREEL_CACHE", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(lm, "dequantize_to_dir", _fake_dequantize(calls))
    out = lm.dequantized("smollm2")
    m = lm.resolve_model("smollm2")
    assert Path(out).parent == tmp_path / "cache" / "dequantized"
    name = Path(out).name
    assert name.startswith(lm.weights_hash(m.directory, m.gguf_file) + "-transformers-") and "-gguf-" in name
    assert lm.dequantized("smollm2") == out and len(calls) == 1  # the second call reads the directory
    assert sorted(p.name for p in Path(out).parent.iterdir()) == [name]  # no temporary directory left


def test_a_process_that_loses_the_race_uses_the_winners_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREEL_CACHE", str(tmp_path / "cache"))
    calls: list = []
    write = _fake_dequantize(calls)

    def racing(name: str, out_dir: str) -> str:  # another process renames its copy while this one writes
        final = out_dir.rsplit(".tmp-", 1)[0]
        write(name, final + ".tmp-other")
        os.replace(final + ".tmp-other", final)
        return write(name, out_dir)

    monkeypatch.setattr(lm, "dequantize_to_dir", racing)
    out = lm.dequantized("smollm2")
    assert json.loads(Path(out, "config.json").read_text())["written_by"].endswith(".tmp-other")
    assert sorted(p.name for p in Path(out).parent.iterdir()) == [Path(out).name]  # the loser's copy removed


def test_not_a_gguf_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a GGUF model"):
        lm.dequantized(str(tmp_path))


def test_an_unwritable_cache_falls_back_to_reading_the_gguf(tmp_path, monkeypatch, caplog):
    from longreel.engines.transformers_engine import TransformersEngine

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LONGREEL_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    engine = TransformersEngine("smollm2", dtype="float32")
    with caplog.at_level("WARNING", logger="longreel"):
        path, kw = engine._text_weights({"gguf_file": engine.local.gguf_file, "local_files_only": True})
    assert path == engine.local.directory and kw["gguf_file"] == engine.local.gguf_file
    assert "reading the GGUF" in caplog.text


@pytest.mark.slow
def test_the_cached_copy_loads_the_weights_transformers_reads_from_the_gguf():
    """Against transformers' own GGUF load (the slow path this cache replaces, ~40 s), in the dtypes the engines
    ask for; the engine itself loads from the cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from longreel.engines.transformers_engine import TransformersEngine

    m = lm.resolve_model("smollm2")
    direct = AutoModelForCausalLM.from_pretrained(m.directory, dtype=torch.float32, **m.load_kwargs())
    engine = TransformersEngine("smollm2", dtype="float32")
    path, kw = engine._text_weights({"local_files_only": True, "gguf_file": m.gguf_file})
    assert path == lm.dequantized("smollm2") and "gguf_file" not in kw
    engine.setup()
    want = direct.state_dict()
    for model in (engine.hf_model, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)):
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert engine.hf_model.generation_config.to_dict() == direct.generation_config.to_dict()
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(bf16[k], want[k].to(torch.bfloat16)) for k in want)
