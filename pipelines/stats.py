"""Funnel statistics computed as data (a PCollection combined per key), never read back from metrics.

Each stage contributes ``((stage, metric), count)`` pairs: ``in``, ``out`` and one
``rejected:<reason>`` per reason. They are summed per key and folded into one ``stats.json``
with a schema version, so that ``in == out + sum(rejected)`` can be checked for every stage.

Distributions for the data card (:mod:`longreel.pipelines.distributions`) travel the same way as
``(("dist:<section>", key), n)`` pairs and are folded into ``stats.json["distributions"]``; a document
without such pairs is unchanged.

What depends on the execution rather than on the config and the inputs is kept out of every data table
(and out of rejects' details), so that re-running the same config on the same inputs rewrites identical
bytes: wall-clock time (a model's latency per clip) and reuse of what an earlier run left in the output
directory (frame-cache hits). Stages report it as ``(("run:<stage>", metric), n)`` pairs (:func:`run_count`,
:func:`timing_pairs`), folded into ``stats.json["run"][<stage>]``: summed per metric, plus
``latency_mean_s = latency_total_s / timed`` for timed stages. ``run`` (:data:`RUN_KEY`) is the one part of
``stats.json`` that differs between two runs of the same config and inputs (:data:`NONDETERMINISTIC_KEYS`);
everything else in it, and every other output file, is the same bytes.

The same funnel pairs also tick Beam counters (:data:`COUNTER_NAMESPACE`, ``<stage>/<metric>``: ``ingest/in``,
``ingest/out``, ``ingest/rejected:not_found``, ``segment/clips``...) as they are produced, so that a runner's UI
(Dataflow, Flink) shows the funnel while the job runs. They are for watching: a runner may count a retried bundle
twice, so ``stats.json`` stays the record (:func:`funnel_from_metrics` reads the counters back).
"""
from __future__ import annotations

import json
import weakref

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter

from longreel.schemas.atomic import write_atomic

STATS_VERSION = "1.0"


def _metric(stage: str, metric: str):
    return lambda _: ((stage, metric), 1)


def stage_counts(label: str, stage: str, inputs, main, rejects, out_units=None):
    """PCollection of ``((stage, metric), 1)`` pairs for one stage, summed later by :class:`WriteStats`.

    ``out_units`` (optional) maps a main row to the unit the stage counts in (for example the
    video id of a clip, so that ``segment`` counts videos in and videos out). A metric with no
    pairs is 0 in the document (every stage always reports ``in`` and ``out``).
    """
    n_in = inputs | f"{label}CountIn" >> beam.Map(_metric(stage, "in"))
    units = main
    if out_units is not None:
        units = main | f"{label}OutUnits" >> beam.Map(out_units) | f"{label}DistinctOut" >> beam.Distinct()
    n_out = units | f"{label}CountOut" >> beam.Map(_metric(stage, "out"))
    by_reason = rejects | f"{label}KeyReasons" >> beam.Map(lambda r: ((stage, "rejected:" + r["reason"]), 1))
    # A zero pair marks the stage as counted by this run even when nothing reached it (a merge must then
    # replace the stage's old numbers with zeros rather than keep them).
    present = one_element(inputs.pipeline) | f"{label}Present" >> beam.Map(lambda _, s=stage: ((s, "in"), 0))
    return (n_in, n_out, by_reason, present) | f"{label}Flatten" >> beam.Flatten()


_ONE_ELEMENT: "weakref.WeakKeyDictionary[beam.Pipeline, beam.PCollection]" = weakref.WeakKeyDictionary()


def one_element(pipeline: beam.Pipeline) -> beam.PCollection:
    """A PCollection of one ``None``, made once per pipeline, for the elements that must exist whatever the data
    (each stage's zero marker, :class:`WriteStats`'s seed). Every step reading it runs in one stage of the runner;
    a ``Create`` each was a stage each, and the local runner runs stages one at a time (ten of them took 0.2-0.3 s
    of a 14-video demo run)."""
    pc = _ONE_ELEMENT.get(pipeline)
    if pc is None:
        pc = _ONE_ELEMENT[pipeline] = pipeline | "OneElement" >> beam.Create([None])
    return pc


