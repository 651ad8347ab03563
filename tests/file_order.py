"""The order in which test files start: the longest first, from the durations a full run recorded.

With ``--dist loadfile`` each pytest-xdist worker takes whole files from one queue. Left to itself xdist orders that
queue by the number of tests in a file, which put the few long end-to-end files (the demo script, the SIGKILL
resume) last and left one worker running them alone at the end. Longest-first (the classic LPT rule for
scheduling jobs on identical machines) starts them while there is still other work to share out.

``tests/durations.json`` maps each test file to its measured seconds (setup + call + teardown of all its tests, on
2 workers); ``pytest --durations-out tests/durations.json`` rewrites it from a run. A file it does not list (a new
one) starts first: its cost is unknown, and a long file at the end costs more than a short one at the start.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

DURATIONS = Path(__file__).resolve().parent / "durations.json"


def file_of(nodeid: str) -> str:
    """``tests/test_x.py::test_y[a]`` -> ``tests/test_x.py``: the unit ``--dist loadfile`` hands to a worker."""
    return nodeid.split("::", 1)[0]


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    """The recorded seconds per test file; empty when there is no record (the order then stays pytest's)."""
    if not path.is_file():
        return {}
    return {str(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}


def longest_first(nodeids: Sequence[str], durations: dict[str, float]) -> list[int]:
    """Indices that reorder ``nodeids`` file by file, longest recorded file first, unrecorded files before all.

    Each file's tests stay together and in their own order (module fixtures are built once), and ties keep
    pytest's collection order, so the result depends only on the inputs.
    """
    first_seen: dict[str, int] = {}
    for nodeid in nodeids:
        first_seen.setdefault(file_of(nodeid), len(first_seen))

    def key(i: int) -> tuple[int, float, int]:
        f = file_of(nodeids[i])
        known = f in durations
        return (int(known), -durations.get(f, 0.0), first_seen[f])

    return sorted(range(len(nodeids)), key=key)


def file_seconds(reports: Iterable[tuple[str, float]]) -> dict[str, float]:
    """``(nodeid, seconds)`` for every setup, call and teardown -> seconds per test file, rounded to 0.1 s."""
    total: dict[str, float] = {}
    for nodeid, seconds in reports:
        f = file_of(nodeid)
        total[f] = total.get(f, 0.0) + seconds
    return {f: round(s, 1) for f, s in sorted(total.items())}


def write_durations(path: Path, seconds: dict[str, float], how: str) -> None:
    doc = {"note": "seconds per test file (setup + call + teardown of its tests); tests/file_order.py starts the "
                   "longest first. Rewrite with: " + how,
           "seconds": dict(sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0])))}
    path.write_text(json.dumps(doc, indent=1) + "\n")
