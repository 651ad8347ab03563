"""It learns: CoT-SFT then GRPO on a procedurally generated video task, tiny Qwen2-VL policy, CPU.

For each seed: build the tiny random Qwen2-VL (offline), CoT-SFT on a few items for a few steps (format, little
skill, so GRPO has room), evaluate greedy accuracy on held-out items, GRPO, evaluate again. Writes
``benchmarks/results/learn.json`` (accuracy before/after per seed, steps, wall time) and
``benchmarks/results/learn_reward.png`` (GRPO reward and held-out accuracy curves). Wall and CPU seconds
(``resource.getrusage``: this process and its children) are recorded per phase; ``passed`` needs a gain of at least
15 points on every seed within ``--cpu-budget-s`` CPU seconds (20 CPU-minutes; wall time is inflated on a shared
machine). With time kinds in ``--kinds`` (``synthetic_task.TIME_KINDS``: answerable only from several frames) the
gain that counts is the pooled one on the time kinds run, and the budget is per seed-run
(``passed_on_all_time_kinds`` says whether the run held all four, as the issue's target pools them); the JSON also
holds, per kind, the held-out accuracy of a rule-based solver that sees only the middle frame (at chance on the
time kinds) and of one that sees all frames (100 %), so the model's numbers can be read against both.

    python benchmarks/learn.py --kinds colour,order,count_colours,direction,change --temporal-patch 4 \
        --out benchmarks/results/learn_time.json

``--temporal-patch`` sets how many consecutive frames one vision patch spans in the tiny model (Qwen's 2 by
default); ``--patch-embed frame_difference`` builds it with a patch embedding over consecutive frames' differences
(trial T5: no better than the random one; ``learn_varshare.py`` measures why); ``--tower-pretrain-steps N`` first
trains the vision tower for N steps to tell what each cell of each frame holds, from labels read off the pixels
(``longreel.testing.perception_tower``; a stand-in for a pretrained tower, never shown a question; diagnostic D22:
with it perfect, SFT learns no time kind with the default 2-layer language model, and 'change' only with 4 layers
of width 128). Every trial on the time kinds,
with its settings fixed before it ran and the diagnostics between trials, is in ``results/learn_time_trials.json``.

Why these defaults (``benchmarks/learn_diagnose.py``, ``results/learn_diagnose.json``, ``results/learn_trials.json``):
SFT at lr 1e-2 over-trained the tiny model on its 64 items and, for seed 1, collapsed the vision-merger features of
red/green/blue (they stayed separable only for seed 0), leaving GRPO nothing to sharpen; SFT lr 3e-3 learns the
format without that collapse. GRPO takes 8 prompts a step, and a KL term to the SFT reference (beta 0.1) keeps
GRPO from collapsing red/green/blue onto one letter (all groups tied) before it has learned to tell them apart.

    python benchmarks/learn.py                 # the full run (2 seeds)
    python benchmarks/learn.py --seeds 0 --grpo-steps 10 --out /tmp/learn.json   # a quick look

Nothing here is tuned to the task beyond what the JSON records: the task, the SFT budget and the GRPO settings are
fixed before the run and written to the JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from longreel.schemas.config import load_yaml  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.eval import evaluate  # noqa: E402
from longreel.trainer.grpo import run_grpo  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.policy import load_policy  # noqa: E402
from longreel.trainer.sft import run_sft  # noqa: E402
from longreel.trainer.config import DataConfig  # noqa: E402
from longreel.trainer.runtime import load_items  # noqa: E402
from longreel.trainer.synthetic_solvers import oracle_answer, single_frame_answer  # noqa: E402
from longreel.trainer.synthetic_task import REASONING, TIME_KINDS, make_items, write_shards  # noqa: E402
from longreel.testing.perception_tower import PERCEPTION_MARKER, pretrain_perception_tower  # noqa: E402
from longreel.testing.tiny_model import PATCH_EMBEDS, build_tiny_qwen2vl  # noqa: E402


def _cfg(overrides: list[str]) -> TrainConfig:
    return load_yaml(TrainConfig, None, overrides)


def _eval(path: str, items, max_new_tokens: int) -> dict:
    model, processor = load_policy(path)
    model.eval()
    return evaluate(model, processor, items, max_new_tokens=max_new_tokens)


def run_items(n: int, seed: int, args) -> list[dict]:
    """``n`` synthetic items of the run's kinds, frame shape and reasoning style (``--kinds``, ``--frames``,
    ``--size``, ``--radius``, ``--reasoning``); every benchmark built on this one draws its items here."""
    return make_items(n, seed=seed, kinds=args.kinds.split(","), n_frames=args.frames, size=args.size,
                      radius=args.radius, reasoning=args.reasoning)


def write_run_shards(items: list[dict], out_dir: Path, args, **kw) -> str:
    """``items`` written as shards with the pack writer (the task goes through the project's own shard writer and
    loader, like real data); the cached ``video_grid_thw`` is the ``--temporal-patch`` processor's, which the
    loader checks against the policy's. Returns the index path."""
    return write_shards(items, str(out_dir), temporal_patch_size=args.temporal_patch, **kw)


