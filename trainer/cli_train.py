"""``longreel train sft|grpo|plot|export``: the trainer's command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from longreel.schemas.config import ConfigError, describe, dump_yaml, load_yaml, unexpected_arguments

log = logging.getLogger("longreel")

DESCRIPTION = """\
Train a video-language policy.

  longreel train sft  --config train.yaml [--set key=value ...]   stage 1: CoT-SFT on <think>/<answer> targets
  longreel train grpo --config train.yaml [--set key=value ...]   stage 2: GRPO with verifiable rewards
  longreel train plot RUN_DIR [RUN_DIR ...] --out curves.png       metric curves of runs to a PNG
  longreel train export RUN/checkpoints/step-N --out DIR           a step checkpoint as a model directory

Every config key can be set from the command line, e.g. --set rollout.n=8 --set optim.lr=1e-6; list them all with
--show-config. Runs resume from RUN/checkpoints when a checkpoint exists (run.resume) and the run there had the same
stage and config (run length, saving, logging, launch, eval and memory keys may differ; run.resume=false starts
over). One run at a time per run.out_dir (RUN/.longreel-train.lock); RUN/config.yaml records its config.
model.path, the shards (and their room in the cache), the launch and the machine are checked before the model loads
(exit 2). Multi-process data parallel:
  torchrun --nproc_per_node 2 -m longreel train grpo --config train.yaml
(gloo on CPU, NCCL on GPU; dist.strategy=fsdp shards the model over the ranks). Several nodes: torchrun on each with one
--rdzv_endpoint, or one process per GPU (srun) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
(docs/TRAINER.md); run.out_dir must be one directory every node mounts (checked before step 1).
SIGTERM or SIGUSR1 (run.stop_signals; Slurm preemption, scancel, sbatch --signal=USR1@300, Kubernetes, torchrun's
shutdown) stops the run after the step in flight with a checkpoint, exit 128 + the signal's number; a second
signal stops it at once. torchrun forwards SIGTERM to the ranks and kills them --shutdown_timeout seconds later
(default 30: give the save time); it forwards SIGUSR1 only with --signals_to_handle SIGTERM,SIGINT,SIGUSR1.
Shards are loaded before step 1 (remote ones through a disk cache); --set data.stream=true reads them as a stream
instead (shard order permuted per epoch, remote shards cached as they are reached), for data too large to fetch first.
Outputs in run.out_dir: metrics.jsonl, tensorboard/, checkpoints/step-N/, final/ (save_pretrained). A step
checkpoint also holds the config and processor files: `longreel eval --model RUN/checkpoints/step-N` reads it.
An FSDP run's step checkpoints hold every rank's shards instead of model.safetensors: `longreel train export` gathers
one in a single process (no GPU, no process group) into a save_pretrained directory; from an unsharded one it copies
the weights and policy files without the optimizer and trainer state.
"""


EXIT_CODES = """\
exit codes:
  0  success: the steps are done (final/ written unless run.save_final=false), or the run stopped at
     run.stop_after before its last step (a checkpoint, no final/); plot and export: written
  1  the run failed: an internal error (a traceback is printed; please report it), or the machine refused
     (disk full, permission denied: one line, no traceback); the newest whole checkpoint resumes it
  2  usage or config error, or a check before the model loads failed (model.path, the shards, the launch,
     run.out_dir held by another run or holding another run's checkpoints, no whole checkpoint to resume).
     One line, no traceback.
  128+N  stopped after the step in flight by signal N of run.stop_signals (SIGTERM: 143, SIGUSR1: 138),
     with a checkpoint; the same command resumes the run
  130 interrupted (Ctrl-C): one line; the run resumes from its newest checkpoint
-v/--debug shows the traceback of any error.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stage", nargs="?", choices=("sft", "grpo", "plot", "export"), help="What to run.")
    p.add_argument("runs", nargs="*", metavar="RUN_DIR",
                   help="plot: run directories or metrics.jsonl files; export: one step checkpoint directory.")
    p.add_argument("--config", help="YAML config file (see --show-config for every key).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set rollout.n=8 (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")
    p.add_argument("--print-config", action="store_true", help="sft/grpo: print the resolved config as YAML; exit.")
    p.add_argument("--out", help="plot: output PNG path (default: curves.png in the first RUN_DIR, or beside its "
                                 "metrics.jsonl); export: the new model directory.")
    # default None, not False or 1: an option given to a stage that does not read it is refused (_unread_option)
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="export: allow model code shipped with the checkpoint (model.trust_remote_code). Opt-in.")
    p.add_argument("--keys", help="plot: comma-separated metric names (default: by stage).")
    p.add_argument("--smooth", type=int, help="plot: moving-average window (steps, >= 1; default 1).")


#: what to use instead of an option that a stage does not read, by option and stage group ("train": sft and grpo)
_INSTEAD = {
    ("--out", "train"): "the run's directory is run.out_dir: use --set run.out_dir=DIR",
    ("--keys", "train"): "it is train plot's: draw the run's curves with `longreel train plot RUN_DIR --keys ...`",
    ("--smooth", "train"): "it is train plot's: draw the run's curves with `longreel train plot RUN_DIR --smooth N`",
    ("--trust-remote-code", "train"): "it is train export's: use --set model.trust_remote_code=true",
    ("--trust-remote-code", "plot"): "it is train export's; plot loads no model",
    ("--print-config", "plot"): "it is sft's and grpo's; plot reads the runs' metrics.jsonl",
    ("--config", "plot"): "plot draws the runs' metrics.jsonl as they are; it takes no config",
    ("--set", "plot"): "plot draws the runs' metrics.jsonl as they are; it takes no config",
    ("--keys", "export"): "it is train plot's; export draws nothing",
    ("--smooth", "export"): "it is train plot's; export draws nothing",
    ("--print-config", "export"): "it is sft's and grpo's; an export's config is the checkpoint's config.json",
}


