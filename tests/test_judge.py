"""The judge: each check's reject reason (scripted verdicts), the stage's funnel and provenance, and real engines
(SmolLM2 under the verdict schema; an OpenAI-compatible test server)."""
import json
import os

import pytest

from longreel.engines.base import Completion, Engine
from longreel.pipelines.gates import judge as J
from longreel.pipelines.judge_config import JudgeConfig
from longreel.pipelines.qra.targets import make_target
from conftest import chat_completions_server

CAPTIONS = [{"clip_id": f"c{i}", "video_id": "v", "start_s": 10.0 * i, "end_s": 10.0 * (i + 1),
             "text": f"Scene {i}: a {colour} picture.", "backend": "facts", "model": "m", "prompt_hash": "h",
             "sampling": "{}", "frame_timestamps": [10.0 * i + 5]} for i, colour in enumerate(("red", "blue", "grey"))]


def _q(qid, category="spatial", reasoning="Checking the video at [00:10-00:20]: it is blue. So the answer is B.",
       options=("red", "blue", "grey", "green"), answer="B"):
    return {"qra_id": qid, "video_id": "v", "category": category, "problem_type": "multiple_choice",
            "question": f"Which colour? ({qid})", "options": list(options), "answer": answer, "reasoning": reasoning,
            "target": make_target(reasoning, answer), "generator": "scripted", "model": "m", "prompt_hash": "h",
            "sampling": "{}", "source_caption_ids": ["c0", "c1", "c2"], "refined": False}


def _verdict(follows=True, unique=True, multi=True):
    return {"answer_follows": follows, "unique_answer": unique, "needs_multiple_clips": multi, "explanation": "x"}


@pytest.mark.parametrize("q, verdict, want", [
    (_q("a"), _verdict(), []),
    (_q("b"), _verdict(follows=False), [J.UNSUPPORTED]),
    (_q("c"), _verdict(unique=False), [J.NOT_UNIQUE]),
    (_q("d", reasoning="Checking the video at [01:40-01:50]: blue. So the answer is B."), _verdict(),
     [J.TIMESTAMP_MISSING]),
    (_q("e", category="temporal"), _verdict(multi=False), [J.SINGLE_CLIP]),
    (_q("f", category="spatial"), _verdict(multi=False), []),  # one clip is fine for a spatial question
    (_q("g", category="plot_narrative"), _verdict(follows=False, multi=False), [J.UNSUPPORTED, J.SINGLE_CLIP]),
])
def test_each_check_and_its_reason(q, verdict, want):
    assert J.failed_checks(q, verdict, CAPTIONS, JudgeConfig()) == want


def test_cited_times_against_caption_spans():
    assert J.missing_times("at 00:29 and at 00:31 and 00:45", CAPTIONS, 1.0) == [45.0]
    assert J.missing_times("at 00:29 and 00:31", CAPTIONS, 0.0) == [31.0]  # the tolerance is what let 31 in


def test_verdict_parsing():
    assert J.parse_verdict(json.dumps(_verdict()))["answer_follows"] is True
    assert J.parse_verdict('{"answer_follows": "yes"}') is None and J.parse_verdict("no json") is None


class ScriptedJudge(Engine):
    """Answers each question's request with its scripted verdict (a dict, raw text, or "fail"). Requests are
    recorded on the class: Beam runs a pickled copy of the engine (in this process)."""

    backend = "scripted"
    supports_schema = True
    seen: list = []

    def __init__(self, verdicts: dict):
        super().__init__("scripted-judge", "rev-9")
        self.verdicts = verdicts

    def generate(self, requests):
        ScriptedJudge.seen += requests
        out = []
        for r in requests:
            qid = r.key.split(":", 1)[1]
            v = self.verdicts[qid]
            if v == "fail":
                out.append(Completion.failed("model_error", "scripted failure"))
            else:
                out.append(Completion(texts=[v if isinstance(v, str) else json.dumps(v)], finish=["stop"],
                                      prompt_tokens=100, vision_tokens=0, new_tokens=20))
        return out


def _write(out_dir, qras):
    import pyarrow.parquet as pq

    from longreel.schemas import KINDS, to_table

    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(to_table(KINDS["qra"], qras), os.path.join(out_dir, "qras-00000-of-00001.parquet"))
    pq.write_table(to_table(KINDS["caption"], CAPTIONS), os.path.join(out_dir, "captions-00000-of-00001.parquet"))