def held_out_items(seed: int, args, work: Path) -> list[dict]:
    """The ``--eval-items`` held-out items of ``seed`` (stream 5000 + seed), written as shards and read back through
    the loader."""
    items = run_items(args.eval_items, 5000 + seed, args)
    eval_index = write_run_shards(items, work / f"shards{seed}", args, split="test")
    return load_items(DataConfig(source="shards", eval_urls=[eval_index]), "eval")


def prepare_data(seed: int, args, work: Path):
    """Train/held-out items of ``seed`` written as shards with the pack writer; return (train_index, held_out)."""
    train = run_items(args.train_items, 100 + seed, args)
    train_index = write_run_shards(train, work / f"shards{seed}", args, split="rl")
    return train_index, held_out_items(seed, args, work)


def _common(seed: int, args, train_index: str) -> list[str]:
    return ["data.source=shards", f"data.train_urls=[{train_index}]", f"run.seed={seed}", "run.progress=false",
            "run.tensorboard=false", f"run.threads={args.threads}", "run.save_every=0"]


def build_base(seed: int, args, work: Path) -> str:
    """The tiny model SFT starts from: random, or with its vision tower pretrained on perception (its report is the
    directory's ``PERCEPTION_MARKER`` file)."""
    base = build_tiny_qwen2vl(work / f"base{seed}", seed=seed, hidden_size=args.hidden_size,
                              num_layers=args.layers, temporal_patch_size=args.temporal_patch,
                              rope_theta=args.rope_theta, patch_embed=args.patch_embed,
                              spatial_merge_size=args.spatial_merge)
    if not args.tower_pretrain_steps:
        return base
    pretrain_perception_tower(
        base, work / f"base{seed}_perception", kinds=args.kinds.split(","), steps=args.tower_pretrain_steps,
        batch=args.tower_pretrain_batch, lr=args.tower_pretrain_lr, train_items=args.tower_pretrain_items,
        seed=seed, n_frames=args.frames, size=args.size, radius=args.radius, threads=args.threads)
    return str(work / f"base{seed}_perception")


def tower_report(base: str) -> dict | None:
    """The perception pretraining's report of a base built by :func:`build_base` (None for a random tower)."""
    path = Path(base) / PERCEPTION_MARKER
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def sft_config(seed: int, args, base: str, train_index: str, out_dir: Path) -> TrainConfig:
    return _cfg(_common(seed, args, train_index) + [
        f"model.path={base}", f"run.out_dir={out_dir}", f"run.steps={args.sft_steps}",
        f"sft.max_items={args.sft_items}", f"data.batch_size={args.sft_batch}", f"optim.lr={args.sft_lr}"]
        + list(args.sft_set))


