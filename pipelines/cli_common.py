"""What the pipeline subcommands share: a model stage's config from the command line, the command line they record
and their exit code."""
from __future__ import annotations

import shlex
import sys

EXIT_EMPTY = 3  # the run finished but nothing survived (see longreel.cli.EXIT_CODES)


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
    if not args.out:
        print(f"longreel {name}: --out is required", file=sys.stderr)
        return None, 2
    unknown = [a for a in beam_args or [] if not a.startswith("--")]
    if unknown:
        print(f"longreel {name}: unexpected arguments {unknown}", file=sys.stderr)
        return None, 2
    overrides = list(args.overrides) + ([f"model={args.model}"] if args.model else []) + \
        ([f"backend={args.backend}"] if args.backend else [])
    try:
        return load_yaml(cls, args.config, overrides, section=section), None
    except (ConfigError, OSError) as e:
        print(f"longreel {name}: bad config: {e}", file=sys.stderr)
        return None, 2
