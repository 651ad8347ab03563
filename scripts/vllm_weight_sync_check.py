#!/usr/bin/env python
"""Does the installed vLLM take a trainer's weights in place? The check behind ``rollout.engine=vllm``.

    python scripts/vllm_weight_sync_check.py --model DIR [--dtype float32] [--tol 1e-3] [--out result.json]

GRPO with ``rollout.engine=vllm`` loads the policy's weights into the running engine after every update
(``VLLMEngine.sync_weights``). This script runs that sync on a causal language model directory (a Hugging Face
checkpoint; SmolLM2-135M on vLLM's CPU backend in ``tox -e vllm``, any Llama/Qwen-style model on a GPU):
  1. vLLM samples a few tokens and reports their log-probs; transformers scores the same tokens with the same weights
     (``gap_before``: the two implementations agree);
  2. every weight of the transformers copy is moved by seeded noise, and the moved weights are synced into the
     engine as ``(name, tensor)`` pairs made one at a time, as a sharded trainer gathers them;
  3. vLLM samples again; its log-probs must equal transformers' on the moved weights (``gap_after`` <= ``--tol``)
     and differ from the old weights' (``gap_to_old_weights`` > 10 x ``--tol``): the engine holds the new weights.
It also reports how many of the handed-over tensors were alive at once, at most (``peak_alive``): vLLM reads them as
they come, so a trainer that gathers each when asked never holds a full copy. The engine has prefix caching on, as
the trainer's rollout engine does: the sample after the sync must take no prompt token from the cache (the sync
clears it; ``cached_prompt_tokens_after_sync`` 0). Last, the rule the trainer's sequence-parallel split relies on:
one request of n = 4 seeded s gives the samples of two requests of n = 2 seeded s and s + 2
(``split_matches_one_request``). Prints a JSON report; exit status 1 if a check fails.

Under ``torchrun`` (``python -m torch.distributed.run --nproc_per_node N scripts/vllm_weight_sync_check.py ...``) it
runs as the trainer's ranks do: the process group first (gloo on CPU, nccl on GPUs), then on every rank an engine
built with ``distributed_executor_backend="external_launcher"``, each rank moving the weights with its own seed, so
the checks show that each rank's engine holds its own rank's weights; the report (``--out`` gets ``.rankR`` before
its suffix) also says whether the process group was still there after the engine's close (vLLM's teardown ends it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local Hugging Face causal LM directory")
    ap.add_argument("--dtype", default="float32", help="vLLM and transformers dtype (float32 on vLLM's CPU backend)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens sampled per check")
    ap.add_argument("--noise", type=float, default=0.02, help="std of the seeded noise added to every weight")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest |vLLM - transformers| log-prob allowed")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM's share of the GPU (default: vLLM's own; ignored on CPU)")
    ap.add_argument("--out", default="", help="also write the JSON report here")
    return ap.parse_args(argv)


def sample(engine, prompt: str, n_tokens: int, seed: int):
    """vLLM's sampled tokens of ``prompt`` and their processed log-probs: (prompt ids, token ids, log-probs, prompt
    tokens served from the prefix cache)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=n_tokens, temperature=1.0, seed=seed, logprobs=0)
    out = engine.llm.generate([prompt], params, use_tqdm=False)[0]
    c = out.outputs[0]
    return (list(out.prompt_token_ids), list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
            int(out.num_cached_tokens or 0))