def grpo_config(seed: int, args, init: str, train_index: str, out_dir: Path, steps: int | None = None) -> TrainConfig:
    return _cfg(_common(seed, args, train_index) + [
        f"model.path={init}", f"run.out_dir={out_dir}", f"run.steps={args.grpo_steps if steps is None else steps}",
        f"data.batch_size={args.grpo_batch}", f"rollout.n={args.group}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        f"optim.lr={args.grpo_lr}", f"optim.warmup_steps={args.grpo_warmup}", f"grpo.loss_agg={args.loss_agg}",
        f"grpo.ppo_epochs={args.ppo_epochs}", f"grpo.beta={args.grpo_beta}"] + list(args.grpo_set))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and its waited-for children (resource.getrusage)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class _Clock:
    """Wall (perf_counter) and CPU (:func:`cpu_seconds`) seconds since creation."""

    def __init__(self):
        self.wall0, self.cpu0 = time.perf_counter(), cpu_seconds()

    def lap(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, cpu_seconds() - self.cpu0


def solver_baselines(items) -> dict:
    """Held-out accuracy per kind of the rule-based solvers that read pixels (no training): one that sees only the
    middle frame, one that sees all frames, and a uniform guess."""
    out: dict[str, dict] = {}
    for it in items:
        frames = it["frames"].numpy()
        row = out.setdefault(it["category"], {"n": 0, "single_frame": 0.0, "all_frames_oracle": 0.0, "chance": 0.0})
        row["n"] += 1
        row["single_frame"] += single_frame_answer(frames, it["question"], it["options"]) == it["answer"]
        row["all_frames_oracle"] += oracle_answer(frames, it["question"], it["options"]) == it["answer"]
        row["chance"] += 1.0 / len(it["options"])
    for row in out.values():
        for k in ("single_frame", "all_frames_oracle", "chance"):
            row[k] /= row["n"]
    return out


def pooled(per_category: dict, kinds) -> float | None:
    """Item-weighted accuracy over ``kinds`` from an ``evaluate`` per-category table (None when none is there)."""
    rows = [per_category[k] for k in kinds if k in per_category]
    n = sum(r["n"] for r in rows)
    return sum(r["accuracy"] * r["n"] for r in rows) / n if n else None


def curve_row(metrics: dict) -> dict:
    """One GRPO step of the reward curve: the step's means, the share of groups with signal (rewards not all
    equal), the KL to the reference, the share of truncated responses, the batches drawn and groups kept under
    ``grpo.dynamic_sampling`` and the training reward per kind (the trainer's ``reward_mean/<category>``), where
    the trainer logged them."""
    row = {k: metrics[k] for k in ("step", "reward_mean", "format_rate", "accuracy", "response_len_mean")}
    for k in ("groups_with_signal", "kl", "truncated_frac", "dynamic_draws", "dynamic_kept_groups"):
        if k in metrics:
            row[k] = metrics[k]
    by_kind = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("reward_mean/")}
    if by_kind:
        row["reward_by_kind"] = by_kind
    return row


def _running_mean(ys: list, w: int) -> list:
    """Mean of the last ``w`` values at each position; ``None`` values (a kind absent from a step) are skipped."""
    out = []
    for i in range(len(ys)):
        win = [y for y in ys[max(0, i - w + 1):i + 1] if y is not None]
        out.append(sum(win) / len(win) if win else None)
    return out


