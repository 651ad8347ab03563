"""Stage ``question_dedup`` (unit: question): near-identical questions of one video, by sentence embeddings.

The questions of a video are embedded (question text, and its options with ``with_options``) with a
sentence-transformers model (all-MiniLM-L6-v2 from its wheel by default) and passed in ``qra_id`` order through
:func:`~longreel.pipelines.gates.near_dup.greedy_near_duplicates`: a question within ``threshold`` cosine
similarity of an earlier kept question of the same video is rejected ``near_duplicate_question`` naming the kept
one. Counts: ``in == out + rejected``.
"""
from __future__ import annotations

import json

import apache_beam as beam

from longreel.pipelines.embed_config import EmbedConfig
from longreel.pipelines.gates.near_dup import greedy_near_duplicates
from longreel.pipelines.stages.base import MAIN, REJECTS, WorkerModel, rejected

STAGE = "question_dedup"
NEAR_DUPLICATE_QUESTION = "near_duplicate_question"



def sentence_embedder(cfg: EmbedConfig):
    from longreel.engines.embeddings import SentenceEmbedder

    q = cfg.question_dedup
    return SentenceEmbedder(q.model, threads=q.threads, batch_size=q.batch_size,
                            trust_remote_code=q.trust_remote_code)


def question_text(q: dict, with_options: bool) -> str:
    if with_options and q.get("options"):
        return q["question"] + "\n" + "\n".join(q["options"])
    return q["question"]


class DedupVideoQuestions(beam.DoFn):
    """``(video_id, [qra rows])`` -> kept rows (main) and ``near_duplicate_question`` rejects."""

    def __init__(self, cfg: EmbedConfig):
        from apache_beam.utils import shared

        self.cfg, self._shared = cfg, shared.Shared()

    def _load(self):
        m = sentence_embedder(self.cfg)
        m.setup()
        return WorkerModel(m)

    def setup(self):
        self.model = self._shared.acquire(self._load).value

    def process(self, element):
        _, rows = element
        rows = sorted(rows, key=lambda q: q["qra_id"])
        qd = self.cfg.question_dedup
        emb = self.model.encode([question_text(q, qd.with_options) for q in rows])
        for d in greedy_near_duplicates(emb, qd.threshold):
            q = rows[d.index]
            if d.kept_index is None:
                yield q
                continue
            kept = rows[d.kept_index]
            yield rejected(STAGE, q["qra_id"], NEAR_DUPLICATE_QUESTION,
                           f"near-duplicate of question {kept['qra_id']} (cosine {d.similarity} >= {qd.threshold})",
                           video_id=q["video_id"],
                           details=json.dumps({"kept_qra_id": kept["qra_id"], "similarity": d.similarity}))


class QuestionDedup(beam.PTransform):
    """qra rows -> ``{"main": kept rows, "rejects"}``."""

    def __init__(self, cfg: EmbedConfig):
        super().__init__()
        self.cfg = cfg
        m = sentence_embedder(cfg)  # resolves the model's files now: a missing model fails the build, not a worker
        self._prov = {"model": cfg.question_dedup.model, "revision": m.revision, "backend": m.backend}

    def provenance(self) -> dict:
        return dict(self._prov)

    def expand(self, qras):
        out = (qras | "KeyByVideo" >> beam.Map(lambda q: (q["video_id"], q))
               | "QuestionsPerVideo" >> beam.GroupByKey()
               | "NearDuplicateQuestions" >> beam.ParDo(DedupVideoQuestions(self.cfg)).with_outputs(REJECTS,
                                                                                                    main=MAIN))
        return {MAIN: out[MAIN], REJECTS: out[REJECTS]}


def add_question_dedup_stage(qras_pcoll, cfg: EmbedConfig, label: str = "QuestionDedup") -> dict:
    """Returns ``{"qras", "rejects", "counts", "provenance"}``; the caller applies :func:`finish_question_dedup_stats`."""
    from longreel.pipelines.stats import stage_counts

    transform = QuestionDedup(cfg)
    out = qras_pcoll | label >> transform
    return {"qras": out[MAIN], "rejects": out[REJECTS],
            "counts": stage_counts(label, STAGE, qras_pcoll, out[MAIN], out[REJECTS]),
            "provenance": transform.provenance()}


def finish_question_dedup_stats(doc: dict, cfg: EmbedConfig, prov: dict) -> dict:
    st = next((s for s in doc.get("stages", []) if s["stage"] == STAGE), None)
    if st is None:
        return doc
    doc.setdefault("embed", {})[STAGE] = {
        "model": dict(prov), "threshold": cfg.question_dedup.threshold,
        "with_options": cfg.question_dedup.with_options, "in": st["in"], "kept": st["out"],
        "rejected": dict(sorted(st.get("rejected", {}).items()))}
    return doc
