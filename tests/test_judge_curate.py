"""The judge as a stage of ``longreel curate``: its engine follows the question writer's by default, rejects per
failed check in the funnel, verdicts and provenance on the kept rows, and real engines (SmolLM2; an
OpenAI-compatible test server) through the whole pipeline."""
import json
import os
import tarfile

import pytest

from longreel.pipelines.gates import judge as J
from longreel.pipelines.judge_config import CurateJudgeConfig, JudgeConfig, follow_generator
from longreel.pipelines.qra_config import QRAConfig
from longreel.schemas.config import ConfigError
from conftest import chat_completions_server
from test_judge import ScriptedJudge, _verdict


def test_the_judge_follows_the_question_writer_by_default():
    plain = follow_generator(CurateJudgeConfig(), QRAConfig())  # the template writer has no model
    assert (plain.backend, plain.model) == ("transformers", "smollm2") and type(plain) is JudgeConfig
    writer = QRAConfig(backend="openai", model="served-writer", base_url="http://h:1/v1", guided_mode="guided_json",
                       api_key_env="MY_KEY", model_revision="r7")
    j = follow_generator(CurateJudgeConfig(), writer)
    assert (j.backend, j.model, j.base_url, j.guided_mode, j.api_key_env, j.model_revision) == (
        "openai", "served-writer", "http://h:1/v1", "guided_json", "MY_KEY", "r7")
    own = follow_generator(CurateJudgeConfig(backend="transformers", model="/models/judge"), writer)
    assert (own.backend, own.model, own.base_url) == ("transformers", "/models/judge", "")
    # a judge model named alone takes the writer's engine, not its model
    assert follow_generator(CurateJudgeConfig(model="other"), writer).model == "other"
    with pytest.raises(ConfigError, match="base_url"):
        follow_generator(CurateJudgeConfig(backend="openai"), QRAConfig())
    # a setting the judge's config gives is kept: its own API key variable was replaced by the writer's
    mine = follow_generator(CurateJudgeConfig(api_key_env="JUDGE_KEY", guided_mode="response_format"), writer)
    assert (mine.backend, mine.base_url, mine.api_key_env, mine.guided_mode) == (
        "openai", "http://h:1/v1", "JUDGE_KEY", "response_format")


def _curate(tmp_path, extra=(), handlers=None):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.sample_corpus import demo_items
    from longreel.schemas.config import load_yaml

    cfg = load_yaml(CurateConfig, None, ["stages=[caption, qra, judge, pack]", *extra])
    out = str(tmp_path / "out")
    return out, run_curate(demo_items(), out, cfg, handlers=handlers or {})


def _shard_ids(out) -> dict:
    """The released questions by id."""
    ids = {}
    for name in sorted(os.listdir(os.path.join(out, "shards"))):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(out, "shards", name)) as tar:
                for m in tar.getmembers():
                    if m.name.endswith(".qras.json"):
                        ids.update({q["qra_id"]: q for q in json.loads(tar.extractfile(m).read())})
    return ids


def test_stage_in_curate_rejects_by_check_and_keeps_verdicts(tmp_path):
    from longreel.pipelines.io.parquet_sink import read_table

    class ByIndex(ScriptedJudge):
        """Fails every other question's answer check and every third one's uniqueness."""

        def generate(self, requests):
            self.verdicts = {}
            for r in requests:
                qid = r.key.split(":", 1)[1]
                i = int(qid.encode().hex(), 16)
                self.verdicts[qid] = _verdict(follows=i % 2 == 0, unique=i % 3 != 0)
            return super().generate(requests)

    ScriptedJudge.seen.clear()
    out, stats = _curate(tmp_path, handlers={"judge": lambda: ByIndex({})})
    st = next(s for s in stats["stages"] if s["stage"] == "judge")
    qras = read_table(out, "qras").to_pylist()
    assert st["in"] == len(qras) > 0 and st["out"] + sum(st["rejected"].values()) == st["in"]
    order = [s["stage"] for s in stats["stages"]]
    assert order.index("qra_balance") < order.index("judge") < order.index("pack_select")
    captions = read_table(out, "captions").to_pylist()
    want = {}
    for q in qras:
        i = int(q["qra_id"].encode().hex(), 16)
        src = [c for c in captions if c["clip_id"] in set(q["source_caption_ids"] or [])]
        failed = J.failed_checks(q, _verdict(follows=i % 2 == 0, unique=i % 3 != 0), src, JudgeConfig())
        if failed:
            want[failed[0]] = want.get(failed[0], 0) + 1
    assert st["rejected"] == want and want  # every reject names its first failed check
    kept = read_table(out, "qras_judged").to_pylist()
    assert len(kept) == st["out"]
    record = json.loads(kept[0]["judge_verdict"]) if kept else None
    assert record is None or (record["judge"] == "scripted-judge" and record["prompt_hash"] ==
                              J.prompt_hash(follow_generator(CurateJudgeConfig(), QRAConfig())))
    sec = stats["judge"]
    assert sec["balanced"] and sec["judge"]["judge"] == "scripted-judge" and sec["judge"]["prompt_hash"]
    # only judged-and-kept questions reach the shards, with the verdict, the judge and its prompt hash
    assert set(_shard_ids(out)) == {q["qra_id"] for q in kept}
    for q in _shard_ids(out).values():
        assert q["judge_verdict"]["judge"] == "scripted-judge" and q["judge_verdict"]["verdict"]["answer_follows"]
    # the captions a question was written from reached the judge
    assert all("Captions:\n[" in r.messages[1]["content"] for r in ScriptedJudge.seen)


@pytest.mark.slow
def test_smollm2_judges_the_demo_corpus_in_curate(tmp_path):
    from longreel.pipelines.io.parquet_sink import read_table

    out, stats = _curate(tmp_path, ["qra.categories=[temporal]", "judge.max_new_tokens=64",
                                    "judge.explanation_chars=40", "judge.threads=1"])
    st = next(s for s in stats["stages"] if s["stage"] == "judge")
    assert st["in"] > 0 and st["out"] + sum(st["rejected"].values()) == st["in"]
    assert set(st["rejected"]) <= set(J.CHECKS)  # SmolLM2's verdicts parse under the schema
    assert stats["judge"]["judge"]["judge"] == "smollm2" and stats["judge"]["judge"]["backend"] == "transformers"
    for r in read_table(out, "rejects").to_pylist():
        if r["stage"] == "judge":
            assert json.loads(r["details"])["failed"][0] == r["reason"]


def test_openai_compatible_server_as_judge_in_curate(tmp_path, monkeypatch):
    def reply(body):
        return {"choices": [{"message": {"content": json.dumps(_verdict(follows=False))}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 12}}

    monkeypatch.setenv("OPENAI_API_KEY", "test")
    with chat_completions_server(reply) as (url, bodies):
        out, stats = _curate(tmp_path, ["judge.backend=openai", f"judge.base_url={url}", "judge.model=served"])
    st = next(s for s in stats["stages"] if s["stage"] == "judge")
    assert len(bodies) == st["in"] > 0 and all(b["model"] == "served" for b in bodies)
    assert st["out"] == 0 and st["rejected"] == {J.UNSUPPORTED: st["in"]}
    assert stats["judge"]["judge"]["backend"] == "openai" and not _shard_ids(out)
