"""What the pipeline subcommands share at their end: the command line they record and their exit code."""
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
