"""Deterministic, retry-safe Parquet output for a stage (in the manner of TFDS's BeamWriter).

Rows are assigned to shards by a hash of their key, grouped, sorted inside the shard, written
under a temporary name and renamed. A retried bundle rewrites the same bytes; a re-run into the
same directory replaces the files and removes shards of the same table left by an earlier run with
another shard count. Every shard is written even when it is empty, so a downstream stage can always
read the table.

The shard count is given, or follows the table's size (``num_shards=None``): the rows' total size is
summed first and the count is one shard per :data:`TARGET_SHARD_BYTES`, as TFDS's BeamWriter sizes its
shards from the data. A shard is what one worker holds and sorts in memory, so no worker holds a whole
large table. The count depends only on the rows, so the same rows give the same files.
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


#: Rows (as their JSON text) per shard when the count follows the size: a shard is sorted in one worker's memory.
TARGET_SHARD_BYTES = 256 << 20
#: More shards than this would be mostly file overhead; a table this large sets ``parquet_shards`` itself.
MAX_AUTO_SHARDS = 4096


def shard_of(key: str, num_shards: int) -> int:
    """Stable across processes and Python versions (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % num_shards


def shard_name(out_dir: str, table: str, index: int, num_shards: int) -> str:
    return FileSystems.join(out_dir, f"{table}-{index:05d}-of-{num_shards:05d}.parquet")


def row_sort_key(kind_key: str, row: dict) -> tuple:
    return (str(row.get(kind_key)), json.dumps(row, sort_keys=True, default=str))


def row_bytes(row: dict) -> int:
    """A row's size for sizing shards (its JSON text: cheap, and proportional to what the shard holds)."""
    return len(json.dumps(row, default=str))


def shards_for(total_bytes: int, target_shard_bytes: int = TARGET_SHARD_BYTES) -> int:
    """The shard count for a table of ``total_bytes``: at least 1, about ``target_shard_bytes`` each."""
    return max(1, min(MAX_AUTO_SHARDS, -(-total_bytes // target_shard_bytes)))


def write_parquet_atomic(path: str, table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_atomic(path, buf.getvalue())


class _WriteShard(beam.DoFn):
    def __init__(self, out_dir: str, table: str, kind: str):
        self.out_dir, self.table, self.kind = out_dir, table, kind

    def process(self, element, num_shards: int):
        index, group = element
        rows = [r for r in group if r is not None]
        k = KINDS[self.kind]
        rows.sort(key=lambda r: row_sort_key(k.key, r))
        path = shard_name(self.out_dir, self.table, index, num_shards)
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
    """rows (dicts of record kind ``kind``) -> ``{out_dir}/{table}-NNNNN-of-NNNNN.parquet``; outputs the paths.

    ``num_shards``: the number of files, or None for one per ``target_shard_bytes`` of rows (see the module)."""

    def __init__(self, out_dir: str, table: str, kind: str, num_shards: int | None = 1,
                 target_shard_bytes: int = TARGET_SHARD_BYTES):
        super().__init__()
        if num_shards is not None and num_shards < 1:
            raise ValueError("num_shards must be >= 1 (or None: follow the table's size)")
        if target_shard_bytes < 1:
            raise ValueError("target_shard_bytes must be >= 1")
        self.out_dir, self.table, self.kind, self.num_shards = out_dir, table, kind, num_shards
        self.target_shard_bytes = target_shard_bytes

    def _shard_count(self, rows):
        """A one-element PCollection: the shard count."""
        if self.num_shards is not None:
            return rows.pipeline | "ShardCount" >> beam.Create([self.num_shards])
        target = self.target_shard_bytes
        return (rows
                | "RowBytes" >> beam.Map(row_bytes)
                | "TableBytes" >> beam.CombineGlobally(sum)
                | "ShardCount" >> beam.Map(shards_for, target))

    def expand(self, rows):
        key_field = KINDS[self.kind].key
        count = self._shard_count(rows)
        n = beam.pvalue.AsSingleton(count)
        keyed = rows | "KeyByShard" >> beam.Map(lambda r, n: (shard_of(str(r[key_field]), n), r), n)
        # A None marker per shard makes every shard present after grouping, so empty shards are written too.
        every = count | "AllShards" >> beam.FlatMap(lambda n: [(i, None) for i in range(n)])
        grouped = (keyed, every) | "WithMarkers" >> beam.Flatten() | "GroupShards" >> beam.GroupByKey()
        paths = grouped | "WriteShards" >> beam.ParDo(_WriteShard(self.out_dir, self.table, self.kind), n)
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
