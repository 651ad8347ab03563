"""The completion marker of a run directory, ``_SUCCESS.json``: its format and its check.

A run writes the marker last (after every table, clip file, shard and the card), so a directory without one
holds an unfinished (crashed, killed, still running) or pre-marker run. The marker names the run's config
(``config_hash`` and the resolved ``config``), its stages, a digest of its inputs and every file the run owns
with its size and sha256; it holds no time, host or absolute path, so re-running the same config on the same
inputs writes the same bytes.

It lives at the bottom of the import graph (stdlib only) so that a consumer outside the pipelines, such as the
trainer or an auditor, can refuse a half-written dataset before reading it::

    from longreel.schemas.run_marker import require_complete_run
    require_complete_run("out/")  # raises IncompleteRun naming what is missing or changed
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
from typing import IO, Callable

MARKER_NAME = "_SUCCESS.json"
MARKER_KIND = "longreel-run"
MARKER_VERSION = "1.0"


class IncompleteRun(ValueError):
    """A run directory has no valid completion marker, or its files differ from what the marker lists."""


def _join(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + rel if "://" in base else os.path.join(base, *rel.split("/"))


def _open_local(path: str) -> IO[bytes]:
    return open(path, "rb")


def safe_relpath(rel: str) -> bool:
    """A marker entry may only name a file inside the run directory (no absolute path, no ``..``)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel or "\0" in rel:
        return False
    norm = posixpath.normpath(rel)
    return norm == rel and not norm.startswith("../") and norm != ".."


def sha256_of(fh: IO[bytes]) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    while chunk := fh.read(1 << 20):
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def parse_marker(blob: bytes, where: str = MARKER_NAME) -> dict:
    try:
        doc = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as e:
        raise IncompleteRun(f"{where}: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != MARKER_KIND:
        kind = doc.get("kind") if isinstance(doc, dict) else None
        raise IncompleteRun(f"{where}: not a longreel run marker (kind {kind!r})")
    if not isinstance(doc.get("files"), list):
        raise IncompleteRun(f"{where}: has no file list")
    return doc


def read_marker(run_dir: str, open_file: Callable[[str], IO[bytes]] | None = None) -> dict | None:
    """The marker document, or None when the directory has none. A marker that is not one raises."""
    opener = open_file or _open_local
    path = _join(run_dir, MARKER_NAME)
    try:
        with opener(path) as fh:
            blob = fh.read()
    except FileNotFoundError:
        return None
    return parse_marker(blob, path)


def check_run_marker(run_dir: str, *, hash_files: bool = True,
                     open_file: Callable[[str], IO[bytes]] | None = None) -> tuple[dict | None, list[dict]]:
    """(marker, problems): every file the marker lists must exist with its size (and sha256 when ``hash_files``).

    A problem is ``{"path", "expected", "found"}``; no marker at all is one problem with path ``_SUCCESS.json``.
    ``open_file`` opens a path or URL for reading in binary (default: local files)."""
    opener = open_file or _open_local
    try:
        marker = read_marker(run_dir, opener)
    except IncompleteRun as e:
        return None, [{"path": MARKER_NAME, "expected": "a longreel run marker", "found": str(e)}]
    if marker is None:
        return None, [{"path": MARKER_NAME, "expected": "present (written last by a finished run)",
                       "found": "missing: the run did not finish, or is still running"}]
    problems = []
    for entry in marker["files"]:
        rel = entry.get("path") if isinstance(entry, dict) else None
        if not safe_relpath(rel):
            problems.append({"path": str(rel), "expected": "a path inside the run directory", "found": rel})
            continue
        want = {"bytes": entry.get("bytes"), "sha256": entry.get("sha256")}
        try:
            with opener(_join(run_dir, rel)) as fh:
                if hash_files:
                    n, digest = sha256_of(fh)
                    got = {"bytes": n, "sha256": digest}
                else:
                    got = {"bytes": len(fh.read()), "sha256": want["sha256"]}
        except FileNotFoundError:
            problems.append({"path": rel, "expected": want, "found": "missing"})
            continue
        if got != want:
            problems.append({"path": rel, "expected": want, "found": got})
    return marker, problems


def require_complete_run(run_dir: str, *, hash_files: bool = True,
                         open_file: Callable[[str], IO[bytes]] | None = None) -> dict:
    """Return the marker of a finished, unchanged run; raise :class:`IncompleteRun` otherwise."""
    marker, problems = check_run_marker(run_dir, hash_files=hash_files, open_file=open_file)
    if problems:
        shown = "; ".join(f"{p['path']}: expected {p['expected']}, found {p['found']}" for p in problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise IncompleteRun(f"{run_dir} is not a complete longreel run: {shown}{more}")
    return marker
