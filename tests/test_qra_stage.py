"""The qra stage through Beam: template generator end to end (CLI on an output directory), and the LLM
path's accounting (unparseable, excess, refinement accepted / changed answer) with a scripted backend
standing in for a model. Counts must add up per stage and per category."""
import json
import random

import apache_beam as beam
import pytest

from longreel.engines.base import Completion, Engine
from longreel.pipelines.qra.text_backend import TextBackend
from longreel.pipelines.io.parquet_sink import WriteSortedParquet, read_table
from longreel.pipelines.qra.generate import VideoQRAWriter
from longreel.pipelines.qra_config import QRAConfig
from longreel.pipelines.runner import make_pipeline
from longreel.pipelines.stages.qra import add_qra_stage
from longreel.pipelines.stats import WriteStats, read_json
from longreel.schemas import KINDS, to_table
from longreel.schemas.records import CATEGORIES


def synth_video(vid: str, n: int, seed: int):
    rng = random.Random(seed)
    video = {"video_id": vid, "sha256": vid * 4, "uri": f"/x/{vid}.mp4", "bytes": 1, "container": "mp4",
             "duration_s": n * 10.0, "fps_avg": 24.0, "fps_real": 24.0, "n_frames": n * 240, "n_frames_header": None,
             "width": 64, "height": 48, "rotation": 0, "decode_delay_s": 0.0, "video_codec": "h264",
             "pix_fmt": "yuv420p", "has_audio": False, "audio_codec": None, "license": None, "attribution": None,
             "probe_version": "t"}
    caps, facts = [], []
    for i in range(n):
        cid = f"{vid}-{i:05d}-abcd"
        caps.append({"clip_id": cid, "video_id": vid, "start_s": i * 10.0, "end_s": i * 10.0 + 10, "text":
                     f"Scene {i}: the {rng.choice(['rabbit', 'bird', 'squirrel'])} {rng.choice(['runs', 'eats'])}.",
                     "backend": "facts", "model": "m", "model_revision": None, "prompt_hash": "h", "sampling": "{}",
                     "frame_timestamps": [i * 10.0 + 5]})
        facts.append({"clip_id": cid, "video_id": vid, "start_s": i * 10.0, "end_s": i * 10.0 + 10,
                      "frame_timestamps": [i * 10.0 + 5], "motion": rng.uniform(0, 30), "black_ratio": 0.0,
                      "brightness": rng.uniform(20, 220), "n_cuts": rng.choice([0, 1, 2]),
                      "dominant_color": rng.choice(["green", "blue", "grey"])})
    return video, caps, facts


def write_tables(out, rows_by_table):
    import os
    os.makedirs(out, exist_ok=True)
    from longreel.pipelines.io.parquet_sink import shard_name, write_parquet_atomic
    for table, (kind, rows) in rows_by_table.items():
        write_parquet_atomic(shard_name(str(out), table, 0, 1), to_table(KINDS[kind], rows))


def check_balanced(stats, stage):
    st = {s["stage"]: s for s in stats["stages"]}[stage]
    assert st["balanced"] and st["in"] == st["out"] + st["rejected_total"], st
    return st


def test_cli_template_end_to_end_counts_add_up(tmp_path):
    from longreel.cli import main

    out = tmp_path / "run"
    v1, c1, f1 = synth_video("aaaa000011112222", 12, 1)
    v2, c2, f2 = synth_video("bbbb000011112222", 2, 2)   # too short for most kinds: not_generated slots
    v3, _, _ = synth_video("cccc000011112222", 3, 3)     # no captions at all
    old_reject = {"stage": "ingest", "key": "/bad.mp4", "reason": "unreadable", "message": "m", "video_id": None,
                  "details": None}
    write_tables(out, {"videos": ("video", [v1, v2, v3]), "captions": ("caption", c1 + c2),
                       "clip_facts": ("clip_facts", f1 + f2), "rejects": ("reject", [old_reject])})
    (out / "stats.json").write_text(json.dumps({"schema_version": "1.0", "kind": "longreel-funnel", "stages": [
        {"stage": "ingest", "unit": "video", "in": 4, "out": 3, "rejected": {"unreadable": 1}, "extra": {},
         "rejected_total": 1, "balanced": True}]}))
    assert main(["-q", "qra", "--out", str(out), "--set", "qra.per_category=3"]) == 0
    stats = read_json(str(out / "stats.json"))
    assert [s["stage"] for s in stats["stages"]] == ["ingest", "qra_context", "qra", "qra_refine",
                                                     "qra_balance"]
    ctx = check_balanced(stats, "qra_context")
    assert ctx["in"] == 3 and ctx["rejected"] == {"no_captions": 1}
    qra = check_balanced(stats, "qra")
    ex = qra["extra"]
    assert ex["requested"] == 2 * 4 * 3 == qra["in"]
    for cat in CATEGORIES:  # per category: requested == kept + rejected
        rej = sum(v for k, v in ex.items() if k.startswith(f"{cat}.rejected."))
        assert ex[f"{cat}.requested"] == ex.get(f"{cat}.kept", 0) + rej
    assert sum(ex.get(f"{c}.kept", 0) for c in CATEGORIES) == ex["kept"] == qra["out"]
    rows = read_table(str(out), "qras").to_pylist()
    assert len(rows) == qra["out"] and len({r["qra_id"] for r in rows}) == len(rows)
    assert all(r["generator"] == "template" and not r["refined"] and r["prompt_hash"] for r in rows)
    rejects = read_table(str(out), "rejects").to_pylist()
    assert old_reject in rejects  # other stages' rejects are kept
    by_reason = {}
    for r in rejects:
        if r["stage"] == "qra":
            by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    assert by_reason == qra["rejected"]  # one reject row per counted rejection
    # re-running gives the same table (deterministic)
    before = sorted(json.dumps(r, sort_keys=True) for r in rows)
    assert main(["-q", "qra", "--out", str(out), "--set", "qra.per_category=3"]) == 0
    assert sorted(json.dumps(r, sort_keys=True) for r in read_table(str(out), "qras").to_pylist()) == before
    assert sum(1 for r in read_table(str(out), "rejects").to_pylist() if r["stage"] == "qra") == \
        sum(by_reason.values())


