"""Benchmark: does curation spread over workers, and does the launcher stay small as the corpus grows? (issue 16)

1. Speed-up: ``longreel curate`` as a user runs it (a fresh process, Beam start-up included), with ``--workers 1``
   and ``--workers 2``, on the 14 shared sample videos and on a 4x copy of them with distinct bytes (each video
   re-muxed by the bundled ffmpeg with a different metadata tag, so dedup keeps them all: 56 videos; near-duplicate
   detection is turned off, since the copies are the same footage). Same run,
   alternating worker counts per repeat; the figure is T(1 worker) / T(2 workers). The two outputs are also
   compared (every file but stats.json's run record and _SUCCESS.json, which hashes it).
2. Launcher: for manifests of 10, 1,000 and 100,000 lines, the seconds from the specs to a built pipeline
   (``plan_inputs`` + ``build_curate``) and the size of the job graph (``pipeline.to_runner_api()``, serialized),
   beside the same for the list the launcher used to build (``expand_inputs`` + ``beam.Create(items)``).

    python benchmarks/scale.py [--config demo|none] [--repeats 1] [--corpora shared,copies] [--skip-launcher]
                               [--out benchmarks/results/scale.json]

When the two outputs differ, the document names the files and table rows that differ (``outputs_diff``) and the
work directory is kept. Each run records the code version it ran (commit, ``.dirty``): do not commit or edit tracked
files while it runs, or the pair is reported as ``code_version_differs`` (compared again with the versions masked).

Wall times on a shared machine are noisy: the ratios, measured back to back, are the figures.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe  # noqa: E402

MANIFEST_LINES = (10, 1_000, 100_000)


def _remux(src: str, out: str, k: int) -> str:
    subprocess.run([ffmpeg_exe(), "-nostdin", "-loglevel", "error", "-y", "-i", src, "-map", "0", "-c", "copy",
                    "-metadata", f"comment=longreel scale copy {k}", out], check=True)
    with open(out, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def remux_copies(src_dir: str, dest: str, copies: int) -> list[str]:
    """``copies`` re-muxes of every video in ``src_dir`` (stream copy, a different ``comment`` tag each). A container
    that drops the tag (MPEG-PS) would give equal bytes, which dedup would reject: that copy goes to MP4."""
    os.makedirs(dest, exist_ok=True)
    made, seen = [], set()
    for name in sorted(os.listdir(src_dir)):
        if name.endswith(".md"):
            continue
        stem, ext = os.path.splitext(name)
        for k in range(copies):
            out = os.path.join(dest, f"{stem}_{ext[1:]}__copy{k}{ext}")
            digest = _remux(os.path.join(src_dir, name), out, k)
            if digest in seen:
                os.unlink(out)
                out = os.path.join(dest, f"{stem}_{ext[1:]}__copy{k}.mp4")
                digest = _remux(os.path.join(src_dir, name), out, k)
            seen.add(digest)
            made.append(out)
    return made


def curate(inputs: str, run_dir: str, workers: int, config: list[str]) -> tuple[float, float]:
    """One ``longreel curate`` into ``run_dir/out``; ``--out`` is relative, so that two runs record one command.
    Returns (wall seconds, CPU seconds of the run's processes: user + system, the workers' included)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "longreel", "-q", "curate", inputs, "--out", "out", "--workers", str(workers),
                    *config], check=True, cwd=run_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _cpu_unit(_=None) -> float:
    data = b"x" * (1 << 20)
    for _ in range(400):
        data = hashlib.sha256(data).digest() * (1 << 15)
    return 0.0


