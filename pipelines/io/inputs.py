"""Turning what the user gave (a glob, a directory, a manifest) into input items, on the workers.

The launcher only plans (:func:`plan_inputs`): one classification and one cheap existence check per spec (a
manifest exists, a glob's first match, a directory's first video file), so a typo is an error before the job
starts and the job graph holds the specs, never the videos. :class:`ReadInputs` does the rest on the workers:
globs and directories through ``fileio.MatchFiles``, manifests through ``fileio.ReadMatches`` (streamed, one
entry at a time), then the repeated-listing check and the licence sidecars.

Everything but an http(s) URL is read through Beam's FileSystems, so ``gs://`` and ``s3://`` work wherever
Beam's ``gcp``/``aws`` extras are installed; an http(s) URL is read with urllib (as an INPUT it is one video, or
a manifest when its path ends as one, but not ``.parquet``). A manifest is one path/URL per line (``.txt``/``.lst``,
``#`` comments allowed), or a table (``.jsonl``/``.json``/``.parquet``) with a ``path`` (or
``uri``/``url``) column and optional ``license`` and ``attribution`` columns. A licence may
also come from a sidecar file ``<video>.license`` (first line: licence, rest: attribution).
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import posixpath
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass

import apache_beam as beam
from apache_beam.io import fileio
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.io.input_kinds import (  # noqa: F401 - the extensions: where callers have found them
    MANIFEST_EXTENSIONS, VIDEO_EXTENSIONS, is_glob, is_manifest_name)
from longreel.pipelines.io.input_kinds import is_http
from longreel.pipelines.io.input_kinds import is_remote as _is_remote

#: seconds a read of a manifest over http(s) may wait for the server (per connection and per read)
URL_TIMEOUT_S = 60


class InputError(ValueError):
    """The input specification itself is wrong (the run cannot start); bad *videos* become rejects instead."""


def input_error_of(exc: BaseException) -> InputError | None:
    """The :class:`InputError` a worker raised, from the failure the runner reports (None if it is another).

    In process the runner re-raises the same type with `` [while running 'step']`` appended; a runner that
    moves the failure between processes keeps only its text, so the message is found by its class name."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, InputError):
            return InputError(re.sub(r" \[while running '[^']*'\]$", "", str(e)))
        e = e.__cause__ or e.__context__
    m = re.search(r"InputError: ([^\n]*?)(?: \[while running|\n|$)", str(exc))
    return InputError(m.group(1)) if m else None


def _item(uri: str, license: str | None = None, attribution: str | None = None) -> dict:
    return {"uri": uri, "license": license, "attribution": attribution}


# ---------------------------------------------------------------------------------------------------------------
# the launcher's part: one plan per spec
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecPlan:
    """One input spec, classified. ``kind``: ``manifest``, ``directory``, ``glob`` or ``path``; ``pattern`` is what
    is matched or opened; ``base`` the directory a manifest's relative entries are resolved against."""
    index: int  # the spec's place on the command line (1-based): earlier listings of a uri win
    spec: str
    kind: str
    pattern: str
    base: str = ""
    #: sha256 of what the launcher read of the spec: a manifest's bytes, a single local file's ``.license``
    #: sidecar ("" when there is none), so that an edited manifest or licence is other inputs
    content: str = ""

    @property
    def where(self) -> str:
        """How a listing by this spec is named in a ``duplicate_input`` reject (manifests name their lines)."""
        return {"directory": f"directory {self.spec}", "glob": f"glob {self.spec}",
                "path": f"argument {self.index}"}.get(self.kind, self.spec)


@dataclass(frozen=True)
class InputPlan:
    """What the launcher hands to the job: the classified specs (the videos are found by :class:`ReadInputs`)."""
    specs: tuple[SpecPlan, ...]

    def digest(self) -> str:
        """Identifies the inputs of a run (its output directory's identity) without listing them.

        A local spec counts as its normalised absolute path (``DIR/``, ``DIR`` and ``//DIR`` are one input), a
        manifest also by its content and a single local file by its ``.license`` sidecar's (:attr:`SpecPlan.content`).
        Directories and globs count as their patterns only: they are listed by the workers, never by the launcher
        (a corpus may hold millions of files), so a video added to or removed from a directory, or a sidecar beside
        a listed video, is not seen here; ``--overwrite`` is the way to re-run such a directory from scratch."""
        return hashlib.sha256(json.dumps([_identity(s) for s in self.specs]).encode()).hexdigest()


