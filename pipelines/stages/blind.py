"""Stage ``blind``: ``qra`` rows -> the same rows with their blind pass count, ``blind`` rows, rejects.

A question a text-only model answers without the video teaches a policy to ignore the video, and the pass-rate
filter would spend k VLM samples on it. Each question is answered ``k`` times with no frames and no captions
(:mod:`longreel.pipelines.gates.blind`; rules in :mod:`longreel.pipelines.blind_config`) by any engine of
:mod:`longreel.engines` and scored with the trainer's rewards. Rejects: ``text_answerable`` (blind pass count /
k >= ``max_pass_rate``), ``invalid_reference``, ``bad_question`` and ``answerer_failed``.

Outputs of :class:`BlindFilter`: ``main``: kept ``qra`` rows with ``blind_k`` and ``blind_pass_count`` set (what the
pack stage puts in the shards); ``scored``: one ``blind`` row per scored question (kept or not: the record of
what the blind model did); ``rejects``; ``counts``: ``pass_count:N`` (the histogram) and the compute bill
(:mod:`longreel.pipelines.compute`: one call per rotation). Funnel (unit: question): ``in == out + rejected``.
"""
from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.blind_config import BlindConfig
from longreel.pipelines.compute import call_pairs
from longreel.pipelines.gates import blind as G
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, WorkerModel, checked, rejected
from longreel.pipelines.stages.passrate import sample_passes
from longreel.task.rewards import validate_reference

STAGE = G.STAGE
SCORED, COUNTS = "scored", "counts"
FAIL_REASONS = ("invalid_reference", "bad_question", "answerer_failed", "schema_violation")



class _BlindBatchFn(beam.DoFn):
    """A batch of ``qra`` rows -> kept rows (main), ``blind`` rows (scored), rejects, counts."""

    def __init__(self, cfg: BlindConfig, provenance: dict, engine_factory=None):
        from apache_beam.utils import shared

        self.cfg, self.prov, self.engine_factory = cfg, provenance, engine_factory
        self._shared = shared.Shared()  # one model per worker process, not one per thread

    def _load(self):
        engine = self.engine_factory() if self.engine_factory else G.build_engine(self.cfg)
        engine.setup()
        return WorkerModel(engine)

    def setup(self):
        self.engine = self._shared.acquire(self._load).value
        self.progress = Progress(STAGE, "questions")

    def _prepare(self, q: dict):
        """(views, None) or (None, reject) for one question."""
        qid, vid = q["qra_id"], q["video_id"]
        try:
            validate_reference(G.problem_type(q), q["answer"], q.get("options"), **self.cfg.reward_params)
        except (KeyError, TypeError, ValueError) as e:
            return None, rejected(STAGE, qid, "invalid_reference", f"{type(e).__name__}: {e}", video_id=vid)
        try:
            return G.views(q, self.cfg), None
        except (KeyError, ValueError) as e:
            return None, rejected(STAGE, qid, "bad_question", str(e), video_id=vid)

    def process(self, batch):
        ready = []
        for q in sorted(batch, key=lambda r: r["qra_id"]):
            vs, reject_ = self._prepare(q)
            if reject_ is not None:
                yield reject_
            else:
                ready.append((q, vs, G.requests_for(q, vs, self.cfg)))
        completions = self.engine.generate([r for _, _, reqs in ready for r in reqs]) if ready else []
        at = 0
        for q, vs, reqs in ready:
            yield from self._decide(q, vs, completions[at:at + len(reqs)])
            at += len(reqs)

    def _decide(self, q: dict, vs, completions):
        qid, vid, cfg = q["qra_id"], q["video_id"], self.cfg
        failed = [c for c in completions if not c.ok]
        if failed:
            yield rejected(STAGE, qid, "answerer_failed", f"{failed[0].error_reason}: {failed[0].error_message}",
                           video_id=vid)
            return
        s = G.score_views(q, vs, completions, cfg, sample_passes)
        answerable = G.is_text_answerable(s.pass_count, s.k, cfg)
        tokens_in = sum(c.prompt_tokens for c in completions)
        tokens_out = sum(c.new_tokens for c in completions)
        vision = None if any(c.vision_tokens is None for c in completions) else sum(c.vision_tokens for c in completions)
        for pair in call_pairs(STAGE, tokens_in, vision, tokens_out, calls=len(completions)):
            yield TaggedOutput(COUNTS, pair)
        yield TaggedOutput(COUNTS, ((STAGE, f"pass_count:{s.pass_count}"), 1))
        p = self.prov
        row = {"qra_id": qid, "video_id": vid, "k": s.k, "pass_count": s.pass_count, "text_answerable": answerable,
               "max_pass_rate": cfg.max_pass_rate, "rewards": s.rewards, "completions": s.completions,
               "sample_reasons": s.reasons, "rotate_options": cfg.rotate_options, "answerer": p["answerer"],
               "answerer_revision": p["answerer_revision"], "backend": p["backend"], "temperature": cfg.temperature,
               "seed": cfg.seed, "prompt_hash": p["prompt_hash"], "input_tokens": tokens_in,
               "output_tokens": tokens_out}
        out = checked(STAGE, "blind", row, qid)
        if not isinstance(out, dict):
            yield out
            return
        yield TaggedOutput(SCORED, out)
        self.progress.tick(f"{qid}: {s.pass_count}/{s.k}")
        if answerable:
            yield rejected(STAGE, qid, G.TEXT_ANSWERABLE,
                           f"answered without the video {s.pass_count}/{s.k} times (max pass rate "
                           f"{cfg.max_pass_rate})", video_id=vid,
                           details=json.dumps({"blind_pass_count": s.pass_count, "k": s.k}))
            return
        yield checked(STAGE, "qra", {**q, "blind_k": s.k, "blind_pass_count": s.pass_count}, qid)


