"""``longreel curate``: videos in, stage tables and a funnel out."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys


from longreel.pipelines.config import CurateConfig
from longreel.pipelines import heap, zygote
from longreel.pipelines.cli_common import refuse_beam_args
from longreel.pipelines.io.input_kinds import is_glob, is_remote, names_one_local_file
from longreel.pipelines.zygote import default_workers
from longreel.schemas.config import ConfigError, describe, load_yaml

log = logging.getLogger("longreel")

DEMO_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo.yaml")


DESCRIPTION = """\
Curate videos into a long-video reasoning dataset.

Stages: ingest (sha256 + probe with PyAV in a killable worker) -> dedup (same bytes = one
video) -> segment (~10 s clips, virtual time ranges or materialized files), then the config's
`stages` (default: caption, qra, pack, card; --set 'stages=[]' stops after segment). Bad
inputs never stop the run: each becomes a row of rejects-*.parquet with a reason code, and
stats.json records, per stage, in / out / rejected by reason.

INPUT is a directory (its video files), a glob, a single path, or a manifest (.txt/.lst one
path or URL per line; .jsonl/.json/.parquet with a `path` column and optional `license`,
`attribution`). gs:// and s3:// work where Beam's gcp/aws extras are installed; an http(s)
URL is a video, or a .txt/.lst/.jsonl/.json manifest (Parquet: download it first).
With --demo (or no INPUT) the embedded sample corpus is used. An INPUT path that does not
exist is an error (exit 2); a manifest entry that does not exist is a `not_found` reject, and
an input listed twice is a `duplicate_input` reject naming its first listing. Globs,
directories and manifests are listed by the pipeline's workers, not before the run: only a
cheap check per INPUT runs first (the manifest exists, the glob matches a first file).

Where it runs: without a Beam --runner, on this machine with --workers processes (default:
every core this process may use; one for a single video file without captions, which has
nothing to spread); --workers 1 runs in this one process. The outputs are
the same bytes for any worker count. Beam options (--runner=DataflowRunner, FlinkRunner,
SparkRunner, ... with their own options) pass through unchanged; --workers then does not
apply.

The output directory: a run holds its lock (OUT/.longreel.lock) throughout, so a second run on
the same directory stops at once, naming the first; _SUCCESS.json is written last (config
hash, stages, every file with size and sha256). A directory holding a finished run with the
same config and inputs is re-run in place (idempotent); one holding another run, or an
unfinished one, is refused unless --overwrite (or --resume for an unfinished run with the
same config).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="Videos: directory, glob, path or manifest.")
    p.add_argument("--out", help="Output directory (local path or gs://, s3://). Required.")
    p.add_argument("--demo", action="store_true", help="Use the embedded sample corpus (real footage).")
    p.add_argument("--config", help="YAML config file; see --show-config for every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set segment.clip_s=5 (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="Local runner only (no --runner): run on N worker processes (default: every core this "
                        "process may use, %(default_n)s here; 1 for a single video file without captions, which "
                        "has nothing to spread); 1 runs in this process. Outputs do not depend on N."
                        % {"default_n": default_workers()})
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="Continue an unfinished run in --out (no _SUCCESS.json) with the same config and inputs.")
    mode.add_argument("--overwrite", action="store_true",
                      help="Remove the run already in --out first: the files its _SUCCESS.json lists and longreel's "
                           "own output names (tables, stats.json, config.yaml, _INPUTS.json and the stage commands' "
                           "config_caption.yaml, config_qra.yaml, filter_config.yaml, blind_config.yaml, "
                           "judge_config.yaml, config_pack.yaml, clips/, frame_cache/, shards/, card/); other files "
                           "are left alone.")