def run_seed(seed: int, args, work: Path) -> dict:
    total = _Clock()
    wall, cpu = {}, {}
    base = build_base(seed, args, work)
    wall["build"], cpu["build"] = total.lap()
    train_index, held_out = prepare_data(seed, args, work)

    sft_dir = work / f"sft{seed}"
    c = _Clock()
    run_sft(sft_config(seed, args, base, train_index, sft_dir))
    wall["sft"], cpu["sft"] = c.lap()
    c = _Clock()
    before = _eval(str(sft_dir / "final"), held_out, args.max_new_tokens)
    wall["eval_sft"], cpu["eval_sft"] = c.lap()

    grpo_dir = work / f"grpo{seed}"
    c = _Clock()
    run_grpo(grpo_config(seed, args, str(sft_dir / "final"), train_index, grpo_dir))
    wall["grpo"], cpu["grpo"] = c.lap()
    c = _Clock()
    after = _eval(str(grpo_dir / "final"), held_out, args.max_new_tokens)
    wall["eval_grpo"], cpu["eval_grpo"] = c.lap()
    wall["total_with_eval"], cpu["total_with_eval"] = total.lap()
    curve = [curve_row(r) for r in read_metrics(grpo_dir / "metrics.jsonl")]
    c = _Clock()
    baselines = solver_baselines(held_out)
    wall["solver_baselines"], cpu["solver_baselines"] = c.lap()
    time_kinds = [k for k in TIME_KINDS if k in before["per_category"]]
    time_sft, time_grpo = pooled(before["per_category"], time_kinds), pooled(after["per_category"], time_kinds)
    n_time = sum(baselines[k]["n"] for k in time_kinds)
    return {
        "time_kinds": time_kinds,
        "accuracy_time_sft": time_sft, "accuracy_time_grpo": time_grpo,
        "gain_points_time": None if time_sft is None else 100.0 * (time_grpo - time_sft),
        "solver_baselines": baselines,
        "single_frame_time": (sum(baselines[k]["single_frame"] * baselines[k]["n"] for k in time_kinds) / n_time
                              if n_time else None),
        "chance_time": sum(baselines[k]["chance"] * baselines[k]["n"] for k in time_kinds) / n_time if n_time else None,
        "seed": seed,
        "accuracy_sft": before["accuracy"], "format_rate_sft": before["format_rate"],
        "accuracy_grpo": after["accuracy"], "format_rate_grpo": after["format_rate"],
        "gain_points": 100.0 * (after["accuracy"] - before["accuracy"]),
        "per_category_sft": before["per_category"], "per_category_grpo": after["per_category"],
        "sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps,
        "tower_pretrain": tower_report(base),
        "wall_s": wall, "cpu_s": cpu,
        "grpo_curve": curve,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_kind = any("reward_by_kind" in c for r in results for c in r["grpo_curve"])
    fig, ax = plt.subplots(1, 3 if by_kind else 2, figsize=(18 if by_kind else 12, 3.8))
    w = 10
    for r in results:
        steps = [c["step"] for c in r["grpo_curve"]]
        ys = [c["reward_mean"] for c in r["grpo_curve"]]
        (raw,) = ax[0].plot(steps, ys, alpha=0.25)
        ax[0].plot(steps, _running_mean(ys, w), color=raw.get_color(), label=f"seed {r['seed']} ({w}-step mean)")
    if by_kind:
        _plot_reward_by_kind(ax[2], results, 25)
    kinds = sorted(results[0]["per_category_sft"])
    width = 0.8 / (2 * len(results) + 1)
    for j, r in enumerate(results):
        for h, (stage, key) in enumerate((("SFT", "per_category_sft"), ("GRPO", "per_category_grpo"))):
            off = (2 * j + h) * width
            ax[1].bar([i + off for i in range(len(kinds))], [r[key][k]["accuracy"] for k in kinds], width,
                      label=f"seed {r['seed']} {stage}")
    base = results[0]["solver_baselines"]
    ax[1].bar([i + 2 * len(results) * width for i in range(len(kinds))], [base[k]["single_frame"] for k in kinds],
              width, color="0.6", label="single-frame solver")
    ax[1].set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds, rotation=20)
    ax[1].legend(fontsize=7)
    ax[0].set_xlabel("GRPO step")
    ax[0].set_ylabel("mean rollout reward")
    ax[0].set_title("GRPO reward (training rollouts)")
    ax[0].legend()
    ax[1].set_ylim(0, 1)
    ax[1].set_title("held-out greedy accuracy per kind")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_reward_by_kind(ax, results: list[dict], w: int) -> None:
    """Training reward per kind, a ``w``-step running mean: one colour per kind, one line style per seed."""
    kinds = sorted({k for r in results for c in r["grpo_curve"] for k in c.get("reward_by_kind", {})})
    colours = {k: f"C{i}" for i, k in enumerate(kinds)}
    for j, r in enumerate(results):
        steps = [c["step"] for c in r["grpo_curve"]]
        for k in kinds:
            ys = [c.get("reward_by_kind", {}).get(k) for c in r["grpo_curve"]]
            pts = [(s, y) for s, y in zip(steps, _running_mean(ys, w)) if y is not None]
            if pts:
                ax.plot(*zip(*pts), color=colours[k], linestyle=("-", "--", ":")[j % 3],
                        label=f"{k} (seed {r['seed']})")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"training reward ({w}-step mean)")
    ax.set_title("GRPO reward per kind")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=2)


def add_item_options(p, *, train: bool = True) -> None:
    """The synthetic items of a seed: which kinds, how the videos are drawn, how many (``train``: the training items
    too, not only the held-out ones)."""
    g = p.add_argument_group("items")
    g.add_argument("--seeds", default="0,1")
    g.add_argument("--kinds", default="colour", help="synthetic question kinds, comma-separated")
    g.add_argument("--frames", type=int, default=4, help="frames per video")
    g.add_argument("--size", type=int, default=112, help="frame side in pixels (a multiple of 28)")
    g.add_argument("--radius", type=float, default=0.25, help="ball radius as a fraction of the frame side")
    g.add_argument("--reasoning", default="short", choices=REASONING,
                   help="CoT targets of the time kinds: a one-phrase reason, or 'trace' (what each frame shows, "
                        "then the answer; synthetic_task._trace)")
    if train:
        g.add_argument("--train-items", type=int, default=512)
    g.add_argument("--eval-items", type=int, default=100)


