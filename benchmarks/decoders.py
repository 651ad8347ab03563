"""Benchmark: which decoder serves the pipeline's sampling patterns fastest (issue 17).

On one long video (Big Buck Bunny, 596 s 1280x720 H.264, from the shared sample corpus), in one run:

* ``clips``: 8 frames per 10 s clip across the whole video (the caption stage), at the facts frame size;
* ``spread64`` / ``spread256``: 64 and 256 frames spread over the video at source size (frame cache, pass-rate);
* ``dense``: 64 frames in a 4 s window (a short dense read);

each exact-frame and keyframe-snapped, with PyAV (threaded decoding) and decord 0.6.0, in-process, one decode
per pattern; the figure is seconds and the ratio to PyAV-exact of the same pattern. torchcodec is recorded as
not measured when it does not import beside the locked torch (see DESIGN.md: PyPI's torchcodec is a CUDA build).

    python benchmarks/decoders.py [--video PATH] [--repeats 1] [--out benchmarks/results/decoders.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from longreel.pipelines.media.decode import BACKENDS, MODES, decode_frames, sample_timestamps  # noqa: E402

DEFAULT_VIDEO = "moviepy__bbb_full.mp4"


def patterns(duration: float) -> dict[str, tuple[list[float], tuple | None]]:
    clips = [t for s in range(int(duration // 10)) for t in sample_timestamps(10.0 * s, 10.0 * s + 10.0, 8)]
    return {"clips": (clips, (170, 96)),
            "spread64": (sample_timestamps(0.0, duration, 64), None),
            "spread256": (sample_timestamps(0.0, duration, 256), None),
            "dense": (sample_timestamps(100.0, 104.0, 64), None)}


def torchcodec_status(video: str) -> str:
    """Whether torchcodec can decode here. Its PyPI wheel loads the system FFmpeg libraries (libavutil.so.56-61);
    PyAV's wheel carries its own under mangled names and these machines have no system FFmpeg."""
    try:
        from torchcodec.decoders import VideoDecoder
        VideoDecoder(video)
    except Exception as e:  # not installed, or its FFmpeg libraries are missing
        lines = [ln for ln in str(e).splitlines() if "cannot open shared object" in ln] or str(e).splitlines()[:1]
        return f"not measured: {type(e).__name__}: {lines[0].strip()[:200] if lines else ''}"
    return "decodes here, not wired as a backend"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--video")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--patterns", default="clips,spread64,spread256,dense")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decoders.json"))
    a = ap.parse_args()
    if a.video is None:
        from longreel.testing.sample_videos import ensure_videos
        a.video = str(ensure_videos([DEFAULT_VIDEO]) / DEFAULT_VIDEO)
    import av
    with av.open(a.video) as c:
        vs = c.streams.video[0]
        duration = float(vs.duration * vs.time_base)
    results = {}
    for name, (ts, size) in patterns(duration).items():
        if name not in a.patterns.split(","):
            continue
        w, h = size or (None, None)
        row = {"frames": len(ts), "size": list(size) if size else "source"}
        ref = None
        for mode in MODES:
            for backend in BACKENDS:
                times = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    d = decode_frames(a.video, ts, width=w, height=h, backend=backend, mode=mode)
                    times.append(time.perf_counter() - t0)
                s = statistics.median(times)
                key = f"{backend}_{mode}"
                if key == "pyav_exact":
                    ref = d
                    base = s
                entry = {"s": round(s, 3), "ratio_vs_pyav_exact": round(s / base, 3)}
                if mode == "exact" and backend != "pyav":
                    import numpy as np
                    diff = np.abs(d.frames.astype(np.int16) - ref.frames.astype(np.int16))
                    entry["same_timestamps"] = d.timestamps == ref.timestamps
                    entry["max_abs_pixel_diff"] = int(diff.max())
                    entry["mean_abs_pixel_diff"] = round(float(diff.mean()), 4)
                row[key] = entry
                print(name, key, entry, flush=True)
        results[name] = row
    exact = {b: sum(r[f"{b}_exact"]["s"] for r in results.values()) for b in BACKENDS}
    doc = {"benchmark": "decoders", "video": os.path.basename(a.video), "duration_s": round(duration, 3),
           "repeats": a.repeats, "threads": "PyAV thread_type=AUTO; decord num_threads=0 (auto)",
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
           "patterns": results, "exact_total_s": {b: round(v, 3) for b, v in exact.items()},
           "fastest_exact": min(exact, key=exact.get), "torchcodec": torchcodec_status(a.video)}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(json.dumps({k: doc[k] for k in ("exact_total_s", "fastest_exact", "torchcodec")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
