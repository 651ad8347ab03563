"""``longreel eval``: greedy accuracy of a model on held-out items, per category and per problem type."""
from __future__ import annotations

import argparse
import json
import os
import sys

from longreel.schemas.config import ConfigError, load_yaml

DESCRIPTION = """\
Evaluate a policy on held-out shards: greedy decoding, scored with the trainer's reward code (trainer.rewards),
accuracy overall, per category and per problem_type; items that cannot be evaluated are counted with their reason.

  longreel eval --model RUN/final --set 'data.eval_urls=["shards/ds-test-{000000..000003}.tar"]'
  longreel eval --model RUN/final --set data.source=synthetic          # the procedural task's held-out items
  longreel eval --model RUN/checkpoints/step-000300 --set data.source=synthetic   # a step checkpoint
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Model directory (default: model.path from the config).")
    p.add_argument("--config", help="YAML config (the same TrainConfig as `longreel train`).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a config key, e.g. --set eval.max_items=200 (repeatable).")
    p.add_argument("--out", help="Write the result JSON here (default: print it).")
    p.add_argument("--outputs", action="store_true", help="Include every model output in the JSON.")


def main(args, extra: list[str]) -> int:
    if extra:
        print(f"longreel eval: unexpected arguments {extra}", file=sys.stderr)
        return 2
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
    from longreel.trainer.preflight import InputCheckError, check_environment, check_model_dir

    try:
        check_model_dir(path, "--model" if args.model else "model.path")
        check_environment(cfg, "eval")
    except InputCheckError as e:
        print(f"longreel eval: {e}", file=sys.stderr)
        return 2
    from longreel.trainer.eval import evaluate
    from longreel.trainer.policy import load_policy, resolve_device, resolve_dtype
    from longreel.trainer.runtime import load_items

    try:
        items = load_items(cfg.data, "eval")
    except (ValueError, RuntimeError, OSError) as e:
        print(f"longreel eval: {e}", file=sys.stderr)
        return 2
    device = resolve_device(cfg.run.device)
    model, processor = load_policy(path, dtype=resolve_dtype(cfg.model.dtype, device), device=device,
                                   attn_implementation=cfg.model.attn_implementation,
                                   vision_attention=cfg.model.vision_attention,
                                   packed_row_attention=cfg.model.packed_row_attention,
                                   trust_remote_code=cfg.model.trust_remote_code)
    model.eval()
    result = evaluate(model, processor, items, max_new_tokens=cfg.eval.max_new_tokens, max_items=cfg.eval.max_items,
                      progress=cfg.run.progress, keep_outputs=args.outputs, batch_size=cfg.eval.batch_size)
    result["model"] = path
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        from longreel.schemas.atomic import write_atomic

        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_atomic(args.out, text + "\n")
        print(f"accuracy {result['accuracy']:.4f} on {result['n']} items ({result['skipped']} skipped); wrote {args.out}")
    else:
        print(text)
    return 0