def _unread_option(args) -> str | None:
    """The first option given that ``args.stage`` does not read, with what to use instead; None when there is none.
    Every stage shares one parser, so ``train sft --out DIR`` parsed, and the run went to the default run.out_dir
    while DIR never existed (exit 0)."""
    group = "train" if args.stage in ("sft", "grpo") else args.stage
    given = {"--out": args.out is not None, "--keys": args.keys is not None, "--smooth": args.smooth is not None,
             "--trust-remote-code": args.trust_remote_code is not None, "--print-config": args.print_config,
             "--config": args.config is not None, "--set": bool(args.overrides)}
    for option, instead in ((o, _INSTEAD.get((o, group))) for o, on in given.items() if on):
        if instead is not None:
            return f"{option} is not an option of train {args.stage}: {instead}"
    return None


def main(args, extra: list[str]) -> int:
    if extra:
        print(f"longreel train: {unexpected_arguments(extra, getattr(args, '_options', ()))}", file=sys.stderr)
        return 2
    from longreel.trainer.config import TrainConfig, with_absolute_paths

    if args.show_config:
        for key, default, help_text in describe(TrainConfig):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if args.stage is None:
        print("longreel train: give a stage: sft, grpo, plot or export", file=sys.stderr)
        return 2
    unread = _unread_option(args)
    if unread is not None:
        print(f"longreel train {args.stage}: {unread}", file=sys.stderr)
        return 2
    if args.stage == "plot":
        return plot(args)
    if args.stage == "export":
        return export(args)
    if args.runs:
        # a run directory would be run.out_dir: --config is the one positional a user means here
        print(f"longreel train {args.stage}: {unexpected_arguments(args.runs, getattr(args, '_options', ()))}",
              file=sys.stderr)
        return 2
    try:
        cfg = with_absolute_paths(load_yaml(TrainConfig, args.config, args.overrides))
    except (ConfigError, OSError) as e:
        print(f"longreel train: bad config: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from longreel.trainer.preflight import InputCheckError, check_run_inputs
    from longreel.trainer.run_lock import check_free

    try:
        check_run_inputs(cfg, args.stage)
        check_free(cfg.run.out_dir)  # before the process group and the model load, not after them
    except InputCheckError as e:
        print(f"longreel train {args.stage}: {e}", file=sys.stderr)
        return 2
    if args.stage == "sft":
        from longreel.trainer.sft import run_sft as run
    else:
        from longreel.trainer.grpo import run_grpo as run
    try:
        result = run(cfg)
    except InputCheckError as e:  # found once the data or the model is loaded: still the user's input, not a bug
        print(f"longreel train {args.stage}: {e}", file=sys.stderr)
        return 2
    import os

    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank:
        print(json.dumps({k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}, sort_keys=True))
    if "signal" not in result:
        return 0
    # a run cut short by the scheduler is not a finished one: a job chain must not go on to use final/
    import signal

    if main_rank:
        print(f"longreel train {args.stage}: stopped after step {result['step']} on {result['signal']}, with a "
              f"checkpoint in {cfg.run.out_dir}/checkpoints; the same command resumes the run", file=sys.stderr)
    return 128 + int(signal.Signals[result["signal"]])


def plot(args) -> int:
    if not args.runs:
        print("longreel train plot: give at least one RUN_DIR", file=sys.stderr)
        return 2
    smooth = 1 if args.smooth is None else args.smooth
    if smooth < 1:
        print(f"longreel train plot: --smooth {smooth}: the moving-average window is 1 step or more", file=sys.stderr)
        return 2
    from longreel.trainer.plot import plot_metrics

    first = args.runs[0].rstrip("/")
    # beside a metrics.jsonl given as a file, in a run directory given as one
    out = args.out or os.path.join(os.path.dirname(first) if os.path.isfile(first) else first, "curves.png")
    keys = args.keys.split(",") if args.keys else None
    try:
        drawn = plot_metrics(args.runs, out, keys=keys, smooth=smooth)
    except (OSError, ValueError) as e:
        print(f"longreel train plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(drawn)})")
    return 0


def export(args) -> int:
    if len(args.runs) != 1 or not args.out:
        print("longreel train export: give one step checkpoint directory and --out DIR", file=sys.stderr)
        return 2
    if args.config or args.overrides:  # the checkpoint's own config.json is the model's; nothing else applies
        print("longreel train export: takes no --config or --set (the checkpoint's config.json is its config)",
              file=sys.stderr)
        return 2
    src = args.runs[0]
    from longreel.trainer.export import export_checkpoint

    try:
        out = export_checkpoint(src, args.out, trust_remote_code=bool(args.trust_remote_code))
    except (FileExistsError, ValueError) as e:  # what the user gave; a full disk is the CLI's one-line exit 1
        print(f"longreel train export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (from {src}): `longreel eval --model {out}` reads it")
    return 0
