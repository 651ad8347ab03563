"""``longreel card``: build a dataset's data card, or verify one against the shards."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys

from longreel.schemas.config import unexpected_arguments

DESCRIPTION = """\
Data cards.

  longreel card build RUN_DIR --out CARD_DIR [--shards DIR_OR_INDEX] [--command "..."]
      A Hugging Face dataset card (README.md with YAML front matter and Datasheets-for-Datasets
      sections), card.json (every claim the card makes, one by one) and six PNG plots (funnel,
      category balance, pass-count histogram, duration histogram, answer letters, blind pass
      counts), from a run's output directory: stats.json, config.yaml, the stage tables and the
      shards' wids index files (RUN_DIR/shards unless --shards is given).

  longreel card verify CARD_DIR SHARDS_OR_INDEX [INDEX ...] [--run RUN_DIR] [--marker RUN_DIR]
      Re-reads the shards (a directory of *.index.json, or index files; local paths or URLs),
      recomputes every count and distribution the card states that the shards determine, checks
      shard sizes and sha256 against the index and each sample's members against its sums.json,
      re-renders README.md from card.json, and prints claim / card / recomputed / ok. Exits 1 on any
      mismatch. With --run, every claim is also recomputed from the run's outputs (tables, stats).
      With --run, or a card in its run directory, every question in the shards must be a row of the
      run's qras table (a table rewritten by a stage run alone fails: run `longreel pack RUN`).
      The run's completion marker (_SUCCESS.json: every file with size and sha256) is checked
      when the card sits in the run directory, or that of --run, or --marker RUN_DIR; a missing
      marker there fails (the run did not finish).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="card_command", metavar="SUBCOMMAND")
    b = sub.add_parser("build", help="Build README.md, card.json and plots from a run's outputs.")
    b.add_argument("run_dir", metavar="RUN_DIR", help="The pipeline's output directory (has stats.json).")
    b.add_argument("--out", required=True, help="Card directory to write (README.md, card.json, *.png).")
    b.add_argument("--shards", help="Shards directory or an index file; default RUN_DIR/shards when it exists.")
    b.add_argument("--name", help="The dataset's name in the card's title (default: the shards' dataset name, else "
                                  "'longreel'). The card names the shard files, and data_files matches them, as the "
                                  "pack wrote them (pack.dataset); without shards it is also the dataset's name.")
    b.add_argument("--pretty-name", help="The card's title.")
    b.add_argument("--command", dest="run_command",
                   help="The exact command that produced the run (default: what stats.json recorded).")
    b.add_argument("--data-prefix", default="data/",
                   help="Directory of the shards relative to the card when published (configs.data_files; "
                        "'data' and 'data/' are the same).")
    b.add_argument("--tables-prefix", default="tables/",
                   help="Directory of the stage tables relative to the card when published.")
    v = sub.add_parser("verify", help="Recompute the card's claims from the shards; exit 1 on any mismatch.")
    v.add_argument("card_dir", metavar="CARD_DIR")
    v.add_argument("shards", metavar="SHARDS_OR_INDEX", nargs="+",
                   help="A shards directory, or index files (paths or URLs; one per split).")
    v.add_argument("--json", dest="as_json", action="store_true", help="Print the rows as JSON instead of a table.")
    v.add_argument("--run", dest="run_dir", metavar="RUN_DIR",
                   help="Also recompute every claim from the run's outputs (stats.json, config.yaml, tables).")
    v.add_argument("--marker", metavar="RUN_DIR",
                   help="Check the run's _SUCCESS.json: every file it lists, size and sha256 (default: the marker of "
                        "--run, or of the card's parent directory when that is a run directory; a missing marker "
                        "fails).")
    v.add_argument("--no-loader", action="store_true",
                   help="Skip the second read of every split through the trainer's shard loader.")
    v.add_argument("--failures-only", action="store_true", help="Print only the rows that do not match.")
    for sp in (b, v):  # what a misspelt option of the subcommand is matched against
        sp.set_defaults(_card_options=tuple(re.findall(r"--[\w-]+", sp.format_usage())))


def _inside(path: str, directory: str) -> bool:
    here, there = os.path.realpath(path), os.path.realpath(directory)
    return here == there or here.startswith(there + os.sep)