def _identity(plan: SpecPlan) -> dict:
    """What :meth:`InputPlan.digest` hashes of one spec. Without a content it is the dict digests were made of
    before contents counted, so a run of absolute paths made then is still the same run."""
    doc = asdict(plan)
    doc["spec"] = plan.spec if _is_remote(plan.spec) else _local_abs(plan.spec)
    if not doc["content"]:
        del doc["content"]
    return doc


def _local_abs(path: str) -> str:
    """``path`` absolute and normalised: one name per file, however it was typed (``a/../b``, ``DIR/``). POSIX
    keeps a leading ``//`` (its meaning is left to the system); Linux and macOS read it as ``/``."""
    path = os.path.abspath(path)
    return path[1:] if path.startswith("//") and os.sep == "/" else path


def _first_video_in(directory: str) -> str | None:
    with os.scandir(directory) as entries:
        return next((e.path for e in entries if e.name.lower().endswith(VIDEO_EXTENSIONS)), None)


def _escape_glob(path: str) -> str:
    """``path`` as a pattern that matches only itself (``[`` -> ``[[]``, as fnmatch reads it)."""
    import glob

    return glob.escape(path)


def plan_spec(index: int, spec: str) -> SpecPlan:
    """Classify one spec, with a check that costs O(1) calls (no listing of what it names)."""
    if is_http(spec):  # Beam has no http(s) filesystem: neither matched nor globbed (a "?" starts its query)
        return _plan_url(index, spec)
    # a local name that is there is that file or directory, glob characters and all ("Film [1080p].mp4")
    glob = is_glob(spec) and (_is_remote(spec) or not os.path.exists(spec))
    local_dir = not glob and not _is_remote(spec) and os.path.isdir(spec)
    if not glob and is_manifest_name(spec) and not local_dir:
        if not FileSystems.exists(spec):
            raise InputError(f"manifest {spec!r} does not exist")
        where = spec if _is_remote(spec) else _local_abs(spec)
        base = posixpath.dirname(spec) if _is_remote(spec) else os.path.dirname(where)
        plan = SpecPlan(index, spec, "manifest", where, base, _manifest_sha256(spec, where))
        if not _is_remote(spec):
            _check_manifest(plan)
        return plan
    if local_dir:
        if _first_video_in(spec) is None:
            raise InputError(f"directory {spec!r} holds no video files ({', '.join(VIDEO_EXTENSIONS)})")
        return SpecPlan(index, spec, "directory", os.path.join(_escape_glob(_local_abs(spec)), "*"))
    if not glob and not _is_remote(spec):
        # A single local path: kept even if missing, so that it turns into a reject with a reason.
        return SpecPlan(index, spec, "path", _local_abs(spec), content=_sidecar_sha256(_local_abs(spec)))
    if not FileSystems.match([spec], limits=[1])[0].metadata_list:
        raise InputError(f"{spec!r} matches no file")
    # local names are matched as absolute paths: a relative one went into the videos table as typed, and a stage
    # run later from another directory read no video and replaced the run's captions with none
    return SpecPlan(index, spec, "glob", spec if _is_remote(spec) else _local_abs(spec))


def _plan_url(index: int, spec: str) -> SpecPlan:
    """An http(s) URL: a video is one input, not checked here (as a manifest's line: its fetch decides, and a
    404 is a ``not_found`` reject); a manifest is read now, as a local one is checked, and again by the workers."""
    if not is_manifest_name(urllib.parse.urlsplit(spec).path):
        return SpecPlan(index, spec, "path", spec)
    if urllib.parse.urlsplit(spec).path.lower().endswith(".parquet"):  # read by seeking, which http does not do
        raise InputError(f"manifest {spec!r}: a Parquet manifest is not read over http(s); download it and give "
                         "the local file")
    data = _read_url(spec)
    plan = SpecPlan(index, spec, "manifest", spec, urllib.parse.urljoin(spec, "."), hashlib.sha256(data).hexdigest())
    _check_listings(plan, io.BytesIO(data))
    return plan


