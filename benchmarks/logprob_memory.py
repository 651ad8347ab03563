"""Memory and time of the sampled tokens' log-probs, forward and backward, at a VLM's vocabulary: the textbook
``log_softmax(logits.float() / T).gather(labels)`` (what ``trainer.policy.token_logprobs`` computed before) against
``trainer.chunked_logprobs.chunked_token_logprobs`` (what it computes now), on the same logits in the same run.

Each measurement runs in its own process. The logits are a leaf tensor made first; then the process's peak resident
memory (``VmHWM``) is reset to its current one, so the peak's growth over the resident memory just before the call
is what the log-probs, their backward and the gradient cost. Reported per case:
``peak_extra_bytes`` (that growth), ``saved_for_backward_bytes`` (what autograd keeps between forward and backward,
counted by ``torch.autograd.graph.saved_tensors_hooks``, each storage once), ``seconds`` (forward + backward, the
median of ``--repeats``), and the largest differences between the two methods' log-probs and gradients.

    python benchmarks/logprob_memory.py          # writes benchmarks/results/logprob_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: (name, dtype of the logits, responses N, response tokens T, vocabulary V, temperature)
CASES = [
    ("qwen2vl-vocab-bf16", "bfloat16", 8, 256, 151936, 1.0),
    ("qwen2vl-vocab-fp32-T0.7", "float32", 8, 128, 151936, 0.7),
]


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Start the peak resident memory (VmHWM) again from the current one (Linux >= 4.0), so that making the inputs
    is not counted."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def textbook(logits, labels, temperature):
    import torch

    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _inputs(dtype: str, n: int, t: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    # filled in place, in its own dtype: no transient float32 copy before the measurement starts
    logits = torch.empty(n, t, vocab, dtype=getattr(torch, dtype)).normal_(0.0, 3.0, generator=g).requires_grad_(True)
    labels = torch.randint(0, vocab, (n, t), generator=g)
    weights = torch.randn(n, t, generator=g)  # a loss that weighs every token differently, as advantages do
    return logits, labels, weights


def child(method: str, case: str, repeats: int, out_path: str | None) -> dict:
    """One method on one case, in this process: peak memory of the first call, then the time of ``repeats`` more."""
    import torch

    from longreel.trainer.chunked_logprobs import chunked_token_logprobs

    torch.set_num_threads(1)
    name, dtype, n, t, vocab, temperature = next(c for c in CASES if c[0] == case)
    fn = textbook if method == "textbook" else chunked_token_logprobs
    logits, labels, weights = _inputs(dtype, n, t, vocab)
    saved: dict[int, int] = {}

    def pack(x):
        if x.device.type == "cpu" and x.numel():
            storage = x.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    _reset_peak()
    before = _status_bytes("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp = fn(logits, labels, temperature)
    (lp * weights).sum().backward()
    peak = _status_bytes("VmHWM")
    result = {"method": method, "case": name, "peak_extra_bytes": max(0, peak - before),
              "saved_for_backward_bytes": sum(v for k, v in saved.items() if k != logits.untyped_storage().data_ptr()),
              "saves_the_logits_themselves": logits.untyped_storage().data_ptr() in saved}
    if out_path:  # the values, for the comparison in the parent
        from safetensors.torch import save_file

        save_file({"logprobs": lp.detach().contiguous(), "grad": logits.grad.contiguous()}, out_path)
    times = []
    for _ in range(repeats):
        logits.grad = None
        start = time.perf_counter()
        (fn(logits, labels, temperature) * weights).sum().backward()
        times.append(time.perf_counter() - start)
    result["seconds"] = statistics.median(times) if times else None
    return result


def run_case(case: str, repeats: int, work: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    rows = {}
    for method in ("textbook", "chunked"):
        values = work / f"{case}-{method}.safetensors"
        proc = subprocess.run([sys.executable, __file__, "--child", method, "--case", case, "--repeats", str(repeats),
                               "--values", str(values)], capture_output=True, text=True, cwd=REPO)
        if proc.returncode:
            raise SystemExit(f"{method} on {case} failed:\n{proc.stderr[-3000:]}")
        rows[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    a = load_file(work / f"{case}-textbook.safetensors")
    b = load_file(work / f"{case}-chunked.safetensors")
    name, dtype, n, t, vocab, temperature = next(c for c in CASES if c[0] == case)
    logit_bytes = n * t * vocab * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    old, new = rows["textbook"], rows["chunked"]
    return {
        "case": name, "logits_dtype": dtype, "N": n, "T": t, "V": vocab, "temperature": temperature,
        "logits_bytes": logit_bytes,
        "textbook": old, "chunked": new,
        "peak_extra_ratio_textbook_over_chunked": round(old["peak_extra_bytes"] / max(new["peak_extra_bytes"], 1), 2),
        "peak_extra_in_logits_textbook": round(old["peak_extra_bytes"] / logit_bytes, 2),
        "peak_extra_in_logits_chunked": round(new["peak_extra_bytes"] / logit_bytes, 2),
        "time_ratio_chunked_over_textbook": (round(new["seconds"] / old["seconds"], 3)
                                             if old["seconds"] and new["seconds"] else None),
        "max_abs_diff_logprobs": float((a["logprobs"] - b["logprobs"]).abs().max()),
        "max_abs_diff_grad": float((a["grad"].float() - b["grad"].float()).abs().max()),
        "max_abs_grad": float(a["grad"].float().abs().max()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "logprob_memory.json"))
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per method and case, after the measured one")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--child", choices=("textbook", "chunked"), help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--values", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.case, args.repeats, args.values)))
        return 0
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        results = [run_case(c, args.repeats, Path(tmp)) for c in args.cases.split(",")]
    doc = {"benchmark": "logprob_memory", "command": "python benchmarks/logprob_memory.py",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "threads_per_process": 1, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in results:
        print(f"{r['case']}: peak extra {r['textbook']['peak_extra_bytes'] / 2**30:.2f} GiB (textbook) vs "
              f"{r['chunked']['peak_extra_bytes'] / 2**30:.2f} GiB (chunked), "
              f"x{r['peak_extra_ratio_textbook_over_chunked']};"
              f" time x{r['time_ratio_chunked_over_textbook']}; max |dlogp| {r['max_abs_diff_logprobs']:.2e}, "
              f"max |dgrad| {r['max_abs_diff_grad']:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
