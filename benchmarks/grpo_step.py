"""GRPO step time of the real trainer (``longreel.trainer.grpo.GRPOTrainer.step``) with MR-SP off and on.

``benchmarks/mrsp.py`` times the phases of a step in isolation; this runs whole trainer steps, sampling
included, on the same benchmark-sized model (``mrsp.build_model``) and real frames of Big Buck Bunny:

* ``plain``: ``mrsp.enabled=false`` (each prompt's video encoded once for its rollouts and old log-probs, the
  reference encodes it again, the update re-encodes it with grad in every micro-batch);
* ``mrsp``: ``mrsp.enabled=true``, ``mrsp.vision=deferred`` (the step's one encode per video serves everything;
  the reference encodes once);
* ``mrsp_frozen``: ``model.freeze_vision=true`` (one tower pass per video per step, reference included);
* ``plain_per_sequence`` / ``mrsp_per_sequence`` (for ``--checkpointing``): as ``plain`` / ``mrsp`` with the
  log-prob passes' text path as it was before the packed row: under checkpointing, one full sequence per response;
* ``plain_mask`` / ``mrsp_mask`` (for ``--checkpointing``): as ``plain`` / ``mrsp`` with the packed row's text
  attention as one SDPA call with its ``[L, L]`` mask (``model.packed_row_attention=mask``) instead of the split
  causal prompt + masked responses (:mod:`longreel.trainer.packed_row_attention`);
* ``mrsp_prompt_at_a_time``: as ``mrsp`` with each prompt's rollouts decoded on their own
  (``rollout.prompts_per_decode=1``, as before the step's prompts were decoded in one batch): run it beside
  ``mrsp`` with several ``--items`` to see what decoding the prompts together saves.

The text path is the same in every variant but ``mrsp_prompt_at_a_time``: rollouts decoded with one copy of each
prompt's K/V, the step's prompts in one batch (``shared_prefix.sample_shared_prefixes``), log-prob passes with the
prompt run once per pass. Every variant trains from the same weights with the same seeds, so the sampled responses
are the same (MR-SP is numerically the plain step), and the timing difference is the vision work (or, for
``mrsp_prompt_at_a_time``, the decode). The first step is a warm-up and is dropped.

    python benchmarks/grpo_step.py                      # writes benchmarks/results/grpo_step.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

VARIANTS = {
    "plain": ["mrsp.enabled=false"],
    "mrsp": ["mrsp.enabled=true", "mrsp.vision=deferred"],
    "mrsp_frozen": ["mrsp.enabled=true", "model.freeze_vision=true"],
    # with --checkpointing: the log-prob passes as before the packed row (N full sequences, the prompt N times)
    "plain_per_sequence": ["mrsp.enabled=false"],
    "mrsp_per_sequence": ["mrsp.enabled=true", "mrsp.vision=deferred"],
    "mrsp_prompt_at_a_time": ["mrsp.enabled=true", "mrsp.vision=deferred", "rollout.prompts_per_decode=1"],
    # with --checkpointing: the packed row through one SDPA call with its [L, L] mask (as before the split)
    "plain_mask": ["mrsp.enabled=false", "model.packed_row_attention=mask"],
    "mrsp_mask": ["mrsp.enabled=true", "mrsp.vision=deferred", "model.packed_row_attention=mask"],
}
PER_SEQUENCE = ("plain_per_sequence", "mrsp_per_sequence")


@contextmanager
def text_path(name: str):
    """For the ``*_per_sequence`` variants, the text decoder reported unable to take a 4D mask while their step
    runs, so checkpointed log-prob passes fall back to one full sequence per response."""
    from longreel.trainer import policy
    from longreel.trainer.mrsp import reuse

    if name not in PER_SEQUENCE:
        yield
        return
    saved = policy.can_pack_responses, reuse.can_pack_responses
    policy.can_pack_responses = reuse.can_pack_responses = lambda model: False
    try:
        yield
    finally:
        policy.can_pack_responses, reuse.can_pack_responses = saved


def make_items(n_items: int, frames: int) -> list[dict]:
    """``n_items`` questions, each on its own ``frames``-frame window of the video (uint8 frames at the size the
    tiny processor keeps: 168 x 280)."""
    import torch

    from mrsp import VIDEO

    from longreel.pipelines.media.decode import decode_frames, sample_timestamps
    from longreel.testing.sample_videos import ensure_videos

    items = []
    for i in range(n_items):
        start = 30.0 + 60.0 * i
        dec = decode_frames(str(ensure_videos([VIDEO]) / VIDEO),
                            sample_timestamps(start, start + frames / 8.0, frames), width=280, height=168)
        meta = {"fps": dec.fps, "frames_indices": list(dec.indices), "total_num_frames": 14315,
                "duration": 596.458, "width": 280, "height": 168}
        items.append({"key": f"bbb_{i}", "video_id": f"bbb_{i}", "frames": torch.from_numpy(dec.frames),
                      "video_metadata": meta, "question": "What does the rabbit do next?",
                      "options": ["wakes up", "eats an apple", "chases the birds", "falls asleep"],
                      "answer": "A", "problem_type": "multiple_choice", "category": "temporal",
                      "target": "<think>At the start the rabbit is asleep.</think><answer>A</answer>"})
    return items


def make_trainer(name: str, model_dir: str, items: list[dict], args, work: Path):
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.grpo import GRPOTrainer

    cfg = load_yaml(TrainConfig, None, [
        f"model.path={model_dir}", f"run.out_dir={work / name}", f"run.steps={args.steps + 1}", "run.save_every=0",
        "run.save_final=false", "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=0",
        f"data.batch_size={len(items)}", f"rollout.n={args.G}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "optim.lr=1e-4", f"optim.grad_accum={args.grad_accum}", f"grpo.beta={args.beta}",
        f"model.gradient_checkpointing={str(args.checkpointing).lower()}", *VARIANTS[name]])
    return GRPOTrainer(cfg, items=items)


KEYS = ("time_step", "time_rollout", "time_reward", "time_logprob", "time_update", "response_len_mean", "loss")


def run_variants(names: list[str], model_dir: str, items: list[dict], args, work: Path) -> dict:
    """Every variant's trainer built up front, then their steps interleaved (step 1 of each, step 2 of each...),
    so a change of machine load during the run falls on every variant alike."""
    import torch

    torch.set_num_threads(1)
    trainers = {name: make_trainer(name, model_dir, items, args, work) for name in names}
    steps: dict = {name: [] for name in names}
    try:
        for _ in range(args.steps + 1):
            for name, trainer in trainers.items():
                cpu0 = time.process_time()
                with text_path(name):
                    m = trainer.step()
                steps[name].append({k: m[k] for k in KEYS} | {"cpu_step": time.process_time() - cpu0})
                print(f"[{name}] step {len(steps[name])}: {m['time_step']:.2f}s (rollout {m['time_rollout']:.2f}, "
                      f"logprob {m['time_logprob']:.2f}, update {m['time_update']:.2f})", file=sys.stderr,
                      flush=True)
    finally:
        for trainer in trainers.values():
            trainer.engine.close()
            trainer.sess.close()
    out = {}
    for name in names:
        measured = steps[name][1:]  # the first step warms up
        out[name] = {"median": {k: statistics.median(s[k] for s in measured) for k in measured[0]},
                     "steps": steps[name], "overrides": VARIANTS[name]}
    return out


def _ratios(results: dict, slow: str, fast: str) -> dict | None:
    """``slow``'s median step, rollout and CPU time over ``fast``'s, when both ran."""
    if slow not in results or fast not in results:
        return None
    a, b = results[slow]["median"], results[fast]["median"]
    return {k: round(a[k] / b[k], 3) for k in ("time_step", "time_rollout", "cpu_step") if b[k]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=64, help="frames per video")
    ap.add_argument("--items", type=int, default=2, help="prompts per step (each on its own video)")
    ap.add_argument("--G", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per group in the update")
    ap.add_argument("--beta", type=float, default=0.05, help="KL coefficient (> 0 loads the reference model)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up step)")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=False,
                    help="gradient checkpointing in every variant (the GPU setting for long videos; the log-prob "
                         "passes then run the prompt and its responses as one packed row)")
    ap.add_argument("--variants", default="plain,mrsp,mrsp_frozen", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grpo_step.json"))
    args = ap.parse_args(argv)
    from mrsp import build_model

    work = Path(tempfile.mkdtemp(prefix="grpo-step-bench-"))
    t0 = time.time()
    load_start = os.getloadavg()
    try:
        model_dir = build_model(work)
        items = make_items(args.items, args.frames)
        results = run_variants(args.variants.split(","), model_dir, items, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results.get("plain", {}).get("median", {}).get("time_step")
    base_cpu = results.get("plain", {}).get("median", {}).get("cpu_step")
    doc = {
        "benchmark": "grpo_step",
        "config": {"frames": args.frames, "prompts_per_step": args.items, "G": args.G,
                   "max_new_tokens": args.max_new_tokens, "grad_accum": args.grad_accum, "beta": args.beta,
                   "measured_steps": args.steps, "warm_up_steps": 1, "threads": 1,
                   "gradient_checkpointing": args.checkpointing,
                   "model": "benchmarks/mrsp.py build_model (Qwen2-VL random: text 4 layers / hidden 128; vision "
                            "depth 4 / width 128)", "video": "moviepy__bbb_full.mp4, 64-frame windows at 168x280"},
        "variants": results,
        "speedup_vs_plain": {k: round(base / v["median"]["time_step"], 3) for k, v in results.items()
                             if base and k != "plain"},
        # CPU seconds of the (single-threaded) process per step: what the step computes, far less sensitive than
        # wall time to the other processes sharing the cores
        "speedup_vs_plain_cpu": {k: round(base_cpu / v["median"]["cpu_step"], 3) for k, v in results.items()
                                 if base_cpu and k != "plain"},
        # what decoding the step's prompts in one batch saves (both variants in the run)
        "batched_decode_speedup": _ratios(results, "mrsp_prompt_at_a_time", "mrsp"),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg_at_start": load_start,
                 "load_avg_at_end": os.getloadavg()},
        "command": "python " + " ".join(["benchmarks/grpo_step.py", *(argv if argv is not None else sys.argv[1:])]),
        "schedule": "variants interleaved step by step in one process (one torch thread)",
        "wall_seconds": round(time.time() - t0, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["speedup_vs_plain"]), json.dumps(doc["speedup_vs_plain_cpu"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
