"""``longreel eval`` in one process against the same evaluation under ``torchrun`` with 2 ranks (each decodes every
second held-out item; rank 0 puts the records together), on the procedural task's held-out items and the tiny
Qwen2-VL-geometry model built offline. Both runs use one intra-op thread a process, so on a 2-core machine the ranks
run side by side; the ratio is what sharing the items buys there, and the two results must be equal. Beside them,
two independent processes evaluating half as many items each, at once, give the bound this machine allows two
processes (its two CPUs may not run two processes at twice the speed of one).

    python benchmarks/eval_shares.py                 # writes benchmarks/results/eval_shares.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(argv: list[str], env: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{argv[:6]} failed:\n{proc.stderr[-3000:]}")
    return wall, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=256, help="held-out items")
    ap.add_argument("--max-new-tokens", type=int, default=192,
                    help="the tiny model writes no answer format, so every item decodes this many tokens")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each, alternated; the best of each is kept")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "eval_shares.json"))
    args = ap.parse_args()
    from longreel.testing.tiny_model import build_tiny_qwen2vl

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                                                    if p))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen2vl(Path(tmp) / "m", seed=0)
        evaluate = ["-m", "longreel", "eval", "--model", str(model), "--outputs", "--set", "data.source=synthetic",
                    "--set", f"data.synthetic_eval={args.items}", "--set", "data.synthetic_kinds=[colour, count]",
                    "--set", f"eval.max_new_tokens={args.max_new_tokens}", "--set", "run.progress=false",
                    "--set", "run.threads=1"]
        one, two, bound = [], [], []
        for _ in range(args.repeats):
            # the machine's own bound for 2 ranks: two independent processes, half the items each, side by side
            start = time.perf_counter()
            procs = [subprocess.Popen([sys.executable, *evaluate, "--set", f"data.synthetic_eval={args.items // 2}",
                                       "--set", f"data.synthetic_seed={seed}"], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for seed in (0, 1)]
            if any(p.wait() for p in procs):
                raise SystemExit("a half-size evaluation failed")
            bound.append(time.perf_counter() - start)
            wall, alone = _timed([sys.executable, *evaluate], env)
            one.append(wall)
            wall, shared = _timed([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *evaluate[1:]],
                                  env)
            two.append(wall)
    ranks = shared.pop("ranks")
    result = {
        "benchmark": "eval_shares",
        "command": "python benchmarks/eval_shares.py " + " ".join(sys.argv[1:]),
        "what": "wall seconds of `longreel eval` (process start, model load, decode, result) on the same items",
        "items": args.items, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "one_process_s": [round(w, 2) for w in one], "two_ranks_s": [round(w, 2) for w in two],
        "two_halves_side_by_side_s": [round(w, 2) for w in bound],
        "speedup_best": round(min(one) / min(two), 3),
        "bound_speedup_best": round(min(one) / min(bound), 3),
        "bound_note": "two independent one-process evaluations of half as many items each (other seeds), run at once: "
                      "what this machine's cores give two processes, with no rendezvous or gather",
        "ranks": ranks,
        "same_result": shared == alone,
        "accuracy": alone["accuracy"], "n": alone["n"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if not result["same_result"]:
        raise SystemExit("the two evaluations differ")


if __name__ == "__main__":
    main()
