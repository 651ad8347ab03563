"""The blind (text-only) filter: rotations, scoring with the trainer's rewards, the text_answerable decision,
the counts, the blind table and the shards' metadata; scripted engines, SmolLM2 and an OpenAI-compatible server."""
import json
import os

import pytest

from longreel.engines.base import Completion, Engine
from longreel.pipelines.blind_config import BlindConfig
from longreel.pipelines.gates import blind as G
from longreel.pipelines.stages.passrate import sample_passes
from longreel.schemas.config import ConfigError

MC = {"qra_id": "q1", "video_id": "v1", "problem_type": "multiple_choice", "question": "Which colour dominates?",
      "options": ["red", "green", "blue", "grey"], "answer": "C"}
OPEN = {"qra_id": "q2", "video_id": "v1", "problem_type": "open_ended", "question": "What colour is it?",
        "options": None, "answer": "blue"}


def _option_lines(messages) -> dict[str, str]:
    """Letter -> option text as the blind model was shown them."""
    text = messages[-1]["content"]
    return {line[0]: line[3:] for line in text.splitlines() if len(line) > 3 and line[1:3] == ". "}


class ScriptedEngine(Engine):
    """Answers by a rule on the options it is shown: ``pick(options_by_letter) -> letter``; every request's n
    samples get the same answer. Requests for which ``fail(request)`` is true come back failed."""

    backend = "scripted"
    supports_schema = True

    def __init__(self, pick, fail=lambda request: False):
        super().__init__("scripted-blind", "rev-1")
        self.pick, self.fail, self.seen = pick, fail, []

    def generate(self, requests):
        out = []
        for r in requests:
            self.seen.append(r)
            if self.fail(r):
                out.append(Completion.failed("model_error", "scripted failure"))
                continue
            letter = self.pick(_option_lines(r.messages))
            text = json.dumps({"reasoning": "guess", "answer": letter})
            out.append(Completion(texts=[text] * r.sampling.n, finish=["stop"] * r.sampling.n, prompt_tokens=10,
                                  vision_tokens=0, new_tokens=5 * r.sampling.n))
        return out


def _run(q, engine, cfg=None):
    cfg = cfg or BlindConfig(k=8)
    vs = G.views(q, cfg)
    return G.score_views(q, vs, engine.generate(G.requests_for(q, vs, cfg)), cfg, sample_passes)


def test_rotation_moves_the_answer_with_its_option():
    for shift in range(4):
        opts, ans = G.rotate(MC["options"], "C", shift)
        assert opts[ord(ans) - ord("A")] == "blue"
        assert sorted(opts) == sorted(MC["options"])


def test_the_blind_prompt_is_the_trainers_without_the_video():
    vs = G.views(MC, BlindConfig(k=8))
    assert [v.shift for v in vs] == [0, 1, 2, 3] and [v.samples for v in vs] == [2, 2, 2, 2]
    for v in vs:
        assert v.messages[0]["role"] == "system" and isinstance(v.messages[1]["content"], str)
        assert "Question: Which colour dominates?" in v.messages[1]["content"]
        assert _option_lines(v.messages)[v.answer] == "blue"
    assert [v.shift for v in G.views(OPEN, BlindConfig(k=8))] == [0]
    assert [v.samples for v in G.views(MC, BlindConfig(k=8, rotate_options=False))] == [8]


def test_content_knowledge_passes_and_letter_bias_does_not():
    knows = ScriptedEngine(lambda opts: next(k for k, v in opts.items() if v == "blue"))
    always_a = ScriptedEngine(lambda opts: "A")
    cfg = BlindConfig(k=8)
    s = _run(MC, knows, cfg)
    assert (s.pass_count, s.k) == (8, 8) and G.is_text_answerable(s.pass_count, s.k, cfg)
    s = _run(MC, always_a, cfg)
    assert (s.pass_count, s.k) == (2, 8) and not G.is_text_answerable(s.pass_count, s.k, cfg)
    # without rotation, a model that always says "C" passes every sample of a "C" question
    s = _run(MC, ScriptedEngine(lambda opts: "C"), BlindConfig(k=8, rotate_options=False))
    assert s.pass_count == 8


def test_threshold_is_inclusive():
    cfg = BlindConfig(k=8, max_pass_rate=0.75)
    assert G.is_text_answerable(6, 8, cfg) and not G.is_text_answerable(5, 8, cfg)


def test_unparseable_output_is_scored_as_written_and_fails():
    assert G.as_tagged('{"reasoning": "r", "answer": "B"}') == "<think>r</think><answer>B</answer>"
    assert G.as_tagged("B") == "B"