def test_stage_rejects_by_reason_and_keeps_the_verdict(tmp_path):
    from longreel.pipelines.cli_judge import run_judge
    from longreel.pipelines.io.parquet_sink import read_table

    out = str(tmp_path / "out")
    qras = [_q("a"), _q("b"), _q("c", category="temporal"), _q("d"), _q("e")]
    verdicts = {"a": _verdict(), "b": _verdict(follows=False), "c": _verdict(unique=False, multi=False),
                "d": "not json", "e": "fail"}
    _write(out, qras)
    ScriptedJudge.seen.clear()
    engine = ScriptedJudge(verdicts)
    doc = run_judge(out, JudgeConfig(), engine_factory=lambda: engine)
    st = next(s for s in doc["stages"] if s["stage"] == "judge")
    assert st["in"] == 5 and st["out"] == 1
    assert st["rejected"] == {J.UNSUPPORTED: 1, J.NOT_UNIQUE: 1, J.UNPARSEABLE: 1, "judge_failed": 1}
    rejects = {r["key"]: r for r in read_table(out, "rejects").to_pylist()}
    assert json.loads(rejects["c"]["details"])["failed"] == [J.NOT_UNIQUE, J.SINGLE_CLIP]
    kept = read_table(out, "qras_judged").to_pylist()
    assert [q["qra_id"] for q in kept] == ["a"]
    record = json.loads(kept[0]["judge_verdict"])
    assert record["judge"] == "scripted-judge" and record["judge_revision"] == "rev-9"
    assert record["prompt_hash"] == J.prompt_hash(JudgeConfig()) and record["verdict"]["answer_follows"]
    sec = doc["judge"]
    assert sec["balanced"] and sec["failed_by_check"][J.SINGLE_CLIP] == 1 and sec["judge"]["backend"] == "scripted"
    assert st["extra"]["compute.calls"] == 4  # the failed request made no countable call
    # the judge saw the captions with their time spans and the question's answer
    first = next(r for r in ScriptedJudge.seen if r.key == "judge:a")
    text = first.messages[1]["content"]
    assert "[00:10-00:20] Scene 1: a blue picture." in text and "Given answer: B" in text
    assert first.schema == J.verdict_schema(JudgeConfig()) and first.sampling.greedy


def test_smollm2_verdicts_parse_under_the_schema(tmp_path):
    from longreel.pipelines.cli_judge import run_judge
    from longreel.pipelines.io.parquet_sink import read_table

    out = str(tmp_path / "out")
    _write(out, [_q("a"), _q("b", category="temporal")])
    doc = run_judge(out, JudgeConfig(max_new_tokens=64, explanation_chars=40, threads=1))
    st = next(s for s in doc["stages"] if s["stage"] == "judge")
    assert st["in"] == 2 and J.UNPARSEABLE not in st["rejected"] and "judge_failed" not in st["rejected"]
    assert doc["judge"]["balanced"] and doc["judge"]["judge"]["judge"] == "smollm2"
    for r in read_table(out, "rejects").to_pylist():
        assert r["reason"] in J.CHECKS and json.loads(r["details"])["failed"][0] == r["reason"]
    for q in read_table(out, "qras_judged").to_pylist():
        assert J.failed_checks(q, json.loads(q["judge_verdict"])["verdict"], CAPTIONS, JudgeConfig()) == []


def test_openai_compatible_server_as_judge(tmp_path, monkeypatch):
    from longreel.pipelines.cli_judge import run_judge

    def reply(body):
        return {"choices": [{"message": {"content": json.dumps(_verdict(multi=False))}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 12}}

    monkeypatch.setenv("OPENAI_API_KEY", "test")
    with chat_completions_server(reply) as (url, bodies):
        out = str(tmp_path / "out")
        _write(out, [_q("a"), _q("b", category="temporal")])
        cfg = JudgeConfig(backend="openai", base_url=url, model="served")
        doc = run_judge(out, cfg)
    assert len(bodies) == 2 and all(b["temperature"] == 0.0 for b in bodies)
    assert all(b["response_format"]["json_schema"]["schema"] == J.verdict_schema(cfg) for b in bodies)
    st = next(s for s in doc["stages"] if s["stage"] == "judge")
    assert st["out"] == 1 and st["rejected"] == {J.SINGLE_CLIP: 1}  # the temporal one needs more than one clip
    assert st["extra"]["compute.input_text_tokens"] == 100


def test_the_card_names_the_judge_and_its_failures(tmp_path):
    from longreel.pipelines.card.build import build_card
    from longreel.pipelines.cli_judge import run_judge
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.sample_corpus import demo_items
    from longreel.schemas.config import load_yaml

    out = str(tmp_path / "out")
    run_curate(demo_items(), out, load_yaml(CurateConfig, None, ["stages=[caption, qra]"]))
    qids = [q["qra_id"] for q in read_table(out, "qras").to_pylist()]
    verdicts = {qid: _verdict(follows=i % 2 == 0) for i, qid in enumerate(qids)}
    run_judge(out, JudgeConfig(), engine_factory=lambda: ScriptedJudge(verdicts))
    card = build_card(out, str(tmp_path / "card"))
    claim = next(c["value"] for c in card["claims"] if c["id"] == "quality/judge")
    assert claim["failed_by_check"][J.UNSUPPORTED] == len(qids) // 2 and claim["judge"]["judge"] == "scripted-judge"
    readme = open(tmp_path / "card" / "README.md").read()
    assert "Judge: scripted-judge (scripted, revision `rev-9`" in readme
    assert f"| {J.UNSUPPORTED} | {len(qids) // 2} |" in readme
