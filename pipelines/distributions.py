"""Distributions the data card states, computed as data: Beam PCollections combined per key.

Every distribution is a *section* of integer counts by *key* (a histogram bin, a category, a split, a
shard name...). A table contributes ``(("dist:<section>", key), n)`` pairs, the same shape as the funnel's
``((stage, metric), n)`` pairs, so they flow into the same :class:`longreel.pipelines.stats.WriteStats`, are summed
per key by the same ``CombinePerKey(sum)``, and land in ``stats.json`` under ``"distributions"`` (see
:func:`fold_distributions`). Values are integers only (durations are summed in milliseconds), so sums do not
depend on the order a runner combines them in, and a re-run writes the same bytes.

The row -> pairs functions are plain Python (:func:`pairs_for_rows`); the Beam side
(:func:`add_distributions`) only maps and groups them, and ``longreel card verify`` recomputes the
``released_*`` and ``shard_*`` sections from shards with the same functions.

Tables understood by :func:`add_distributions` (each optional):

=================  ==============================================================================
``videos``         VIDEO rows -> ``video_duration_s`` (binned), ``video_totals`` (videos, duration_ms),
                   ``video_license``
``clips``          CLIP rows -> ``clips_per_video`` (videos by their number of clips), ``clip_totals``
``captions``       CAPTION rows -> ``caption_words`` (binned), ``caption_totals`` (captions, words)
``qras``           QRA rows -> ``qra_category``, ``qra_problem_type``, ``qra_category_type``,
                   ``qra_mc_answer``
``pass_rate``      PASS_RATE rows -> ``pass_count`` (questions by pass count), ``pass_k``, ``pass_label``,
                   ``pass_split``
``pack_samples``   the pack stage's sample descriptors (or samples read back from shards) ->
                   ``released_*`` (samples/questions per split, category, type, MC answer letter, pass
                   count, frames per video, licences of the released videos)
``shards``         the pack stage's shard infos -> ``shard_bytes``, ``shard_samples``, ``shard_questions``
=================  ==============================================================================
"""
from __future__ import annotations

import json
import math
import re

DIST_PREFIX = "dist:"
DISTRIBUTIONS_VERSION = "1.0"

