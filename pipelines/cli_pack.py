"""``longreel pack``: an output directory's videos + QRA (+ pass-rate) tables -> frame cache, shards, index."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from longreel.pipelines.cli_common import command_line, exit_code, refuse_beam_args, run_settings_base
from longreel.pipelines.pack.config import PackConfig
from longreel.schemas.config import ConfigError, describe, load_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Pack a curated output directory into training shards.

Reads OUT's `videos`, `qras` and, when present, `pass_rate` tables. Each QRA gets a split:
the pass-rate record's sft / rl (drop and missing records are rejects), or `default_split`
when there is no pass-rate table. Each video with kept QRAs is decoded once per parameter
set into the frame cache (uint8 frames sampled and resized by the target processor's rules,
.npy + JSON metadata, checked by size and sha256 and rebuilt when corrupt), then written
as WebDataset shards `{dataset}-{split}-{index:06d}.tar` (one sample = one video: frames
once, all its questions) with a wids index `{dataset}-{split}.index.json` per split.
Re-running with the same inputs and config rewrites byte-identical shards and index.
The funnel (pack_select, frame_cache, pack_write) and a `pack` summary are merged into
OUT/stats.json; rejects are merged into OUT/rejects-*.parquet. See docs/SHARDS.md.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", nargs="?", metavar="OUT", help="Output directory of a curate run (local or gs://, s3://).")
    p.add_argument("--out", dest="out_option", metavar="OUT",
                   help="The same as OUT (the other stage commands take --out).")
    p.add_argument("--config",
                   help="YAML config file over the run's own pack settings (OUT/config.yaml); see --show-config "
                        "for every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set max_frames=32 (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")


def main(args, beam_args: list[str]) -> int:
    if args.show_config:
        for key, default, help_text in describe(PackConfig):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if args.out and args.out_option and args.out != args.out_option:
        print(f"longreel pack: OUT {args.out} and --out {args.out_option} differ: give one", file=sys.stderr)
        return 2
    args.out = args.out or args.out_option
    if not args.out:
        print("longreel pack: OUT is required", file=sys.stderr)
        return 2
    if refuse_beam_args("pack", args, beam_args):
        return 2
    try:
        cfg = load_yaml(PackConfig, args.config, args.overrides, section="pack",
                        base=run_settings_base("pack", args.out, "pack"))
    except (ConfigError, OSError) as e:
        print(f"longreel pack: bad config: {e}", file=sys.stderr)
        return 2
    from longreel.pipelines.model_paths import check_model_paths
    from longreel.pipelines.stages.pack import run_pack

    check_model_paths([("pack.processor", cfg.processor)] if cfg.processor else [], beam_args)
    try:
        stats = run_pack(args.out, cfg, beam_args, command=command_line(args, "pack"))
    except FileNotFoundError as e:
        print(f"longreel pack: {e}", file=sys.stderr)
        return 2
    by = {s["stage"]: s for s in stats["stages"]}
    print(json.dumps({s: {k: by[s][k] for k in ("in", "out", "rejected_total", "balanced")}
                      for s in ("pack_select", "frame_cache", "pack_write") if s in by}))
    return exit_code("pack", stats, ["pack_write"], args.out)
