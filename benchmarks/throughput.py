"""Benchmark: `longreel curate` of Big Buck Bunny with every CPU stage against the bare ffmpeg decode of the file.

All in one run, on the 10-minute Big Buck Bunny (596 s, 1280x720 H.264, from the shared sample videos):

* **baseline**: the ffmpeg binary the project uses (``longreel.pipelines.media.ffmpeg_bin``) decoding the video
  stream fully, ``ffmpeg -i IN -map 0:v:0 -f null -`` (its default threads; a ``-threads 1`` run too);
* **curate**: ``longreel curate`` in a fresh process, one worker, with the stages caption (``facts`` backend), qra
  (``template``), filter (on the frame cache, ``frame_source: cache``) and pack. The filter's answerer is the
  scripted one of ``longreel.testing.answerers`` (no model: model costs are the compute bill's business, this
  measures the CPU side), which is why the run is started through this file's ``--child`` mode (the CLI cannot be
  handed an answerer) rather than ``python -m longreel curate``; everything else is ``run_curate`` as the CLI
  calls it.
* **curate on every core**: the same run with the worker count ``longreel curate`` picks for one video with a
  caption stage (every core; ``--workers``), since ffmpeg's baseline decodes on every core too. The long video's
  decode is cut into tasks the workers share; its decode passes are not counted (their log is in the workers).
* **stage CPU**: the same run with stages added one at a time ([], +caption, +qra, +pack, +filter); a stage's CPU
  seconds are what adding it cost (user + system, the process and its decode workers).
* **decode passes per video**: counted from the run's own ``longreel.decode`` log records (one per worker decode
  call) and the frame cache's ``hit``/``built`` counts in ``stats.json``.
* **peak RSS of a decode worker** (``VmHWM`` of the worker process) decoding the caption frames (8 per 10 s clip)
  and the frame cache's frames in one pass, on the 10-minute video and on a 1-hour one made by concatenating six
  copies with the same ffmpeg binary (concat demuxer, stream copy).
* the decoder comparison table of ``benchmarks/results/decoders.json`` (``benchmarks/decoders.py``), copied in.
* **every-core pairs**: ``--pairs`` more (ffmpeg, curate on every core) runs back to back; the median of their
  ratios is the every-core figure, since one pair's ratio swings with what else the machine runs.

Wall seconds and CPU seconds are both reported: on a shared machine CPU seconds are the steadier figure, and the
load average at start and end is recorded.

    nice -n 10 python benchmarks/throughput.py [--video PATH] [--long-copies 6] [--no-stage-cpu] [--no-rss]
        [--pairs 3] [--out benchmarks/results/throughput.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULT_VIDEO = "moviepy__bbb_full.mp4"  # a sample video (longreel.testing.sample_videos)
RATIO_TARGET = 1.3
STAGE_STEPS = (("base (ingest, dedup, segment)", []), ("caption", ["caption"]), ("qra", ["caption", "qra"]),
               ("pack", ["caption", "qra", "pack"]), ("filter", ["caption", "qra", "filter", "pack"]))


# -- measuring a child process ----------------------------------------------------------------------------------

def measured(args: list[str], env: dict | None = None, cwd: str | None = None) -> dict:
    """Run ``args``; wall seconds and the CPU seconds of the process and every child it waited for (wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=cwd)
    err = proc.stderr.read()
    _pid, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{args[:4]}... exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
            "user_s": round(ru.ru_utime, 3), "sys_s": round(ru.ru_stime, 3), "max_rss_kib": ru.ru_maxrss}


def ffmpeg_decode(ff: str, video: str, threads: int | None = None) -> dict:
    args = [ff, "-nostdin", "-loglevel", "error"] + (["-threads", str(threads)] if threads else []) + \
           ["-i", video, "-map", "0:v:0", "-f", "null", "-"]
    return measured(args)


# -- the curate run (child mode) --------------------------------------------------------------------------------

class _PassCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.passes: Counter = Counter()

    def emit(self, record):
        if record.msg.startswith("decode pass:"):
            self.passes[os.path.realpath(str(record.args[0]))] += 1