@contextlib.contextmanager
def _card_session(args):
    """A card written into its run's directory (``card build OUT --out OUT/card``, what curate does) is one of the
    run's steps: it holds the run's lock (a run still writing is not described half way) and the run's
    ``_SUCCESS.json`` is written again with the card's files, which ``card verify`` checks against it. A card
    elsewhere touches nothing of the run. Yields the session, or None."""
    if "://" in args.run_dir or "://" in args.out or not _inside(args.out, args.run_dir):
        yield None
        return
    from longreel.pipelines.stage_session import StageSession

    options = {k: getattr(args, k) for k in ("shards", "name", "pretty_name", "run_command", "data_prefix",
                                              "tables_prefix")}
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()
    with StageSession(args.run_dir, "card", digest, command=" ".join(["longreel", *getattr(args, "_argv", [])])) as s:
        yield s


def _check_out(out: str) -> None:
    """``--out`` must be (or become) a directory: a file there made a FileExistsError traceback after the run's
    marker was already removed. Checked before anything is written or removed."""
    if "://" in out:
        return
    path = os.path.abspath(out)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        what = f"--out {out}" if path == os.path.abspath(out) else f"--out {out}: {path}"
        raise ValueError(f"{what} is a file, not a directory")


def _check_shards(shards: str | None) -> None:
    """A ``--shards`` given must hold an index: a directory without one made a "No shards" card, exit 0, over the
    run's good one. A local path is looked at here; an URL's index is read (what its reader says is the error)."""
    if shards is None:
        return
    from longreel.pipelines.card.shardread import INDEX_SUFFIX, as_local, list_indexes, read_index

    local = as_local(shards)
    if "://" not in local and not os.path.exists(local):
        raise FileNotFoundError(f"--shards {shards}: no such shards directory or {INDEX_SUFFIX} file")
    try:
        found = list_indexes(local)
        if not found:
            raise ValueError(f"--shards {shards}: no *{INDEX_SUFFIX} in it (a run without shards: leave --shards out)")
        if "://" in local:
            for path in found:
                read_index(path)
    except OSError as e:  # an URL that cannot be read (FileNotFoundError, the user's mistake, stays as it is)
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"--shards {shards}: cannot read it: {e}") from None


def _build(args, session) -> dict:
    from longreel.pipelines.card.build import build_card

    card = build_card(args.run_dir, args.out, args.shards, name=args.name, pretty_name=args.pretty_name,
                      command=args.run_command, data_prefix=args.data_prefix, tables_prefix=args.tables_prefix,
                      before_write=session.begin_writes if session is not None else None)
    if session is not None:
        session.finish()
    return card


def main(args, extra: list[str]) -> int:
    if extra:
        options = getattr(args, "_card_options", ())  # the subcommand's (build's or verify's)
        print(f"longreel card: {unexpected_arguments(extra, options)}", file=sys.stderr)
        return 2
    if args.card_command == "build":
        try:
            _check_out(args.out)
            _check_shards(args.shards)
            with _card_session(args) as session:
                card = _build(args, session)
        except (FileNotFoundError, ValueError) as e:
            print(f"longreel card build: {e}", file=sys.stderr)
            return 2
        print(f"card: {args.out}/README.md ({len(card['claims'])} claims in card.json)")
        return 0
    if args.card_command == "verify":
        from longreel.pipelines.card.verify import default_marker_dir, verify
        try:
            rep = verify(args.card_dir, args.shards, loader=not args.no_loader, run_dir=args.run_dir,
                         marker=args.marker or default_marker_dir(args.card_dir, args.run_dir))
        except (OSError, ValueError) as e:  # OSError: an index URL that answers an error status or cannot be reached
            print(f"longreel card verify: {e}", file=sys.stderr)
            return 2
        if args.as_json:
            rows = rep.failures() if args.failures_only else rep.rows
            print(json.dumps(rows, indent=1, ensure_ascii=False, default=str))
        else:
            if args.failures_only:
                shown = rep.failures()
                rep_rows, rep.rows = rep.rows, shown
                print(rep.table())
                rep.rows = rep_rows
            else:
                print(rep.table())
            bad = rep.failures()
            print(f"\n{len(rep.rows) - len(bad)} of {len(rep.rows)} claims match"
                  + (f"; {len(bad)} MISMATCH: " + ", ".join(r['claim'] for r in bad) if bad else "."))
        return 0 if rep.ok else 1
    print("longreel card: give a subcommand: build or verify (see --help)", file=sys.stderr)
    return 2