def extra_count(label: str, stage: str, metric: str, pcoll):
    """A further count a stage reports (for example ``clips`` for segment)."""
    return pcoll | f"{label}Count" >> beam.Map(_metric(stage, metric))


DIST_PREFIX = "dist:"
RUN_PREFIX = "run:"
RUN_KEY = "run"
#: The keys of ``stats.json`` whose values differ between two runs of the same config and inputs.
NONDETERMINISTIC_KEYS = (RUN_KEY,)


def run_count(stage: str, metric: str, n=1) -> tuple:
    """A pair for ``stats.json["run"][stage][metric]`` (what this execution did, e.g. a frame-cache hit)."""
    return ((RUN_PREFIX + stage, metric), n)


def timing_pairs(label: str, stage: str, seconds):
    """PCollection of wall-clock seconds (one float per timed item, e.g. a model call's latency per clip) ->
    pairs that :class:`WriteStats` folds into ``stats.json["run"][stage]`` as ``timed``, ``latency_total_s``
    and ``latency_mean_s`` (never into the funnel or a table)."""
    return seconds | f"{label}TimingPairs" >> beam.FlatMap(
        lambda s: [run_count(stage, "timed"), run_count(stage, "latency_total_s", float(s))])


def fold_run(pairs: list) -> dict:
    """``run:`` pairs -> ``{stage: {metric: n}}`` (sorted), with ``latency_mean_s`` for timed stages."""
    acc: dict[str, dict] = {}
    for (stage, metric), v in pairs:
        st = acc.setdefault(stage[len(RUN_PREFIX):], {})
        st[metric] = st.get(metric, 0) + v
    out = {}
    for stage in sorted(acc):
        st = dict(sorted(acc[stage].items()))
        if "latency_total_s" in st:
            st["latency_total_s"] = round(float(st["latency_total_s"]), 6)
            n = st.get("timed", 0)
            st["latency_mean_s"] = round(st["latency_total_s"] / n, 6) if n else 0.0
        out[stage] = st
    return out


def _is_side_pair(p) -> bool:
    """A distribution or run pair (not a funnel count)."""
    return str(p[0][0]).startswith((DIST_PREFIX, RUN_PREFIX))


def build_stats(pairs: list, stage_order: list[str], units: dict[str, str], meta: dict) -> dict:
    """Fold summed pairs into the stats document (a pure function; tested directly).

    Pairs whose first element starts with ``dist:`` are distributions: they go to ``"distributions"``
    (present only when there are any), never into the funnel; ``run:`` pairs go to ``"run"`` (the same)."""
    dist_pairs = [p for p in pairs if str(p[0][0]).startswith(DIST_PREFIX)]
    run = [p for p in pairs if str(p[0][0]).startswith(RUN_PREFIX)]
    pairs = [p for p in pairs if not _is_side_pair(p)]
    stages = {s: {"stage": s, "unit": units.get(s, "item"), "in": 0, "out": 0, "rejected": {}, "extra": {}}
              for s in stage_order}
    for (stage, metric), n in pairs:
        st = stages.setdefault(stage, {"stage": stage, "unit": units.get(stage, "item"), "in": 0, "out": 0,
                                       "rejected": {}, "extra": {}})
        if metric in ("in", "out"):
            st[metric] += n
        elif metric.startswith("rejected:"):
            reason = metric.split(":", 1)[1]
            st["rejected"][reason] = st["rejected"].get(reason, 0) + n
        else:
            st["extra"][metric] = st["extra"].get(metric, 0) + n
    ordered = [stages[s] for s in stage_order] + [v for k, v in sorted(stages.items()) if k not in stage_order]
    for st in ordered:
        st["rejected"] = dict(sorted(st["rejected"].items()))
        st["rejected_total"] = sum(st["rejected"].values())
        st["balanced"] = st["in"] == st["out"] + st["rejected_total"]
    doc = {"schema_version": STATS_VERSION, "kind": "longreel-funnel", **meta, "stages": ordered}
    if dist_pairs:
        from longreel.pipelines.distributions import fold_distributions
        doc["distributions"] = fold_distributions(dist_pairs)
    if run:
        doc[RUN_KEY] = fold_run(run)
    return doc


