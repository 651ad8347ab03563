#!/usr/bin/env python
"""GPU check (not run in CI): a few GRPO steps with the vLLM rollout engine on a small real VLM, weights synced from
the trainer into vLLM after every update.

    python scripts/gpu_check_grpo_vllm.py --model /models/Qwen2.5-VL-3B-Instruct [--steps 3] [--out /tmp/vllm-check]

Needs a CUDA GPU, ``pip install 'longreel[gpu]'`` (vllm) and a local model directory (nothing is downloaded). The
prompts are the procedural video task of ``longreel.trainer.synthetic_task`` rendered at 224 px.

What it prints per step: reward/format/accuracy, step time split, and ``behav_logp_absdiff`` = mean |log-prob under
the trainer's weights - log-prob reported by vLLM| on the sampled tokens. With the weight sync working this stays at
bf16 noise level (~1e-2) at every step; without it, it grows after the first update. The check passes (exit status
0, ``sync_ok``) when every step's ``behav_logp_absdiff`` is at most ``--max-diff`` (default 0.1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local directory of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-diff", type=float, default=0.1, help="largest acceptable behav_logp_absdiff")
    p.add_argument("--out", default="/tmp/longreel-vllm-check")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.grpo import GRPOTrainer
    from longreel.trainer.synthetic_task import make_items

    items = make_items(16, seed=0, kinds=("colour", "exit_side", "count"), size=224, n_frames=8)
    cfg = load_yaml(TrainConfig, None, [
        f"model.path={args.model}", f"run.out_dir={args.out}", "run.device=cuda", "model.dtype=bfloat16",
        "rollout.engine=vllm", f"rollout.n={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"data.batch_size={args.batch}", f"run.steps={args.steps}", f"optim.lr={args.lr}", "run.save_every=0",
        "run.resume=false", "run.progress=false", "run.save_final=false", "model.gradient_checkpointing=true",
        "rollout.vllm_gpu_memory_utilization=0.35", "rollout.vllm_max_model_len=4096"])
    trainer = GRPOTrainer(cfg, items=items)
    rows = []
    t0 = time.perf_counter()
    try:
        while trainer.sess.step < cfg.run.steps:
            m = trainer.step()
            trainer.sess.logger.log(trainer.sess.step, m)
            rows.append(m)
            print(json.dumps({"step": trainer.sess.step, **{k: round(v, 4) if isinstance(v, float) else v
                                                           for k, v in m.items()
                                                           if k in ("reward_mean", "format_rate", "accuracy",
                                                                    "behav_logp_absdiff", "time_rollout",
                                                                    "time_logprob", "time_update", "grad_norm")}}),
                  flush=True)
    finally:
        trainer.engine.close()
        trainer.sess.close()
    diffs = [r.get("behav_logp_absdiff") for r in rows]
    ok = all(d is not None and d <= args.max_diff for d in diffs)
    print(json.dumps({"steps": len(rows), "wall_s": round(time.perf_counter() - t0, 1), "behav_logp_absdiff": diffs,
                      "sync_ok": ok, "gpu": torch.cuda.get_device_name(0),
                      "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
