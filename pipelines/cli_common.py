"""What the pipeline subcommands share: the check of the Beam options they pass on, a model stage's config from the
command line, the command line they record and their exit code."""
from __future__ import annotations

import argparse
import logging
import re
import shlex
import sys

from longreel.schemas.config import closest, unexpected_arguments

EXIT_EMPTY = 3  # the run finished but nothing survived (see longreel.cli.EXIT_CODES)

log = logging.getLogger("longreel")


def command_line(args, name: str) -> str:
    """The command as typed (recorded in stats.json, the card and the output directory's lock)."""
    return shlex.join(["longreel", *getattr(args, "_argv", [name])])


def exit_code(name: str, doc: dict, products: list[str], out_dir: str) -> int:
    """0, or 3 with a message when one of ``products`` (stages of :data:`longreel.pipelines.stats.PRODUCTS`) put out
    nothing."""
    from longreel.pipelines.stats import nothing_survived

    empty = nothing_survived(doc, products)
    if empty is None:
        return 0
    print(f"longreel {name}: the run finished but nothing survived: {empty}; see the rejects-*.parquet tables in "
          f"{out_dir}", file=sys.stderr)
    return EXIT_EMPTY


def beam_args_error(beam_args: list[str], own_options=(), positional_for: str | None = None) -> str | None:
    """Why the arguments left over by a pipeline subcommand's own parser are not all Beam pipeline options, or None.

    Beam drops an option it does not know with a warning ("Discarding unparseable args") and runs on, so a misspelt
    option (``--workerz 2``, ``--run DataflowRunner``, ``--temp-location``) gave a run without it that exited 0: a
    local run instead of a Dataflow job, the default instead of the value typed. The options known are those of
    every Beam options class, the named runner's included; ``own_options`` (the subcommand's) serve suggestions, and a
    lone positional argument is named as the value of ``positional_for`` (or of ``--config``, a YAML file)."""
    args = list(beam_args)
    parser = _beam_parser()
    try:
        known, rest = parser.parse_known_args(args)
    except argparse.ArgumentError as e:  # a Beam option with a bad value: one line, not Beam's whole usage
        # `longreel curate --runner DataflowRunner VIDEOS ...`: the subcommand's parser, which does not know
        # --runner, hands "DataflowRunner" to INPUT, and Beam's parser then sees the option without its value
        return (f"bad Beam option: {e} (a value written after a Beam option that comes before INPUT or OUT is "
                "taken as INPUT/OUT: write Beam options as --name=VALUE, or after the command's paths)")
    if known.runner and _import_runner(known.runner):  # a runner module may add its own options class
        known, rest = _beam_parser().parse_known_args(args)
    options = [a for a in rest if a.startswith("-")]
    if not options:
        return unexpected_arguments(rest, own_options, positional_for) if rest else None
    candidates = set(own_options) | set(re.findall(r"--[\w-]+", parser.format_usage()))
    named = []
    for option in options:
        flag = option.split("=", 1)[0]
        near = closest(flag, candidates)
        named.append(flag + (f" (did you mean {near}?)" if near else ""))
    return (f"unknown option{'s' if len(named) > 1 else ''} {', '.join(named)}: neither an option of this command "
            "nor a Beam pipeline option (Beam would drop it with a warning and run without it)")


def _beam_parser() -> argparse.ArgumentParser:
    """Beam's own parser of every pipeline options class imported so far (what ``PipelineOptions`` parses with),
    raising ``ArgumentError`` on a bad value instead of exiting."""
    from apache_beam.options.pipeline_options import PipelineOptions

    parsers: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=parsers.append)
    parsers[0].exit_on_error = False
    return parsers[0]


def _import_runner(name: str) -> bool:
    """Import the module of the runner ``name`` (what Beam does when the pipeline is made); False if it cannot be
    made here, which the pipeline then reports."""
    from apache_beam.runners.runner import create_runner

    try:
        create_runner(name)
    except Exception:  # noqa: BLE001 - a missing extra or a bad name is the pipeline's to report, with its own words
        return False
    return True


