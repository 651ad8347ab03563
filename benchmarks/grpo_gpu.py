"""GRPO step of the real trainer on a GPU with a 2B-class policy: plain vs MR-SP at 64, 256 and 1,024 frames.

The policy is a *random-initialised* Qwen2-VL with the geometry of Qwen2-VL-2B (text: 28 layers, width 1536, 12
heads / 2 KV heads, vocabulary 151,936, tied embeddings; vision: 32 blocks, width 1280, merger to 1536), built from
its config on the GPU: no weights are downloaded, and the compute per token is that of the real model. The tokenizer
and processor are the project's offline tiny ones (``longreel.testing.tiny_model``), whose token ids the config keeps.
Frames are seeded random uint8 at 168 x 280 (60 visual tokens per two frames: 1,920 / 7,680 / 30,720 video tokens at
64 / 256 / 1,024 frames); the content does not change the work done.

Every variant runs ``GRPOTrainer.step`` (bf16, SDPA, gradient checkpointing, KL to a reference model) from the same
weights and seeds; the first step warms up and is dropped. Per step it reports the trainer's own phase times
(rollout, reward, old/ref log-prob, update) and, from CUDA-synchronised forward hooks on the vision towers, how much
of each phase was vision-tower encoding:

* ``plain``: ``mrsp.enabled=false``;
* ``mrsp``: ``mrsp.enabled=true``, ``mrsp.vision=deferred`` (one tower pass per video per step feeds rollouts,
  old log-probs and the update's gradient; the tower's activations are held from rollout to update);
* ``mrsp_recompute``: ``mrsp.vision=recompute`` (the update re-encodes each video once with grad);
* ``plain_native`` / ``mrsp_native``: as ``plain`` / ``mrsp`` with ``model.vision_attention=native`` (transformers'
  per-block SDPA loop in the tower instead of :mod:`longreel.trainer.vision_attention`'s batched call);
* ``plain_mask`` / ``mrsp_mask``: as ``plain`` / ``mrsp`` with ``model.packed_row_attention=mask`` (the update's
  packed row through one SDPA call with an ``[L, L]`` mask instead of :mod:`longreel.trainer.packed_row_attention`'s
  causal prompt + masked responses).

    python benchmarks/grpo_gpu.py                          # on a GPU; writes benchmarks/results/grpo_gpu.json
    python benchmarks/grpo_gpu.py --geometry small --frames 8 --device cpu --out /tmp/g.json   # CPU smoke run
"""
from __future__ import annotations

import argparse
import gc
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

REPO = Path(__file__).resolve().parents[1]  # longreel must be installed (pip install -e . or .): no sys.path edits,
# which would shadow the installed ``longreel.schemas`` / ``longreel.trainer`` mapping with the bare folder

VARIANTS = {
    "plain": ["mrsp.enabled=false"],
    "mrsp": ["mrsp.enabled=true", "mrsp.vision=deferred"],
    "mrsp_recompute": ["mrsp.enabled=true", "mrsp.vision=recompute"],
    # transformers' own vision attention (one SDPA call per two-frame block) instead of the batched default
    "plain_native": ["mrsp.enabled=false", "model.vision_attention=native"],
    "mrsp_native": ["mrsp.enabled=true", "mrsp.vision=deferred", "model.vision_attention=native"],
    # the packed row's text attention as one SDPA call with its [L, L] mask instead of the split default
    "plain_mask": ["mrsp.enabled=false", "model.packed_row_attention=mask"],
    "mrsp_mask": ["mrsp.enabled=true", "mrsp.vision=deferred", "model.packed_row_attention=mask"],
}

#: Qwen2-VL-2B's published geometry (its config.json), applied to a random init.
GEOMETRIES = {
    "2b": {"text": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "max_window_layers": 28,
                    "mrope_section": [16, 24, 24], "tie_word_embeddings": True},
           "vision": {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16}},
    # the same code path at a size a CPU runs in seconds (smoke test of the script)
    "small": {"text": {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "max_window_layers": 2,
                       "mrope_section": [4, 6, 6], "tie_word_embeddings": True},
              "vision": {"depth": 2, "embed_dim": 64, "hidden_size": 128, "mlp_ratio": 2, "num_heads": 2}},
}