# Upper edges (exclusive) of histogram bins; the last bin is open ("3600+").
DURATION_EDGES_S = (5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
CAPTION_WORD_EDGES = (10, 20, 40, 60, 80, 120, 160, 240, 320)
MC_LETTERS = ("A", "B", "C", "D")

# section -> (table it comes from, unit counted, description, key order: "bins:<edges name>" (every bin, zeros
# included) | "int" (every integer from 0 to the largest) | "int_sparse" (the integers seen, in numeric order) |
# "enum:<name>" (every allowed value) | "name" (sorted))
SECTIONS: dict[str, dict] = {
    "video_duration_s": {"table": "videos", "unit": "videos", "order": "bins:duration",
                         "description": "Videos by duration in seconds (bins [lo, hi))."},
    "video_totals": {"table": "videos", "unit": "", "order": "name",
                     "description": "Videos and their summed duration in milliseconds."},
    "video_license": {"table": "videos", "unit": "videos", "order": "name",
                      "description": "Videos by licence (\"unknown\" when the input did not say)."},
    "clips_per_video": {"table": "clips", "unit": "videos", "order": "int_sparse",
                        "description": "Videos by their number of clips."},
    "clip_totals": {"table": "clips", "unit": "", "order": "name",
                    "description": "Clips and their summed length in milliseconds."},
    "caption_words": {"table": "captions", "unit": "captions", "order": "bins:caption",
                      "description": "Captions by length in words (bins [lo, hi))."},
    "caption_totals": {"table": "captions", "unit": "", "order": "name",
                       "description": "Captions and their summed length in words."},
    "qra_category": {"table": "qras", "unit": "questions", "order": "enum:category",
                     "description": "Generated questions by category."},
    "qra_problem_type": {"table": "qras", "unit": "questions", "order": "enum:problem_type",
                         "description": "Generated questions by problem type."},
    "qra_category_type": {"table": "qras", "unit": "questions", "order": "name",
                          "description": "Generated questions by category/problem type."},
    "qra_mc_answer": {"table": "qras", "unit": "questions", "order": "enum:letter",
                      "description": "Generated multiple-choice questions by answer letter."},
    "pass_count": {"table": "pass_rate", "unit": "questions", "order": "int",
                   "description": "Scored questions by pass count (passing samples out of k)."},
    "pass_k": {"table": "pass_rate", "unit": "questions", "order": "int_sparse",
               "description": "Scored questions by k (samples per question)."},
    "pass_label": {"table": "pass_rate", "unit": "questions", "order": "enum:label",
                   "description": "Scored questions by difficulty label."},
    "pass_split": {"table": "pass_rate", "unit": "questions", "order": "enum:split",
                   "description": "Scored questions by split (drop = filtered out)."},
    "released_split_samples": {"table": "pack_samples", "unit": "samples", "order": "name",
                               "description": "Released samples (one video in one split) per split."},
    "released_split_questions": {"table": "pack_samples", "unit": "questions", "order": "name",
                                 "description": "Released questions per split."},
    "released_category": {"table": "pack_samples", "unit": "questions", "order": "enum:category",
                          "description": "Released questions by category."},
    "released_problem_type": {"table": "pack_samples", "unit": "questions", "order": "enum:problem_type",
                              "description": "Released questions by problem type."},
    "released_mc_answer": {"table": "pack_samples", "unit": "questions", "order": "enum:letter",
                           "description": "Released multiple-choice questions by answer letter."},
    "released_pass_count": {"table": "pack_samples", "unit": "questions", "order": "int",
                            "description": "Released questions by pass count (when a pass-rate filter ran)."},
    "released_blind_pass_count": {"table": "pack_samples", "unit": "questions", "order": "int",
                                  "description": "Released questions by blind pass count (when the blind filter "
                                                 "ran)."},
    "released_frames_per_video": {"table": "pack_samples", "unit": "videos", "order": "int_sparse",
                                  "description": "Released videos by number of cached frames."},
    "released_license": {"table": "pack_samples", "unit": "videos", "order": "name",
                         "description": "Released videos by licence."},
    "released_attribution": {"table": "pack_samples", "unit": "videos", "order": "name",
                             "description": "Released videos by \"licence | attribution\"."},
    "shard_bytes": {"table": "shards", "unit": "bytes", "order": "name", "description": "Bytes per shard."},
    "shard_samples": {"table": "shards", "unit": "samples", "order": "name", "description": "Samples per shard."},
    "shard_questions": {"table": "shards", "unit": "questions", "order": "name",
                        "description": "Questions per shard."},
}

TABLES = ("videos", "clips", "captions", "qras", "pass_rate", "pack_samples", "shards")


def _enum(name: str) -> tuple[str, ...]:
    from longreel.schemas import CATEGORIES, PROBLEM_TYPES
    return {"category": CATEGORIES, "problem_type": PROBLEM_TYPES, "letter": MC_LETTERS,
            "label": ("easy", "medium", "hard"), "split": ("sft", "rl", "drop")}[name]


def bin_label(value: float, edges: tuple) -> str:
    lo = 0
    for hi in edges:
        if value < hi:
            return f"{lo}-{hi}"
        lo = hi
    return f"{lo}+"


def bin_labels(edges: tuple) -> list[str]:
    labels, lo = [], 0
    for hi in edges:
        labels.append(f"{lo}-{hi}")
        lo = hi
    return labels + [f"{lo}+"]


_EDGES = {"duration": DURATION_EDGES_S, "caption": CAPTION_WORD_EDGES}


def _p(section: str, key, n: int = 1):
    return ((DIST_PREFIX + section, str(key)), int(n))


def _ms(seconds) -> int:
    return int(round(float(seconds) * 1000))


def word_count(text: str) -> int:
    return len(text.split())


def _mc_letter(answer: str) -> str:
    a = (answer or "").strip().upper()
    return a if a in MC_LETTERS else "other"


# ---------------------------------------------------------------------------------------------------------------
# row -> pairs (plain Python; the Beam side and `card verify` share them)
# ---------------------------------------------------------------------------------------------------------------


def video_pairs(v: dict) -> list:
    return [_p("video_duration_s", bin_label(float(v["duration_s"]), DURATION_EDGES_S)),
            _p("video_totals", "videos"), _p("video_totals", "duration_ms", _ms(v["duration_s"])),
            _p("video_license", v.get("license") or "unknown")]


def clip_pairs(c: dict) -> list:
    return [_p("clip_totals", "clips"), _p("clip_totals", "duration_ms", _ms(c["end_s"]) - _ms(c["start_s"]))]


def caption_pairs(c: dict) -> list:
    n = word_count(c["text"])
    return [_p("caption_words", bin_label(n, CAPTION_WORD_EDGES)), _p("caption_totals", "captions"),
            _p("caption_totals", "words", n)]


def qra_pairs(q: dict, prefix: str = "qra") -> list:
    out = [_p(f"{prefix}_category", q["category"]), _p(f"{prefix}_problem_type", q["problem_type"])]
    if prefix == "qra":
        out.append(_p("qra_category_type", f"{q['category']}/{q['problem_type']}"))
    if q["problem_type"] == "multiple_choice":
        out.append(_p(f"{prefix}_mc_answer", _mc_letter(q["answer"])))
    return out


def pass_rate_pairs(r: dict) -> list:
    return [_p("pass_count", int(r["pass_count"])), _p("pass_k", int(r["k"])), _p("pass_label", r["label"]),
            _p("pass_split", r["split"])]


def sample_member_texts(sample: dict) -> dict[str, str]:
    """``{member name: text}`` of a sample descriptor's inline members (``meta.json``, ``qras.json``...)."""
    return {f["name"]: f["text"] for f in sample.get("files", []) if "text" in f}


def released_pairs(sample: dict) -> list:
    """Pairs of one released sample (one video in one split): a pack sample descriptor or a sample read back
    from a shard (``{"split", "key", "files": [{"name", "text"}...]}``)."""
    qras = json.loads(sample_member_texts(sample)["qras.json"])
    split = sample["split"]
    out = [_p("released_split_samples", split), _p("released_split_questions", split, len(qras))]
    for q in qras:
        out += qra_pairs(q, prefix="released")
        pr = q.get("pass_rate")
        if pr and pr.get("pass_count") is not None:
            out.append(_p("released_pass_count", int(pr["pass_count"])))
        if q.get("blind_pass_count") is not None:
            out.append(_p("released_blind_pass_count", int(q["blind_pass_count"])))
    return out


def license_attribution(license: str | None, attribution: str | None) -> str:
    return f"{license or 'unknown'} | {attribution or 'no attribution recorded'}"


def released_video_facts(sample: dict) -> tuple[str, int, str, str]:
    """(video id, cached frames, licence, attribution) of a released sample: counted once per video across
    splits."""
    meta = json.loads(sample_member_texts(sample)["meta.json"])
    return (meta["video_id"], int(meta["num_frames"]), meta.get("license") or "unknown",
            meta.get("attribution") or "")


def video_fact_pairs(fact: tuple) -> list:
    _vid, frames, lic, attribution = fact
    return [_p("released_frames_per_video", frames), _p("released_license", lic),
            _p("released_attribution", license_attribution(lic, attribution))]


def shard_pairs(info: dict) -> list:
    url = info["url"]
    return [_p("shard_bytes", url, info["bytes"]), _p("shard_samples", url, info["nsamples"]),
            _p("shard_questions", url, info.get("nquestions", 0))]


_ROW_PAIRS = {"videos": video_pairs, "clips": clip_pairs, "captions": caption_pairs, "qras": qra_pairs,
              "pass_rate": pass_rate_pairs, "pack_samples": released_pairs, "shards": shard_pairs}


def pairs_for_rows(table: str, rows) -> list:
    """Every pair a table contributes, computed without Beam (tests, ``card build`` from tables, ``verify``)."""
    rows = list(rows)
    out = []
    for r in rows:
        out += _ROW_PAIRS[table](r)
    if table == "clips":
        per_video: dict[str, int] = {}
        for c in rows:
            per_video[c["video_id"]] = per_video.get(c["video_id"], 0) + 1
        out += [_p("clips_per_video", n) for n in per_video.values()]
    if table == "pack_samples":
        facts = sorted({released_video_facts(s) for s in rows})
        out += [p for f in facts for p in video_fact_pairs(f)]
    return out


def sum_pairs(pairs) -> list:
    acc: dict = {}
    for k, n in pairs:
        acc[k] = acc.get(k, 0) + n
    return sorted(acc.items())


# ---------------------------------------------------------------------------------------------------------------
# Beam
# ---------------------------------------------------------------------------------------------------------------


def add_distributions(tables: dict, label: str = "Dist"):
    """``{table name: PCollection of rows}`` -> PCollection of ``(("dist:<section>", key), n)`` pairs.

    Flatten the result with the funnel pairs into the pipeline's :class:`longreel.pipelines.stats.WriteStats`: the
    pairs are summed per key there and folded into ``stats.json["distributions"]``. Table names are those of
    :data:`TABLES`; an unknown name is an error (a typo would silently drop a section from the card).
    """
    import apache_beam as beam

    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise ValueError(f"add_distributions: unknown table(s) {unknown}; known: {list(TABLES)}")
    if not tables:
        raise ValueError("add_distributions: no tables given")
    parts = []
    for name in TABLES:
        if name not in tables or tables[name] is None:
            continue
        pc = tables[name]
        tag = f"{label}{''.join(w.capitalize() for w in name.split('_'))}"
        parts.append(pc | f"{tag}Pairs" >> beam.FlatMap(_ROW_PAIRS[name]))
        if name == "clips":
            parts.append(pc
                         | f"{tag}ByVideo" >> beam.Map(lambda c: (c["video_id"], 1))
                         | f"{tag}SumByVideo" >> beam.CombinePerKey(sum)
                         | f"{tag}PerVideo" >> beam.Map(lambda kv: _p("clips_per_video", kv[1])))
        if name == "pack_samples":
            parts.append(pc
                         | f"{tag}VideoFacts" >> beam.Map(released_video_facts)
                         | f"{tag}DistinctVideos" >> beam.Distinct()
                         | f"{tag}VideoPairs" >> beam.FlatMap(video_fact_pairs))
    return tuple(parts) | f"{label}Flatten" >> beam.Flatten()


# ---------------------------------------------------------------------------------------------------------------
# folding into stats.json
# ---------------------------------------------------------------------------------------------------------------


def _num(key: str) -> float:
    m = re.match(r"^-?\d+(\.\d+)?", key)
    return float(m.group(0)) if m else math.inf


def order_counts(section: str, counts: dict[str, int]) -> dict[str, int]:
    """Counts in the section's order, with the zero bins / enum values / integers in range filled in."""
    order = SECTIONS.get(section, {}).get("order", "name")
    if order.startswith("bins:"):
        labels = bin_labels(_EDGES[order.split(":", 1)[1]])
        return {**{b: int(counts.get(b, 0)) for b in labels},
                **{k: int(v) for k, v in sorted(counts.items()) if k not in labels}}
    if order.startswith("enum:"):
        values = _enum(order.split(":", 1)[1])
        return {**{v: int(counts.get(v, 0)) for v in values},
                **{k: int(v) for k, v in sorted(counts.items()) if k not in values}}
    if order == "int_sparse":
        ints = sorted((k for k in counts if re.fullmatch(r"-?\d+", k)), key=int)
        return {**{k: int(counts[k]) for k in ints}, **{k: int(v) for k, v in sorted(counts.items()) if k not in ints}}
    if order == "int":
        ints = sorted(int(k) for k in counts if re.fullmatch(r"-?\d+", k))
        if ints:
            lo, hi = min(0, ints[0]), ints[-1]
            filled = {str(i): int(counts.get(str(i), 0)) for i in range(lo, hi + 1)} if hi - lo <= 1024 else \
                {str(i): int(counts[str(i)]) for i in ints}
        else:
            filled = {}
        return {**filled, **{k: int(v) for k, v in sorted(counts.items()) if k not in filled}}
    return {k: int(counts[k]) for k in sorted(counts)}


def fold_distributions(pairs) -> dict:
    """Summed ``(("dist:<section>", key), n)`` pairs -> the ``"distributions"`` block of ``stats.json``."""
    by: dict[str, dict[str, int]] = {}
    for (section, key), n in pairs:
        if not section.startswith(DIST_PREFIX):
            raise ValueError(f"not a distribution pair: {section!r}")
        s = section[len(DIST_PREFIX):]
        by.setdefault(s, {})
        by[s][key] = by[s].get(key, 0) + int(n)
    sections = {}
    for s in sorted(by, key=lambda s: (list(SECTIONS).index(s) if s in SECTIONS else len(SECTIONS), s)):
        spec = SECTIONS.get(s, {})
        sections[s] = {"table": spec.get("table"), "unit": spec.get("unit", ""),
                       "description": spec.get("description", ""), "counts": order_counts(s, by[s])}
    return {"schema_version": DISTRIBUTIONS_VERSION, "sections": sections}


#: the table(s) a stage's rows go to, by its stats.json name: a stage run alone on an output directory rewrites them, so
#: the sections computed from them before are stale (:func:`drop_stale_sections`)
STAGE_TABLES = {"caption": ("captions",), "qra": ("qras",), "passrate": ("pass_rate",),
                "pack_write": ("pack_samples", "shards")}


def drop_stale_sections(distributions: dict | None, stages) -> dict | None:
    """``distributions`` without the sections read from a table that one of ``stages`` rewrote: a stage run alone
    (``longreel qra``, ``pack``...) computes none, and its older ones would describe rows that are gone, which
    ``longreel card build`` then published and ``card verify`` refused. A missing section is computed by
    ``card build`` from the tables or shards instead."""
    stale = {t for s in stages for t in STAGE_TABLES.get(s, ())}
    if not distributions or not stale:
        return distributions
    sections = {k: v for k, v in distributions.get("sections", {}).items()
                if SECTIONS.get(k, {}).get("table", v.get("table")) not in stale}
    return {**distributions, "sections": sections}


def merge_distributions(old: dict | None, new: dict | None) -> dict | None:
    """Sections in ``new`` replace those in ``old``; the others are kept (a stage run alone adds its own)."""
    if not old:
        return new
    if not new:
        return old
    sections = {**old.get("sections", {}), **new.get("sections", {})}
    ordered = sorted(sections, key=lambda s: (list(SECTIONS).index(s) if s in SECTIONS else len(SECTIONS), s))
    return {"schema_version": new.get("schema_version", DISTRIBUTIONS_VERSION),
            "sections": {s: sections[s] for s in ordered}}


def distributions_from_rows(tables: dict) -> dict:
    """The ``"distributions"`` block for ``{table: rows}`` computed without Beam."""
    pairs = []
    for name, rows in tables.items():
        if name not in _ROW_PAIRS:
            raise ValueError(f"unknown table {name!r}")
        pairs += pairs_for_rows(name, rows)
    return fold_distributions(sum_pairs(pairs))
