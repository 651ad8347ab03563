"""The update's packed row, text attention split (causal prompt + masked responses) vs one [L, L]-masked call.

Under gradient checkpointing the GRPO update runs a prompt and its G responses as one row
(:func:`longreel.trainer.packed_responses.packed_row_logits`); :mod:`longreel.trainer.packed_row_attention` runs
the prompt's rows as causal SDPA and only the responses' rows with a mask. This times exactly that pass (the
policy's ``sequence_logprobs`` from precomputed video features, forward + backward, checkpointed layers in
training mode) both ways on one model, in one process, interleaved, and reports each way's median time, peak
memory (CUDA) and how far the two ways' log-probs and gradients are apart.

    python benchmarks/packed_row.py --frames 256,1024                  # on a GPU, Qwen2-VL-2B geometry (random)
    python benchmarks/packed_row.py --device cpu --geometry small --frames 64,256 --out /tmp/p.json   # CPU
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # grpo_gpu: the same policy geometries and items

from grpo_gpu import GEOMETRIES, build_policy, make_item  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("mask", "split")


def _set_mode(model, mode: str) -> None:
    from longreel.trainer.packed_row_attention import PACKED_ROW_ATTENTION

    model.config.text_config._attn_implementation = PACKED_ROW_ATTENTION if mode == "split" else "sdpa"


def _inputs(model, processor, frames: int, g: int, tokens: int, device):
    import torch

    from longreel.trainer.policy import encode_prompt, encode_video, video_token_id

    prompt = encode_prompt(processor, make_item(frames, seed=0), video_token_id=video_token_id(model)).to(device)
    with torch.no_grad():
        embeds = encode_video(model, prompt)
    gen = torch.Generator().manual_seed(0)
    # ordinary text tokens of the tiny tokenizer (both geometries keep its ids): never a video placeholder
    resp = torch.randint(0, 300, (g, tokens), generator=gen).to(device)
    mask = torch.ones_like(resp)
    weights = torch.randn(g, tokens, generator=gen).to(device)
    return prompt, embeds, resp, mask, weights


def _pass(model, prompt, embeds, resp, mask, weights, sync):
    """One update pass: log-probs of the G responses as one packed row, then its backward."""
    from longreel.trainer.policy import sequence_logprobs

    model.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    lp = sequence_logprobs(model, prompt, resp, mask, video_embeds=embeds)
    (lp.float() * weights).sum().backward()
    sync()
    return time.perf_counter() - t0, lp.detach().float()


def measure(model, processor, frames: int, args, device) -> dict:
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompt, embeds, resp, mask, weights = _inputs(model, processor, frames, args.G, args.tokens, device)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    peak, logprobs, grads = {}, {}, {}
    probe = model.get_input_embeddings().weight  # every row's gradient flows into it (tied head too)
    for rep in range(args.repeats + 1):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):  # interleaved: drift hits both alike
            _set_mode(model, mode)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            dt, lp = _pass(model, prompt, embeds, resp, mask, weights, sync)
            if rep == 0:  # warm-up: kept for the comparison, not timed
                logprobs[mode], grads[mode] = lp, probe.grad.detach().float().clone()
                if cuda:
                    peak[mode] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                continue
            times[mode].append(dt)
    _set_mode(model, "split")
    med = {m: round(statistics.median(v), 4) for m, v in times.items()}
    gdiff = float((grads["split"] - grads["mask"]).norm() / grads["mask"].norm().clamp_min(1e-30))
    return {"row_tokens": prompt.length + args.G * (args.tokens - 1), "prompt_tokens": prompt.length,
            "seconds": med, "all_seconds": {m: [round(x, 4) for x in v] for m, v in times.items()},
            "speedup_split_vs_mask": round(med["mask"] / med["split"], 3),
            "peak_gib": peak or None,
            "max_abs_logprob_diff": float((logprobs["split"] - logprobs["mask"]).abs().max()),
            "embedding_grad_rel_diff": gdiff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", default="2b", choices=sorted(GEOMETRIES))
    ap.add_argument("--frames", default="256,1024", help="comma-separated frame counts (60 video tokens per 2)")
    ap.add_argument("--G", type=int, default=8, help="responses per prompt")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per response")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per mode, after one warm-up each")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="parameter dtype (auto: bf16 on a GPU, fp32 on CPU); fp32 on a GPU checks the two ways agree "
                         "to fp32 rounding")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "packed_row.json"))
    args = ap.parse_args(argv)
    import torch
    import transformers

    from longreel.trainer.activation_checkpointing import enable_checkpointing
    from longreel.trainer.policy import load_policy

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run it on a GPU, or pass --device cpu --geometry small")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="packed-row-bench-"))
    out = Path(args.out)
    t0 = time.time()
    doc = {"benchmark": "packed_row", "command": "python benchmarks/packed_row.py " + " ".join(argv or sys.argv[1:]),
           "what": "policy.sequence_logprobs from precomputed video features + backward, gradient checkpointing, "
                   "training mode: the GRPO update's packed row (prompt + G responses), text attention split vs "
                   "one [L, L]-masked SDPA call; median of the timed passes, interleaved",
           "geometry": args.geometry, "config": {k: v for k, v in vars(args).items() if k != "out"},
           "host": {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor(),
                    "threads": torch.get_num_threads()},
           "results": {}}
    try:
        path = build_policy(work, args.geometry, args.device)
        auto = "bfloat16" if args.device == "cuda" else "float32"
        dtype = getattr(torch, auto if args.dtype == "auto" else args.dtype)
        model, processor = load_policy(path, dtype=dtype, device=device)
        enable_checkpointing(model)
        model.train()
        for frames in [int(f) for f in args.frames.split(",")]:
            try:
                doc["results"][str(frames)] = measure(model, processor, frames, args, device)
            except torch.OutOfMemoryError as e:  # a size that does not fit is a result, not a crash
                doc["results"][str(frames)] = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
            print(f"[{frames} frames] {json.dumps(doc['results'][str(frames)])}", file=sys.stderr, flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["wall_seconds"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
