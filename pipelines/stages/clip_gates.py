"""Stages ``align`` and ``clip_dedup`` (unit: caption): CLIP embeddings of the frames the caption stage decoded.

::

    frames (the caption stage's decoded clips) --EmbedFrames--> (clip_id, frame embeddings (n, d))
    captions --CoGroupByKey(clip_id)--> caption + its frame embeddings
      -> align       clip_score = mean cos(caption text, frame)   rejects: caption_misaligned (align.min_score)
      -> clip_dedup  one global greedy pass over the clips' mean embeddings in (video_id, start_s, clip_id) order
                                                                  rejects: near_duplicate_clip (action drop)

No frame is decoded again: the caption stage keeps the frames it decoded for the facts and the captioner (at the
captioner's pixel budget; the facts captioner's 128x128 budget is small for CLIP, which resizes to its input size)
and this stage embeds them where they were decoded; only the embeddings cross the shuffle. ``clip_dedup`` compares
every clip with every kept clip in one worker: O(clips x kept) dot products of d floats (d = 512 for ViT-B-32),
computed a block at a time (benchmarks/results/gates_embed.json: 10,000 distinct clips); the cost grows with the
square of the clips, so a corpus of millions wants an approximate nearest-neighbour index instead.
"""
from __future__ import annotations

import json

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.embed_config import EmbedConfig
from longreel.pipelines.gates import alignment as A
from longreel.pipelines.gates.near_dup import greedy_near_duplicates, mean_embedding
from longreel.pipelines.stages.base import MAIN, REJECTS, WorkerModel, checked, rejected

ALIGN, DEDUP = A.STAGE, "clip_dedup"
NEAR_DUPLICATE_CLIP = "near_duplicate_clip"
COUNTS = "counts"



def clip_embedder(cfg: EmbedConfig):
    from longreel.engines.embeddings import ClipEmbedder

    c = cfg.clip
    return ClipEmbedder(c.name, None if c.random_init else c.checkpoint, seed=c.seed, threads=c.threads,
                        batch_size=c.batch_size)


class _WithClip(beam.DoFn):
    """A DoFn that uses the CLIP model: one per worker process, shared by every DoFn given the same ``shared``."""

    def __init__(self, cfg: EmbedConfig, shared):
        self.cfg, self._shared = cfg, shared

    def _load(self):
        m = clip_embedder(self.cfg)
        m.setup()
        return WorkerModel(m)

    def setup(self):
        self.clip = self._shared.acquire(self._load).value


class EmbedFrames(_WithClip):
    """A decoded clip ``{"clip", "frames", ...}`` -> ``(clip_id, (n_frames, d) float32)``."""

    def process(self, el):
        if el.get("frames") is None or not len(el["frames"]):
            return
        yield el["clip"]["clip_id"], self.clip.images(el["frames"])


def join_caption(element):
    """``(clip_id, {"cap": [row], "emb": [frames_emb]})`` -> ``(row, frames_emb)`` (clips rejected before or at
    the caption stage have no caption; every caption has the frames it was written from)."""
    _, g = element
    for row in g["cap"]:
        embs = list(g["emb"])
        yield row, (embs[0] if embs else None)


class AlignFn(_WithClip):
    """``(caption row, frames_emb)`` -> the row with ``clip_score`` (main, still paired), rejects, score-bin counts."""

    def process(self, pair):
        row, frames_emb = pair
        cid, vid = row["clip_id"], row["video_id"]
        if frames_emb is None:
            yield rejected(ALIGN, cid, "frames_missing", "no frame embeddings for this caption", video_id=vid)
            return
        score = A.clip_score(self.clip.texts([row["text"]])[0], frames_emb)
        yield TaggedOutput(COUNTS, ((ALIGN, f"score_bin:{A.score_bin(score)}"), 1))
        m = self.cfg.align.min_score
        if m is not None and score < m:
            yield rejected(ALIGN, cid, A.MISALIGNED, f"clip_score {score} < align.min_score {m}", video_id=vid,
                           details=json.dumps({"clip_score": score}))
            return
        yield {**row, "clip_score": score}, frames_emb


def decide_duplicates(pairs, threshold: float, action: str):
    """All ``(row, frames_emb)`` pairs -> rows (main) and ``near_duplicate_clip`` rejects (action drop)."""
    items = sorted(((r, e) for r, e in pairs if e is not None),
                   key=lambda p: (p[0]["video_id"], p[0]["start_s"], p[0]["clip_id"]))
    missing = [r for r, e in pairs if e is None]
    for r in sorted(missing, key=lambda r: r["clip_id"]):
        yield rejected(DEDUP, r["clip_id"], "frames_missing", "no frame embeddings for this caption",
                       video_id=r["video_id"])
    if not items:
        return
    import numpy as np

    emb = np.stack([mean_embedding(e) for _, e in items])
    for d in greedy_near_duplicates(emb, threshold):
        row = items[d.index][0]
        if d.kept_index is None:
            yield row
            continue
        kept = items[d.kept_index][0]
        detail = json.dumps({"kept_clip_id": kept["clip_id"], "kept_video_id": kept["video_id"],
                             "similarity": d.similarity})
        yield TaggedOutput(COUNTS, ((DEDUP, "near_duplicates"), 1))
        if action == "drop":
            yield rejected(DEDUP, row["clip_id"], NEAR_DUPLICATE_CLIP,
                           f"near-duplicate of clip {kept['clip_id']} (cosine {d.similarity} >= {threshold})",
                           video_id=row["video_id"], details=detail)
        else:
            yield {**row, "near_duplicate_of": kept["clip_id"]}


