"""``longreel curate``: videos in, stage tables and a funnel out."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys

import yaml

from pipelines.config import CurateConfig
from pipelines.io.inputs import InputError, expand_inputs
from schemas.config import ConfigError, describe, load_yaml

log = logging.getLogger("longreel")

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo.yaml")


def demo_overrides() -> list[str]:
    """The demo config as ``key=value`` overrides (to layer it under a user's own --config)."""
    with open(DEMO_CONFIG, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)

    def walk(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
    return list(walk(doc))

DESCRIPTION = """\
Curate videos into a long-video reasoning dataset.

Stages: ingest (sha256 + probe with PyAV in a killable worker) -> dedup (same bytes = one
video) -> segment (~10 s clips, virtual time ranges or materialized files). Bad inputs never
stop the run: each becomes a row of rejects-*.parquet with a reason code, and stats.json
records, per stage, in / out / rejected by reason.

INPUT is a directory (its video files), a glob, a single path, or a manifest (.txt/.lst one
path or URL per line; .jsonl/.json/.parquet with a `path` column and optional `license`,
`attribution`). gs:// and s3:// work where Beam's gcp/aws extras are installed.
With --demo (or no INPUT) the embedded sample corpus is used.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="Videos: directory, glob, path or manifest.")
    p.add_argument("--out", help="Output directory (local path or gs://, s3://). Required.")
    p.add_argument("--demo", action="store_true", help="Use the embedded sample corpus (real footage).")
    p.add_argument("--config", help="YAML config file; see --show-config for every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set segment.clip_s=5 (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")


def main(args, beam_args: list[str]) -> int:
    if args.show_config:
        for key, default, help_text in describe(CurateConfig):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if not args.out:
        print("longreel curate: --out is required", file=sys.stderr)
        return 2
    unknown = [a for a in beam_args if not a.startswith("--")]
    if unknown:
        print(f"longreel curate: unexpected arguments {unknown}", file=sys.stderr)
        return 2
    try:
        overrides = list(args.overrides)
        if args.demo or not args.inputs:
            # The demo config is the base; the user's --config and --set go on top of it.
            base = demo_overrides()
            cfg = load_yaml(CurateConfig, args.config, base + overrides) if args.config else \
                load_yaml(CurateConfig, DEMO_CONFIG, overrides)
        else:
            cfg = load_yaml(CurateConfig, args.config, overrides)
    except (ConfigError, OSError) as e:
        print(f"longreel curate: bad config: {e}", file=sys.stderr)
        return 2
    try:
        if args.demo or not args.inputs:
            from pipelines.sample_corpus import demo_items
            items = demo_items()
        else:
            items = expand_inputs(args.inputs)
    except (InputError, RuntimeError) as e:
        print(f"longreel curate: {e}", file=sys.stderr)
        return 2
    from pipelines.curate import run_curate
    command = shlex.join(["longreel", *getattr(args, "_argv", ["curate"])])
    stats = run_curate(items, args.out, cfg, beam_args, command=command)
    print(json.dumps(stats["totals"]))
    return 0