def read_json(path: str) -> dict | None:
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path, compression_type="uncompressed") as fh:
        return json.loads(fh.read())


def merge_stats(old: dict | None, new: dict, stage_order: list[str] | None = None,
                computed: set[str] | None = None) -> dict:
    """Replace ``old``'s entries for the stages this run computed, keep the others (a stage run alone
    on an existing output directory adds itself to that directory's funnel).

    ``computed`` names the stages the run counted; a stage ``new`` only lists for ordering (with zero
    counts) keeps its old entry. ``None`` means every stage ``new`` lists.
    """
    if not old:
        return new
    replaced = {s["stage"] for s in new["stages"]} if computed is None else set(computed)
    new_by = {s["stage"]: s for s in new["stages"]}
    old_names = {s["stage"] for s in old["stages"]}
    # Old stages keep their places (a replaced one is swapped in place); stages new to the document follow.
    stages = [new_by[s["stage"]] if s["stage"] in replaced and s["stage"] in new_by else s for s in old["stages"]]
    stages += [s for s in new["stages"] if s["stage"] not in old_names]
    if stage_order:
        rank = {s: i for i, s in enumerate(stage_order)}
        if all(s["stage"] in rank for s in stages):
            stages.sort(key=lambda s: rank[s["stage"]])
    merged = {**old, **{k: v for k, v in new.items() if k != "stages"}, "stages": stages}
    if old.get("distributions"):
        from longreel.pipelines.distributions import drop_stale_sections, merge_distributions
        merged["distributions"] = merge_distributions(drop_stale_sections(old["distributions"], replaced),
                                                      new.get("distributions"))
    # run: the stages this run computed replace (or drop) their old entries; the others keep theirs
    run = {s: v for s, v in (old.get(RUN_KEY) or {}).items() if s not in replaced}
    run.update(new.get(RUN_KEY) or {})
    merged.pop(RUN_KEY, None)
    if run:
        merged[RUN_KEY] = dict(sorted(run.items()))
    return merged


COUNTER_NAMESPACE = "longreel"


class _TickCounters(beam.DoFn):
    """Funnel pairs -> Beam counters (distribution and run pairs are not funnel counts, and are not ints)."""

    def process(self, pair):
        (stage, metric), n = pair
        if not _is_side_pair(pair):
            Metrics.counter(COUNTER_NAMESPACE, f"{stage}/{metric}").inc(n)
        return ()


def funnel_from_metrics(result) -> dict[tuple[str, str], int]:
    """``{(stage, metric): n}`` from a finished pipeline's counters (summed over the steps that tick each)."""
    out: dict[tuple[str, str], int] = {}
    for c in result.metrics().query(MetricsFilter().with_namespace(COUNTER_NAMESPACE))["counters"]:
        stage, metric = c.key.metric.name.split("/", 1)
        out[(stage, metric)] = out.get((stage, metric), 0) + c.committed
    return out


def write_json(path: str, doc: dict) -> str:
    return write_atomic(path, json.dumps(doc, indent=2, sort_keys=False) + "\n")


