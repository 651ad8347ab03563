"""``longreel cache``: list or prune the trainer's disk cache of remote shards (``trainer.shard_cache``)."""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from longreel.schemas.config import unexpected_arguments

DESCRIPTION = """\
The trainer downloads remote shards (http(s)://, gs://, s3://) once into a disk cache
(data.cache_dir; default $LONGREEL_CACHE/shards or ~/.cache/longreel/shards) and never deletes
them on its own. List what it holds, least recently used first, or prune it:

  longreel cache list
  longreel cache prune --max-gb 200            # least recently used first, until 200 GB are left
  longreel cache prune --older-than-days 30    # every shard no run has used for 30 days
  longreel cache prune --all --dry-run         # what --all would remove, removing nothing

A shard a run is downloading right now is kept; one a running trainer has open stays readable by it
(the kernel frees the file when it is closed), and a later run downloads it again.
"""


EXIT_CODES = """\
exit codes:
  0  success: listed or pruned
  1  an internal error (a traceback is printed; please report it), or the machine refused (disk full,
     permission denied: one line, no traceback)
  2  usage or config error: bad arguments, config, or a path that is not what it must be. One line.
  130 interrupted (Ctrl-C)
-v/--debug shows the traceback of any error.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "prune"], help="list the cached shards, or prune them")
    p.add_argument("--dir", help="The cache directory (default: data.cache_dir's default, shown by `list`).")
    p.add_argument("--max-gb", type=float, metavar="GB", help="prune: keep at most this many GB (1 GB = 1e9 bytes).")
    p.add_argument("--older-than-days", type=float, metavar="DAYS",
                   help="prune: remove shards no run has used for more than this many days.")
    p.add_argument("--all", action="store_true", help="prune: remove every cached shard.")
    p.add_argument("--dry-run", action="store_true", help="prune: print what would be removed, remove nothing.")
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")


def main(args, extra: list[str]) -> int:
    from longreel.trainer.shard_cache import choose_evictions, default_cache_dir, prune, scan

    if extra:
        print(f"longreel cache: {unexpected_arguments(extra, getattr(args, '_options', ()))}", file=sys.stderr)
        return 2
    criteria = [args.max_gb is not None, args.older_than_days is not None, args.all]
    if args.action == "list" and (any(criteria) or args.dry_run):
        print("longreel cache list: --max-gb, --older-than-days, --all and --dry-run belong to `prune`",
              file=sys.stderr)
        return 2
    if args.action == "prune" and sum(criteria) != 1:
        print("longreel cache prune: give one of --max-gb, --older-than-days or --all", file=sys.stderr)
        return 2
    for name in ("max_gb", "older_than_days"):
        value = getattr(args, name)
        if value is not None and value < 0:
            print(f"longreel cache prune: --{name.replace('_', '-')} must be >= 0, got {value}", file=sys.stderr)
            return 2
    cache_dir = args.dir or default_cache_dir()
    shards = scan(cache_dir)
    if args.action == "list":
        report(cache_dir, shards, [], args.json, mode="list")
        return 0
    victims = shards if args.all else choose_evictions(
        shards, max_bytes=None if args.max_gb is None else int(args.max_gb * 1e9),
        older_than_s=None if args.older_than_days is None else args.older_than_days * 86400)
    if args.dry_run:
        report(cache_dir, shards, victims, args.json, mode="dry-run")
    else:
        report(cache_dir, shards, prune(victims), args.json, mode="prune")
    return 0


def report(cache_dir: str, shards, victims, as_json: bool, *, mode: str) -> None:
    """``victims``: the shards pruned (``mode`` "prune") or that would be (``mode`` "dry-run")."""
    removed = mode == "prune"
    gone = {c.path for c in victims}
    rows = [{"file": c.path.name, "bytes": c.bytes,
             "last_used": dt.datetime.fromtimestamp(c.last_used, dt.timezone.utc).isoformat(timespec="seconds"),
             "pruned": c.path in gone} for c in shards]
    total = sum(c.bytes for c in shards)
    freed = sum(c.bytes for c in victims)
    if as_json:
        print(json.dumps({"cache_dir": cache_dir, "shards": rows, "bytes": total, "pruned_bytes": freed,
                          "removed": removed}, indent=1))
        return
    print(f"shard cache {cache_dir}: {len(shards)} shard(s), {total / 1e9:.2f} GB")
    for r in rows:
        mark = ("removed " if removed else "would go") if r["pruned"] else "        "
        print(f"  {mark}  {r['last_used']}  {r['bytes'] / 1e6:10.1f} MB  {r['file']}")
    if mode != "list":
        verb = "removed" if removed else "would remove"
        print(f"{verb} {len(victims)} shard(s), {freed / 1e9:.2f} GB; {(total - freed) / 1e9:.2f} GB left")