def child(out: str, stages: list[str], inputs: str, forked: bool = False, workers: int = 1) -> int:
    """``run_curate`` as ``longreel curate INPUTS --out OUT --workers N`` runs it, with the scripted answerer for
    the filter; writes ``OUT/bench_child.json`` (decode passes per video, from the decode log: counted for one
    worker in this process only). ``forked``: the one worker forked from the zygote (``run_curate(in_process=False)``),
    not what ``--workers 1`` runs: an A/B only. Exits as the ``longreel`` executable does (no interpreter teardown).

    A run that forks its workers starts their zygote first thing, as ``longreel curate`` does once it has read its
    config, so that the zygote's imports overlap this process's."""
    if workers > 1 or forked:
        from longreel.pipelines import zygote
        zygote.prestart()
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import plan_inputs
    from longreel.schemas.config import load_yaml
    from longreel.testing.answerers import ScriptedAnswerer

    logging.basicConfig(level=logging.WARNING)
    counter = _PassCounter()
    dlog = logging.getLogger("longreel.decode")
    dlog.setLevel(logging.DEBUG)
    dlog.addHandler(counter)
    sets = [f"stages=[{','.join(stages)}]", "caption.backend=facts", "qra.backend=template"]
    if "filter" in stages:
        # the filter reads the pack stage's frame cache (same parameters as the pack's defaults); the answerer is
        # handed in, so no model directory is read ("model" only has to be non-empty for the config check)
        sets += ["filter.frame_source=cache", f"filter.cache_dir={os.path.join(out, 'frame_cache')}",
                 "filter.model=scripted", "filter.max_pixels=200704", "filter.min_pixels=100352"]
    cfg = load_yaml(CurateConfig, None, sets)
    handlers = {"filter": ScriptedAnswerer(cfg.filter, default=cfg.filter.k // 2)} if "filter" in stages else None
    stats = run_curate(plan_inputs([inputs]), out, cfg, None, command="benchmarks/throughput.py --child",
                       handlers=handlers, workers=workers, in_process=workers == 1 and not forked)
    with open(os.path.join(out, "bench_child.json"), "w") as fh:
        json.dump({"decode_passes": dict(counter.passes), "totals": stats["totals"],
                   "frame_cache": (stats.get("run") or {}).get("frame_cache")}, fh)
    from longreel.cli import exit_without_teardown
    exit_without_teardown(0)


FORKED_ONE_WORKER: list[str] = []  # ["--forked-one-worker"] when main() is given it


def curate(video_dir: str, out: str, stages: list[str], workers: int = 1) -> dict:
    env = dict(os.environ)
    m = measured([sys.executable, os.path.abspath(__file__), "--child", out, "--stages", ",".join(stages),
                  "--workers", str(workers), *FORKED_ONE_WORKER, video_dir], env=env, cwd=tempfile.gettempdir())
    with open(os.path.join(out, "bench_child.json")) as fh:
        info = json.load(fh)
    with open(os.path.join(out, "stats.json")) as fh:
        stats = json.load(fh)
    m["stages"] = stages
    m["workers"] = workers
    m["decode_passes_per_video"] = info["decode_passes"]
    m["frame_cache"] = info["frame_cache"]
    m["funnel"] = {s["stage"]: {"in": s["in"], "out": s["out"]} for s in stats["stages"]}
    return m


def every_core_pairs(ff: str, video: str, vdir: str, work: str, workers: int, pairs: int) -> dict:
    """``pairs`` x (ffmpeg's full decode, then curate with ``workers``), back to back: the ratio of each pair and
    their median, the every-core figure (each pair's two runs see the same minutes of a shared machine)."""
    rows = []
    for k in range(pairs):
        base = ffmpeg_decode(ff, video)
        run = curate(vdir, os.path.join(work, f"pair{k}"), STAGE_STEPS[-1][1], workers)
        rows.append({"ffmpeg_wall_s": base["wall_s"], "curate_wall_s": run["wall_s"], "ffmpeg_cpu_s": base["cpu_s"],
                     "curate_cpu_s": run["cpu_s"], "ratio_wall": round(run["wall_s"] / base["wall_s"], 3),
                     "load_average_1min": round(os.getloadavg()[0], 2)})
    ratios = sorted(r["ratio_wall"] for r in rows)
    median = ratios[len(ratios) // 2] if len(ratios) % 2 else round((ratios[len(ratios) // 2 - 1]
                                                                     + ratios[len(ratios) // 2]) / 2, 3)
    return {"workers": workers, "pairs": rows, "median_ratio_wall": median}


# -- peak RSS of a decode worker ----------------------------------------------------------------------------------

def concat_copies(ff: str, video: str, copies: int, dest: str) -> str:
    """``copies`` x ``video`` in one file by stream copy (concat demuxer; the list file quotes the path)."""
    lst = dest + ".txt"
    quoted = "'" + os.path.abspath(video).replace("'", "'\\''") + "'"
    with open(lst, "w") as fh:
        fh.write("".join(f"file {quoted}\n" for _ in range(copies)))
    subprocess.run([ff, "-nostdin", "-loglevel", "error", "-y", "-f", "concat", "-safe", "0", "-i", lst,
                    "-map", "0:v:0", "-c", "copy", dest], check=True)
    return dest


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0])  # kB
    return out


def worker_peak_rss(video: str) -> dict:
    """Probe ``video`` and decode the caption frames (8 per ~10 s clip, facts size) plus the frame cache's frames
    in one pass in a fresh :class:`IsolatedWorker`; the worker's peak RSS and CPU seconds."""
    from longreel.pipelines.caption_config import CaptionConfig
    from longreel.pipelines.media.decode import FrameRequest, decode_many_in_worker, sample_timestamps
    from longreel.pipelines.media.worker import IsolatedWorker
    from longreel.pipelines.pack.config import PackConfig
    from longreel.pipelines.stages.caption import decode_size, frame_budget, open_frame_cache

    tmp = tempfile.mkdtemp(prefix="longreel-bench-rss-")
    try:
        with IsolatedWorker(default_timeout=3600) as w:
            probe = w.call("probe", path=video)
            video_row = {**probe, "video_id": "v", "sha256": "0" * 64}
            dur = float(probe["duration_s"])
            n_clips = max(1, round(dur / 10.0))
            caps = [t for i in range(n_clips) for t in sample_timestamps(i * dur / n_clips, (i + 1) * dur / n_clips, 8)]
            size = decode_size(video_row, frame_budget(CaptionConfig()))
            cache = open_frame_cache(PackConfig(), tmp)
            reqs = [FrameRequest(caps, *size), FrameRequest(cache.plan(video_row)[1])]
            pid = w._proc.pid
            before = _status(pid)
            t0 = time.perf_counter()
            cpu0 = _cpu_of(pid)
            got = decode_many_in_worker(w, video, reqs, rotation=probe.get("rotation"))
            wall = time.perf_counter() - t0
            after = _status(pid)
            cpu = _cpu_of(pid) - cpu0
            frames = [int(g.frames.shape[0]) for g in got]
            out_bytes = sum(int(g.frames.nbytes) for g in got)
            del got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"duration_s": round(dur, 3), "frames": frames, "output_mib": round(out_bytes / 2 ** 20, 1),
            "peak_rss_mib": round(after["VmHWM"] / 1024, 1), "rss_after_probe_mib": round(before["VmRSS"] / 1024, 1),
            "rss_anon_end_mib": round(after.get("RssAnon", 0) / 1024, 1), "decode_wall_s": round(wall, 2),
            "decode_cpu_s": round(cpu, 2)}


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- main ---------------------------------------------------------------------------------------------------------

def decoder_table() -> dict | None:
    path = os.path.join(HERE, "results", "decoders.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        doc = json.load(fh)
    table = {pat: {k: v for k, v in row.items() if isinstance(v, dict)} for pat, row in doc.get("patterns", {}).items()}
    return {"source": "benchmarks/results/decoders.json (benchmarks/decoders.py, its own run)",
            "default_backend": doc.get("default_backend") or doc.get("chosen"), "patterns": table,
            "notes": {k: v for k, v in doc.items() if k in ("threads", "torchcodec", "note", "notes")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--video", help=f"video file (default: the sample video {DEFAULT_VIDEO})")
    ap.add_argument("--long-copies", type=int, default=6, help="copies concatenated for the long RSS input")
    ap.add_argument("--short-s", type=float, default=20.0, help="length of the short input (fixed-cost run)")
    ap.add_argument("--no-stage-cpu", action="store_true", help="skip the stage-by-stage runs")
    ap.add_argument("--no-rss", action="store_true", help="skip the decode worker RSS measurement")
    ap.add_argument("--pairs", type=int, default=3,
                    help="back-to-back pairs (ffmpeg, curate on every core) for the every-core ratio: its median is "
                         "the figure (one pair swings by 10-20%% on a shared machine)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "throughput.json"))
    ap.add_argument("--forked-one-worker", action="store_true",
                    help="A/B: run the one worker forked from the zygote (run_curate in_process=False), not in process")
    ap.add_argument("--workers", type=int, default=None,
                    help="workers of the second full run (default: every core, what `longreel curate` picks for one "
                         "video with a caption stage); 0 leaves that run out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--stages", help=argparse.SUPPRESS)
    ap.add_argument("inputs", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, [s for s in a.stages.split(",") if s], a.inputs, a.forked_one_worker, a.workers or 1)
    if a.forked_one_worker:
        FORKED_ONE_WORKER.append("--forked-one-worker")
    if a.video is None:
        from longreel.testing.sample_videos import ensure_videos
        a.video = str(ensure_videos([DEFAULT_VIDEO]) / DEFAULT_VIDEO)
    from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe
    from longreel.pipelines.zygote import default_workers

    ff = ffmpeg_exe()
    load_start = os.getloadavg()
    work = tempfile.mkdtemp(prefix="longreel-bench-throughput-")
    doc: dict = {"benchmark": "throughput", "video": os.path.basename(a.video),
                 "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]), "nice": os.nice(0),
                 "one_worker": "forked from the zygote" if a.forked_one_worker else "in process (as --workers 1)",
                 "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ffmpeg": ff,
                             "shared": "yes: other jobs ran on this machine at the same time; see load_average",
                             "load_average_start": [round(x, 2) for x in load_start]}}
    try:
        vdir = os.path.join(work, "videos")
        os.makedirs(vdir)
        os.symlink(os.path.abspath(a.video), os.path.join(vdir, os.path.basename(a.video)))
        base = {"default_threads": ffmpeg_decode(ff, a.video), "threads_1": ffmpeg_decode(ff, a.video, 1)}
        doc["ffmpeg_full_decode"] = {"command": [os.path.basename(ff), "-i", "IN", "-map", "0:v:0", "-f", "null", "-"],
                                     **base}
        full = curate(vdir, os.path.join(work, "full"), STAGE_STEPS[-1][1])
        doc["curate"] = full
        ref, ref1 = base["default_threads"], base["threads_1"]
        doc["ratio_wall_vs_ffmpeg"] = round(full["wall_s"] / ref["wall_s"], 3)
        doc["ratio_cpu_vs_ffmpeg"] = round(full["cpu_s"] / ref["cpu_s"], 3)
        doc["ratio_wall_vs_ffmpeg_1_thread"] = round(full["wall_s"] / ref1["wall_s"], 3)
        n_default = default_workers() if a.workers is None else a.workers
        if n_default > 1:
            # ffmpeg decodes on every core by default, and so does `longreel curate` for this input: the same run
            # with the CLI's worker count, its long video's decode cut into tasks the workers share
            many = curate(vdir, os.path.join(work, "full_default_workers"), STAGE_STEPS[-1][1], n_default)
            many["decode_passes_per_video"] = "not counted: the decode log is in the worker processes"
            doc["curate_default_workers"] = {**many, "ratio_wall_vs_ffmpeg": round(many["wall_s"] / ref["wall_s"], 3),
                                             "ratio_cpu_vs_ffmpeg": round(many["cpu_s"] / ref["cpu_s"], 3)}
            doc["every_core_pairs"] = every_core_pairs(ff, a.video, vdir, work, n_default, a.pairs)
        # The per-run fixed cost (imports, pipeline construction, start-up) apart: the same run on the first
        # seconds of the video (stream copy), and ffmpeg on those; the difference is what the rest of the video cost.
        sdir = os.path.join(work, "short_videos")
        os.makedirs(sdir)
        short = os.path.join(sdir, "short.mp4")
        subprocess.run([ff, "-nostdin", "-loglevel", "error", "-y", "-i", a.video, "-map", "0:v:0", "-t",
                        str(a.short_s), "-c", "copy", short], check=True)
        short_ff = ffmpeg_decode(ff, short)
        short_run = curate(sdir, os.path.join(work, "short"), STAGE_STEPS[-1][1])
        doc["short_input"] = {"seconds": a.short_s, "ffmpeg_full_decode": short_ff, "curate": short_run}
        doc["marginal"] = {
            "what": "(full video - its first seconds): curate vs ffmpeg; the run's fixed cost left out",
            "curate_cpu_s": round(full["cpu_s"] - short_run["cpu_s"], 3),
            "ffmpeg_cpu_s": round(ref["cpu_s"] - short_ff["cpu_s"], 3),
            "curate_wall_s": round(full["wall_s"] - short_run["wall_s"], 3),
            "ffmpeg_wall_s": round(ref["wall_s"] - short_ff["wall_s"], 3)}
        mg = doc["marginal"]
        mg["ratio_cpu"] = round(mg["curate_cpu_s"] / mg["ffmpeg_cpu_s"], 3)
        mg["ratio_wall"] = round(mg["curate_wall_s"] / mg["ffmpeg_wall_s"], 3)
        doc["fixed_cost"] = {"curate_cpu_s_on_short_input": short_run["cpu_s"],
                             "curate_wall_s_on_short_input": short_run["wall_s"]}
        passes = list(full["decode_passes_per_video"].values())
        doc["decode_passes_per_video"] = passes
        if not a.no_stage_cpu:
            steps, prev = [], None
            for name, stages in STAGE_STEPS[:-1]:
                m = curate(vdir, os.path.join(work, f"s{len(steps)}"), stages)
                steps.append((name, m))
            steps.append((STAGE_STEPS[-1][0], full))
            rows = []
            for name, m in steps:
                rows.append({"stage": name, "stages_run": m["stages"], "run_cpu_s": m["cpu_s"],
                             "run_wall_s": m["wall_s"],
                             "stage_cpu_s": round(m["cpu_s"] - (prev["cpu_s"] if prev else 0.0), 3),
                             "decode_passes_per_video": list(m["decode_passes_per_video"].values())})
                prev = m
            doc["stage_cpu"] = rows
        doc["decoders"] = decoder_table()
        if not a.no_rss:
            long_path = concat_copies(ff, a.video, a.long_copies, os.path.join(work, "long.mp4"))
            doc["decode_worker_rss"] = {"10min": worker_peak_rss(a.video), "long": worker_peak_rss(long_path),
                                        "long_input": f"{a.long_copies} x {os.path.basename(a.video)}, concat "
                                                      "demuxer, stream copy"}
            r = doc["decode_worker_rss"]
            doc["decode_worker_rss"]["peak_ratio_long_vs_10min"] = round(r["long"]["peak_rss_mib"]
                                                                         / r["10min"]["peak_rss_mib"], 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["targets"] = {"ratio_max": RATIO_TARGET, "decode_passes_per_video": 1,
                      "peak_rss": "flat with length (long / 10 min close to 1)"}
    doc["meets_targets"] = {"ratio_wall": doc["ratio_wall_vs_ffmpeg"] <= RATIO_TARGET,
                            "ratio_cpu": doc["ratio_cpu_vs_ffmpeg"] <= RATIO_TARGET,
                            "ratio_wall_every_core_median": bool(doc.get("every_core_pairs", {}).get("pairs"))
                            and doc["every_core_pairs"]["median_ratio_wall"] <= RATIO_TARGET,
                            "decode_passes": bool(passes) and all(p == 1 for p in passes),
                            "marginal_ratio_cpu": doc["marginal"]["ratio_cpu"] <= RATIO_TARGET,
                            "marginal_ratio_wall": doc["marginal"]["ratio_wall"] <= RATIO_TARGET}
    if "decode_worker_rss" in doc:
        doc["meets_targets"]["peak_rss_flat"] = doc["decode_worker_rss"]["peak_ratio_long_vs_10min"] <= 1.1
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