def add_build_options(p) -> None:
    """The tiny policy SFT starts from."""
    g = p.add_argument_group("tiny model build")
    g.add_argument("--hidden-size", type=int, default=64, help="tiny model text width (build parameter)")
    g.add_argument("--layers", type=int, default=2, help="tiny model text decoder layers (build parameter)")
    g.add_argument("--rope-theta", type=float, default=1e6,
                   help="tiny model text rotary base (build parameter; Qwen2-VL's 1e6)")
    g.add_argument("--temporal-patch", type=int, default=2,
                   help="frames per vision patch of the tiny model (build parameter; Qwen's 2); the shards are "
                        "written for it")
    g.add_argument("--spatial-merge", type=int, default=2,
                   help="patches per side of one merged vision token of the tiny model (build parameter; Qwen's 2; "
                        "8 at 112 px: one token per frame group)")
    g.add_argument("--patch-embed", default="random", choices=PATCH_EMBEDS,
                   help="tiny model vision patch embedding (build parameter): the library's random init, or "
                        "'frame_difference' (most channels see consecutive frames' difference; see tiny_model)")
    g.add_argument("--tower-pretrain-steps", type=int, default=0,
                   help="steps of perception pretraining of the vision tower before SFT (0: the random tower): "
                        "per-cell, per-frame labels read from the pixels (longreel.testing.perception_tower), "
                        "never the questions; its CPU time counts in the seed-run's")
    g.add_argument("--tower-pretrain-items", type=int, default=1024)
    g.add_argument("--tower-pretrain-batch", type=int, default=16)
    g.add_argument("--tower-pretrain-lr", type=float, default=1e-3)


def add_max_new_tokens(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=16, help="response length cap of rollouts and evaluation")


def add_training_options(p) -> None:
    """SFT and GRPO settings."""
    g = p.add_argument_group("training")
    g.add_argument("--sft-items", type=int, default=64)
    g.add_argument("--sft-steps", type=int, default=60)
    g.add_argument("--sft-batch", type=int, default=4)
    g.add_argument("--sft-lr", type=float, default=3e-3)
    g.add_argument("--sft-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer.config override for the SFT stage (repeatable)")
    g.add_argument("--grpo-steps", type=int, default=250)
    g.add_argument("--grpo-batch", type=int, default=8)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--grpo-lr", type=float, default=1e-3)
    g.add_argument("--grpo-warmup", type=int, default=0, help="optim.warmup_steps of the GRPO stage")
    g.add_argument("--ppo-epochs", type=int, default=1, help="grpo.ppo_epochs")
    g.add_argument("--grpo-beta", type=float, default=0.1,
                   help="grpo.beta: KL (k3) to the SFT reference; keeps the answer distribution from collapsing "
                        "before the weak colour features are learned")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--loss-agg", default="token_mean")
    g.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer.config override for the GRPO stage (repeatable)")
    add_max_new_tokens(g)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_item_options(p)
    add_build_options(p)
    add_training_options(p)
    g = p.add_argument_group("run")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--cpu-budget-s", type=float, default=1200.0, help="the CPU-seconds target (20 CPU-minutes)")
    g.add_argument("--notes", default="", help="free text stored in the JSON")
    g.add_argument("--work", default="", help="working directory (default: a temp dir)")
    g.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "learn.json"))
    g.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing --out JSON")
    g.add_argument("--merge", default="", metavar="A.json,B.json",
                   help="combine the JSONs of seeds run as separate processes into --out (no training)")
    return p


def run_seeds(args):
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="longreel-learn-"))
    clock = _Clock()
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        r = run_seed(seed, args, work)
        results.append(r)
        if r["gain_points_time"] is not None:
            print(f"seed {seed}: time kinds SFT {r['accuracy_time_sft']:.3f} -> GRPO {r['accuracy_time_grpo']:.3f} "
                  f"({r['gain_points_time']:+.1f}); per kind GRPO "
                  f"{ {k: v['accuracy'] for k, v in r['per_category_grpo'].items()} }", flush=True)
        print(f"seed {seed}: held-out accuracy SFT {r['accuracy_sft']:.3f} -> GRPO {r['accuracy_grpo']:.3f} "
              f"({r['gain_points']:+.1f} points; format {r['format_rate_sft']:.2f} -> {r['format_rate_grpo']:.2f}); "
              f"sft {r['wall_s']['sft']:.0f}s/{r['cpu_s']['sft']:.0f} cpu-s, "
              f"grpo {r['wall_s']['grpo']:.0f}s/{r['cpu_s']['grpo']:.0f} cpu-s", flush=True)
    wall, cpu = clock.lap()
    return results, wall, cpu


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.replot:
        doc = json.loads(Path(args.out).read_text())
        plot(doc["per_seed"], REPO / doc["reward_curve_png"])
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.merge:
        results, wall, cpu, args = merge_runs(args.merge, args)
    else:
        results, wall, cpu = run_seeds(args)
    png = out.with_name(out.stem + "_reward.png")
    plot(results, png)
    return summarise(results, args, wall, cpu, out, png, argv)


