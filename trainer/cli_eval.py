"""``longreel eval``: greedy accuracy of a model on held-out items, per category and per problem type."""
from __future__ import annotations

import argparse
import json
import sys

from longreel.schemas.config import ConfigError, load_yaml, unexpected_arguments

DESCRIPTION = """\
Evaluate a policy on held-out shards: greedy decoding, scored with the trainer's reward code (longreel.task.rewards),
accuracy overall, per category and per problem_type; items that cannot be evaluated are counted with their reason.

  longreel eval --model RUN/final --set 'data.eval_urls=["shards/ds-test-{000000..000003}.tar"]'
  longreel eval --model RUN/final --set data.source=synthetic          # the procedural task's held-out items
  longreel eval --model RUN/checkpoints/step-000300 --set data.source=synthetic   # a step checkpoint
  torchrun --nproc_per_node 8 -m longreel eval --model RUN/final --set 'data.eval_urls=["shards/ds-test-{000000..000003}.tar"]'
      # each of the 8 ranks decodes every 8th item; rank 0 prints the result, the numbers one process gives
"""


EXIT_CODES = """\
exit codes:
  0  success: the result printed (or written to --out). Items that could not be evaluated are in it
     ("skipped", "skipped_items"), and so are the shards and samples the loader skipped under
     data.on_error=skip ("loader_skipped": counts, "skipped_shards" / "skipped_samples": each with its reason)
  1  no item could be evaluated (each one skipped, or none loaded): the result is still printed (or written),
     with "accuracy": null, and one line names the first reasons; or an internal error (a traceback is
     printed; please report it), or the machine refused (disk full, permission denied: one line, no traceback)
  2  usage or config error: bad arguments, config, or a path that is not what it must be. One line.
  130 interrupted (Ctrl-C)
-v/--debug shows the traceback of any error.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Model directory (default: model.path from the config).")
    p.add_argument("--config", help="YAML config (the same TrainConfig as `longreel train`).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a config key, e.g. --set eval.max_items=200 (repeatable).")
    p.add_argument("--out", help="Write the result JSON here (default: print it).")
    p.add_argument("--outputs", action="store_true", help="Include every model output in the JSON.")
    p.add_argument("--show-config", action="store_true",
                   help="Print every config key eval reads, with default and help; exit.")


#: the config keys ``longreel eval`` reads (of the TrainConfig ``longreel train`` uses): what --show-config lists
EVAL_KEYS = frozenset({
    "model.path", "model.dtype", "model.attn_implementation", "model.vision_attention", "model.packed_row_attention",
    "model.trust_remote_code", "data.source", "data.eval_urls", "data.synthetic_eval", "data.synthetic_seed",
    "data.synthetic_kinds", "data.on_error", "data.cache_remote", "data.cache_dir", "data.fetch_retries",
    "eval.max_new_tokens", "eval.max_items", "eval.batch_size", "run.device", "run.threads", "run.progress",
    "dist.backend", "dist.timeout_s"})


def show_config() -> int:
    from longreel.schemas.config import describe
    from longreel.trainer.config import TrainConfig

    for key, default, help_text in describe(TrainConfig):
        if key in EVAL_KEYS:
            print(f"{key} = {default}\n    {help_text}")
    return 0


def main(args, extra: list[str]) -> int:
    if extra:
        problem = unexpected_arguments(extra, getattr(args, "_options", ()),
                                       positional_for=None if args.model else "--model")
        print(f"longreel eval: {problem}", file=sys.stderr)
        return 2
    if args.show_config:
        return show_config()
    from longreel.trainer.config import TrainConfig

    try:
        cfg = load_yaml(TrainConfig, args.config, args.overrides)
    except (ConfigError, OSError) as e:
        print(f"longreel eval: bad config: {e}", file=sys.stderr)
        return 2
    path = args.model or cfg.model.path
    if not path:
        print("longreel eval: give --model or model.path", file=sys.stderr)
        return 2
    from longreel.trainer.preflight import (InputCheckError, check_environment, check_launch, check_model_dir,
                                            check_output_file, read_launch)

    try:
        check_model_dir(path, "--model" if args.model else "model.path")
        if args.out:  # before the evaluation, not after it, when its result would be lost
            check_output_file(args.out, "--out")
        check_environment(cfg, "eval")
        check_launch(cfg, read_launch())
    except InputCheckError as e:
        print(f"longreel eval: {e}", file=sys.stderr)
        return 2
    from longreel.trainer.policy import resolve_device
    from longreel.trainer.runtime import init_distributed

    try:
        # under torchrun each rank decodes every WORLD_SIZE-th item; one process otherwise
        info = init_distributed(resolve_device(cfg.run.device), cfg.dist.backend, cfg.dist.timeout_s)
    except InputCheckError as e:
        print(f"longreel eval: {e}", file=sys.stderr)
        return 2
    try:
        result = evaluate_share(cfg, path, info, keep_outputs=args.outputs)
    except InputCheckError as e:
        print(f"longreel eval: {e}", file=sys.stderr)
        return 2
    finally:
        if info.enabled and info.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    if result is None:  # not rank 0
        return 0
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        from longreel.schemas.atomic import write_atomic

        try:
            write_atomic(args.out, text + "\n")
        except OSError as e:  # the machine refused after the check (a full disk): the result is not lost
            print(text)
            print(f"longreel eval: failed: writing {args.out}: {e.strerror} (the result is printed above)",
                  file=sys.stderr)
            return 1
        if result["n"]:
            print(f"accuracy {result['accuracy']:.4f} on {result['n']} items ({result['skipped']} skipped"
                  f"{_loader_note(result)}); wrote {args.out}")
    else:
        print(text)
    if not result["n"]:  # an accuracy of nothing is not a result: a script must not take it for one
        print(f"longreel eval: {_nothing_evaluated(result)}" + (f"; the result is in {args.out}" if args.out else ""),
              file=sys.stderr)
        return 1
    return 0


def _loader_note(result: dict) -> str:
    """``; the loader skipped 2 shards and 1 sample`` when it did (data.on_error=skip), else nothing."""
    counts = result.get("loader_skipped") or {}
    parts = [f"{n} {what}{'s' if n != 1 else ''}" for what, n in (("shard", counts.get("shards", 0)),
                                                                  ("sample", counts.get("samples", 0))) if n]
    return f"; the loader skipped {' and '.join(parts)}" if parts else ""


def _nothing_evaluated(result: dict, shown: int = 2) -> str:
    """One line for a result with no item scored: how many were skipped, and the first ``shown`` reasons with their
    counts and first message (the result lists every one)."""
    firsts: dict[str, tuple[int, str]] = {}
    for skip in result["skipped_items"]:
        n, message = firsts.get(skip["reason"], (0, skip["message"]))
        firsts[skip["reason"]] = (n + 1, message)
    reasons = [f"{n} {reason}: {_short(message)}" for reason, (n, message) in list(firsts.items())[:shown]]
    line = "no item could be evaluated: " + (f"{result['skipped']} skipped ({'; '.join(reasons)})" if reasons
                                             else "no item was loaded")
    lost = result.get("skipped_shards", []) + result.get("skipped_samples", [])
    if lost:
        first = ": ".join(str(part) for part in (lost[0]["url"], lost[0]["reason"]) if part)
        line += f"{_loader_note(result)} (first: {_short(first)})"
    return line


def _short(message: str, limit: int = 160) -> str:
    """A message on one line, cut to ``limit`` characters: a processor's error can run to many lines."""
    flat = " ".join(str(message).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def evaluate_share(cfg, path: str, info, *, keep_outputs: bool) -> dict | None:
    """This rank's share of the evaluation, put together on rank 0 (which returns the result; the others None).
    Held-out shards that one rank cannot read stop every rank with the lowest rank's message."""
    from longreel.trainer.eval import score_items, summarize
    from longreel.trainer.policy import load_policy, resolve_dtype
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.runtime import all_gather_objects, first_problem, load_items

    if cfg.run.threads:
        import torch

        torch.set_num_threads(cfg.run.threads)
    items, problem, loader = [], None, {}
    try:
        items = load_items(cfg.data, "eval", loader)
    except (ValueError, RuntimeError, OSError) as e:
        problem = str(e)
    problem = first_problem(problem, info)
    if problem is not None:
        raise InputCheckError(problem)
    if cfg.eval.max_items:
        items = items[:cfg.eval.max_items]
    model, processor = load_policy(path, dtype=resolve_dtype(cfg.model.dtype, info.device), device=info.device,
                                   attn_implementation=cfg.model.attn_implementation,
                                   vision_attention=cfg.model.vision_attention,
                                   packed_row_attention=cfg.model.packed_row_attention,
                                   trust_remote_code=cfg.model.trust_remote_code)
    model.eval()
    mine = list(range(info.rank, len(items), info.world))
    records = score_items(model, processor, [items[i] for i in mine], indices=mine,
                          max_new_tokens=cfg.eval.max_new_tokens, keep_outputs=keep_outputs,
                          progress=cfg.run.progress and info.is_main, batch_size=cfg.eval.batch_size)
    everyone = all_gather_objects(records, info)
    if not info.is_main:
        return None
    result = summarize((r for share in everyone for r in share), keep_outputs=keep_outputs)
    # every rank read every item, so rank 0's loader saw every skip: what was not evaluated, in the result itself
    skips = loader.get("skips", [])
    result.update(loader_skipped={"shards": loader.get("skipped_shards", 0),
                                  "samples": loader.get("skipped_samples", 0)},
                  skipped_shards=[{k: s[k] for k in ("url", "reason", "lost")} for s in skips if s["whole_shard"]],
                  skipped_samples=[{k: s[k] for k in ("url", "key", "reason")} for s in skips
                                   if not s["whole_shard"]])
    result["model"] = path
    if info.enabled:
        result["ranks"] = info.world
    return result