HEIGHT, WIDTH, FPS = 168, 280, 8.0
PROFILE_ROWS = 30


def build_policy(work: Path, geometry: str, device: str) -> str:
    """A save_pretrained directory: the tiny processor + a random Qwen2-VL of ``geometry`` (bf16, seed 0)."""
    import torch
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    from longreel.testing.tiny_model import build_tiny_qwen2vl

    base = build_tiny_qwen2vl(work / "tiny", seed=0)
    cfg = AutoConfig.from_pretrained(base)
    geo = GEOMETRIES[geometry]
    text = dict(geo["text"])
    mrope, tie = text.pop("mrope_section"), text.pop("tie_word_embeddings")
    for k, v in text.items():
        setattr(cfg.text_config, k, v)
    cfg.text_config.layer_types = ["full_attention"] * text["num_hidden_layers"]
    cfg.text_config.rope_parameters = {**cfg.text_config.rope_parameters, "mrope_section": mrope}
    cfg.tie_word_embeddings = tie
    for k, v in geo["vision"].items():
        setattr(cfg.vision_config, k, v)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()
    out = work / "policy"
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(base).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    (out / "bench_params.json").write_text(json.dumps({"parameters": params}))
    return str(out)


def make_item(frames: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    video = torch.randint(0, 256, (frames, HEIGHT, WIDTH, 3), dtype=torch.uint8, generator=g)
    meta = {"fps": FPS, "frames_indices": list(range(frames)), "total_num_frames": frames,
            "duration": frames / FPS, "width": WIDTH, "height": HEIGHT}
    return {"key": f"v{seed}", "video_id": f"v{seed}", "frames": video, "video_metadata": meta,
            "question": "What does the rabbit do after the butterfly lands?",
            "options": ["wakes up", "eats an apple", "chases the birds", "falls asleep"], "answer": "A",
            "problem_type": "multiple_choice", "category": "temporal",
            "target": "<think>At the start the rabbit is asleep.</think><answer>A</answer>"}


class VisionTimer:
    """CUDA-synchronised wall time of every vision-tower forward, attributed to the trainer phase it ran in."""

    def __init__(self, sync):
        self.sync, self.phase, self.totals, self._t0 = sync, "other", {}, []

    def attach(self, module) -> None:
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_):
        self.sync()
        self._t0.append(time.perf_counter())

    def _post(self, *_):
        self.sync()
        dt = time.perf_counter() - self._t0.pop()
        self.totals[self.phase] = self.totals.get(self.phase, 0.0) + dt

    @contextmanager
    def in_phase(self, name: str):
        prev, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = prev


def _phase_wrap(trainer, timer: VisionTimer) -> None:
    """Tag the trainer's phase methods so the tower time lands in the phase that called it."""
    for attr, phase in (("_rollout", "rollout"), ("_old_and_ref_logprobs", "logprob"), ("_update", "update")):
        fn = getattr(trainer, attr)

        def wrapped(*a, _fn=fn, _phase=phase, **kw):
            with timer.in_phase(_phase):
                return _fn(*a, **kw)
        setattr(trainer, attr, wrapped)