def main(args, beam_args: list[str]) -> int:
    if args.show_config:
        for key, default, help_text in describe(CurateConfig):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if not args.out:
        print("longreel curate: --out is required", file=sys.stderr)
        return 2
    try:
        overrides = list(args.overrides)
        # the demo's settings are the base: the user's --config and --set go on top of them
        base = DEMO_CONFIG if args.demo or not args.inputs else None
        cfg = load_yaml(CurateConfig, args.config, overrides, base=base)
    except (ConfigError, OSError) as e:
        print(f"longreel curate: bad config: {e}", file=sys.stderr)
        return 2
    workers = args.workers or _default_workers(args, cfg)
    if _forks_local_workers(beam_args, workers):  # its imports then overlap this process's (Beam's, the stages')
        zygote.prestart()
    try:
        with heap.paused():  # start-up without collections; the run turns them back on (see _run_locked)
            # after the zygote's start: the check imports Beam, which the zygote then imports beside it
            if refuse_beam_args("curate", args, beam_args):
                return 2
            if args.demo and args.inputs:  # they were ignored (recorded in the run's command all the same)
                print("longreel curate: --demo curates the embedded sample corpus: give INPUT or --demo, not both",
                      file=sys.stderr)
                return 2
            return _run(args, beam_args, cfg, workers)
    finally:
        zygote.discard()  # unless the run adopted it


def _run(args, beam_args: list[str], cfg: CurateConfig, workers: int) -> int:
    from longreel.pipelines.io.inputs import InputError, plan_inputs
    from longreel.pipelines.model_paths import check_model_paths, curate_models
    try:
        if args.demo or not args.inputs:
            from longreel.pipelines.sample_corpus import demo_items
            items = demo_items()
        else:
            missing = [i for i in args.inputs if _missing_local_path(i)]
            if missing:
                raise InputError(f"no such file or directory: {', '.join(missing)}")
            items = plan_inputs(args.inputs)
        check_model_paths(curate_models(cfg), beam_args)
    except (InputError, RuntimeError) as e:
        print(f"longreel curate: {e}", file=sys.stderr)
        return 2
    from longreel.pipelines.cli_common import command_line, exit_code
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.portable import preflight
    preflight(beam_args, [args.out, *args.inputs])  # a portable run that would hang or write elsewhere stops here
    if_exists = "overwrite" if args.overwrite else "resume" if args.resume else "error"
    stats = run_curate(items, args.out, cfg, beam_args, command=command_line(args, "curate"), if_exists=if_exists,
                       workers=workers)
    print(json.dumps(stats["totals"]))
    products = ["segment"] + [s for s in ("caption", "qra") if s in cfg.stages]
    products += ["passrate"] * ("filter" in cfg.stages) + ["pack_write"] * ("pack" in cfg.stages)
    return exit_code("curate", stats, products, args.out)


def _default_workers(args, cfg: CurateConfig) -> int:
    """Every core, unless the run has nothing to spread over them: one video file and no caption stage. Ingest and
    segment take a video in one task, so a second worker would only add its start-up (one 10-minute video, stages
    ingest to segment: 4.7-5.4 s on 2 workers against 3.9-4.4 s on 1 here); the caption stage splits a long video's
    decode into tasks that do spread."""
    specs = [s for s in args.inputs if s]
    one_file = not args.demo and len(specs) == 1 and names_one_local_file(specs[0])
    return 1 if one_file and "caption" not in cfg.stages else default_workers()


def _forks_local_workers(beam_args: list[str], workers: int) -> bool:
    """Whether this run will fork its workers from a zygote (:func:`~longreel.pipelines.runner.make_pipeline`: the
    local runner, several workers, none of Beam's own local modes), judged without importing Beam: only when no
    Beam option names a runner or a running mode (a run that does not fork just never adopts the zygote)."""
    return workers > 1 and not any(a.startswith(("--runner", "--direct_running_mode")) for a in beam_args)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of worker processes, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {n}")
    return n


def _missing_local_path(spec: str) -> bool:
    """A command-line INPUT naming a local path that does not exist: a typo, not a video to reject."""
    return bool(spec) and not is_remote(spec) and not is_glob(spec) and not os.path.lexists(spec)
