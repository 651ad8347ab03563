"""``longreel cost``: GPU-hours of a curation run of a given size, stage by stage, and what each lever saves."""
from __future__ import annotations

import argparse
import json
import os
import sys

from longreel.schemas.config import unexpected_arguments

DESCRIPTION = """\
Project the GPU-hours of a curation run, stage by stage (captioning, QRA generation and refinement, the blind
text-only filter, the pass-rate filter), from a cost config: model throughput per replica, tokens per model call
of each stage, and the scale (pipelines/configs/cost.yaml; its default scale is the LongVideo-Reason data of the
LongVILA-R1 paper). With --stats, the tokens per call are the means a real run measured (its stats.json compute
counts) for each stage it ran of caption, QRA, refinement, blind and pass-rate. Prints where the hours go and what each lever is worth (batched k-sample
answering, prefix caching of the QRA context, the blind filter before the VLM filter).

  longreel cost                                   # the paper's scale, assumed tokens per call
  longreel cost --stats OUT --videos 500 --mean-duration-s 300 --questions 4000
  longreel cost --set models.generator.decode_tokens_per_s=5000 --json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="Cost config YAML (default: pipelines/configs/cost.yaml, shipped with longreel).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one value of the cost config, e.g. --set scale.videos=1000 (repeatable; "
                        "scale.videos and scale.questions_generated act as --videos and --questions unless "
                        "scale.questions_released is set too).")
    p.add_argument("--stats", metavar="RUN_DIR_OR_STATS_JSON",
                   help="Take the tokens per call from a run's stats.json (its compute counts) where it called a model.")
    p.add_argument("--videos", type=int, help="Videos in the run to project (scale.videos; the questions scale "
                                              "with them, per video as configured, unless --questions is given).")
    p.add_argument("--mean-duration-s", type=float, help="Mean video duration in seconds (scale.mean_duration_s).")
    p.add_argument("--questions", type=int, help="Questions generated, before the filters "
                                                 "(scale.questions_generated; the released ones keep their share).")
    p.add_argument("--json", dest="as_json", action="store_true", help="Print the projection as JSON.")


def _read_stats(path: str) -> dict:
    from longreel.schemas.config import ConfigError

    if os.path.isdir(path):
        path = os.path.join(path, "stats.json")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--stats: no stats.json at {path}") from None
    except ValueError as e:
        raise ConfigError(f"--stats: {path} is not JSON ({e})") from None


def _scale_overrides(overrides: list[str], videos: int | None, questions: int | None):
    """``--set scale.videos=N`` (the --help example) and ``--set scale.questions_generated=N`` taken as --videos and
    --questions, which keep the config's ratios: set alone, they projected 1,000 videos' QRA calls refining the
    default scale's 208,000 questions. A ``--set`` of the scale's other numbers keeps every value as given."""
    own = {"scale.questions_released"}
    if any(o.split("=", 1)[0].strip() in own for o in overrides):
        return overrides, videos, questions
    rest = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "scale.videos" and videos is None:
            videos = _count(value, key)
        elif key.strip() == "scale.questions_generated" and questions is None:
            questions = _count(value, key)
        else:
            rest.append(o)
    return rest, videos, questions


def _count(value: str, key: str) -> int:
    from longreel.schemas.config import ConfigError

    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{key}: expected a whole number, got {value.strip()!r}") from None


def main(args, extra: list[str]) -> int:
    from longreel.pipelines import cost

    if extra:
        problem = unexpected_arguments(extra, getattr(args, "_options", ()),
                                       positional_for=None if args.stats else "--stats")
        print(f"longreel cost: {problem}", file=sys.stderr)
        return 2
    overrides, videos, questions = _scale_overrides(list(args.overrides), args.videos, args.questions)
    if args.mean_duration_s is not None:
        overrides.append(f"scale.mean_duration_s={args.mean_duration_s}")
    cfg = cost.rescale(cost.load(args.config, overrides), videos=videos, questions=questions)
    cost.check(cfg)
    measured: list[str] = []
    if args.stats:
        cfg, measured = cost.workload_from_stats(cfg, _read_stats(args.stats))
    rows, lever_rows = cost.stage_rows(cfg), cost.levers(cfg)
    if args.as_json:
        print(json.dumps({"scale": cfg["scale"], "gpu": cfg.get("gpu"), "measured_stages": measured, "stages": rows,
                          "total_gpu_hours": sum(r["gpu_hours"] for r in rows), "levers": lever_rows,
                          "reference_gpu_hours": cfg.get("reference_gpu_hours"), "models": cfg["models"]},
                         indent=1))
    else:
        print(cost.format_report(cfg, rows, lever_rows, measured))
    return 0