def _tower(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or getattr(model, "visual")


def run_variant(name: str, model_dir: str, frames: int, args, work: Path) -> dict:
    import torch

    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.grpo import GRPOTrainer

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = load_yaml(TrainConfig, None, [
        f"model.path={model_dir}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "model.attn_implementation=sdpa", f"model.gradient_checkpointing={str(args.checkpointing).lower()}",
        f"run.out_dir={work / name}", f"run.steps={args.steps + 1}", "run.save_every=0",
        "run.save_final=false", "run.progress=false", "run.tensorboard=false", "run.seed=0",
        f"run.device={args.device}", "run.deterministic=false",
        f"data.batch_size={args.items}", f"rollout.n={args.G}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "optim.lr=1e-5", f"optim.grad_accum={args.grad_accum}", f"grpo.beta={args.beta}", *VARIANTS[name]])
    items = [make_item(frames, seed=i) for i in range(args.items)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(cfg, items=items)
    timer = VisionTimer(sync)
    timer.attach(_tower(trainer.sess.model))
    if getattr(trainer, "ref", None) is not None:
        timer.attach(_tower(trainer.ref))
    _phase_wrap(trainer, timer)
    profiled = _profile_last_update(trainer, args.steps + 1, cuda) if args.profile_update else None
    steps = []
    try:
        for _ in range(args.steps + 1):
            timer.totals = {}
            sync()
            m = trainer.step()
            sync()
            row = {k: m[k] for k in ("time_step", "time_rollout", "time_reward", "time_logprob", "time_update",
                                     "response_len_mean")}
            row.update({f"encode_in_{k}": round(v, 4) for k, v in timer.totals.items()})
            steps.append(row)
            print(f"[{name} {frames}f] step {len(steps)}: {m['time_step']:.2f}s (rollout {m['time_rollout']:.2f}, "
                  f"logprob {m['time_logprob']:.2f}, update {m['time_update']:.2f}; encode "
                  f"{ {k: round(v, 2) for k, v in timer.totals.items()} })", file=sys.stderr, flush=True)
    finally:
        trainer.engine.close()
        trainer.sess.close()
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del trainer
    gc.collect()  # the phase wrappers make a reference cycle: free this variant's weights before the next one
    if cuda:
        torch.cuda.empty_cache()
    measured = steps[1:]
    keys = sorted({k for s in measured for k in s})
    return {"median": {k: round(statistics.median(s.get(k, 0.0) for s in measured), 4) for k in keys},
            "steps": steps, "peak_gib": round(peak, 2) if peak is not None else None,
            "overrides": VARIANTS[name], **({"update_profile": profiled} if profiled else {})}


def _profile_last_update(trainer, calls: int, cuda: bool) -> list:
    """Run the ``calls``-th ``_update`` (the last measured step's) under ``torch.profiler`` and fill the returned
    list with its top operators by self device time (self CPU time without a GPU): what the update spends on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn, seen, rows = trainer._update, [0], []

    def wrapped(*a, **kw):
        seen[0] += 1
        if seen[0] != calls:
            return fn(*a, **kw)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            out = fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:PROFILE_ROWS]
        rows.extend({"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key, 0) / 1e3, 2),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in events)
        return out

    trainer._update = wrapped
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="2b")
    ap.add_argument("--frames", default="64,256,1024", help="comma-separated frame counts")
    ap.add_argument("--items", type=int, default=1, help="prompts per step (each on its own video)")
    ap.add_argument("--G", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 loads the reference model)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per variant (after one warm-up step)")
    ap.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                    help="gradient checkpointing in the update (needed for 1,024 frames on 80 GB)")
    ap.add_argument("--variants", default="plain,mrsp,mrsp_recompute", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument("--profile-update", action="store_true",
                    help="profile the last measured step's update (torch.profiler): top operators per variant")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "grpo_gpu.json"))
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run it on a GPU, or pass --device cpu --geometry small for a smoke run")
    work = Path(tempfile.mkdtemp(prefix="grpo-gpu-bench-"))
    t0 = time.time()
    out = Path(args.out)
    import transformers

    doc = {"benchmark": "grpo_gpu", "geometry": args.geometry, "geometry_config": GEOMETRIES[args.geometry],
           "config": {k: v for k, v in vars(args).items() if k not in ("out",)}, "results": {}, "speedup": {},
           # The stack is part of the result: transformers 5.17 silently dropped the vision features (grpo_gpu.md).
           "host": {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor(),
                    "cpus": os.cpu_count()}}
    try:
        model_dir = build_policy(work, args.geometry, args.device)
        doc["parameters"] = json.loads((Path(model_dir) / "bench_params.json").read_text())["parameters"]
        for frames in [int(f) for f in args.frames.split(",")]:
            res = doc["results"][str(frames)] = {}
            for name in args.variants.split(","):
                try:
                    res[name] = run_variant(name, model_dir, frames, args, work)
                except torch.OutOfMemoryError as e:  # a size that does not fit is a result, not a crash
                    res[name] = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
                gc.collect()  # the failed variant's trainer is freed once its traceback is gone
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(doc, indent=1) + "\n")  # after each variant: a time-out keeps what finished
            base = res.get("plain", {}).get("median", {}).get("time_step")
            doc["speedup"][str(frames)] = {k: round(base / v["median"]["time_step"], 3) for k, v in res.items()
                                           if base and k != "plain" and "median" in v}
            out.write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["wall_seconds"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["speedup"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