class ScriptedEngine(Engine):
    """Stands in for a model behind the QRA stage's text backend: answers each request with the next scripted text
    (generation calls and refinement calls are told apart by their schema title; None scripts a failure)."""
    backend = "scripted"
    supports_schema = True

    def __init__(self, generations, refinements):
        super().__init__("scripted-model", "rev1")
        self.generations, self.refinements = list(generations), list(refinements)
        self.requests = []

    def count_tokens(self, messages):
        return sum(len(m["content"].split()) for m in messages)

    def generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            queue = self.generations if r.schema["title"] == "qra_generation" else self.refinements
            text = queue.pop(0)
            out.append(Completion.failed("model_error", "boom") if text is None else
                       Completion(texts=[text], finish=["stop"], guided=True,
                                  prompt_tokens=self.count_tokens(r.messages), new_tokens=len(text.split())))
        return out


def ScriptedBackend(generations, refinements) -> TextBackend:
    return TextBackend(ScriptedEngine(generations, refinements))


def mc(q, answer="B", reasoning="Checking the video at [00:10-00:20] and [00:30-00:40]. So the answer is B."):
    return {"question": q, "problem_type": "multiple_choice", "options": ["red", "green", "blue", "grey"],
            "reasoning": reasoning, "answer": answer}


def op(q, answer="the rabbit"):
    return {"question": q, "problem_type": "open_ended", "reasoning": "Checking the video at [00:10-00:20].",
            "answer": answer}


def test_llm_accounting_and_refinement_events():
    cfg = QRAConfig(backend="openai", categories=["temporal", "spatial"], per_category=2)
    # calls in order: temporal MC, temporal open, spatial MC, spatial open
    gens = [
        json.dumps({"questions": [mc("Which colour appears first?")]}),
        "<think>let me think</think> sorry, no JSON here",                        # unparseable: 1 slot
        json.dumps({"questions": [mc("Which colour is on the left?"), mc("Which colour is at the top?")]}),  # 1 excess
        None,                                                                     # backend failure
    ]
    refs = [
        json.dumps({"reasoning": "At [00:10-00:20] the red shape shows first. So the answer is B.", "answer": "B"}),
        json.dumps({"reasoning": "At [00:30-00:40] it is clearly blue. So the answer is C.", "answer": "C"}),
    ]
    backend = ScriptedBackend(gens, refs)
    writer = VideoQRAWriter(cfg, backend)
    _, caps, facts = synth_video("dddd000011112222", 6, 4)
    events = list(writer.process("dddd000011112222", 60.0, caps, {f["clip_id"]: f for f in facts}))
    counts = {}
    for e in events:
        if e[0] == "count":
            counts[e[1]] = counts.get(e[1], 0) + e[2]
    rows = [e[1] for e in events if e[0] == "qra"]
    rejects = [e[1] for e in events if e[0] == "reject"]
    assert counts[("qra", "requested")] == 4 and counts[("qra", "in")] == 5  # one excess item
    assert counts[("qra", "out")] == 2 == len(rows)
    assert {r["reason"] for r in rejects if r["stage"] == "qra"} == {"unparseable", "excess_item", "generation_failed"}
    assert counts[("qra", "in")] == counts[("qra", "out")] + sum(
        v for k, v in counts.items() if k[0] == "qra" and k[1].startswith("rejected:"))
    # refinement: the first rewrite keeps the answer and is applied; the second changes it and is rejected
    assert counts[("qra_refine", "in")] == 2 and counts[("qra_refine", "out")] == 1
    assert counts[("qra_refine", "rejected:refine_changed_answer")] == 1
    refined = [r for r in rows if r["refined"]]
    kept_unrefined = [r for r in rows if not r["refined"]]
    assert len(refined) == 1 and len(kept_unrefined) == 1
    assert refined[0]["draft_reasoning"].startswith("Checking the video") and refined[0]["refine_prompt_hash"]
    assert refined[0]["target"] == f"<think>{refined[0]['reasoning']}</think><answer>B</answer>"
    assert kept_unrefined[0]["answer"] == "B" and kept_unrefined[0]["reasoning"].startswith("Checking")
    assert counts[("qra", "refined")] == 1 and counts[("qra", "temporal.refined")] == 1
    # the refinement schema pins the answer by default
    ref_reqs = [r for r in backend.engine.requests if r.schema["title"] == "qra_refinement"]
    assert ref_reqs[0].schema["properties"]["answer"] == {"type": "string", "enum": ["B"]}
    assert all(r["generator"] == "scripted" and r["model"] == "scripted-model" for r in rows)
    # the compute bill: 4 generation calls (one failed: a call all the same) and 2 refinement calls, with the
    # tokens the engine reported
    gen_reqs = [r for r in backend.engine.requests if r.schema["title"] == "qra_generation"]
    assert counts[("qra", "compute.calls")] == 4 == len(gen_reqs)
    assert counts[("qra", "compute.input_text_tokens")] == sum(
        backend.engine.count_tokens(r.messages) for r, g in zip(gen_reqs, gens) if g is not None)
    assert counts[("qra", "compute.output_tokens")] == sum(len(g.split()) for g in gens if g is not None)
    assert counts[("qra_refine", "compute.calls")] == 2 and counts[("qra", "compute.input_vision_tokens")] == 0


