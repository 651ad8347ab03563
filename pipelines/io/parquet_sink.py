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
from dataclasses import dataclass

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


# -- several tables through one set of transforms ------------------------------------------------------------------

@dataclass(frozen=True)
class TableSpec:
    """One table of :class:`WriteTables`: what :class:`WriteSortedParquet` is given."""

    out_dir: str
    table: str
    kind: str
    num_shards: int | None = 1
    target_shard_bytes: int = TARGET_SHARD_BYTES

    def __post_init__(self):
        if self.num_shards is not None and self.num_shards < 1:
            raise ValueError("num_shards must be >= 1 (or None: follow the table's size)")
        if self.target_shard_bytes < 1:
            raise ValueError("target_shard_bytes must be >= 1")


def _shards_of(i: int, specs: tuple[TableSpec, ...], auto_counts: dict) -> int:
    """Table ``i``'s shard count: given, or from its rows' bytes (a table without rows has none summed: 1 shard)."""
    spec = specs[i]
    if spec.num_shards is not None:
        return spec.num_shards
    return auto_counts.get(i) or shards_for(0, spec.target_shard_bytes)


def _auto_row_bytes(item, specs):
    i, row = item
    if specs[i].num_shards is None:
        yield i, row_bytes(row)


def _key_by_shard(item, specs, auto_counts):
    i, row = item
    spec = specs[i]
    return (i, shard_of(str(row[KINDS[spec.kind].key]), _shards_of(i, specs, auto_counts))), row


class _WriteTableShard(beam.DoFn):
    def __init__(self, specs: tuple[TableSpec, ...]):
        self.specs = specs

    def process(self, element, auto_counts: dict):
        (i, index), group = element
        spec = self.specs[i]
        n = _shards_of(i, self.specs, auto_counts)
        writer = _WriteShard(spec.out_dir, spec.table, spec.kind)
        for path in writer.process((index, group), n):
            yield i, path


class WriteTables(beam.PTransform):
    """``{name: rows}`` -> the tables of ``specs`` (``{name: TableSpec}``), each written exactly as
    :class:`WriteSortedParquet` writes it (same shard assignment, order and files, stale shards removed), but all
    through one set of transforms: one key-by-shard, one grouping, one writer, one clean-up.

    Why: a Beam transform costs the launcher time to apply and the runner a stage to schedule whatever it carries.
    A run of ``longreel curate`` with every CPU stage wrote seven tables of 24 leaf transforms each (168 of the graph's
    419); a short run's fixed cost is mostly such per-transform work. Outputs ``{name: sorted shard paths}``."""

    def __init__(self, specs: dict[str, TableSpec]):
        super().__init__()
        if not specs:
            raise ValueError("no tables")
        self.names = list(specs)
        self.specs = tuple(specs[n] for n in self.names)

    @property
    def tables(self) -> dict[str, int | None]:
        """table -> its shard count (None: follows the size)."""
        return {s.table: s.num_shards for s in self.specs}

    def expand(self, pcolls: dict):
        specs = self.specs
        p = pcolls[self.names[0]].pipeline
        tagged = [pcolls[n] | f"Tag{i}" >> beam.Map(lambda r, i: (i, r), i) for i, n in enumerate(self.names)]
        rows = tagged | "AllRows" >> beam.Flatten()
        if any(s.num_shards is None for s in specs):
            auto = (rows
                    | "RowBytes" >> beam.FlatMap(_auto_row_bytes, specs)
                    | "TableBytes" >> beam.CombinePerKey(sum)
                    | "ShardCounts" >> beam.MapTuple(lambda i, b: (i, shards_for(b, specs[i].target_shard_bytes))))
        else:
            auto = p | "NoSizedTables" >> beam.Create([])
        counts = beam.pvalue.AsDict(auto)
        keyed = rows | "KeyByShard" >> beam.Map(_key_by_shard, specs, counts)
        # A None marker per shard makes every shard present after grouping, so empty shards are written too.
        every = (p | "Tables" >> beam.Create(list(range(len(specs))))
                 | "AllShards" >> beam.FlatMap(lambda i, c: [((i, s), None) for s in range(_shards_of(i, specs, c))],
                                               counts))
        grouped = (keyed, every) | "WithMarkers" >> beam.Flatten() | "GroupShards" >> beam.GroupByKey()
        paths = grouped | "WriteShards" >> beam.ParDo(_WriteTableShard(specs), counts)
        cleaned = (paths
                   | "ByTable" >> beam.GroupByKey()
                   | "RemoveStale" >> beam.MapTuple(lambda i, ps: (i, _remove_stale(list(ps), specs[i].out_dir,
                                                                                    specs[i].table))))
        return cleaned


class TableSink:
    """The tables a pipeline's stages write, collected while the graph is built and written by one
    :class:`WriteTables` (:meth:`write`); see :func:`write_table`."""

    def __init__(self):
        self.inputs: dict[str, beam.PCollection] = {}
        self.specs: dict[str, TableSpec] = {}

    def add(self, rows, label: str, spec: TableSpec) -> None:
        if label in self.inputs:
            raise ValueError(f"table label {label!r} given twice")
        self.inputs[label], self.specs[label] = rows, spec

    def write(self, label: str = "WriteTables"):
        if not self.inputs:
            return None
        return self.inputs | label >> WriteTables(self.specs)


def write_table(rows, label: str, out_dir: str, table: str, kind: str, num_shards: int | None = 1,
                sink: TableSink | None = None) -> None:
    """Write ``rows`` as ``table``: through ``sink`` (one writer for the run's tables) when given, else by its own
    :class:`WriteSortedParquet` labelled ``label``. The files are the same either way."""
    if sink is not None:
        sink.add(rows, label, TableSpec(out_dir, table, kind, num_shards))
    else:
        rows | label >> WriteSortedParquet(out_dir, table, kind, num_shards)


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