def provenance(engine, cfg: BlindConfig) -> dict:
    return {"answerer": engine.model, "answerer_revision": engine.revision, "backend": engine.backend,
            "prompt_hash": G.prompt_hash(cfg), "k": cfg.k, "max_pass_rate": cfg.max_pass_rate,
            "rotate_options": cfg.rotate_options, "temperature": cfg.temperature, "constrained": cfg.constrained}


class BlindFilter(beam.PTransform):
    """Stage ``blind``: qra rows -> ``{"main", "scored", "rejects", "counts"}``. ``engine_factory`` (tests, custom
    clients): a zero-argument callable returning a :class:`longreel.engines.base.Engine`."""

    def __init__(self, cfg: BlindConfig, engine_factory=None):
        super().__init__()
        cfg.check()
        self.cfg, self.engine_factory = cfg, engine_factory
        # provenance needs no loaded model: the engine resolves its files and revision when built
        self._prov = provenance(engine_factory() if engine_factory else G.build_engine(cfg), cfg)

    def provenance(self) -> dict:
        return dict(self._prov)

    def expand(self, qras):
        batches = qras | "Batch" >> beam.BatchElements(min_batch_size=1, max_batch_size=self.cfg.batch_size)
        from longreel.pipelines.resources import on_model_step

        out = batches | "AnswerBlind" >> on_model_step(beam.ParDo(
            _BlindBatchFn(self.cfg, self._prov, self.engine_factory)).with_outputs(SCORED, REJECTS, COUNTS,
                                                                                   main=MAIN), self.cfg.resources)
        return {MAIN: out[MAIN], SCORED: out[SCORED], REJECTS: out[REJECTS], COUNTS: out[COUNTS]}


def finish_blind_stats(doc: dict, k: int, provenance: dict | None = None, config_hash: str | None = None) -> dict:
    """Fold the ``blind`` stage's counts into ``doc["blind"]``: the blind pass-count histogram over 0..k (zeros
    included), text-answerable and failed questions, the answerer's provenance."""
    st = next((s for s in doc.get("stages", []) if s["stage"] == STAGE), None)
    if st is None:
        return doc
    extra, rejected_ = st.get("extra", {}), st.get("rejected", {})
    hist = [int(extra.get(f"pass_count:{i}", 0)) for i in range(k + 1)]
    scored = sum(hist)
    answerable = int(rejected_.get(G.TEXT_ANSWERABLE, 0))
    section = {"k": k, "questions_in": st["in"], "scored": scored, "pass_count_histogram": hist,
               "text_answerable": answerable,
               "text_answerable_share": round(answerable / scored, 6) if scored else 0.0,
               "kept": st["out"],
               "failed_by_reason": {r: n for r, n in sorted(rejected_.items()) if r != G.TEXT_ANSWERABLE}}
    section["balanced"] = (st["in"] == st["out"] + sum(rejected_.values())
                           and scored == st["out"] + answerable + int(rejected_.get("schema_violation", 0)))
    if provenance:
        section["answerer"] = dict(provenance)
    if config_hash:
        section["config_hash"] = config_hash
    doc["blind"] = section
    return doc


def add_blind_stage(qras_pcoll, out_dir: str, cfg: BlindConfig, engine_factory=None, label: str = "Blind",
                    tables=None) -> dict:
    """Add the blind filter after ``qras_pcoll``; write the ``blind`` table under ``out_dir``. Returns
    ``{"qras": kept rows, "scored", "rejects", "counts": ((stage, metric), n) pairs (funnel included),
    "provenance"}``; the caller applies ``finish_blind_stats(doc, cfg.k, provenance)`` to its stats."""
    from longreel.pipelines.io.parquet_sink import write_table
    from longreel.pipelines.stats import stage_counts

    transform = BlindFilter(cfg, engine_factory)
    out = qras_pcoll | label >> transform
    write_table(out[SCORED], f"{label}WriteTable", out_dir, "blind", "blind", cfg.parquet_shards, tables)
    funnel = stage_counts(label, STAGE, qras_pcoll, out[MAIN], out[REJECTS])
    counts = (funnel, out[COUNTS]) | f"{label}AllCounts" >> beam.Flatten()
    return {"qras": out[MAIN], "scored": out[SCORED], "rejects": out[REJECTS], "counts": counts,
            "provenance": transform.provenance()}
