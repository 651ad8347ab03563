"""Stage ``judge``: ``qra`` rows + their videos' ``caption`` rows -> judged ``qra`` rows, rejects, counts.

Per video (``CoGroupByKey``), each question and the captions it was written from (``source_caption_ids``; all the
video's captions when none of them is found) go to the judge (:mod:`longreel.pipelines.gates.judge`); a question
failing a check is rejected with the first failed check as its reason (all of them in ``details``). Kept rows
carry ``judge_verdict`` (JSON: the verdict, the judge's model, revision and prompt hash). Counts: the funnel
(unit: question), ``failed:<check>`` per failed check, and the compute bill (one call per question).
"""
from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.compute import call_pairs
from longreel.pipelines.gates import judge as J
from longreel.pipelines.gates.engine import build_engine
from longreel.pipelines.judge_config import JudgeConfig
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, WorkerModel, checked, rejected

STAGE = J.STAGE
COUNTS = "counts"



class _JudgeVideoFn(beam.DoFn):
    def __init__(self, cfg: JudgeConfig, provenance: dict, engine_factory=None):
        from apache_beam.utils import shared

        self.cfg, self.prov, self.engine_factory = cfg, provenance, engine_factory
        self._shared = shared.Shared()

    def _load(self):
        engine = self.engine_factory() if self.engine_factory else build_engine(self.cfg)
        engine.setup()
        return WorkerModel(engine)

    def setup(self):
        self.engine = self._shared.acquire(self._load).value
        self.progress = Progress(STAGE, "questions")

    def process(self, element):
        _vid, groups = element
        qras = sorted(groups["qras"], key=lambda q: q["qra_id"])
        captions = list(groups["captions"])
        if not qras:
            return
        sources = [self._sources(q, captions) for q in qras]
        completions = self.engine.generate([J.request_for(q, src, self.cfg) for q, src in zip(qras, sources)])
        for q, src, c in zip(qras, sources, completions):
            yield from self._decide(q, src, c)

    @staticmethod
    def _sources(q: dict, captions: list[dict]) -> list[dict]:
        ids = set(q.get("source_caption_ids") or [])
        return [c for c in captions if c["clip_id"] in ids] or captions

    def _decide(self, q: dict, captions: list[dict], c):
        qid, vid = q["qra_id"], q["video_id"]
        self.progress.tick(qid)
        if not c.ok:
            yield rejected(STAGE, qid, "judge_failed", f"{c.error_reason}: {c.error_message}", video_id=vid)
            return
        for pair in call_pairs(STAGE, c.prompt_tokens, c.vision_tokens, c.new_tokens):
            yield TaggedOutput(COUNTS, pair)
        verdict = J.parse_verdict(c.text)
        if verdict is None:
            yield rejected(STAGE, qid, J.UNPARSEABLE, f"unreadable verdict: {c.text[:200]!r}", video_id=vid)
            return
        failed = J.failed_checks(q, verdict, captions, self.cfg)
        for check in failed:
            yield TaggedOutput(COUNTS, ((STAGE, f"failed:{check}"), 1))
        if failed:
            yield rejected(STAGE, qid, failed[0], f"failed {', '.join(failed)}: {verdict['explanation'][:200]}",
                           video_id=vid, details=json.dumps({"failed": failed, "verdict": verdict}, sort_keys=True))
            return
        record = {"verdict": verdict, "judge": self.prov["judge"], "judge_revision": self.prov["judge_revision"],
                  "prompt_hash": self.prov["prompt_hash"]}
        yield checked(STAGE, "qra", {**q, "judge_verdict": json.dumps(record, sort_keys=True)}, qid)


def provenance(engine, cfg: JudgeConfig) -> dict:
    return {"judge": engine.model, "judge_revision": engine.revision, "backend": engine.backend,
            "prompt_hash": J.prompt_hash(cfg)}


class JudgeQRAs(beam.PTransform):
    """``{"qras", "captions"}`` -> ``{"main", "rejects", "counts"}``."""

    def __init__(self, cfg: JudgeConfig, engine_factory=None):
        super().__init__()
        cfg.check()
        self.cfg, self.engine_factory = cfg, engine_factory
        self._prov = provenance(engine_factory() if engine_factory else build_engine(cfg), cfg)

    def provenance(self) -> dict:
        return dict(self._prov)

    def expand(self, inputs):
        from longreel.pipelines.stats import stage_counts

        qras, captions = inputs["qras"], inputs["captions"]
        keyed = {"qras": qras | "KeyQRAs" >> beam.Map(lambda r: (r["video_id"], r)),
                 "captions": captions | "KeyCaptions" >> beam.Map(lambda r: (r["video_id"], r))}
        grouped = keyed | "ByVideo" >> beam.CoGroupByKey()
        from longreel.pipelines.resources import on_model_step

        out = grouped | "Judge" >> on_model_step(beam.ParDo(
            _JudgeVideoFn(self.cfg, self._prov, self.engine_factory)).with_outputs(REJECTS, COUNTS, main=MAIN),
            self.cfg.resources)
        funnel = stage_counts("Judge", STAGE, qras, out[MAIN], out[REJECTS])
        counts = (funnel, out[COUNTS]) | "JudgeCounts" >> beam.Flatten()
        return {MAIN: out[MAIN], REJECTS: out[REJECTS], COUNTS: counts}


def finish_judge_stats(doc: dict, provenance: dict | None = None) -> dict:
    """``doc["judge"]``: questions in, kept, failures per check (a question can fail several), rejects by reason,
    the judge's model, revision and prompt hash."""
    st = next((s for s in doc.get("stages", []) if s["stage"] == STAGE), None)
    if st is None:
        return doc
    extra = st.get("extra", {})
    doc["judge"] = {"questions_in": st["in"], "kept": st["out"], "rejected_by_reason": dict(st.get("rejected", {})),
                    "failed_by_check": {c: int(extra.get(f"failed:{c}", 0)) for c in J.CHECKS},
                    "balanced": st["in"] == st["out"] + sum(st.get("rejected", {}).values()),
                    **({"judge": dict(provenance)} if provenance else {})}
    return doc


def add_judge_stage(qras_pcoll, captions_pcoll, out_dir: str, cfg: JudgeConfig, engine_factory=None,
                    label: str = "Judge", tables=None) -> dict:
    """Add the judge after ``qras_pcoll`` (``longreel curate``); write the kept rows with their verdicts as the
    ``qras_judged`` table under ``out_dir``. Returns ``{"qras", "rejects", "counts", "provenance"}``; the caller
    applies ``finish_judge_stats(doc, provenance)`` to its stats."""
    from longreel.pipelines.io.parquet_sink import write_table

    transform = JudgeQRAs(cfg, engine_factory)
    out = {"qras": qras_pcoll, "captions": captions_pcoll} | label >> transform
    write_table(out[MAIN], f"{label}WriteTable", out_dir, "qras_judged", "qra", cfg.parquet_shards, tables)
    return {"qras": out[MAIN], "rejects": out[REJECTS], "counts": out[COUNTS], "provenance": transform.provenance()}
