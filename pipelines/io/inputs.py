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


def _manifest_rows(uri: str) -> list[tuple[dict, str]]:
    """(item, where it is listed) per entry of a manifest."""
    ext = posixpath.splitext(uri.lower())[1]
    base = posixpath.dirname(uri) if _is_remote(uri) else os.path.dirname(os.path.abspath(uri))
    raw = _read_bytes(uri)
    rows: list[dict] = []
    where: list[str] = []
    if ext in (".txt", ".lst"):
        for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                rows.append({"path": line})
                where.append(f"{uri} line {n}")
    elif ext == ".jsonl":
        for n, line in enumerate(raw.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(f"{uri}:{n}: not JSON: {e}") from None
                where.append(f"{uri} line {n}")
    elif ext == ".json":
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{uri}: not JSON: {e}") from None
        rows = data if isinstance(data, list) else data.get("videos", []) if isinstance(data, dict) else None
        if not isinstance(rows, list):
            raise InputError(f"{uri}: expected a list of entries (or {{\"videos\": [...]}})")
    elif ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(io.BytesIO(raw)).to_pylist()
        except pa.ArrowException as e:
            raise InputError(f"{uri}: not a readable Parquet file: {e}") from None
    if not where:
        where = [f"{uri} entry {n}" for n in range(1, len(rows) + 1)]
    out = []
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict):
            raise InputError(f"{uri}: entry {n} is not an object")
        path = r.get("path") or r.get("uri") or r.get("url")
        if not path or not isinstance(path, str):
            raise InputError(f"{uri}: entry {n} has no path/uri/url")
        if not _is_remote(path) and not os.path.isabs(path):
            path = posixpath.join(base, path) if _is_remote(base) else os.path.join(base, path)
        out.append((_item(path, r.get("license"), r.get("attribution")), where[n - 1]))
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
    A uri listed again (a repeated manifest line, a file named by two arguments) is kept as an item
    with ``duplicate_of`` (where it was first listed) and ``source`` (where again): ingest turns it into
    a ``duplicate_input`` reject, so that every listed input is counted. The first listing is the input.
    """
    listed: list[tuple[dict, str]] = []
    for n, spec in enumerate(specs, 1):
        if not spec:
            continue
        arg = f"argument {n}"
        low = spec.lower()
        is_glob = any(c in spec for c in "*?[")
        if not is_glob and low.endswith(MANIFEST_EXTENSIONS) and not (not _is_remote(spec) and os.path.isdir(spec)):
            if not FileSystems.exists(spec):
                raise InputError(f"manifest {spec!r} does not exist")
            try:
                listed.extend(_manifest_rows(spec))
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"cannot read manifest {spec!r}: {e}") from None
            continue
        if not is_glob and not _is_remote(spec) and os.path.isdir(spec):
            pattern = os.path.join(spec, "*")
            matched = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list]
            matched = [m for m in matched if m.lower().endswith(VIDEO_EXTENSIONS)]
            if not matched:
                raise InputError(f"directory {spec!r} holds no video files ({', '.join(VIDEO_EXTENSIONS)})")
            listed.extend((_item(m), f"directory {spec}") for m in sorted(matched))
            continue
        if not is_glob and not _is_remote(spec):
            # A single local path: keep it even if missing, so it turns into a reject with a reason.
            listed.append((_item(spec), arg))
            continue
        matched = [m.path for r in FileSystems.match([spec]) for m in r.metadata_list]
        if not matched:
            raise InputError(f"{spec!r} matches no file")
        listed.extend((_item(m), f"glob {spec}") for m in sorted(matched))
    first: dict[str, str] = {}
    items = []
    for it, where in listed:
        if it["uri"] in first:
            it = {**it, "duplicate_of": first[it["uri"]], "source": where}
        else:
            first[it["uri"]] = where
            if it["license"] is None:
                it["license"], it["attribution"] = _sidecar_license(it["uri"])
        items.append(it)
    # stable: a repeated uri sorts after its first listing, which is therefore the one that is probed
    return sorted(items, key=lambda x: x["uri"])
