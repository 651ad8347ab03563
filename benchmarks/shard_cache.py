"""Benchmark: the trainer's memory for remote shards, with and without the disk cache (``data.cache_remote``).

The trainer holds every item (``runtime.load_items``). It writes synthetic shards with the pack writer
(``learn.py``'s items, ``--items`` of them), serves them over http from this machine, and loads them in a fresh
process per mode, reporting the process's anonymous and file-backed resident memory (``RssAnon`` / ``RssFile`` of
``/proc/self/status``) after the load, against the same figures just before it:

* ``local``: the index as a local path (memory-mapped; the baseline);
* ``http_streamed``: the index over http with ``data.cache_remote=false`` (the frames in anonymous memory);
* ``http_cache_first``: over http with the cache, starting empty (download, then memory-mapped);
* ``http_cache_again``: the same again (read from the cache: only the index is fetched);
* ``stream_http_cache_first``: ``data.stream=true`` over http with an empty cache (shards cached as reached, the next
  one downloading ahead), one epoch drawn in batches of ``--batch``;
* ``stream_http_nocache``: ``data.stream=true`` with ``data.cache_remote=false`` (frames in RAM for the shard read).

For every mode it also reports when the first batch of ``--batch`` items is there (``first_batch_s``: a trainer's
first step can start then; with the loaded modes that is after the whole load) and how much the cache holds at that
moment (``cache_mb_at_first_batch``). The stream modes' memory is the peak over the epoch, sampled after each batch.
``--serve-mbps`` throttles each http response (0: loopback speed), for figures nearer a real network.

Anonymous memory is what a trainer cannot give back under pressure; file-backed pages the kernel drops and reads
again. Each mode checks that its items equal the local ones (ids and frames' sha256).

    python benchmarks/shard_cache.py [--items 2048] [--serve-mbps 0] [--out benchmarks/results/shard_cache.json]
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

MODES = ("local", "http_streamed", "http_cache_first", "http_cache_again", "stream_http_cache_first",
         "stream_http_nocache")


def _status_mb() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _dir_mb(path: str) -> float:
    root = Path(path)
    return sum(f.stat().st_size for f in root.glob("*.tar")) / 1e6 if root.is_dir() else 0.0


def _rows(items) -> list[tuple[str, str]]:
    return [(it["qra_id"], hashlib.sha256(it["frames"].numpy().tobytes()).hexdigest()) for it in items]


def _digests(rows: list[tuple[str, str]]) -> tuple[str, str]:
    """sha256 of the items (question id, frames' sha256) in their order, and of the set (sorted by question id:
    the stream's order is its own)."""
    ordered, as_set = hashlib.sha256(), hashlib.sha256()
    for q, f in rows:
        ordered.update(f"{q}:{f}".encode())
    for q, f in sorted(rows):
        as_set.update(f"{q}:{f}".encode())
    return ordered.hexdigest(), as_set.hexdigest()


def child(url: str, cache_remote: bool, cache_dir: str, stream: bool = False, batch: int = 8,
          n_items: int = 0) -> dict:
    """One load (or one streamed epoch) in this process: memory before and after, times, and digests of the items."""
    import torch  # noqa: F401  (imported before the 'before' figure, as in a trainer)

    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_stream import ShardItemStream

    before = _status_mb()
    t0 = time.perf_counter()
    if not stream:
        items = load_items(DataConfig(train_urls=[url], cache_remote=cache_remote, cache_dir=cache_dir), "train")
        wall = first = time.perf_counter() - t0
        cache_first = _dir_mb(cache_dir) if cache_remote else 0.0
        after = _status_mb()
        rows = _rows(items)
    else:
        s = ShardItemStream([url], seed=0, cache_dir=cache_dir if cache_remote else None)
        rows, peak_anon, first, cache_first, hashing = [], 0.0, None, 0.0, 0.0
        while len(rows) < n_items:
            got = [it for _, it in s.next_batch(min(batch, n_items - len(rows)))]
            if first is None:
                first = time.perf_counter() - t0
                cache_first = _dir_mb(cache_dir) if cache_remote else 0.0
            peak_anon = max(peak_anon, _status_mb()["RssAnon"])
            t_hash = time.perf_counter()
            rows.extend(_rows(got))  # and drop the batch, as a trainer does after its step
            hashing += time.perf_counter() - t_hash
            del got
        wall = time.perf_counter() - t0 - hashing  # the digests' time is not the stream's
        s.close()
    ordered, as_set = _digests(rows)
    out = {"items": len(rows), "load_s": round(wall, 3), "first_batch_s": round(first, 3),
           "cache_mb_at_first_batch": round(cache_first, 1), "items_sha256": ordered, "items_set_sha256": as_set}
    if stream:  # the stream's items come and go: its figure is the peak while drawing
        out["rss_anon_mb_peak_added"] = round(peak_anon - before["RssAnon"], 1)
    else:
        out["rss_anon_mb_added"] = round(after["RssAnon"] - before["RssAnon"], 1)
        out["rss_file_mb_added"] = round(after["RssFile"] - before["RssFile"], 1)
    return out


def run_child(url: str, cache_remote: bool, cache_dir: str, stream: bool = False, batch: int = 8,
              n_items: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", url, "--cache-dir", cache_dir, "--batch", str(batch),
           "--items", str(n_items)]
    if not cache_remote:
        cmd.append("--no-cache")
    if stream:
        cmd.append("--stream")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _server(directory: str, mbps: float):
    """An http server for ``directory`` on 127.0.0.1; with ``mbps`` > 0 each response is paced to that rate."""
    rate = mbps * 1e6

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def copyfile(self, source, outputfile):
            if rate <= 0:
                return super().copyfile(source, outputfile)
            t0, sent = time.monotonic(), 0
            while chunk := source.read(1 << 16):
                outputfile.write(chunk)
                sent += len(chunk)
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=directory))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=2048, help="synthetic videos written (one question each)")
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="items a step draws (the first batch's time is reported)")
    p.add_argument("--serve-mbps", type=float, default=0.0, help="pace each http response to this many MB/s (0: off)")
    p.add_argument("--out", default=str(learn.REPO / "benchmarks" / "results" / "shard_cache.json"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, not args.no_cache, args.cache_dir, args.stream, args.batch, args.items)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="longreel-shard-cache-"))
    build = learn.build_parser().parse_args(["--kinds", "colour,count_colours,direction", "--size", str(args.size),
                                             "--frames", str(args.frames), "--temporal-patch", "1"])
    index = learn.write_run_shards(learn.run_items(args.items, 7, build), work / "shards", build, split="rl")
    shards = sorted((work / "shards").glob("*.tar"))
    shard_mb = sum(f.stat().st_size for f in shards) / 1e6
    server = _server(str(work / "shards"), args.serve_mbps)
    url = f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(index)}"
    cache, stream_cache = str(work / "cache"), str(work / "stream-cache")
    n, b = args.items, args.batch
    try:
        results = {"local": run_child(index, True, cache, batch=b),
                   "http_streamed": run_child(url, False, cache, batch=b),
                   "http_cache_first": run_child(url, True, cache, batch=b),
                   "http_cache_again": run_child(url, True, cache, batch=b),
                   "stream_http_cache_first": run_child(url, True, stream_cache, True, b, n),
                   "stream_http_nocache": run_child(url, False, stream_cache + "-unused", True, b, n)}
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(work, ignore_errors=True)
    loaded = [m for m in MODES if not m.startswith("stream_")]
    same = (len({results[m]["items_sha256"] for m in loaded}) == 1
            and len({r["items_set_sha256"] for r in results.values()}) == 1)
    first, streamed = results["http_cache_first"], results["stream_http_cache_first"]
    doc = {"benchmark": "shard_cache", "items": n, "shards": len(shards), "shards_mb": round(shard_mb, 1),
           "batch": b, "serve_mbps": args.serve_mbps,
           "command": "python " + " ".join(["benchmarks/shard_cache.py"] + list(argv if argv is not None
                                                                              else sys.argv[1:])),
           "items_identical_in_every_mode": same, "modes": results,
           "anon_mb_streamed_over_cached": round(results["http_streamed"]["rss_anon_mb_added"]
                                                 - results["http_cache_again"]["rss_anon_mb_added"], 1),
           "first_batch_speedup_stream_over_load": round(first["first_batch_s"] / streamed["first_batch_s"], 2),
           "cache_mb_at_first_batch": {"load": first["cache_mb_at_first_batch"],
                                       "stream": streamed["cache_mb_at_first_batch"]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    for mode, r in results.items():
        mem = (f"anon peak +{r['rss_anon_mb_peak_added']:.0f} MB" if "rss_anon_mb_peak_added" in r else
               f"anon +{r['rss_anon_mb_added']:.0f} MB  file-backed +{r['rss_file_mb_added']:.0f} MB")
        print(f"{mode:24s} all items {r['load_s']:.2f} s  first batch {r['first_batch_s']:.2f} s  "
              f"cache then {r['cache_mb_at_first_batch']:.0f} MB  {mem}")
    print(f"{len(shards)} shards, {shard_mb:.0f} MB; items identical in every mode: {same}; wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
