"""What the pass-rate filter is worth: GRPO on the items the SFT model finds `medium` vs as many unfiltered items.

For each seed (tiny random Qwen2-VL, CPU, the task of ``benchmarks/learn.py``):

1. CoT-SFT on its own items (as ``learn.py``).
2. A pool of items is written as WebDataset shards with the pack writer, and ``longreel filter --shards`` (the
   pipeline's pass-rate filter, as a subprocess, on the packed shards) answers each k times with the SFT model and
   labels it easy / medium / hard.
3. Arms with the same number M of items, written as shards: ``medium`` (the first M medium items of the pool)
   and ``unfiltered`` (M items drawn at random from the whole pool, whatever their label); with ``--arms`` also
   ``online``: the unfiltered items under ``grpo.dynamic_sampling`` (DAPO's online filter: groups whose rewards tie
   under the current policy are dropped and more prompts drawn, up to ``--max-draws`` batches a step).
4. GRPO from the same SFT checkpoint, same settings and steps, on each arm; held-out greedy accuracy every
   ``--eval-every`` steps (``eval.every``, on shards of held-out items), and the SFT model's own at step 0.

``--reuse-sft`` / ``--reuse-filter`` take an earlier run's SFT model and pass-rate labels from ``--work`` (both are
deterministic under the seed and settings), so a new arm runs alone; ``--compare FILE`` then adds the other arms of
the same seeds from that earlier run's JSON (same settings, checked) to the comparisons and the plot, marked as
taken from it.

Writes ``benchmarks/results/passrate_value.json`` (filter statistics, per-arm reward curves and held-out accuracy
per step, per kind; CPU seconds from ``resource.getrusage``, children included) and ``passrate_value.png``.

    python benchmarks/passrate_value.py                          # 2 seeds
    python benchmarks/passrate_value.py --seeds 0 --grpo-steps 4 --pool-items 16 --arm-items 4 --eval-items 10 \\
        --eval-every 2 --out /tmp/pv.json                         # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learn  # noqa: E402  (benchmarks/learn.py: the same SFT/GRPO settings and helpers)
from learn import (REPO, _cfg, _common, _Clock, _eval, build_base, cpu_seconds, curve_row, pooled,  # noqa: E402
                   run_items, sft_config, write_run_shards)

from longreel.trainer.grpo import run_grpo  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.sft import run_sft  # noqa: E402
from longreel.trainer.synthetic_task import TIME_KINDS  # noqa: E402

ARMS = ("medium", "unfiltered", "online")
STYLE = {"medium": "-", "unfiltered": "--", "online": ":"}
# what may differ between runs that are merged or compared: how they were run, not what they measured
NOT_SETTINGS = ("seeds", "merge", "reuse_sft", "reuse_filter", "arms", "max_draws", "compare")


def run_filter_cli(pool_index: str, model: str, out_dir: Path, args, seed: int) -> dict:
    """``longreel filter --shards`` on the pool with the SFT model (or, with ``--reuse-filter``, an earlier run's
    output in ``out_dir``); return {qra_id: pass_rate row} and stats."""
    cmd = [sys.executable, "-m", "longreel", "filter", "--out", str(out_dir), "--shards", pool_index,
           "--model", model, "--set", f"k={args.k}", "--set", f"max_new_tokens={args.max_new_tokens}",
           "--set", f"temperature={args.temperature}", "--set", "sft_fraction=0", "--set", "device=cpu",
           "--set", f"seed={seed}", "--set", "batch_size=8"]
    reused = args.reuse_filter and (out_dir / "stats.json").exists()
    returncode = None
    if not reused:
        done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)), capture_output=True,
                              text=True)
        returncode = done.returncode
        # exit 0, or the "nothing survived" code: both leave a complete pass_rate table
        if not (out_dir / "stats.json").exists():
            raise RuntimeError(f"longreel filter failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {**read_filter_output(out_dir), "returncode": returncode, "reused": reused,
            "command": " ".join(["longreel"] + cmd[3:])}


def read_filter_output(out_dir: Path) -> dict:
    import pyarrow.parquet as pq

    rows = {}
    for f in sorted(out_dir.glob("pass_rate-*.parquet")):
        for r in pq.read_table(f).to_pylist():
            rows[r["qra_id"]] = r
    return {"rows": rows, "stats": json.loads((out_dir / "stats.json").read_text())["passrate"]}


def arm_sets(name: str, args) -> list[str]:
    """The trainer settings an arm adds to the shared GRPO settings."""
    if name == "online":
        return ["grpo.dynamic_sampling=true", f"grpo.max_draws={args.max_draws}"]
    return []


def mean_after_sft(held: list[dict]) -> float | None:
    """Held-out accuracy averaged over an arm's evaluations after step 0 (steady where single evaluations are noisy)."""
    accs = [h["accuracy"] for h in held if h["step"] > 0]
    return sum(accs) / len(accs) if accs else None


