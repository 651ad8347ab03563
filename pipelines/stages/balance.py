"""Funnel stage ``qra_balance`` of the QRA stage: multiple-choice options permuted with a seeded, recorded
permutation and the answer remapped (:mod:`longreel.pipelines.gates.options`); options that depend on their position
are rejected ``position_dependent_option``. Unit: question; ``in == out + rejected``; ``extra``: ``shuffled``
(multiple-choice rows permuted), ``passed_through`` (other rows, or every row when the step is off)."""
from __future__ import annotations

import apache_beam as beam
from apache_beam.pvalue import TaggedOutput

from longreel.pipelines.gates.options import STAGE, balance
from longreel.pipelines.stages.base import MAIN, REJECTS, checked, rejected

COUNTS = "counts"


class _BalanceFn(beam.DoFn):
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def process(self, row):
        if not self.enabled:
            yield TaggedOutput(COUNTS, ((STAGE, "passed_through"), 1))
            yield row
            return
        out, reason, message = balance(row)
        if out is None:
            yield rejected(STAGE, row["qra_id"], reason, message, video_id=row["video_id"])
            return
        yield TaggedOutput(COUNTS, ((STAGE, "shuffled" if out.get("option_permutation") else "passed_through"), 1))
        yield checked(STAGE, "qra", out, out["qra_id"])


class BalanceOptions(beam.PTransform):
    """qra rows -> ``{"main": balanced rows, "rejects", "counts": funnel + extra pairs}``."""

    def __init__(self, enabled: bool = True, label: str = "Balance"):
        super().__init__()
        self.enabled, self.label = enabled, label

    def expand(self, qras):
        from longreel.pipelines.stats import stage_counts

        out = qras | "Permute" >> beam.ParDo(_BalanceFn(self.enabled)).with_outputs(REJECTS, COUNTS, main=MAIN)
        funnel = stage_counts(self.label, STAGE, qras, out[MAIN], out[REJECTS])
        counts = (funnel, out[COUNTS]) | "Counts" >> beam.Flatten()
        return {MAIN: out[MAIN], REJECTS: out[REJECTS], COUNTS: counts}
