"""The engine layer (``longreel.engines``): one implementation per engine, shared by captions, QRA, pass-rate
answers and vLLM rollouts, with the same contract everywhere: ``n`` samples per request under the request's own
seed (independent of the batch), results in request order, a failing request failing alone."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from longreel.engines.base import Engine, EngineRequest, Sampling, Video

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("longreel", "pipelines", "trainer", "schemas", "data_cards")
#: a module a client library of one engine lives behind: only longreel/engines may import it
ENGINE_LIBRARIES = ("vllm", "openai", "llguidance")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_engine_layer_talks_to_the_engine_libraries():
    """One implementation per engine: no product module outside longreel/engines imports vLLM, the OpenAI SDK or
    the constrained-decoding library."""
    offenders = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "longreel" / "engines") or path.is_relative_to(ROOT / "longreel" / "testing"):
                continue
            bad = _imported_roots(path) & set(ENGINE_LIBRARIES)
            if bad:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert offenders == []


def test_every_engine_shares_the_interface():
    from longreel.engines.openai_engine import OpenAIEngine
    from longreel.engines.transformers_engine import TransformersEngine
    from longreel.engines.vllm_engine import VLLMEngine

    for cls in (TransformersEngine, VLLMEngine, OpenAIEngine):
        assert issubclass(cls, Engine) and cls.generate is not Engine.generate and cls.supports_schema
    assert len({cls.backend for cls in (TransformersEngine, VLLMEngine, OpenAIEngine)}) == 3


@pytest.fixture(scope="module")
def smollm2():
    from longreel.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine("smollm2", dtype="float32", batch_size=4)
    assert engine.kind == "text" and engine.revision.startswith("sha256:")
    return engine


def _text(seed: int, n: int = 1, temperature: float = 1.0, max_new_tokens: int = 12, key: str = "r") -> EngineRequest:
    return EngineRequest(key=key, messages=[{"role": "user", "content": f"Name a colour. ({key})"}],
                         sampling=Sampling(max_new_tokens=max_new_tokens, temperature=temperature, n=n, seed=seed))


@pytest.mark.slow
def test_text_samples_depend_on_the_seed_not_on_the_batch(smollm2):
    alone = smollm2.generate([_text(7, n=3, key="a")])[0]
    batch = smollm2.generate([_text(1, key="b"), _text(7, n=3, key="a"), _text(0, temperature=0.0, key="c")])
    assert alone.ok and len(alone.texts) == len(alone.token_ids) == len(alone.finish) == 3
    assert batch[1].texts == alone.texts and batch[1].token_ids == alone.token_ids  # same seed, other neighbours
    assert len(set(alone.texts)) > 1  # three draws, not one answer repeated
    assert smollm2.generate([_text(8, n=3, key="a")])[0].texts != alone.texts  # another seed, other draws
    eos = set(smollm2.eos_ids())
    for ids, finish in zip(alone.token_ids, alone.finish):
        assert (ids[-1] in eos) == (finish == "stop") and not any(t in eos for t in ids[:-1])
    assert alone.new_tokens == sum(len(ids) - (f == "stop") for ids, f in zip(alone.token_ids, alone.finish))
    assert alone.prompt_tokens == smollm2.count_tokens(_text(7, key="a").messages)


@pytest.mark.slow
def test_a_schema_constrains_each_sample(smollm2):
    import json

    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    req = EngineRequest(key="s", messages=[{"role": "user", "content": "Pick a colour as JSON."}],
                        sampling=Sampling(max_new_tokens=24, temperature=1.0, n=2, seed=3), schema=schema)
    [c] = smollm2.generate([req])
    assert c.guided and c.finish == ["stop", "stop"]
    assert all(json.loads(t)["colour"] in ("red", "green", "blue") for t in c.texts)


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from longreel.engines.transformers_engine import TransformersEngine
    from longreel.testing.tiny_model import build_tiny_qwen2vl

    path = build_tiny_qwen2vl(tmp_path_factory.mktemp("tiny") / "qwen2vl", seed=0)
    engine = TransformersEngine(str(path), batch_size=8)
    assert engine.kind == "vision"
    return engine


def _video_request(key: str, seed: int, n: int, frames: np.ndarray | None = None) -> EngineRequest:
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, (4, 56, 84, 3), dtype=np.uint8) if frames is None else frames
    video = Video(frames=frames, fps=2.0, frame_indices=[0, 1, 2, 3], total_frames=4, duration_s=2.0)
    return EngineRequest(key=key, messages=[{"role": "user", "content": [{"type": "video"},
                                                                         {"type": "text", "text": "What happens?"}]}],
                         video=video, sampling=Sampling(max_new_tokens=6, temperature=1.0, top_k=0, n=n, seed=seed))


def test_video_requests_sample_n_under_their_seed_and_fail_alone(tiny_vlm):
    model = tiny_vlm.hf_model
    calls = []
    real = model.generate
    model.generate = lambda *a, **kw: (calls.append(kw.get("num_return_sequences", 1)), real(*a, **kw))[1]
    try:
        alone = tiny_vlm.generate([_video_request("a", 5, n=3)])[0]
        bad = _video_request("bad", 6, n=3, frames=np.zeros((4, 0, 0, 3), np.uint8))
        batch = tiny_vlm.generate([_video_request("b", 9, n=2), bad, _video_request("a", 5, n=3)])
    finally:
        model.generate = real
    assert alone.ok and len(alone.texts) == 3 and calls[0] == 3  # k samples in one generate call
    assert batch[0].ok and len(batch[0].texts) == 2
    assert not batch[1].ok and batch[1].error_reason == "model_error" and batch[1].texts == []
    assert batch[2].texts == alone.texts  # the same seed gives the same samples beside other requests