def comparisons(arms: dict) -> dict:
    """Points between arms, final and averaged over the evaluations, for the pairs both present."""
    out = {}
    for a, b in (("medium", "unfiltered"), ("online", "unfiltered"), ("online", "medium")):
        if a in arms and b in arms:
            out[f"{a}_minus_{b}"] = {
                "final_points": 100 * (arms[a]["final_accuracy"] - arms[b]["final_accuracy"]),
                "mean_over_evaluations_points": 100 * (arms[a]["mean_held_out"] - arms[b]["mean_held_out"])}
    return out


def curves(run_dir: Path) -> dict:
    reward, evals = [], []
    for r in read_metrics(run_dir / "metrics.jsonl"):
        reward.append(curve_row(r))
        if "eval_accuracy" in r:
            evals.append({"step": r["step"], "accuracy": r["eval_accuracy"],
                          "per_kind": {k.split("/", 1)[1]: v for k, v in r.items()
                                       if k.startswith("eval_accuracy/")}})
    return {"reward": reward, "held_out": evals}


def run_seed(seed: int, args, work: Path) -> dict:
    total = _Clock()
    wall, cpu = {}, {}

    sft_index = write_run_shards(run_items(args.sft_items, 300 + seed, args), work / f"sft_shards{seed}", args,
                                 dataset="sft", split="sft")
    held_out = run_items(args.eval_items, 5000 + seed, args)
    eval_index = write_run_shards(held_out, work / f"eval_shards{seed}", args, dataset="heldout", split="test")
    sft_dir = work / f"sft{seed}"
    reused = args.reuse_sft and (sft_dir / "final" / "config.json").exists()
    if not reused:  # SFT is deterministic under the seed: --reuse-sft takes an earlier run's (same settings)
        c = _Clock()
        base = build_base(seed, args, work)  # only SFT starts from it
        wall["build"], cpu["build"] = c.lap()
        c = _Clock()
        run_sft(sft_config(seed, args, base, sft_index, sft_dir))
        wall["sft"], cpu["sft"] = c.lap()
    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items

    sft_eval = _eval(str(sft_dir / "final"), load_items(DataConfig(source="shards", eval_urls=[eval_index]), "eval"),
                     args.max_new_tokens)

    pool = run_items(args.pool_items, 100 + seed, args)
    pool_index = write_run_shards(pool, work / f"pool{seed}", args, dataset="pool", split="rl")
    c = _Clock()
    filt = run_filter_cli(pool_index, str(sft_dir / "final"), work / f"filter{seed}", args, seed)
    wall["filter"], cpu["filter"] = c.lap()
    labels = {it["key"]: filt["rows"][it["key"]]["label"] for it in pool}
    by_kind: dict[str, dict[str, int]] = {}
    for it in pool:
        row = by_kind.setdefault(it["category"], {"easy": 0, "medium": 0, "hard": 0})
        row[labels[it["key"]]] += 1
    medium = [it for it in pool if labels[it["key"]] == "medium"]
    m = min(args.arm_items, len(medium))
    if m == 0:
        raise RuntimeError(f"seed {seed}: the filter kept no medium item of {len(pool)}")
    import numpy as np

    rng = np.random.default_rng([seed, 77])
    unfiltered = [pool[i] for i in sorted(rng.choice(len(pool), m, replace=False))]
    arms = {"medium": medium[:m], "unfiltered": unfiltered, "online": unfiltered}
    out = {}
    for name in args.arms.split(","):
        items = arms[name]
        index = write_run_shards(items, work / f"arm_{name}{seed}", args, dataset=name, split="rl")
        run_dir = work / f"grpo_{name}{seed}"
        c = _Clock()
        run_grpo(_cfg(_common(seed, args, index) + [
            f"model.path={sft_dir / 'final'}", f"run.out_dir={run_dir}", f"run.steps={args.grpo_steps}",
            f"data.batch_size={args.grpo_batch}", f"rollout.n={args.group}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
            f"optim.lr={args.grpo_lr}", f"optim.warmup_steps={args.grpo_warmup}", f"grpo.loss_agg={args.loss_agg}",
            f"grpo.ppo_epochs={args.ppo_epochs}", f"grpo.beta={args.grpo_beta}",
            f"data.eval_urls=[{eval_index}]", f"eval.every={args.eval_every}",
            f"eval.max_new_tokens={args.max_new_tokens}"] + list(args.grpo_set) + arm_sets(name, args)))
        wall[f"grpo_{name}"], cpu[f"grpo_{name}"] = c.lap()
        cv = curves(run_dir)
        held = [{"step": 0, "accuracy": sft_eval["accuracy"],
                 "per_kind": {k: v["accuracy"] for k, v in sft_eval["per_category"].items()}}] + cv["held_out"]
        for h in held:
            counts = {k: {"n": v["n"], "accuracy": h["per_kind"][k]} for k, v in sft_eval["per_category"].items()
                      if k in h["per_kind"]}
            h["time_kinds"] = pooled(counts, TIME_KINDS)
        out[name] = {"items": len(items),
                     "labels": {lab: sum(labels[it["key"]] == lab for it in items) for lab in ("easy", "medium", "hard")},
                     "reward_curve": cv["reward"], "held_out": held, "trainer_sets": arm_sets(name, args),
                     "final_accuracy": held[-1]["accuracy"], "final_time_kinds": held[-1]["time_kinds"],
                     "mean_held_out": mean_after_sft(held),
                     "mean_reward": sum(r["reward_mean"] for r in cv["reward"]) / max(len(cv["reward"]), 1)}
    wall["total"], cpu["total"] = total.lap()
    return {"seed": seed, "sft_reused": reused, "pool_items": len(pool), "arm_items": m, "pool_labels_by_kind": by_kind,
            "filter": {"stats": filt["stats"], "command": filt["command"], "returncode": filt["returncode"],
                       "reused": filt["reused"]},
            "sft_accuracy": sft_eval["accuracy"], "arms": out, "comparisons": comparisons(out),
            "wall_s": wall, "cpu_s": cpu}


