"""Deterministic, retry-safe Parquet output for a stage (in the manner of TFDS's BeamWriter).

Rows are assigned to a fixed number of shards by a hash of their key, grouped, sorted
inside the shard, written under a temporary name and renamed. A retried bundle rewrites
the same bytes; a re-run into the same directory replaces the files and removes shards of
the same table left by an earlier run with another shard count. Every shard is written
even when it is empty, so a downstream stage can always read the table.
"""
from __future__ import annotations

import hashlib
import io
import json

import apache_beam as beam
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from longreel.schemas import KINDS, to_table
from longreel.schemas.atomic import write_atomic


def shard_of(key: str, num_shards: int) -> int:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % num_shards


def shard_name(out_dir: str, table: str, index: int, num_shards: int) -> str:
    return FileSystems.join(out_dir, f"{table}-{index:05d}-of-{num_shards:05d}.parquet")


def row_sort_key(kind_key: str, row: dict) -> tuple:
    return (str(row.get(kind_key)), json.dumps(row, sort_keys=True, default=str))


def write_parquet_atomic(path: str, table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_atomic(path, buf.getvalue())


class _WriteShard(beam.DoFn):
    def __init__(self, out_dir: str, table: str, kind: str, num_shards: int):
        self.out_dir, self.table, self.kind, self.num_shards = out_dir, table, kind, num_shards

    def process(self, element):
        index, group = element
        rows = [r for r in group if r is not None]
        k = KINDS[self.kind]
        rows.sort(key=lambda r: row_sort_key(k.key, r))
        path = shard_name(self.out_dir, self.table, index, self.num_shards)
        write_parquet_atomic(path, to_table(k, rows))
        yield path


def _remove_stale(paths, out_dir: str, table: str):
    keep = set(paths)
    pattern = FileSystems.join(out_dir, f"{table}-*-of-*.parquet")
    stale = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list if m.path not in keep]
    if stale:
        FileSystems.delete(stale)
    return sorted(keep)


class WriteSortedParquet(beam.PTransform):
    """rows (dicts of record kind ``kind``) -> ``{out_dir}/{table}-NNNNN-of-NNNNN.parquet``; outputs the paths."""

    def __init__(self, out_dir: str, table: str, kind: str, num_shards: int = 1):
        super().__init__()
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        self.out_dir, self.table, self.kind, self.num_shards = out_dir, table, kind, num_shards

    def expand(self, rows):
        key_field = KINDS[self.kind].key
        n = self.num_shards
        keyed = rows | "KeyByShard" >> beam.Map(lambda r: (shard_of(str(r[key_field]), n), r))
        # A None marker per shard makes every shard present after grouping, so empty shards are written too.
        every = rows.pipeline | "AllShards" >> beam.Create([(i, None) for i in range(n)])
        grouped = (keyed, every) | "WithMarkers" >> beam.Flatten() | "GroupShards" >> beam.GroupByKey()
        paths = grouped | "WriteShards" >> beam.ParDo(_WriteShard(self.out_dir, self.table, self.kind, n))
        return (paths
                | "AllPaths" >> beam.combiners.ToList()
                | "RemoveStale" >> beam.Map(_remove_stale, self.out_dir, self.table))


def read_table(out_dir: str, table: str):
    """Read every shard of a stage's table as one pyarrow Table (sorted shard order)."""
    import pyarrow as pa

    pattern = FileSystems.join(out_dir, f"{table}-*-of-*.parquet")
    paths = sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list)
    if not paths:
        raise FileNotFoundError(f"no {table} table under {out_dir} (looked for {pattern})")
    tables = []
    for p in paths:
        with FileSystems.open(p, compression_type="uncompressed") as fh:
            tables.append(pq.read_table(io.BytesIO(fh.read())))
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]
