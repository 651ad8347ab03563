"""Benchmark: the trainer's memory for remote shards, with and without the disk cache (``data.cache_remote``).

The trainer holds every item (``runtime.load_items``). It writes synthetic shards with the pack writer
(``learn.py``'s items, ``--items`` of them), serves them over http from this machine, and loads them in a fresh
process per mode, reporting the process's anonymous and file-backed resident memory (``RssAnon`` / ``RssFile`` of
``/proc/self/status``) after the load, against the same figures just before it:

* ``local``: the index as a local path (memory-mapped; the baseline);
* ``http_streamed``: the index over http with ``data.cache_remote=false`` (the frames in anonymous memory);
* ``http_cache_first``: over http with the cache, starting empty (download, then memory-mapped);
* ``http_cache_again``: the same again (read from the cache: only the index is fetched).

Anonymous memory is what a trainer cannot give back under pressure; file-backed pages the kernel drops and reads
again. Each mode checks that its items equal the local ones (ids and frames' sha256).

    python benchmarks/shard_cache.py [--items 2048] [--out benchmarks/results/shard_cache.json]
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learn  # noqa: E402  (puts the repository on sys.path)

MODES = ("local", "http_streamed", "http_cache_first", "http_cache_again")


def _status_mb() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def child(url: str, cache_remote: bool, cache_dir: str) -> dict:
    """One load in this process: memory before and after, wall time, and a digest of the items."""
    import torch  # noqa: F401  (imported before the 'before' figure, as in a trainer)

    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items

    before = _status_mb()
    t0 = time.perf_counter()
    items = load_items(DataConfig(train_urls=[url], cache_remote=cache_remote, cache_dir=cache_dir), "train")
    wall = time.perf_counter() - t0
    after = _status_mb()
    h = hashlib.sha256()
    for it in items:
        h.update(it["qra_id"].encode())
        h.update(it["frames"].numpy().tobytes())
    return {"items": len(items), "load_s": round(wall, 3), "items_sha256": h.hexdigest(),
            "rss_anon_mb_added": round(after["RssAnon"] - before["RssAnon"], 1),
            "rss_file_mb_added": round(after["RssFile"] - before["RssFile"], 1)}


def run_child(url: str, cache_remote: bool, cache_dir: str) -> dict:
    cmd = [sys.executable, __file__, "--child", url, "--cache-dir", cache_dir]
    if not cache_remote:
        cmd.append("--no-cache")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=2048, help="synthetic videos written (one question each)")
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--out", default=str(learn.REPO / "benchmarks" / "results" / "shard_cache.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, not args.no_cache, args.cache_dir)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="longreel-shard-cache-"))
    build = learn.build_parser().parse_args(["--kinds", "colour,count_colours,direction", "--size", str(args.size),
                                             "--frames", str(args.frames), "--temporal-patch", "1"])
    index = learn.write_run_shards(learn.run_items(args.items, 7, build), work / "shards", build, split="rl")
    shard_mb = sum(f.stat().st_size for f in (work / "shards").glob("*.tar")) / 1e6

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(work / "shards")))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(index)}"
    cache = str(work / "cache")
    try:
        results = {"local": run_child(index, True, cache),
                   "http_streamed": run_child(url, False, cache),
                   "http_cache_first": run_child(url, True, cache),
                   "http_cache_again": run_child(url, True, cache)}
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(work, ignore_errors=True)
    same = len({r["items_sha256"] for r in results.values()}) == 1
    doc = {"benchmark": "shard_cache", "items": args.items, "shards_mb": round(shard_mb, 1),
           "command": "python " + " ".join(["benchmarks/shard_cache.py"] + list(argv if argv is not None
                                                                              else sys.argv[1:])),
           "items_identical_in_every_mode": same, "modes": results,
           "anon_mb_streamed_over_cached": round(results["http_streamed"]["rss_anon_mb_added"]
                                                 - results["http_cache_again"]["rss_anon_mb_added"], 1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for mode, r in results.items():
        print(f"{mode:17s} load {r['load_s']:.2f} s  anon +{r['rss_anon_mb_added']:.0f} MB  "
              f"file-backed +{r['rss_file_mb_added']:.0f} MB")
    print(f"shards {shard_mb:.0f} MB; items identical in every mode: {same}; wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
