"""Benchmark: what flushing a step checkpoint to the disk costs (``trainer.checkpoint.save_checkpoint``), and what
checking one before a resume costs (``checkpoint_problem``).

``save_checkpoint`` calls ``fsync`` on every file and directory it writes before the rename into place, so that a
machine that goes down just after a save does not come back with a renamed checkpoint of empty or partial files. The
baseline is the same save with the flush turned off (the kernel then writes the pages back later, on its own
schedule), measured in the same run, alternating, ``--repeats`` times each. The model is a random one of
SmolLM2-135M's geometry (``--layers``, ``--hidden``; no weights needed) with an AdamW state after one step, so the
checkpoint is the weights plus two moments, about 12 bytes a parameter in fp32.

    python benchmarks/checkpoint_save.py [--repeats 3] [--out benchmarks/results/checkpoint_save.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

import longreel.trainer.checkpoint as checkpoint


def build(layers: int, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.ones(1, 8, dtype=torch.long)).logits.sum().backward()
    opt.step()  # the moments exist from here on
    return model, opt


def timed_save(root: Path, model, opt, flush: bool) -> float:
    real = checkpoint._fsync
    checkpoint._fsync = real if flush else (lambda path: None)
    try:
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        checkpoint.save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=None, trainer_state={"loader": {}})
        return time.perf_counter() - t
    finally:
        checkpoint._fsync = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dir", default=None,
                    help="Where to write the checkpoints (default: a temp dir on $TMPDIR's disk).")
    ap.add_argument("--out", default="benchmarks/results/checkpoint_save.json")
    args = ap.parse_args()
    model, opt = build(args.layers, args.hidden)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        timed_save(work / "warm", model, opt, flush=True)  # first write of the files: page cache and allocation
        times = {"with_fsync": [], "without_fsync": []}
        for _ in range(args.repeats):
            for mode in times:
                times[mode].append(timed_save(work / mode, model, opt, flush=mode == "with_fsync"))
        step = work / "with_fsync" / "step-000001"
        size = sum(f.stat().st_size for f in step.iterdir() if f.is_file())
        checks = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            assert checkpoint.checkpoint_problem(step) is None
            checks.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    doc = {
        "benchmark": "checkpoint_save",
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": size,
        "save_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "save_s_median": {k: round(v, 3) for k, v in med.items()},
        "fsync_cost_ratio": round(med["with_fsync"] / med["without_fsync"], 2),
        "fsync_cost_s_per_gb": round((med["with_fsync"] - med["without_fsync"]) / (size / 1e9), 3),
        "check_s": [round(x, 4) for x in checks],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
