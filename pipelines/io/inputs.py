"""Turning what the user gave (a glob, a directory, a manifest) into a sorted list of input items.

Everything is read through Beam's FileSystems, so ``gs://`` and ``s3://`` work wherever Beam's
``gcp``/``aws`` extras are installed. A manifest is one path/URL per line (``.txt``/``.lst``,
``#`` comments allowed), or a table (``.jsonl``/``.json``/``.parquet``) with a ``path`` (or
``uri``/``url``) column and optional ``license`` and ``attribution`` columns. A licence may
also come from a sidecar file ``<video>.license`` (first line: licence, rest: attribution).
"""
from __future__ import annotations

import io
import json
import os
import posixpath

from apache_beam.io.filesystems import FileSystems

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpeg", ".mpg", ".ts", ".ogg", ".ogv",
                    ".flv", ".wmv", ".3gp")
MANIFEST_EXTENSIONS = (".txt", ".lst", ".jsonl", ".json", ".parquet")


class InputError(ValueError):
    """The input specification itself is wrong (the run cannot start); bad *videos* become rejects instead."""


def _item(uri: str, license: str | None = None, attribution: str | None = None) -> dict:
    return {"uri": uri, "license": license, "attribution": attribution}


def _is_remote(uri: str) -> bool:
    return "://" in uri


def _read_bytes(uri: str) -> bytes:
    with FileSystems.open(uri, compression_type="uncompressed") as fh:
        return fh.read()


def _manifest_rows(uri: str) -> list[dict]:
    ext = posixpath.splitext(uri.lower())[1]
    base = posixpath.dirname(uri) if _is_remote(uri) else os.path.dirname(os.path.abspath(uri))
    raw = _read_bytes(uri)
    rows: list[dict] = []
    if ext in (".txt", ".lst"):
        for line in raw.decode("utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                rows.append({"path": line})
    elif ext == ".jsonl":
        for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{uri}:{n}: not JSON: {e}") from None
    elif ext == ".json":
        data = json.loads(raw)
        rows = data if isinstance(data, list) else data.get("videos", [])
    elif ext == ".parquet":
        import pyarrow.parquet as pq
        rows = pq.read_table(io.BytesIO(raw)).to_pylist()
    out = []
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise InputError(f"{uri}: entry {n} is not an object")
        path = r.get("path") or r.get("uri") or r.get("url")
        if not path or not isinstance(path, str):
            raise InputError(f"{uri}: entry {n} has no path/uri/url")
        if not _is_remote(path) and not os.path.isabs(path):
            path = posixpath.join(base, path) if _is_remote(base) else os.path.join(base, path)
        out.append(_item(path, r.get("license"), r.get("attribution")))
    return out


def _sidecar_license(uri: str) -> tuple[str | None, str | None]:
    side = uri + ".license"
    try:
        if not FileSystems.exists(side):
            return None, None
        text = _read_bytes(side).decode("utf-8").strip().splitlines()
    except Exception:
        return None, None
    if not text:
        return None, None
    return text[0].strip(), "\n".join(text[1:]).strip() or None


def expand_inputs(specs: list[str]) -> list[dict]:
    """Expand input specs into items ``{"uri", "license", "attribution"}``, sorted by uri.

    A spec that matches nothing is an :class:`InputError` (the user mistyped it); an entry of a
    manifest that does not exist is kept, so that it becomes a ``not_found`` reject with its name.
    """
    items: list[dict] = []
    for spec in specs:
        if not spec:
            continue
        low = spec.lower()
        is_glob = any(c in spec for c in "*?[")
        if not is_glob and low.endswith(MANIFEST_EXTENSIONS):
            if not FileSystems.exists(spec):
                raise InputError(f"manifest {spec!r} does not exist")
            items.extend(_manifest_rows(spec))
            continue
        if not is_glob and not _is_remote(spec) and os.path.isdir(spec):
            pattern = os.path.join(spec, "*")
            matched = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
            matched = [m for m in matched if m.lower().endswith(VIDEO_EXTENSIONS)]
            if not matched:
                raise InputError(f"directory {spec!r} holds no video files ({', '.join(VIDEO_EXTENSIONS)})")
            items.extend(_item(m) for m in matched)
            continue
        if not is_glob and not _is_remote(spec):
            # A single local path: keep it even if missing, so it turns into a reject with a reason.
            items.append(_item(spec))
            continue
        matched = [m.path for r in FileSystems.match([spec]) for m in r.metadata_list]
        if not matched:
            raise InputError(f"{spec!r} matches no file")
        items.extend(_item(m) for m in matched)
    for it in items:
        if it["license"] is None:
            it["license"], it["attribution"] = _sidecar_license(it["uri"])
    seen = set()
    unique = []
    for it in sorted(items, key=lambda x: x["uri"]):
        if it["uri"] in seen:  # the same path listed twice is one input, not a duplicate video
            continue
        seen.add(it["uri"])
        unique.append(it)
    return unique