@pytest.mark.parametrize("overrides, match", [({"k": 0}, "k"), ({"temperature": 0.0}, "temperature"),
                                              ({"max_pass_rate": 0.0}, "max_pass_rate"),
                                              ({"backend": "openai"}, "base_url")])
def test_config_checks(overrides, match):
    with pytest.raises(ConfigError, match=match):
        BlindConfig(**overrides).check()


# ---- the stage in a curation run --------------------------------------------------------------------------

def _demo_run(tmp_path, engine_factory, extra=()):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.sample_corpus import demo_items
    from longreel.schemas.config import load_yaml

    cfg = load_yaml(CurateConfig, None, ["stages=[caption, qra, blind, pack]", "blind.k=4", *extra])
    out = str(tmp_path / "out")
    stats = run_curate(demo_items(), out, cfg, handlers={"blind": engine_factory})
    return out, stats


def test_stage_in_curate_rejects_counts_and_shards(tmp_path):
    from longreel.pipelines.io.parquet_sink import read_table

    # pass 1: a model with a letter bias only: nothing is text-answerable, every row carries its count
    out, stats = _demo_run(tmp_path / "a", lambda: ScriptedEngine(lambda opts: "A"))
    st = next(s for s in stats["stages"] if s["stage"] == "blind")
    qras = read_table(out, "qras").to_pylist()
    blind = read_table(out, "blind").to_pylist()
    assert st["in"] == len(qras) == len(blind) and st["out"] + sum(st["rejected"].values()) == st["in"]
    sec = stats["blind"]
    assert sec["balanced"] and sec["k"] == 4 and sum(sec["pass_count_histogram"]) == len(blind)
    assert sec["answerer"]["answerer"] == "scripted-blind" and sec["answerer"]["backend"] == "scripted"
    mc = [b for b in blind if b["qra_id"] in {q["qra_id"] for q in qras if q["problem_type"] == "multiple_choice"}]
    assert mc and all(b["pass_count"] == 1 for b in mc)  # one rotation of four puts the answer at A
    assert st["extra"]["compute.calls"] == sum(4 if b in mc else 1 for b in blind)
    assert st["extra"]["compute.output_tokens"] == 5 * 4 * len(blind)
    # the shards carry the blind pass count of every released question
    shard_qras = _shard_questions(out)
    assert shard_qras and all(q["blind_k"] == 4 and q["blind_pass_count"] is not None for q in shard_qras)

    # pass 2: the model reads every multiple-choice answer: those are rejected text_answerable
    answers = {q["qra_id"]: q for q in qras}

    def oracle():
        def pick(opts):
            for q in answers.values():
                if q["options"] and sorted(q["options"]) == sorted(opts.values()):
                    right = q["options"][ord(q["answer"]) - ord("A")]
                    return next(k for k, v in opts.items() if v == right)
            return "A"
        return ScriptedEngine(pick)

    out2, stats2 = _demo_run(tmp_path / "b", oracle)
    st2 = next(s for s in stats2["stages"] if s["stage"] == "blind")
    assert st2["rejected"].get("text_answerable") == len(mc)
    rejects = [r for r in read_table(out2, "rejects").to_pylist() if r["stage"] == "blind"]
    assert {r["reason"] for r in rejects} == {"text_answerable"}
    assert {r["key"] for r in rejects} == {b["qra_id"] for b in mc}
    assert json.loads(rejects[0]["details"]) == {"blind_pass_count": 4, "k": 4}
    assert not {q["qra_id"] for q in _shard_questions(out2)} & {b["qra_id"] for b in mc}


def test_a_failed_request_rejects_its_question_only(tmp_path):
    from longreel.pipelines.io.parquet_sink import read_table

    def cuts(request):
        return "shot cuts" in request.messages[-1]["content"]

    out, stats = _demo_run(tmp_path, lambda: ScriptedEngine(lambda opts: "A", fail=cuts))
    n_cut_questions = sum("shot cuts" in q["question"] for q in read_table(out, "qras").to_pylist())
    st = next(s for s in stats["stages"] if s["stage"] == "blind")
    assert n_cut_questions and st["rejected"] == {"answerer_failed": n_cut_questions}
    assert stats["blind"]["balanced"] and stats["blind"]["failed_by_reason"] == {"answerer_failed": n_cut_questions}
    assert len(read_table(out, "blind")) == st["in"] - n_cut_questions


def _shard_questions(out):
    import tarfile

    found = []
    shards = os.path.join(out, "shards")
    for name in sorted(os.listdir(shards)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(shards, name)) as tar:
                for m in tar.getmembers():
                    if m.name.endswith(".qras.json"):
                        found += json.loads(tar.extractfile(m).read())
    return found