class WriteStats(beam.PTransform):
    """pairs -> ``stats.json`` (``finish`` may add totals computed from the folded document).

    ``extras``: ``{key: singleton PCollection}``; each value is put under ``doc[key]`` (a stage's summary that is
    not a funnel count, e.g. the pack's shard sizes)."""

    def __init__(self, path: str, stage_order: list[str], units: dict[str, str], meta: dict, finish=None,
                 merge: bool = False, extras: dict | None = None):
        super().__init__()
        self.path, self.stage_order, self.units, self.meta, self.finish = path, stage_order, units, meta, finish
        self.merge = merge
        self.extras = dict(extras or {})

    def expand(self, pairs):
        finish = self.finish
        extra_keys = sorted(self.extras)

        def fold(items, *extra_values):
            doc = build_stats(items, self.stage_order, self.units, self.meta)
            if self.merge:
                computed = {stage for (stage, _), _ in items if not stage.startswith((DIST_PREFIX, RUN_PREFIX))}
                doc = merge_stats(read_json(self.path), doc, self.stage_order, computed)
            doc.update(zip(extra_keys, extra_values))
            if finish is not None:
                doc = finish(doc)
            return write_json(self.path, doc)

        pairs | "Counters" >> beam.ParDo(_TickCounters())
        # One always-present element, so that the document is written even when no stage saw any input.
        seed = one_element(pairs.pipeline) | "Seed" >> beam.Map(lambda _: (("_", "_"), 0))
        side = [beam.pvalue.AsSingleton(self.extras[k]) for k in extra_keys]
        return ((pairs, seed) | "WithSeed" >> beam.Flatten()
                | "SumPerKey" >> beam.CombinePerKey(sum)
                | "DropSeed" >> beam.Filter(lambda kv: kv[0] != ("_", "_"))
                | "Collect" >> beam.combiners.ToList()
                | "Fold" >> beam.Map(lambda items: sorted(items))
                | "Write" >> beam.Map(fold, *side))


#: every funnel stage in pipeline order (``curate``'s layout with every optional stage; a test holds them equal): where
#: a stage run alone puts a stage new to a run's funnel
PIPELINE_ORDER = ("ingest", "dedup", "segment", "clip_facts", "clip_filter", "caption", "align", "clip_dedup",
                  "qra_context", "qra", "qra_refine", "qra_balance", "question_dedup", "judge", "blind", "passrate",
                  "pack_select", "frame_cache", "pack_write")


# What a stage hands on, for the "nothing survived" check: (stage, what its ``out`` counts).
PRODUCTS = {"segment": "videos with clips", "caption": "captions", "qra": "questions",
            "blind": "questions kept by the blind filter", "passrate": "questions kept by the pass-rate filter",
            "pack_write": "questions packed into shards"}


def _upstream_rejects(doc: dict, name: str) -> str:
    """What the stages before ``name`` rejected, when ``name`` itself rejected nothing: it got nothing to work on
    (every clip rejected by clip_facts before the captioner), which "none rejected" misstated."""
    parts = []
    for s in doc.get("stages", []):
        if s["stage"] == name:
            break
        if s["rejected"]:
            parts.append(f"{s['stage']} rejected " + ", ".join(f"{r} {n}" for r, n in sorted(s["rejected"].items())))
    return "; ".join(parts) if parts else "none rejected"


def nothing_survived(doc: dict, stages: list[str]) -> str | None:
    """The first of ``stages`` (names of :data:`PRODUCTS`) whose output is empty, described for a person; None
    when each has at least one. The CLI exits 3 on it: the run finished, but left nothing to use."""
    by = {s["stage"]: s for s in doc.get("stages", [])}
    for name in stages:
        st = by.get(name)
        if st is None or st["out"] > 0:
            continue
        if name == "segment" and "totals" in doc:
            reasons: dict[str, int] = {}
            for s in doc["stages"]:
                if s["stage"] in ("ingest", "dedup", "segment"):
                    for r, n in s["rejected"].items():
                        reasons[r] = reasons.get(r, 0) + n
            n_in = doc["totals"]["videos_in"]
        else:
            reasons, n_in = st["rejected"], st["in"]
        why = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or _upstream_rejects(doc, name)
        return f"0 {PRODUCTS.get(name, name + ' outputs')} from {n_in} in ({why})"
    return None