def parallel_capacity() -> float:
    """What this machine gives two processes right now: T(2 CPU-bound units, one after the other) / T(the same two
    units in 2 processes at once). 2.0 on two idle cores; less while other work runs on the machine. It bounds
    the speed-up any 2-worker run can show in the same minutes."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_cpu_unit, range(2))  # start-up, not timed
        t0 = time.perf_counter()
        _cpu_unit(), _cpu_unit()
        serial = time.perf_counter() - t0
        t0 = time.perf_counter()
        pool.map(_cpu_unit, range(2), chunksize=1)
        parallel = time.perf_counter() - t0
    return round(serial / parallel, 3)


def comparable(out: str, code_version: str | None = None) -> dict[str, str]:
    """sha256 per output file, with stats.json's run record left out and _SUCCESS.json (which hashes it) aside.

    ``code_version``: this run's recorded code version, replaced by a placeholder in every file before hashing, so
    that two runs made from different checkouts can still be compared for what they computed."""
    from longreel.pipelines.stats import NONDETERMINISTIC_KEYS
    got = {}
    for root, _, names in os.walk(out):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), out)
            data = open(os.path.join(root, n), "rb").read()
            if rel == "_SUCCESS.json":
                continue
            if rel == "stats.json":
                doc = {k: v for k, v in json.loads(data).items() if k not in NONDETERMINISTIC_KEYS}
                data = json.dumps(doc, sort_keys=True).encode()
            if code_version:
                data = data.replace(code_version.encode(), b"<code_version>")
            got[rel] = hashlib.sha256(data).hexdigest()
    return got


def recorded_code_version(out: str) -> str | None:
    with open(os.path.join(out, "stats.json")) as fh:
        return json.load(fh).get("code_version")


def _table_of(rel: str) -> str | None:
    """``videos-00000-of-00001.parquet`` -> ``videos``; None for a file that is not a table shard."""
    base = os.path.basename(rel)
    if not base.endswith(".parquet") or "-of-" not in base:
        return None
    return base.rsplit("-", 3)[0]


def _rows_by_key(out: str, table: str, rels: list[str]) -> dict[str, list[str]]:
    """A table's rows (all its shards, in either run) keyed by its kind's key; a row as sorted JSON."""
    import pyarrow.parquet as pq

    from longreel.pipelines.io.parquet_sink import KINDS
    kind = next((k for k in (table, table[:-1], table.replace("_rates", "_rate")) if k in KINDS), None)
    fields = [KINDS[kind].key] if kind else [KINDS[k].key for k in KINDS]
    rows: dict[str, list[str]] = {}
    for rel in rels:
        path = os.path.join(out, rel)
        if not os.path.exists(path):
            continue
        for r in pq.read_table(path).to_pylist():
            key = next((str(r[f]) for f in fields if f in r), json.dumps(r, sort_keys=True, default=str))
            rows.setdefault(key, []).append(json.dumps(r, sort_keys=True, default=str))
    return rows


def _table_diff(a: str, b: str, table: str, rels: list[str]) -> dict:
    """Row counts, the keys whose rows differ (at most 20), and for rejects the reasons on either side."""
    ra, rb = _rows_by_key(a, table, rels), _rows_by_key(b, table, rels)
    differ = sorted(k for k in set(ra) | set(rb) if sorted(ra.get(k, [])) != sorted(rb.get(k, [])))
    doc = {"rows": [sum(map(len, ra.values())), sum(map(len, rb.values()))],
           "shard_files": [sorted(r for r in rels if os.path.exists(os.path.join(a, r))),
                           sorted(r for r in rels if os.path.exists(os.path.join(b, r)))],
           "keys_differing": len(differ), "keys": differ[:20]}
    if table == "rejects":
        def reasons(rows, k):
            return sorted({json.loads(x).get("reason") for x in rows.get(k, [])} - {None})
        doc["reasons"] = {k: [reasons(ra, k), reasons(rb, k)] for k in differ[:20]}
    if differ:  # one differing row in full, to read the field that moved
        k = differ[0]
        doc["example"] = {"key": k, "first": ra.get(k, [])[:1], "second": rb.get(k, [])[:1]}
    return doc


def compare(a: str, b: str) -> dict:
    """What differs between two runs' outputs: files (relative paths) and, per Parquet table, a row summary.

    Each run records the code version it ran (the checkout's commit, ``.dirty`` when tracked files differ from it,
    read once when the run starts). A commit or an edit of a tracked file between the two runs changes it, and with
    it stats.json and the card: that says the code changed, not that a worker count computed something else. Such
    a pair is reported (``code_version_differs``) and compared again with each run's version masked
    (``identical_but_code_version``)."""
    ha, hb = comparable(a), comparable(b)
    files = sorted(r for r in set(ha) | set(hb) if ha.get(r) != hb.get(r))
    doc = {"identical": not files, "files_differing": files}
    va, vb = recorded_code_version(a), recorded_code_version(b)
    if va != vb:
        ma, mb = comparable(a, va), comparable(b, vb)
        doc["code_version_differs"] = [va, vb]
        doc["identical_but_code_version"] = ma == mb
        files = sorted(r for r in set(ma) | set(mb) if ma.get(r) != mb.get(r))
        doc["files_differing_but_code_version"] = files
    tables = sorted({t for t in map(_table_of, files) if t})
    if tables:
        doc["tables"] = {}
        for t in tables:
            rels = sorted(r for r in set(ha) | set(hb) if _table_of(r) == t)
            try:
                doc["tables"][t] = _table_diff(a, b, t, rels)
            except Exception as e:  # a diagnosis must not lose the run's other figures
                doc["tables"][t] = {"error": repr(e)}
    return doc


def speedup(name: str, inputs: str, n_videos: int, work: str, repeats: int, config: list[str]) -> dict:
    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    load = [round(os.getloadavg()[0], 2)]
    outs = {}
    for r in range(repeats):
        for workers in (1, 2):
            run_dir = os.path.join(work, f"{name}-w{workers}-r{r}")
            os.makedirs(run_dir)
            wall, used = curate(inputs, run_dir, workers, config)
            times[workers].append(wall)
            cpu[workers].append(used)
            load.append(round(os.getloadavg()[0], 2))
            outs[workers] = os.path.join(run_dir, "out")
            print(f"{name}: {n_videos} videos, {workers} worker(s): {times[workers][-1]:.1f} s", flush=True)
    one, two = min(times[1]), min(times[2])
    stats = json.load(open(os.path.join(outs[1], "stats.json")))
    diff = compare(outs[1], outs[2])
    if "code_version_differs" in diff:
        print(f"{name}: the checkout changed between the runs ({diff['code_version_differs']}): do not commit or "
              f"edit tracked files while this benchmark runs", flush=True)
    if not diff["identical"]:
        print(f"{name}: outputs differ; kept {outs[1]} and {outs[2]}: {json.dumps(diff)[:2000]}", flush=True)
    return {"corpus": name, "videos": n_videos, "totals": stats["totals"], "parallel_capacity_after": parallel_capacity(),
            "wall_s": {"1": [round(t, 2) for t in times[1]], "2": [round(t, 2) for t in times[2]]},
            "cpu_s": {"1": [round(t, 2) for t in cpu[1]], "2": [round(t, 2) for t in cpu[2]]},
            "load_average_1min": load,
            "speedup_2_workers": round(one / two, 3),
            "outputs_identical": diff["identical"],
            **({} if diff["identical"] else {"outputs_diff": diff, "outputs_kept": [outs[1], outs[2]]})}


def launcher(work: str, lines: int) -> dict:
    import apache_beam as beam

    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import build_curate
    from longreel.pipelines.io.inputs import expand_inputs, plan_inputs
    from longreel.schemas.config import load_yaml

    manifest = os.path.join(work, f"manifest-{lines}.txt")
    with open(manifest, "w") as fh:
        fh.writelines(f"videos/v{i:07d}.mp4\n" for i in range(lines))
    cfg = load_yaml(CurateConfig, None, ["stages=[]"])
    row = {"lines": lines}
    for how, inputs in (("workers", lambda: plan_inputs([manifest])), ("launcher_list", lambda: expand_inputs([manifest]))):
        t0 = time.perf_counter()
        p = beam.Pipeline()
        build_curate(p, inputs(), os.path.join(work, "out"), cfg)
        graph = p.to_runner_api().SerializeToString()
        row[how] = {"launcher_s": round(time.perf_counter() - t0, 3), "graph_bytes": len(graph)}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("demo", "none"), default="demo",
                    help="demo: the demo config (facts captions, template questions, pack, card); none: stages=[]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--corpora", default="shared,copies",
                    help="comma-separated: shared (the 14 videos), copies (the --copies x corpus)")
    ap.add_argument("--skip-launcher", action="store_true", help="leave out the launcher figures (part 2)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "scale.json"))
    a = ap.parse_args()
    from longreel.pipelines.cli_curate import DEMO_CONFIG
    from longreel.testing.sample_videos import ensure_videos

    config = ["--config", DEMO_CONFIG] if a.config == "demo" else ["--set", "stages=[]"]
    # the copies are the same footage re-muxed: near-duplicate detection (on by default) would keep one of each and
    # the 4x corpus would be no more work than the shared one; this measures scaling, so every copy goes through
    config += ["--set", "dedup.near_duplicates=false"]
    from longreel.pipelines.provenance import code_version
    if code_version().endswith(".dirty"):
        print("warning: tracked files differ from the commit; an edit while the runs go on changes what they "
              "record (see compare)", flush=True)
    videos = str(ensure_videos())
    n_shared = len([n for n in os.listdir(videos) if not n.endswith(".md")])
    work = tempfile.mkdtemp(prefix="longreel-scale-")
    try:
        graphs = [] if a.skip_launcher else [launcher(work, n) for n in MANIFEST_LINES]
        for g in graphs:
            print(f"manifest of {g['lines']} lines: {g}", flush=True)
        copies = remux_copies(videos, os.path.join(work, "copies"), a.copies)
        distinct = len({hashlib.sha256(open(c, "rb").read()).hexdigest() for c in copies})
        capacity_before = parallel_capacity()
        corpora = a.corpora.split(",")
        runs = ([speedup("shared", videos, n_shared, work, a.repeats, config)] if "shared" in corpora else []) + \
            ([speedup(f"shared_x{a.copies}", os.path.join(work, "copies"), len(copies), work, a.repeats, config)]
             if "copies" in corpora else [])
    finally:
        # a run whose outputs differ keeps its work directory: the two outputs are the evidence
        if all(r["outputs_identical"] for r in locals().get("runs") or []) and "runs" in locals():
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory kept: {work}", flush=True)
    small, large = (graphs[0]["workers"], graphs[-1]["workers"]) if graphs else ({}, {})
    doc = {
        "benchmark": "scale",
        "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus_affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                    "platform": platform.platform(),
                    "note": "shared machine: other engineers ran test suites and benchmarks at the same time (see "
                            "load_average_1min: 2 cores), so wall times and the speed-up are indicative; "
                            "parallel_capacity says what two processes got"},
        "config": a.config,
        "code_version": code_version(),
        "parallel_capacity_before": capacity_before,
        "copies": {"videos": len(copies), "distinct_sha256": distinct},
        "speedup": runs,
        "launcher": graphs,
    }
    if graphs:
        doc["graph_bytes_ratio_100k_to_10"] = round(large["graph_bytes"] / small["graph_bytes"], 4)
        doc["launcher_s_ratio_100k_to_10"] = round(large["launcher_s"] / small["launcher_s"], 3)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(json.dumps({k: doc.get(k) for k in ("graph_bytes_ratio_100k_to_10", "launcher_s_ratio_100k_to_10")}),
          [(r["corpus"], r["speedup_2_workers"], r["outputs_identical"]) for r in runs])
    return 0


if __name__ == "__main__":
    sys.exit(main())