def refuse_beam_args(name: str, args, beam_args: list[str] | None) -> bool:
    """Print why the leftover arguments of ``longreel NAME`` are refused, if they are; True then (exit 2)."""
    from longreel.pipelines.io.filesystems_check import missing_filesystem

    options = getattr(args, "_options", ())
    # the run directory a stray positional most likely is: the command's own option for it, when not given
    directory = next((o for o in ("--out", "--clips-dir") if o in options), None)
    given = directory is not None and getattr(args, directory[2:].replace("-", "_"), None)
    error = beam_args_error(beam_args or [], options, None if given else directory)
    if error is None:  # a gs:// or s3:// path this environment has no client for: before anything is read
        paths = [getattr(args, a, None) for a in ("out", "clips_dir")] + list(getattr(args, "inputs", None) or [])
        error = missing_filesystem([p for p in paths if isinstance(p, str)])
    if error is None:  # the named runner's own checks, which Beam makes only once the output is being written
        from longreel.pipelines.runner import runner_options_error
        error = runner_options_error(beam_args)
    if error is not None:
        print(f"longreel {name}: {error}", file=sys.stderr)
    return error is not None


def run_settings_base(name: str, out_dir: str | None, section: str) -> dict | None:
    """The settings a stage run alone on a ``curate`` run starts from: that run's ``section`` of OUT/config.yaml,
    under the user's ``--config`` and ``--set``. Starting from the defaults instead made a re-run of one stage quietly
    change what the user did not name (``longreel pack`` on the demo wrote a second dataset under the default name
    and frame rate). None, and the defaults, for a directory no ``curate`` wrote."""
    if not out_dir:
        return None
    from longreel.pipelines.io.run_dir import run_settings

    data = run_settings(out_dir, section)
    if data is not None and section == "judge":
        data = _judge_as_run(data, run_settings(out_dir, "qra") or {})
    if data is not None:
        log.info("%s: starting from the run's %s settings in its config.yaml (--config and --set change them)",
                 name, section)
    return data


def _judge_as_run(judge: dict, qra: dict) -> dict | None:
    """The run's judge settings as its curate resolved them: its null engine keys are the question writer's
    (:func:`~longreel.pipelines.judge_config.follow_generator`), so that ``longreel judge`` alone judges with the
    model the run's judge used. None (the defaults) when the recorded sections do not validate.

    config.yaml records every key, so which of them the user set is gone; a key at its default is taken as not set
    (followed), which is what curate did unless the user set a key to its own default value."""
    from longreel.pipelines.judge_config import CurateJudgeConfig, follow_generator
    from longreel.pipelines.qra_config import QRAConfig
    from longreel.schemas.config import ConfigError, from_dict, to_dict

    defaults = to_dict(CurateJudgeConfig())
    given = {k: v for k, v in judge.items() if k not in defaults or v != defaults[k]}
    try:
        return to_dict(follow_generator(from_dict(CurateJudgeConfig, given), from_dict(QRAConfig, qra)))
    except ConfigError:
        return None


def model_stage_config(name: str, cls, args, section: str, beam_args: list[str] | None = None):
    """The config of a model stage run alone on an output directory (``longreel filter``, ``blind``, ``judge``):
    ``--show-config``, the required ``--out``, ``--model``/``--backend`` as overrides of the config file and
    ``--set``. Returns ``(config, None)``, or ``(None, exit code)`` when the command is done (the config was shown)
    or wrong (one line on stderr, exit 2)."""
    from longreel.schemas.config import ConfigError, describe, load_yaml

    if args.show_config:
        for key, default, help_text in describe(cls):
            print(f"{key} = {default}\n    {help_text}")
        return None, 0
    if beam_args is not None and refuse_beam_args(name, args, beam_args):  # first: a stray positional is the --out
        return None, 2
    if not args.out:
        print(f"longreel {name}: --out is required", file=sys.stderr)
        return None, 2
    overrides = list(args.overrides) + ([f"model={args.model}"] if args.model else []) + \
        ([f"backend={args.backend}"] if args.backend else [])
    try:
        return load_yaml(cls, args.config, overrides, section=section,
                         base=run_settings_base(name, args.out, section)), None
    except (ConfigError, OSError) as e:
        print(f"longreel {name}: bad config: {e}", file=sys.stderr)
        return None, 2
