"""Benchmark: `longreel curate` (ingest + probe + segment, materialize, stream copy) vs the bare ffmpeg CLI.

All in one run, on the 10-minute Big Buck Bunny and on re-muxed copies of it with distinct
bytes (so dedup keeps them all):

* ffmpeg alone: ``ffmpeg -i IN -c copy -f segment -segment_time 10 OUT%03d.mp4`` (per-video time);
* ``longreel curate`` as a user runs it (a fresh process, Beam start-up included) on 1 and on N videos.

The marginal cost per video is ``(T(N) - T(1)) / (N - 1)``, the fixed start-up ``T(1) - marginal``.
Targets: marginal / ffmpeg <= 1.2; start-up <= 3 s. The machine's load average is recorded at start and end
(a shared machine: the three repeats run interleaved so that its noise hits both alike).

    nice -n 10 python benchmarks/segment.py [--video PATH] [--copies 8] [--repeats 3] [--workers N]
                                            [--out benchmarks/results/segment.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
from longreel.pipelines.media.ffmpeg_bin import ffmpeg_exe  # noqa: E402

DEFAULT_VIDEO = "moviepy__bbb_full.mp4"  # a sample video (longreel.testing.sample_videos)
MARGINAL_MAX, STARTUP_MAX_S = 1.2, 3.0


CPU: list[float] = []  # CPU seconds of each timed() call, in call order (user + system, its children included)


def timed(args: list[str], cwd: str | None = None) -> float:
    """Wall seconds of ``args``; its CPU seconds (wait4: the process and the children it waited for) go to CPU."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args)
    CPU.append(ru.ru_utime + ru.ru_stime)
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--video", help=f"video file (default: the sample video {DEFAULT_VIDEO})")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, help="--workers for both longreel runs (default: the CLI's default, every "
                                                "core; the single video is passed as a directory, so it gets them too)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "segment.json"))
    a = ap.parse_args()
    if a.video is None:
        from longreel.testing.sample_videos import ensure_videos
        a.video = str(ensure_videos([DEFAULT_VIDEO]) / DEFAULT_VIDEO)
    ff = ffmpeg_exe()
    load_start = os.getloadavg()
    work = tempfile.mkdtemp(prefix="longreel-bench-segment-")
    try:
        vids = os.path.join(work, "videos")
        os.makedirs(vids)
        for i in range(a.copies):  # distinct bytes: a different metadata tag in each re-mux
            subprocess.run([ff, "-nostdin", "-loglevel", "error", "-y", "-i", a.video, "-map", "0", "-c", "copy",
                            "-metadata", f"comment=longreel benchmark copy {i}", os.path.join(vids, f"bbb_{i:02d}.mp4")],
                           check=True)
        one = os.path.join(work, "one")
        os.makedirs(one)
        os.link(os.path.join(vids, "bbb_00.mp4"), os.path.join(one, "bbb_00.mp4"))

        ffmpeg_times, ff_cpu, cpu1, cpun = [], [], [], []
        for r in range(a.repeats):
            out = os.path.join(work, f"ff{r}")
            os.makedirs(out)
            ffmpeg_times.append(timed([ff, "-nostdin", "-loglevel", "error", "-y", "-i", a.video, "-c", "copy",
                                       "-f", "segment", "-segment_time", "10", os.path.join(out, "%03d.mp4")]))
            ff_cpu.append(CPU[-1])
            shutil.rmtree(out)
        # near-duplicate detection off: the copies are the same footage (it rejects all but one of them), and this
        # measures ingest + segment, as before dedup.near_duplicates became the default (benchmarks/scale.py does too)
        longreel = [sys.executable, "-m", "longreel", "-q", "curate", "--set", "stages=[]", "--set", "segment.mode=materialize",
                    "--set", "segment.cut=copy", "--set", "dedup.near_duplicates=false"]
        if a.workers:
            longreel += ["--workers", str(a.workers)]
        t1, tn = [], []
        for r in range(a.repeats):  # interleaved so that machine noise hits both alike
            out = os.path.join(work, f"lr1_{r}")
            t1.append(timed(longreel + [one, "--out", out]))
            cpu1.append(CPU[-1])
            shutil.rmtree(out)
            out = os.path.join(work, f"lrn_{r}")
            tn.append(timed(longreel + [vids, "--out", out]))
            cpun.append(CPU[-1])
            with open(os.path.join(out, "stats.json")) as fh:
                totals = json.load(fh)["totals"]
            assert totals["videos_ok"] == a.copies and totals["clips"] == 60 * a.copies, totals
            shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ff_s = statistics.median(ffmpeg_times)
    one_s = statistics.median(t1)
    n_s = statistics.median(tn)
    marginal = (n_s - one_s) / (a.copies - 1)
    startup = one_s - marginal
    ff_c, one_c, n_c = (statistics.median(x) for x in (ff_cpu, cpu1, cpun))
    marginal_c = (n_c - one_c) / (a.copies - 1)
    doc = {
        "benchmark": "segment",
        "video": os.path.basename(a.video),
        "copies": a.copies,
        "repeats": a.repeats,
        "workers": a.workers or f"default: every core ({os.cpu_count()} here)",
        "command": "python benchmarks/segment.py " + " ".join(sys.argv[1:]), "nice": os.nice(0),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "ffmpeg": ff,
                    "shared": "yes: other jobs ran on this machine at the same time; see the load averages",
                    "load_average_start": [round(x, 2) for x in load_start],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "ffmpeg_cli_per_video_s": {"median": round(ff_s, 3), "all": [round(x, 3) for x in ffmpeg_times]},
        "longreel_1_video_s": {"median": round(one_s, 3), "all": [round(x, 3) for x in t1]},
        f"longreel_{a.copies}_videos_s": {"median": round(n_s, 3), "all": [round(x, 3) for x in tn]},
        "marginal_per_video_s": round(marginal, 3),
        "startup_s": round(startup, 3),
        "marginal_ratio_vs_ffmpeg": round(marginal / ff_s, 3),
        "cpu_s": {"what": "user + system CPU seconds (the process and its children), medians; steadier than wall "
                          "seconds on a shared machine",
                  "ffmpeg_cli_per_video": round(ff_c, 3), "longreel_1_video": round(one_c, 3),
                  f"longreel_{a.copies}_videos": round(n_c, 3), "marginal_per_video": round(marginal_c, 3),
                  "startup": round(one_c - marginal_c, 3), "marginal_ratio_vs_ffmpeg": round(marginal_c / ff_c, 3),
                  "all": {"ffmpeg": [round(x, 3) for x in ff_cpu], "longreel_1": [round(x, 3) for x in cpu1],
                          f"longreel_{a.copies}": [round(x, 3) for x in cpun]}},
        "targets": {"marginal_ratio_max": MARGINAL_MAX, "startup_max_s": STARTUP_MAX_S},
        "meets_targets": {"marginal_ratio": marginal / ff_s <= MARGINAL_MAX, "startup": startup <= STARTUP_MAX_S,
                          "marginal_ratio_cpu": marginal_c / ff_c <= MARGINAL_MAX},
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