def split_matches_one_request(engine, prompt: str, n_tokens: int, n: int, seed: int) -> tuple[bool, int]:
    """vLLM seeds child ``j`` of a request seeded ``s`` with ``s + j``, the rule the trainer's SP split relies on:
    one request of ``n`` seeded ``s`` against two of ``n / 2`` seeded ``s`` and ``s + n / 2``. Also returns the
    prompt tokens the whole request's children took from the prefix cache (they share the prompt's prefill)."""
    import vllm

    def ask(shares):
        params = [vllm.SamplingParams(n=k, max_tokens=n_tokens, temperature=1.0, seed=s) for k, s in shares]
        return engine.llm.generate([prompt] * len(shares), params, use_tqdm=False)

    engine.llm.reset_prefix_cache()
    [whole] = ask([(n, seed)])
    halves = ask([(n // 2, seed), (n - n // 2, seed + n // 2)])
    ids = [list(o.token_ids) for o in whole.outputs]
    return ids == [list(o.token_ids) for h in halves for o in h.outputs], int(whole.num_cached_tokens or 0)


def score(model, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """transformers' log-probs of ``ids`` after ``prompt_ids``."""
    import torch

    x = torch.tensor([prompt_ids + ids], device=model.device)
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids, device=logits.device)[:, None])[:, 0].tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def move_weights(model, std: float, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_((torch.randn(p.shape, generator=g) * std).to(p.device, p.dtype))


class OneAtATime:
    """The model's ``(name, tensor)`` pairs, each a fresh copy made when drawn (as a sharded trainer's gather makes
    them), counting how many copies were alive at once, at most."""

    def __init__(self, model):
        self.state, self.alive, self.peak, self.n = model.state_dict(), [], 0, 0

    def __iter__(self):
        for name, t in self.state.items():
            copy = t.clone()
            self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(copy)]
            self.peak, self.n = max(self.peak, len(self.alive)), self.n + 1
            yield name, copy
            del copy


def join_ranks() -> tuple[int, int]:
    """Under torchrun: the process group, as the trainer makes it, and this process's (rank, world size)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def run(args) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from longreel.engines.vllm_engine import VLLMEngine

    rank, world = join_ranks()
    launcher = {"distributed_executor_backend": "external_launcher"} if world > 1 else {}
    # prefix caching on, as the trainer's rollout engine has it: the sample after the sync finds the prompt's blocks
    # cached unless the sync cleared them
    engine = VLLMEngine(args.model, dtype=args.dtype, max_model_len=512, enforce_eager=True, return_logprobs=True,
                        in_process=True, gpu_memory_utilization=args.gpu_memory_utilization,
                        enable_prefix_caching=True, **launcher)
    engine.setup()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    # longer than two of vLLM's KV blocks (16 tokens on GPUs, 128 on its CPU backend): only whole blocks are cached
    prompt = "The river was calm in the morning, and the boats lay still by the old stone bridge. " * 16 + "Then"
    p0, ids0, lp0, _ = sample(engine, prompt, args.tokens, seed=1)
    gap_before = gap(lp0, score(model, p0, ids0))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    move_weights(model, args.noise, seed=rank)
    pairs = OneAtATime(model)
    engine.sync_weights(pairs)
    p1, ids1, lp1, cached_after_sync = sample(engine, prompt, args.tokens, seed=1)
    gap_after = gap(lp1, score(model, p1, ids1))
    split_same, shared_prompt_tokens = split_matches_one_request(engine, prompt, args.tokens, n=4, seed=11)
    model.load_state_dict(old)
    gap_old = gap(lp1, score(model, p1, ids1))
    import vllm

    report = {"vllm": vllm.__version__, "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
              "device": device, "tokens_before": ids0, "tokens_after": ids1, "gap_before": gap_before,
              "gap_after": gap_after, "gap_to_old_weights": gap_old, "tensors_synced": pairs.n,
              "peak_alive": pairs.peak, "prompt_tokens": len(p0), "cached_prompt_tokens_after_sync": cached_after_sync,
              "split_matches_one_request": split_same, "prompt_tokens_shared_by_a_requests_children":
              shared_prompt_tokens, "tol": args.tol, "rank": rank, "world_size": world}
    report["passed"] = bool(gap_before <= args.tol and gap_after <= args.tol and gap_old > 10 * args.tol
                            and pairs.n == len(old) and cached_after_sync == 0 and split_same)
    engine.close()
    report["process_group_after_close"] = dist.is_initialized()
    if dist.is_initialized():
        dist.destroy_process_group()
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        if report["world_size"] > 1:
            out = out.with_name(f"{out.stem}.rank{report['rank']}{out.suffix}")
        out.write_text(text + "\n", encoding="utf-8")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