def add_compared_arms(results: list[dict], path: str, args) -> None:
    """Adds to each seed's arms those of the same seed in an earlier run's JSON (run under the same settings: its
    arms are what this run would give for them), marked with ``from``; recomputes the comparisons."""
    doc = json.loads(Path(path).read_text())
    mine = {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS + ("out", "work", "replot", "notes")}
    theirs = {k: v for k, v in doc["settings"].items() if k not in NOT_SETTINGS}
    if any(theirs.get(k) != v for k, v in mine.items()):
        diff = sorted(k for k, v in mine.items() if theirs.get(k) != v)
        raise SystemExit(f"--compare {path}: settings differ ({', '.join(diff)})")
    earlier = {r["seed"]: r for r in doc["per_seed"]}
    for r in results:
        if r["seed"] not in earlier:
            raise SystemExit(f"--compare {path} has no seed {r['seed']}")
        old = earlier[r["seed"]]
        if old["sft_accuracy"] != r["sft_accuracy"]:
            raise SystemExit(f"--compare {path}: seed {r['seed']}'s SFT model differs "
                             f"({old['sft_accuracy']} vs {r['sft_accuracy']} held out)")
        for name, arm in old["arms"].items():
            if name not in r["arms"]:
                arm = dict(arm, **{"from": os.path.relpath(path, REPO)})
                arm.setdefault("mean_held_out", mean_after_sft(arm["held_out"]))
                r["arms"][name] = arm
        r["comparisons"] = comparisons(r["arms"])


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    w = 10
    for r in results:
        for name in [a for a in ARMS if a in r["arms"]]:
            arm = r["arms"][name]
            ys = [c["reward_mean"] for c in arm["reward_curve"]]
            avg = [sum(ys[max(0, i - w + 1):i + 1]) / len(ys[max(0, i - w + 1):i + 1]) for i in range(len(ys))]
            color = f"C{r['seed']}"
            ax[0].plot([c["step"] for c in arm["reward_curve"]], avg, STYLE[name], color=color,
                       label=f"seed {r['seed']} {name}")
            ax[1].plot([h["step"] for h in arm["held_out"]], [h["accuracy"] for h in arm["held_out"]], STYLE[name],
                       marker="o", color=color, label=f"seed {r['seed']} {name}")
    ax[0].set_xlabel("GRPO step")
    ax[0].set_ylabel(f"rollout reward ({w}-step mean)")
    ax[0].set_title("training reward (each arm on its own items)")
    ax[1].set_xlabel("GRPO step")
    ax[1].set_ylabel("held-out greedy accuracy")
    ax[1].set_title("held-out accuracy (same items for every arm)")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser():
    p = learn.build_parser()
    p.description = __doc__
    p.add_argument("--pool-items", type=int, default=96, help="items the filter labels")
    p.add_argument("--arm-items", type=int, default=48, help="items per arm at most (both arms get the same M)")
    p.add_argument("--k", type=int, default=8, help="filter samples per question")
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--reuse-sft", action="store_true", help="keep an SFT checkpoint already in --work (same seed "
                                                            "and settings) instead of training it again")
    p.add_argument("--reuse-filter", action="store_true", help="keep the pass-rate labels already in --work (same "
                                                               "SFT model, seed and settings) instead of filtering again")
    p.add_argument("--arms", default="medium,unfiltered",
                   help=f"comma-separated arms to train, of {', '.join(ARMS)} (online: the unfiltered items under "
                        "grpo.dynamic_sampling)")
    p.add_argument("--max-draws", type=int, default=3, help="online arm: grpo.max_draws")
    p.add_argument("--compare", help="an earlier run's JSON (same settings) whose other arms of the same seeds join "
                                     "the comparisons and the plot")
    # sized for a 2-core machine shared by 7 jobs (trial P1, 160 items / 120 steps, could not finish in time)
    p.set_defaults(kinds="colour," + ",".join(TIME_KINDS), grpo_steps=60, eval_items=100,
                   out=str(REPO / "benchmarks" / "results" / "passrate_value.json"))
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - set(ARMS))
    if unknown or not args.arms:
        parser.error(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    out = Path(args.out)
    if args.replot:
        doc = json.loads(out.read_text())
        plot(doc["per_seed"], out.with_suffix(".png"))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:  # seeds run as separate processes side by side: wall is the longest, CPU the sum
        docs = [json.loads(Path(f).read_text()) for f in args.merge.split(",")]
        drop = tuple(k for k in NOT_SETTINGS if k != "arms")
        if any({k: v for k, v in d["settings"].items() if k not in drop}
               != {k: v for k, v in docs[0]["settings"].items() if k not in drop} for d in docs):
            raise SystemExit("cannot merge runs with different settings")
        results = [r for d in docs for r in d["per_seed"]]
        args = argparse.Namespace(**dict(vars(args), **{k: v for k, v in docs[0]["settings"].items() if k != "merge"}))
        args.seeds = ",".join(d["settings"]["seeds"] for d in docs)
        return summarise(results, args, max(d["wall_s_total"] for d in docs), sum(d["cpu_s_total"] for d in docs),
                         out, argv, merged_from=docs)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="longreel-passrate-value-"))
    clock = _Clock()
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        r = run_seed(seed, args, work)
        results.append(r)
        finals = " / ".join(f"{name} {arm['final_accuracy']:.3f}" for name, arm in r["arms"].items())
        print(f"seed {seed}: M={r['arm_items']} items per arm; pool labels {r['filter']['stats']['labels']}; "
              f"held-out accuracy SFT {r['sft_accuracy']:.3f} -> {finals}; cpu {r['cpu_s']['total']:.0f}s",
              flush=True)
    wall, cpu = clock.lap()
    if args.compare:
        add_compared_arms(results, args.compare, args)
    return summarise(results, args, wall, cpu, out, argv)