def test_add_qra_stage_in_a_pipeline(tmp_path):
    v, c, f = synth_video("eeee000011112222", 8, 5)
    cfg = QRAConfig(per_category=2)
    p = make_pipeline([])
    out = add_qra_stage(p, p | "C" >> beam.Create(c), p | "F" >> beam.Create(f), p | "V" >> beam.Create([v]),
                        str(tmp_path), cfg)
    out["rejects"] | "WR" >> WriteSortedParquet(str(tmp_path), "rejects", "reject")
    out["counts"] | WriteStats(str(tmp_path / "stats.json"), ["qra_context", "qra", "qra_refine"], {}, {})
    p.run().wait_until_finish()
    stats = read_json(str(tmp_path / "stats.json"))
    qra = check_balanced(stats, "qra")
    assert qra["in"] == 8 and len(read_table(str(tmp_path), "qras")) == qra["out"] > 0


PREFIX = r"Checking the video at \[[0-9]{2}:[0-9]{2}-[0-9]{2}:[0-9]{2}\]"


@pytest.mark.parametrize("supports_pattern", [True, False])
def test_reasoning_prefix_goes_to_the_schema_where_it_can_and_is_checked_everywhere(supports_pattern):
    """qra.reasoning_prefix: backends whose decoder takes a JSON-schema pattern get it in the schema (generation and
    refinement); every output is checked, so a backend without patterns gets the same rule as a reject."""
    from longreel.pipelines.qra.generate import VideoQRAWriter

    cfg = QRAConfig(backend="openai", categories=["temporal"], per_category=2, mc_fraction=1.0, refine=True,
                    reasoning_prefix=PREFIX)
    gens = [json.dumps({"questions": [mc("Which colour appears first?"),
                                      mc("Which colour comes last?", reasoning="The end shows grey at [00:50-00:60]. "
                                                                                "So the answer is B.")]})]
    refs = [json.dumps({"reasoning": "Checking the video at [00:10-00:20], the red car leaves first. So the answer "
                                     "is B.", "answer": "B"})]
    backend = ScriptedBackend(gens, refs)
    backend.engine.supports_pattern = supports_pattern
    events = list(VideoQRAWriter(cfg, backend).process("vid", 60.0, [
        {"clip_id": f"vid-{i:05d}", "video_id": "vid", "start_s": 10.0 * i, "end_s": 10.0 * i + 10,
         "text": f"clip {i}"} for i in range(6)], {}))
    schemas = [json.dumps(r.schema) for r in backend.engine.requests]
    assert len(schemas) == 2  # one generation call, one refinement
    assert all(("pattern" in s) == supports_pattern for s in schemas)
    reasons = [e[1]["reason"] for e in events if e[0] == "reject"]
    assert reasons == ["reasoning_prefix_mismatch"]
    kept = [e[1] for e in events if e[0] == "qra"]
    assert len(kept) == 1 and kept[0]["reasoning"].startswith("Checking the video at [00:10-00:20], the red car")


def test_reasoning_prefix_must_be_a_regular_expression():
    from longreel.schemas.config import ConfigError

    with pytest.raises(ConfigError, match="reasoning_prefix"):
        QRAConfig(reasoning_prefix="Checking [00:").check()
