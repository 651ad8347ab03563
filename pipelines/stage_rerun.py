"""What a stage run alone on an existing output directory writes besides its own tables, and the check that it has
videos to read before it replaces any.

Its rejects replace that stage's earlier rejects (other stages' rows are kept, so re-runs are
idempotent) and its funnel entries are merged into ``stats.json`` after the stages already there.
"""
from __future__ import annotations

import logging
import os

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.io.parquet_sink import WriteSortedParquet, read_table
from longreel.pipelines.stats import PIPELINE_ORDER, WriteStats, read_json

log = logging.getLogger("longreel")


class VideosNotFound(FileNotFoundError):
    """None of a run's videos is at the path its videos table recorded."""


def _exists(uri: str) -> bool:
    if "://" not in uri:
        return os.path.isfile(uri)
    try:
        return FileSystems.exists(uri)
    except ValueError:  # http(s): not a Beam filesystem; the stage's own fetch says whether it is there
        return True


def check_videos_reachable(videos: list[dict], out_dir: str, stage: str, table: str) -> None:
    """Refuse a stage run alone that would decode none of its videos, before it writes anything.

    Such a run (on another machine, after the videos moved) rejects every item as unreadable and replaces
    ``table`` with an empty one: the stage's earlier output would be lost to a mount that is missing. A run with
    some videos missing goes ahead (each missing one's items become rejects, as in curate) and is warned about up
    front. The search stops at the first video found, so a healthy run pays one existence check; only local
    paths are all checked for the warning (a remote check per video costs a request)."""
    if not videos:
        return
    uris = [str(v.get("uri") or "") for v in videos]
    if not any(_exists(u) for u in uris if u):
        raise VideosNotFound(
            f"none of the {len(uris)} videos in {out_dir}'s videos table is at its recorded path (first: "
            f"{uris[0] or '(no uri)'}): {stage} would reject every one and replace {table}-* with an empty table, so "
            "nothing was written. Make the videos reachable at those paths (mount or copy them) and run again.")
    missing = [u for u in uris if u and "://" not in u and not os.path.isfile(u)]
    if missing:
        log.warning("%s: %d of %d videos are not at their recorded paths (first: %s); their items become rejects",
                    stage, len(missing), len(uris), missing[0])


def _stage_order(old: list[str], stages: list[str]) -> list[str]:
    """The funnel's stage order after re-running ``stages``: pipeline order, as ``curate`` with every stage lays it
    out (a caption re-run stays before qra, a filter run after curate goes before pack), so the funnel and exit
    3's "what the stages before rejected" read as the data flowed; a stage no pipeline knows goes last."""
    canonical = {s: i for i, s in enumerate(PIPELINE_ORDER)}
    merged = [s for s in old if s not in stages] + list(stages)
    return sorted(merged, key=lambda s: canonical.get(s, len(canonical)))


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
    order = _stage_order([s["stage"] for s in old.get("stages", [])], stages)
    kept = p | "OtherRejects" >> beam.Create(earlier)
    ((kept, rejects) | "AllRejects" >> beam.Flatten()
     | "WriteRejects" >> WriteSortedParquet(out_dir, "rejects", "reject", shards))
    counts | "WriteStats" >> WriteStats(FileSystems.join(out_dir, "stats.json"), order, units, meta, finish=finish,
                                        merge=True, extras=extras)