def summarise(results, args, wall, cpu, out: Path, argv, merged_from=None) -> int:
    png = out.with_suffix(".png")
    plot(results, png)
    for r in results:  # runs written before the online arm carry neither figure
        for arm in r["arms"].values():
            arm.setdefault("mean_held_out", mean_after_sft(arm["held_out"]))
        r.setdefault("comparisons", comparisons(r["arms"]))
    pairs = sorted({k for r in results for k in r["comparisons"]})
    by_pair = {k: {stat: [r["comparisons"][k][stat] for r in results if k in r["comparisons"]]
                   for stat in ("final_points", "mean_over_evaluations_points")} for k in pairs}
    doc = {
        "benchmark": "passrate_value",
        "question": "GRPO on the SFT model's medium items vs the same number of unfiltered items, same steps"
                    + ("; and on the unfiltered items under dynamic sampling (online)" if "online" in args.arms
                       else ""),
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("out", "work", "replot", "notes", "merge", "reuse_sft", "reuse_filter", "compare")},
        "compared_with": args.compare,
        "merged_from": [d["command"] for d in merged_from] if merged_from else None,
        "per_seed": results,
        "comparisons_by_seed": by_pair,
        "mean_comparisons": {k: {stat: sum(v) / len(v) for stat, v in d.items() if v} for k, d in by_pair.items()},
        "wall_s_total": wall, "cpu_s_total": cpu,
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + list(argv if argv is not None
                                                                                  else sys.argv[1:])),
        "plot": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
        "notes": args.notes,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for k, d in by_pair.items():
        print(f"{k.replace('_', ' ')}: held-out accuracy {[round(g, 1) for g in d['final_points']]} points at the "
              f"last step, {[round(g, 1) for g in d['mean_over_evaluations_points']]} averaged over the evaluations")
    print(f"wall {wall:.0f}s, cpu {cpu:.0f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