class ClipGates(beam.PTransform):
    """``{"captions", "frames"}`` -> ``{"main": captions, "rejects", "counts"}`` for the stages in ``stages``
    (``align``, ``clip_dedup`` or both, in that order). ``frames``: the caption stage's decoded clips."""

    def __init__(self, cfg: EmbedConfig, stages: list[str]):
        super().__init__()
        from apache_beam.utils import shared

        cfg.check_clip_model()
        self.cfg, self.stages = cfg, [s for s in (ALIGN, DEDUP) if s in stages]
        self._shared = shared.Shared()  # EmbedFrames and AlignFn share one model per process
        self._prov = provenance(clip_embedder(cfg))

    def provenance(self) -> dict:
        return dict(self._prov)

    def expand(self, pcolls):
        from longreel.pipelines.stats import stage_counts

        cfg = self.cfg
        embs = pcolls["frames"] | "EmbedFrames" >> beam.ParDo(EmbedFrames(cfg, self._shared))
        keyed = pcolls["captions"] | "KeyCaptions" >> beam.Map(lambda r: (r["clip_id"], r))
        pairs = {"cap": keyed, "emb": embs} | "CaptionFrames" >> beam.CoGroupByKey() | "Pair" >> beam.FlatMap(
            join_caption)
        rejects, counts = [], []
        rows_in = pcolls["captions"]
        if ALIGN in self.stages:
            al = pairs | "Align" >> beam.ParDo(AlignFn(cfg, self._shared)).with_outputs(REJECTS, COUNTS, main=MAIN)
            pairs = al[MAIN]
            rows_out = pairs | "AlignedRows" >> beam.Map(lambda p: p[0])
            rejects.append(al[REJECTS])
            counts += [stage_counts("Align", ALIGN, rows_in, rows_out, al[REJECTS]), al[COUNTS]]
            rows_in = rows_out
        if DEDUP in self.stages:
            d = cfg.clip_dedup
            dd = (pairs | "AllClips" >> beam.combiners.ToList()
                  | "NearDuplicateClips" >> beam.FlatMap(decide_duplicates, d.threshold, d.action).with_outputs(
                      REJECTS, COUNTS, main=MAIN))
            rows_out = dd[MAIN]
            rejects.append(dd[REJECTS])
            counts += [stage_counts("ClipDedup", DEDUP, rows_in, rows_out, dd[REJECTS]), dd[COUNTS]]
        else:
            rows_out = pairs | "GatedRows" >> beam.Map(lambda p: p[0])
        out = rows_out | "CheckCaptions" >> beam.Map(lambda r: checked(self.stages[-1], "caption", r, r["clip_id"]))
        main = out | "ValidCaptions" >> beam.Filter(lambda r: isinstance(r, dict))
        bad = out | "InvalidCaptions" >> beam.Filter(lambda r: not isinstance(r, dict)) | "InvalidAsRejects" >> beam.Map(lambda t: t.value)
        return {MAIN: main, REJECTS: tuple(rejects) + (bad,) | "ClipGateRejects" >> beam.Flatten(),
                COUNTS: tuple(counts) | "ClipGateCounts" >> beam.Flatten()}


def provenance(model) -> dict:
    return {"model": model.name, "revision": model.revision, "backend": model.backend}


def finish_clip_gate_stats(doc: dict, cfg: EmbedConfig, prov: dict) -> dict:
    """Fold the ``align`` / ``clip_dedup`` counts into ``doc["embed"]``: the clip_score histogram (bins of
    :data:`~longreel.pipelines.gates.alignment.BIN_WIDTH`), rejects, the model."""
    by = {s["stage"]: s for s in doc.get("stages", [])}
    section = doc.setdefault("embed", {})
    if ALIGN in by:
        st = by[ALIGN]
        hist = [int(st.get("extra", {}).get(f"score_bin:{i}", 0)) for i in range(A.BINS)]
        section[ALIGN] = {"model": dict(prov), "min_score": cfg.align.min_score, "in": st["in"], "kept": st["out"],
                          "rejected": dict(sorted(st.get("rejected", {}).items())), "bin_width": A.BIN_WIDTH,
                          "histogram": hist, **A.summarise(hist)}
    if DEDUP in by:
        st = by[DEDUP]
        section[DEDUP] = {"model": dict(prov), "threshold": cfg.clip_dedup.threshold, "action": cfg.clip_dedup.action,
                          "in": st["in"], "kept": st["out"],
                          "near_duplicates": int(st.get("extra", {}).get("near_duplicates", 0)),
                          "rejected": dict(sorted(st.get("rejected", {}).items()))}
    return doc