def _read_url(url: str) -> bytes:
    """The bytes of a manifest at ``url``; a failure is an :class:`InputError` in one line."""
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as fh:  # noqa: S310 - the user's own URL
            return fh.read()
    except urllib.error.HTTPError as e:
        e.close()
        gone = " does not exist" if e.code in (404, 410) else ""
        raise InputError(f"manifest {url!r}{gone} (HTTP {e.code} {e.reason})") from None
    except (OSError, ValueError) as e:  # refused, timed out, no such host; a malformed URL
        raise InputError(f"cannot read manifest {url!r}: {getattr(e, 'reason', None) or e}") from None


def _manifest_sha256(spec: str, path: str) -> str:
    """The manifest's content hash (manifests are lists of names: small next to the videos they name)."""
    h = hashlib.sha256()
    try:
        with FileSystems.open(path, compression_type="uncompressed") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise InputError(f"cannot read manifest {spec!r}: {e}") from None
    return h.hexdigest()


def _sidecar_sha256(path: str) -> str:
    """The content hash of a single local file's ``.license`` sidecar; "" when it has none (or it cannot be
    read: the workers then read none either)."""
    try:
        with open(path + ".license", "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return ""


#: entries of a local manifest the launcher reads before the run (the workers list them all)
CHECKED_ENTRIES = 10_000


def _check_manifest(plan: SpecPlan) -> None:
    """Read the first :data:`CHECKED_ENTRIES` entries of a local manifest before the run: a manifest of the wrong
    form or with a bad line near its top (what a mistake usually gives) is refused in one line, before anything is
    written. Found by the workers, it failed the pipeline with each worker's traceback (Beam's harness prints them)
    before that line. Past them, the workers list the rest as before, so a manifest of any length costs the
    launcher a bounded read. A manifest listing nothing is refused too."""
    with open(plan.pattern, "rb") as fh:
        _check_listings(plan, fh)


def _check_listings(plan: SpecPlan, fh) -> None:
    listings = manifest_listings(plan, fh)
    if next(listings, None) is None:
        raise InputError(f"manifest {plan.spec!r} lists no videos")
    for _ in itertools.islice(listings, CHECKED_ENTRIES - 1):
        pass


def plan_inputs(specs: list[str]) -> InputPlan:
    """Plan every spec (empty ones are skipped but keep their argument number). Raises :class:`InputError`."""
    return InputPlan(tuple(plan_spec(n, s) for n, s in enumerate(specs, 1) if s))


# ---------------------------------------------------------------------------------------------------------------
# the workers' part: listings, then items
# ---------------------------------------------------------------------------------------------------------------
# A listing is (uri, {"pos": [spec index, entry], "where": ..., "license": ..., "attribution": ...}); the
# smallest pos of a uri is its input, the others are repeats.

def _listing(uri: str, plan: SpecPlan, entry: int, where: str, license=None, attribution=None) -> tuple:
    return uri, {"pos": [plan.index, entry], "where": where, "license": license, "attribution": attribution}


def _text_rows(fh, uri: str, as_json: bool):
    """(line number, row) per non-empty line; streamed, so a manifest of any length fits in memory."""
    for n, line in enumerate(io.TextIOWrapper(fh, encoding="utf-8"), 1):
        if as_json:
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{uri}:{n}: not JSON: {e}") from None
        else:
            line = line.strip()
            if line and not line.startswith("#"):
                yield n, {"path": line}


def _json_rows(fh, uri: str):
    try:
        data = json.loads(fh.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{uri}: not JSON: {e}") from None
    # an object without "videos" (one entry, or a dataframe's to_json) was read as an empty list: nothing, silently
    rows = data if isinstance(data, list) else data.get("videos") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise InputError(f"{uri}: expected a list of entries (or {{\"videos\": [...]}})")
    yield from ((None, r) for r in rows)


def _parquet_rows(fh, uri: str):
    """One record batch at a time (pyarrow reads the file's row groups lazily)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        for batch in pq.ParquetFile(fh).iter_batches():
            yield from ((None, r) for r in batch.to_pylist())
    except pa.ArrowException as e:
        raise InputError(f"{uri}: not a readable Parquet file: {e}") from None


def manifest_listings(plan: SpecPlan, fh):
    """The listings of an open manifest, in order. A malformed manifest is an :class:`InputError`, as is an
    entry that is not an object or names no path; an entry naming a missing file is kept (a ``not_found`` later)."""
    uri = plan.spec
    ext = posixpath.splitext(uri.lower())[1]
    rows = (_text_rows(fh, uri, as_json=ext == ".jsonl") if ext in (".txt", ".lst", ".jsonl")
            else _json_rows(fh, uri) if ext == ".json" else _parquet_rows(fh, uri))
    try:
        for n, (line, r) in enumerate(rows, 1):
            if not isinstance(r, dict):
                raise InputError(f"{uri}: entry {n} is not an object")
            path = r.get("path") or r.get("uri") or r.get("url")
            if not path or not isinstance(path, str):
                raise InputError(f"{uri}: entry {n} has no path/uri/url")
            if not _is_remote(path) and not os.path.isabs(path):
                path = _resolve(plan.base, path)
            where = f"{uri} line {line}" if line is not None else f"{uri} entry {n}"
            for field in ("license", "attribution"):
                # a number or a list here went on to be probed and then rejected as a schema violation, or dropped
                if r.get(field) is not None and not isinstance(r[field], str):
                    raise InputError(f"{where}: {field} must be a string, got {r[field]!r}")
            yield _listing(path, plan, n, where, r.get("license") or None, r.get("attribution") or None)
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read manifest {uri!r}: {e}") from None


def _resolve(base: str, entry: str) -> str:
    """A manifest's relative entry against the directory of the manifest (a URL's as a browser would: ``..``)."""
    if is_http(base):
        return urllib.parse.urljoin(base, entry)
    return posixpath.join(base, entry) if _is_remote(base) else os.path.join(base, entry)


def open_manifest(uri: str):
    """``uri`` open for reading in binary: over http(s) with :data:`URL_TIMEOUT_S`, else through FileSystems."""
    if is_http(uri):
        return urllib.request.urlopen(uri, timeout=URL_TIMEOUT_S)  # noqa: S310 - the user's own URL
    return FileSystems.open(uri, compression_type="uncompressed")


def _opened_listings(plan: SpecPlan):
    """The listings of the manifest ``plan`` names, opened here (a URL the launcher read may fail since)."""
    try:
        fh = open_manifest(plan.pattern)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read manifest {plan.spec!r}: {getattr(e, 'reason', None) or e}") from None
    with fh:
        yield from manifest_listings(plan, fh)


def matched_listings(plan: SpecPlan, path: str):
    """The listing of one file a glob or directory matched (a directory lists only its video files)."""
    if plan.kind == "directory" and not path.lower().endswith(VIDEO_EXTENSIONS):
        return
    yield _listing(path, plan, 0, plan.where)


def resolve_listings(uri: str, listings) -> list[dict]:
    """All listings of one uri -> items: the first listed is the input, each later one an item with
    ``duplicate_of`` (where it was first listed) and ``source`` (where again), which ingest rejects."""
    ordered = sorted(listings, key=lambda li: li["pos"])
    first = ordered[0]
    items = [_item(uri, first["license"], first["attribution"])]
    for li in ordered[1:]:
        items.append({**_item(uri, li["license"], li["attribution"]), "duplicate_of": first["where"],
                      "source": li["where"]})
    return items


def _read_bytes(uri: str) -> bytes:
    with FileSystems.open(uri, compression_type="uncompressed") as fh:
        return fh.read()


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


def with_sidecar_license(item: dict) -> dict:
    """An input without a licence of its own takes its sidecar's (repeats are rejected, so they need none)."""
    if item["license"] is not None or item.get("duplicate_of"):
        return item
    lic, attribution = _sidecar_license(item["uri"])
    return {**item, "license": lic, "attribution": attribution}


class _ManifestListings(beam.DoFn):
    def __init__(self, plan: SpecPlan):
        self.plan = plan

    def process(self, readable):
        with readable.open(compression_type="uncompressed") as fh:
            yield from manifest_listings(self.plan, fh)


def _spec_listings(p, plan: SpecPlan):
    label = f"Spec{plan.index}"
    if plan.kind == "manifest" and is_http(plan.pattern):  # no http filesystem in Beam to match it with
        return (p | f"{label}Url" >> beam.Create([plan])
                | f"{label}Read" >> beam.FlatMap(_opened_listings))
    if plan.kind == "manifest":
        return (p | f"{label}Match" >> fileio.MatchFiles(plan.pattern)
                | f"{label}Open" >> fileio.ReadMatches()
                | f"{label}Read" >> beam.ParDo(_ManifestListings(plan)))
    if plan.kind == "path":
        return p | f"{label}Path" >> beam.Create([_listing(plan.pattern, plan, 0, plan.where)])
    return (p | f"{label}Match" >> fileio.MatchFiles(plan.pattern)
            | f"{label}Listings" >> beam.FlatMap(lambda m, plan=plan: matched_listings(plan, m.path)))


class ReadInputs(beam.PTransform):
    """An :class:`InputPlan` -> items ``{"uri", "license", "attribution"}`` (and ``duplicate_of``/``source`` for a
    uri listed again), found on the workers. The grouping by uri is the fusion break after the matching: the
    items of one glob or manifest spread over the workers from there."""

    def __init__(self, plan: InputPlan):
        super().__init__()
        self.plan = plan

    def expand(self, pbegin):
        p = pbegin.pipeline
        branches = [_spec_listings(p, plan) for plan in self.plan.specs]
        listings = (tuple(branches) | "AllListings" >> beam.Flatten() if branches
                    else p | "NoListings" >> beam.Create([]))
        return (listings
                | "GroupByUri" >> beam.GroupByKey()
                | "Resolve" >> beam.FlatMapTuple(resolve_listings)
                | "SidecarLicence" >> beam.Map(with_sidecar_license))


def _local_listings(plan: SpecPlan):
    if plan.kind == "manifest":
        yield from _opened_listings(plan)
    elif plan.kind == "path":
        yield _listing(plan.pattern, plan, 0, plan.where)
    else:
        for m in sorted(m.path for r in FileSystems.match([plan.pattern]) for m in r.metadata_list):
            yield from matched_listings(plan, m)


def expand_inputs(specs: list[str]) -> list[dict]:
    """Expand input specs into items ``{"uri", "license", "attribution"}``, sorted by uri, in this process (for
    callers that want the list; ``longreel curate`` reads its inputs on the workers with :class:`ReadInputs`).

    A spec that matches nothing is an :class:`InputError` (the user mistyped it); an entry of a
    manifest that does not exist is kept, so that it becomes a ``not_found`` reject with its name.
    A uri listed again (a repeated manifest line, a file named by two arguments) is kept as an item
    with ``duplicate_of`` (where it was first listed) and ``source`` (where again): ingest turns it into
    a ``duplicate_input`` reject, so that every listed input is counted. The first listing is the input.
    """
    by_uri: dict[str, list[dict]] = {}
    for plan in plan_inputs(specs).specs:
        for uri, li in _local_listings(plan):
            by_uri.setdefault(uri, []).append(li)
    # stable: a repeated uri sorts after its first listing, which is therefore the one that is probed
    items = [with_sidecar_license(it) for uri, lis in by_uri.items() for it in resolve_listings(uri, lis)]
    return sorted(items, key=lambda x: x["uri"])
