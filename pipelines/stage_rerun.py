"""What a stage run alone on an existing output directory writes besides its own tables.

Its rejects replace that stage's earlier rejects (other stages' rows are kept, so re-runs are
idempotent) and its funnel entries are merged into ``stats.json`` after the stages already there.
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.io.parquet_sink import WriteSortedParquet, read_table
from longreel.pipelines.stats import WriteStats, read_json


def write_rerun_outputs(p, out_dir: str, stages: list[str], units: dict[str, str], rejects, counts, meta: dict,
                        shards: int = 1, *, finish=None, extras: dict | None = None) -> None:
    """Add to ``p`` the rejects table (earlier rows of other stages + ``rejects``) and the merged ``stats.json``.

    ``finish`` / ``extras``: as in :class:`~longreel.pipelines.stats.WriteStats` (totals from the folded document;
    singleton PCollections put under their keys)."""
    try:
        earlier = [r for r in read_table(out_dir, "rejects").to_pylist() if r["stage"] not in stages]
    except FileNotFoundError:
        earlier = []
    old = read_json(FileSystems.join(out_dir, "stats.json")) or {}
    order = [s["stage"] for s in old.get("stages", []) if s["stage"] not in stages] + list(stages)
    kept = p | "OtherRejects" >> beam.Create(earlier)
    ((kept, rejects) | "AllRejects" >> beam.Flatten()
     | "WriteRejects" >> WriteSortedParquet(out_dir, "rejects", "reject", shards))
    counts | "WriteStats" >> WriteStats(FileSystems.join(out_dir, "stats.json"), order, units, meta, finish=finish,
                                        merge=True, extras=extras)