def merge_runs(paths: str, args):
    """Seeds run as separate processes (side by side): one document; the settings must agree but for the seeds.
    Wall is the longest run's, CPU the sum."""
    docs = [json.loads(Path(p).read_text()) for p in paths.split(",")]
    ignore = ("seeds", "merge", "cpu_budget_s")
    first = {k: v for k, v in docs[0]["settings"].items() if k not in ignore}
    for d in docs[1:]:
        other = {k: v for k, v in d["settings"].items() if k not in ignore}
        if other != first:
            raise SystemExit(f"cannot merge runs with different settings: {first} vs {other}")
    merged = argparse.Namespace(**dict(vars(args), **first))
    merged.seeds = ",".join(d["settings"]["seeds"] for d in docs)
    results = [r for d in docs for r in d["per_seed"]]
    return results, max(d["wall_s_total"] for d in docs), sum(d["cpu_s_total"] for d in docs), merged


def summarise(results, args, wall, cpu, out, png, argv) -> int:
    min_gain = min(r["gain_points"] for r in results)
    time_gains = [r["gain_points_time"] for r in results if r["gain_points_time"] is not None]
    max_seed_cpu = max(r["cpu_s"]["total_with_eval"] for r in results)
    # with time kinds in the mix the target is theirs: GRPO >= +15 points over SFT on the pooled time kinds, every
    # seed, each seed-run within the CPU budget; without them, the original overall-gain target
    if time_gains:
        passed = round(min(time_gains), 6) >= 15.0 and max_seed_cpu <= args.cpu_budget_s
    else:
        passed = round(min_gain, 6) >= 15.0 and cpu <= args.cpu_budget_s
    kinds_run = args.kinds.split(",")
    # the target pools all four time kinds; a run on some of them can pass on those only
    all_time_kinds = all(k in kinds_run for k in TIME_KINDS)
    summary = {
        "benchmark": "learn",
        "task": {"kinds": args.kinds.split(","), "generator": "longreel.trainer.synthetic_task",
                 "data_path": "synthetic_task.write_shards (longreel.task.shard_format writer) -> trainer.data loader", "train_items": args.train_items,
                 "eval_items": args.eval_items, "frames": args.frames, "size": args.size, "radius": args.radius,
                 "reasoning": args.reasoning},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work", "replot", "notes", "merge")},
        "merged_from": args.merge.split(",") if args.merge else None,
        "per_seed": results,
        "min_gain_points": min_gain,
        "min_gain_points_time_kinds": min(time_gains) if time_gains else None,
        "target_gain_points": 15.0,
        "cpu_budget_s": args.cpu_budget_s,
        "max_seed_cpu_s": max_seed_cpu,
        # the target is "within 20 CPU-minutes": judged on CPU time from resource.getrusage (wall time is inflated
        # on a shared machine and is reported beside it)
        "passed": passed,
        "time_kinds_run": [k for k in TIME_KINDS if k in kinds_run],
        "passed_on_all_time_kinds": bool(time_gains) and passed and all_time_kinds,
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + list(argv if argv is not None
                                                                                  else sys.argv[1:])),
        "wall_s_total": wall,
        "cpu_s_total": cpu,
        "cpu": {"threads": args.threads, "machine": platform.machine(), "cpus_visible": os.cpu_count(),
                "torch": torch.__version__},
        "reward_curve_png": str(png.relative_to(REPO)) if png.is_relative_to(REPO) else str(png),
        "notes": args.notes,
    }
    out.write_text(json.dumps(summary, indent=1) + "\n")
    if time_gains:
        print(f"time kinds: gains {[round(g, 1) for g in time_gains]} points (single-frame solver "
              f"{[round(r['single_frame_time'], 3) for r in results]}, chance {results[0]['chance_time']:.3f})")
    print(f"total wall {wall:.0f}s, cpu {cpu:.0f}s; min gain {min_gain:.1f} points; passed={summary['passed']} "
          f"(on the time kinds {summary['time_kinds_run']}; on all four: {summary['passed_on_all_time_kinds']}); "
          f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
