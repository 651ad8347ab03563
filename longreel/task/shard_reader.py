"""Reading longreel shards: the one reader behind the trainer's loader (``longreel.trainer.data.ShardDataset``) and
``longreel card verify``, so that what the card checks is what training reads.

Sources: shard URLs, brace patterns (``dir/ds-sft-{000000..000011}.tar``, expanded by ``braceexpand``, the library
webdataset uses), local globs (``dir/*-sft-*.tar``, sorted) or wids index files, whose shard URLs are resolved against
the index's own location. A glob must match a file; remote URLs are not globbed (an object store would need listing
credentials here): give a brace pattern or the index. URLs may be
local paths, ``file://``, ``http(s)://`` (standard library), ``gs://`` (``gsutil cat``), ``s3://`` (``aws s3 cp
URL -``), both run as argument lists through webdataset's ``Pipe``, or an explicit ``pipe:COMMAND`` (webdataset's
shell pipe: the user's own command, refused when ``WDS_SECURE=1``).

Safety: members are parsed, never extracted; only ``.npy`` (``allow_pickle=False``), ``.json`` and ``.txt`` are
accepted; pickle-style members and any other extension are errors, as are member names that are absolute, contain
``..``, backslashes or NUL, and non-regular members (links, devices, directories).

Why a hand-written tar parser rather than ``tarfile``/webdataset's: it reads members into pooled (or memory-mapped)
buffers so that frames become zero-copy numpy views, and it tells a truncated or corrupt stream from a bad sample
(see ``benchmarks/loader.py`` for the throughput it buys).
"""
from __future__ import annotations

import glob
import hashlib
import http.client
import io
import json
import logging
import os
import re
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from braceexpand import braceexpand

from longreel.task.transfer_stop import cut_on_stop

log = logging.getLogger("longreel")

PICKLE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "mp", "msgpack", "joblib"})
ALLOWED_EXTS = frozenset({"npy", "json", "txt"})
REQUIRED = ("frames.npy", "meta.json", "qras.json")
BLOCK = 512


class ShardError(RuntimeError):
    """A shard or one of its samples is unreadable, corrupt or unsafe. Names the shard and the key."""

    def __init__(self, shard: str, key: str | None, message: str):
        where = f"{shard}: sample {key!r}" if key else f"{shard}"
        super().__init__(f"{where}: {message}")
        self.shard, self.key, self.detail = shard, key, message
        # set by read_shard when the error ends a shard: the samples lost with the rest of it, and how that is known
        self.lost, self.lost_note = 0, ""


class UnsafeMemberError(ShardError):
    """A tar member whose name or type could escape an extraction directory (never extracted here)."""


# ------------------------------------------------------------------------------------------------ URLs


@dataclass(frozen=True)
class ShardSpec:
    url: str
    sha256: str | None = None
    bytes: int | None = None
    nsamples: int | None = None


def is_url(s: str) -> bool:
    """Whether ``s`` names a scheme (``http://``, ``gs://``, ``file://``, ...) rather than a local path."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s))


def _join(base: str, rel: str) -> str:
    if is_url(rel) or rel.startswith(("/", "pipe:")):
        return rel
    if base.startswith(("http://", "https://")):
        return urllib.parse.urljoin(base, rel)
    if is_url(base):
        return base.rsplit("/", 1)[0] + "/" + rel
    return os.path.join(os.path.dirname(base), rel)


def resolve_shards(source) -> list[ShardSpec]:
    """URLs, brace patterns, local globs or wids index files (``*.json``; they too may be a pattern) -> shard specs,
    in the given order (a glob's matches sorted)."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    out: list[ShardSpec] = []
    for item in items:
        if isinstance(item, ShardSpec):
            out.append(item)
            continue
        for s in (u for pattern in braceexpand(os.fspath(item)) for u in _glob(pattern)):
            if s.endswith(".json"):
                out.extend(_index_specs(s))
            else:
                out.append(ShardSpec(s))
    if not out:
        raise ValueError(f"no shards in {source!r}")
    return out


def _index_specs(s: str) -> list[ShardSpec]:
    """The shards a wids index lists, their URLs resolved against the index's own location. A malformed index is a
    ValueError naming it (an HTML error page at the URL, a list, an entry without its url): read unchecked it was an
    AttributeError or KeyError, reported as a bug."""
    with open_url(s) as fh:
        text = fh.read()
    try:
        doc = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError too: the error must name the index, not only the JSON position
        raise ValueError(f"{s} is not a wids shard index (not JSON: {e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{s} is not a wids shard index (a JSON {type(doc).__name__}, not an object)")
    if doc.get("__kind__") != "wids-shard-index-v1" or not isinstance(doc.get("shardlist"), list):
        raise ValueError(f"{s} is not a wids shard index (__kind__ wids-shard-index-v1 with a shardlist)")
    return [_index_entry(s, i, e) for i, e in enumerate(doc["shardlist"])]


def _index_entry(s: str, i: int, e) -> ShardSpec:
    """Entry ``i`` of index ``s``'s shardlist: ``url`` a string, ``nsamples`` a count, ``sha256`` and ``bytes`` (the
    names the pack stage writes) absent or of their type, so that what the loader and the cache check is sound."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{s}: shardlist entry {i} {what} (each entry is {{url, nsamples[, bytes, sha256]}})")

    if not isinstance(e, dict):
        raise bad(f"is a JSON {type(e).__name__}, not an object")
    if not isinstance(e.get("url"), str) or not e["url"]:
        raise bad("has no url" if "url" not in e else f"has url {e['url']!r}, not a shard URL")
    n = e.get("nsamples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # a count of samples (a bool is an int to Python)
        raise bad("has no nsamples" if "nsamples" not in e else f"has nsamples {n!r}, not a count of samples")
    sha = e.get("sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
        raise bad(f"has sha256 {sha!r}, not 64 hex digits")
    size = e.get("bytes")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise bad(f"has bytes {size!r}, not a size in bytes")
    return ShardSpec(_join(s, e["url"]), sha, size, n)


def local_path(url: str) -> str | None:
    """The filesystem path of a local path or ``file://`` URL; None for anything read over a network or a pipe."""
    if url.startswith("file://"):
        return urllib.parse.urlparse(url).path
    if is_url(url) or url.startswith("pipe:"):
        return None
    return url


def _glob(pattern: str) -> list[str]:
    """A local glob's files, sorted (the order every rank and every run sees); anything else as it is. ``http(s)``
    URLs pass untouched: ``?`` there starts a query."""
    if pattern.startswith(("http://", "https://", "pipe:")) or not glob.has_magic(pattern):
        return [pattern]
    if is_url(pattern) and not pattern.startswith("file://"):
        raise ValueError(f"{pattern}: globs are expanded for local paths only; for a URL give a brace pattern "
                         "(ds-rl-{000000..000031}.tar) or the shard index (.json)")
    local = local_path(pattern)
    found = sorted(f for f in glob.glob(local) if os.path.isfile(f))
    if not found:
        raise ValueError(f"{pattern}: matches no file")
    return found


def open_url(url: str):
    """A binary read stream for a local path, file://, http(s)://, gs://, s3:// or pipe: URL."""
    local = local_path(url)
    if local is not None:
        return open(local, "rb")
    if url.startswith(("http://", "https://")):
        return urllib.request.urlopen(url, timeout=120)  # noqa: S310 - the trainer's own shard URLs
    from webdataset.gopen import Pipe, gopen
    if url.startswith("s3://"):
        return Pipe(["aws", "s3", "cp", url, "-"], mode="rb", bufsize=1 << 20, ignore_status=[141])
    if url.startswith("gs://"):
        return Pipe(["gsutil", "cat", url], mode="rb", bufsize=1 << 20, ignore_status=[141])
    if url.startswith("pipe:"):
        return gopen(url, "rb", bufsize=1 << 20)
    raise ValueError(f"{url}: unsupported URL scheme")


# ------------------------------------------------------------------------------------------------ tar reading


def check_member_name(name: str) -> None:
    if not name or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or "\\" in name or "\0" in name:
        raise ValueError(f"absolute or malformed member name {name!r}")
    if any(part == ".." for part in name.split("/")):
        raise ValueError(f"member name {name!r} escapes the archive (..)")


def _split_name(name: str) -> tuple[str, str]:
    """``dir/key.a.b`` -> (``dir/key``, ``a.b``), webdataset's rule (the key ends at the first dot of the basename)."""
    d, _, base = name.rpartition("/")
    key, dot, ext = base.partition(".")
    if not dot or not key:
        raise ValueError(f"member {name!r} has no key.extension form")
    return (f"{d}/{key}" if d else key), ext


@dataclass
class RawSample:
    key: str
    members: dict[str, bytes]
    offset: int


class _BufferPool:
    """Reuses large member buffers once nothing else references them.

    Fresh multi-megabyte allocations cost a page fault per 4 KiB page on first touch, which made
    reading frames ~3x slower than a raw read of the same bytes. A buffer is handed out again only
    when its reference count shows that no array, view or tensor made from it is alive any more
    (every numpy view and ``torch.from_numpy`` tensor keeps its base alive), so reuse is invisible.
    """

    MIN_BYTES = 1 << 20

    def __init__(self, max_buffers: int = 8):
        self.max_buffers = max_buffers
        self.buffers: list[np.ndarray] = []

    def get(self, n: int) -> np.ndarray:
        import sys
        best, b = None, None
        for i in range(len(self.buffers)):
            b = self.buffers[i]
            # references: the list, ``b``, getrefcount's argument (no views, arrays or tensors alive)
            if b.nbytes >= n and b.nbytes <= n + (n >> 2) + (1 << 16) and sys.getrefcount(b) <= 3:
                best = i
                break
        del b
        if best is not None:
            b = self.buffers.pop(best)
            self.buffers.append(b)
            return b[:n]
        b = np.empty(n, dtype=np.uint8)
        self.buffers.append(b)
        if len(self.buffers) > self.max_buffers:
            for i in range(len(self.buffers) - 1):
                if sys.getrefcount(self.buffers[i]) <= 2:  # the list, getrefcount's argument
                    del self.buffers[i]
                    break
            else:
                self.buffers.pop(0)  # all in use: forget the oldest (its users keep it alive)
        return b[:n]


class _MmapStream:
    """A local shard mapped copy-on-write: members come out as zero-copy (writable) numpy views.

    The file's bytes are never copied into the process: the consumer reads them straight from the page
    cache. A shard must not be truncated in place while its items are alive (pack only ever renames
    new files into place, which is safe)."""

    def __init__(self, path: str):
        import mmap
        with open(path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        self._arr = np.frombuffer(self._mm, dtype=np.uint8) if self._mm is not None else np.empty(0, np.uint8)
        self.pos = 0

    def readinto(self, b) -> int:
        n = min(len(b), self.size - self.pos)
        memoryview(b)[:n] = self._arr[self.pos:self.pos + n]
        self.pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = self._arr[self.pos:end].tobytes()
        self.pos = end
        return out

    def take(self, n: int) -> np.ndarray:
        v = self._arr[self.pos:self.pos + n]
        self.pos += len(v)
        return v

    def close(self) -> None:
        self._arr = None  # the mapping goes when the last view made from it does

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _TarReader:
    """A minimal streaming tar (ustar, with GNU long names and pax ``path``/``size``) reader.

    Each member's data is read with one ``readinto`` into its own ``bytearray`` (a single copy, as a
    raw read makes; the frames array is then a zero-copy view of it). Headers are checked by
    ``tarfile.TarInfo.frombuf`` (checksum included). Nothing is ever written to disk.
    """

    def __init__(self, stream, url: str, pool: _BufferPool | None = None):
        self.stream, self.url = stream, url
        self.offset = 0
        self.pool = pool

    def _read_data(self, n: int):
        """A member's data: pooled numpy buffer for large members, bytes-like either way."""
        if hasattr(self.stream, "take") and n >= BLOCK:
            v = self.stream.take(n)
            self.offset += len(v)
            return v
        if self.pool is None or n < _BufferPool.MIN_BYTES:
            return self._read_exact(n)
        buf = self.pool.get(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.stream.readinto(view[got:got + (4 << 20)])
            if not k:
                break
            got += k
        view.release()
        self.offset += got
        return buf[:got]

    def _read_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.stream.readinto(view[got:])
            if not k:
                break
            got += k
        self.offset += got
        view.release()
        if got < n:
            del buf[got:]
        return buf

    def _skip_padding(self, size: int) -> bool:
        pad = -size % BLOCK
        return len(self._read_exact(pad)) == pad if pad else True

    def _rest_is_zero(self) -> tuple[bool, int]:
        n, zero = 0, True
        while True:
            chunk = self.stream.read(1 << 20)
            if not chunk:
                return zero, n
            n += len(chunk)
            if zero and chunk.strip(b"\0"):
                zero = False

    def members(self):
        """Yield ``(TarInfo, data: bytearray | None)``; raises ShardError on a damaged/truncated stream, naming the
        sample only when a member's name says whose bytes were cut (a header or the end blocks name no sample: the
        grouping in :func:`iter_tar_samples` knows which one is pending)."""
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            start = self.offset
            block = self._read_exact(BLOCK)
            if not block:
                raise ShardError(self.url, None, "truncated tar stream: no end-of-archive blocks")
            if len(block) < BLOCK:
                raise ShardError(self.url, None, f"truncated tar stream at byte {start}")
            if not block.strip(b"\0"):
                zero, _ = self._rest_is_zero()
                if not zero:
                    raise ShardError(self.url, None, f"corrupt tar stream: data after an end-of-archive "
                                                     f"block at byte {start}")
                return
            try:
                ti = tarfile.TarInfo.frombuf(bytes(block), "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise ShardError(self.url, None, f"corrupt tar stream: damaged member header at byte "
                                                 f"{start}: {e}") from None
            ti.offset = start
            size = int(pax.get("size", ti.size)) if ti.type not in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME) \
                else ti.size
            if size < 0 or size > (1 << 40):
                raise ShardError(self.url, None, f"corrupt tar stream: member size {size} at byte {start}")
            if ti.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE):
                data = self._read_exact(size)
                if len(data) < size or not self._skip_padding(size):
                    raise ShardError(self.url, None, f"truncated tar stream in an extended header at {start}")
                if ti.type == tarfile.GNUTYPE_LONGNAME:
                    long_name = bytes(data).rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif ti.type == tarfile.XHDTYPE:
                    pax = _parse_pax(bytes(data), self.url, None)
                continue
            if long_name is not None:
                ti.name = long_name
            if "path" in pax:
                ti.name = pax["path"]
            ti.size = size
            long_name, pax = None, {}
            if ti.isreg():
                data = self._read_data(size)
                if len(data) < size or not self._skip_padding(size):
                    raise ShardError(self.url, member_key(ti.name), f"member {ti.name!r} is truncated "
                                                                 f"({len(data)} of {size} bytes)")
                yield ti, data
            else:
                if size and ti.type not in (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.DIRTYPE):
                    self._read_exact(size)
                    self._skip_padding(size)
                yield ti, None


def _parse_pax(data: bytes, url: str, key) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        m = re.match(rb"(\d+) ", data[pos:pos + 24])
        if not m:
            raise ShardError(url, key, "corrupt tar stream: malformed pax header")
        length = int(m.group(1))
        rec = data[pos + m.end():pos + length - 1]
        k, _, v = rec.partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        pos += length
    return out


def iter_tar_samples(stream, url: str, pool: _BufferPool | None = None) -> Iterator[RawSample | ShardError]:
    """Group a tar stream's members by key. Yields samples, or a :class:`ShardError` for a bad sample
    (the caller decides: raise or skip). A broken tar stream raises :class:`ShardError` (nothing after
    it can be trusted), naming the sample it cut; the whole samples before the break are yielded first."""
    reader = _TarReader(stream, url, pool)
    try:
        yield from _grouped(reader.members(), url)
    except _Break as b:
        if b.whole is not None:
            yield b.whole
        raise b.error from None


class _Break(Exception):
    """The tar stream broke while grouping: the pending sample if it is whole (kept), and the error to raise."""

    def __init__(self, whole: RawSample | None, error: ShardError):
        super().__init__(str(error))
        self.whole, self.error = whole, error


def _grouped(members, url: str) -> Iterator[RawSample | ShardError]:
    """:func:`iter_tar_samples`'s grouping of ``members``; a broken stream raises :class:`_Break`."""
    cur: RawSample | None = None
    bad_key: str | None = None  # a sample already reported bad: its remaining members are dropped
    last_key: str | None = None
    while True:
        try:
            ti, data = next(members)
        except StopIteration:
            break
        except ShardError as e:  # the stream broke: the sample pending here may be whole all the same
            raise _break_at(cur, e, url) from None
        name = ti.name
        try:
            check_member_name(name)
        except ValueError as e:
            err = UnsafeMemberError(url, cur.key if cur else last_key, f"rejected member: {e}")
            if cur is not None:
                bad_key, cur = cur.key, None
            yield err
            continue
        try:
            key, ext = _split_name(name)
        except ValueError as e:
            yield ShardError(url, last_key, str(e))
            continue
        if cur is not None and key != cur.key:
            yield cur
            cur = None
        last_key = key
        if key == bad_key:
            continue
        bad_key = None
        if data is None:
            err_cls = UnsafeMemberError if (ti.issym() or ti.islnk() or ti.isdev()) else ShardError
            yield err_cls(url, key, f"member {name!r} is not a regular file (type {ti.type!r})")
            bad_key, cur = key, None
            continue
        last = ext.rsplit(".", 1)[-1].lower()
        if last in PICKLE_EXTS:
            yield ShardError(url, key, f"member {name!r}: pickle-style members are never loaded")
            bad_key, cur = key, None
            continue
        if last not in ALLOWED_EXTS:
            yield ShardError(url, key, f"member {name!r}: unsupported extension .{last} (npy, json, txt only)")
            bad_key, cur = key, None
            continue
        if cur is None:
            cur = RawSample(key, {}, ti.offset)
        if ext in cur.members:
            yield ShardError(url, key, f"duplicate member {name!r}")
            bad_key, cur = key, None
            continue
        cur.members[ext] = data
    if cur is not None:
        yield cur


def member_key(name: str) -> str | None:
    """The sample key of a tar member's name (webdataset's rule, :func:`_split_name`); None for a name without one."""
    try:
        return _split_name(name)[0]
    except ValueError:
        return None


def _break_at(cur: RawSample | None, err: ShardError, url: str) -> _Break:
    """Where a broken stream leaves the pending sample ``cur``. A sample is only complete once the next one's first
    member shows up, so a break in that member must not take ``cur`` with it: a sample's members are contiguous, so
    a break in another sample's member leaves ``cur`` whole. A break that no member name places (in a header, before
    the end blocks) leaves it whole only if it has its members (:func:`_is_whole`); otherwise ``cur`` is the cut
    one and the error names it."""
    if cur is None or (err.key is not None and err.key != cur.key) or (err.key is None and _is_whole(cur)):
        return _Break(cur, err)
    named = type(err)(url, cur.key, err.detail)
    return _Break(None, named)


def _is_whole(raw: RawSample) -> bool:
    """``raw`` has the required members and every one its sums.json lists (the writer puts sums.json last)."""
    if any(x not in raw.members for x in REQUIRED):
        return False
    if "sums.json" not in raw.members:  # a foreign shard's sample: the required members are all it is read for
        return True
    try:
        listed = json.loads(_as_bytes(raw.members["sums.json"]))
    except ValueError:
        return False
    return isinstance(listed, dict) and all(name in raw.members for name in listed)


def _as_bytes(data) -> bytes | bytearray:
    return data if isinstance(data, (bytes, bytearray)) else memoryview(data).tobytes()


def _load_npy(data) -> np.ndarray:
    """An ``.npy`` payload -> array viewing ``data`` (zero-copy; writable when ``data`` is a bytearray).
    Object dtypes (which would need pickle) are refused."""
    mv = memoryview(data)
    bio = io.BytesIO(mv[:min(len(mv), 1 << 16)])
    version = np.lib.format.read_magic(bio)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(bio)
    elif version in ((2, 0), (3, 0)):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(bio)
    else:
        raise ValueError(f"unsupported npy version {version}")
    if dtype.hasobject:
        raise ValueError("object arrays need pickle: refused")
    count = int(np.prod(shape)) if shape else 1
    offset = bio.tell()
    if len(mv) - offset != count * dtype.itemsize:
        raise ValueError(f"npy payload has {len(mv) - offset} bytes, header says {count * dtype.itemsize}")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def decode_sample(raw: RawSample, url: str, verify: bool) -> dict:
    """Check and decode one video sample -> ``{"key", "frames" (np.uint8), "meta", "qras"}``."""
    m = raw.members
    missing = [x for x in REQUIRED if x not in m]
    if missing:
        raise ShardError(url, raw.key, f"incomplete sample: missing {missing} (has {sorted(m)})")
    if verify:
        if "sums.json" not in m:
            raise ShardError(url, raw.key, "no sums.json to verify against (pass verify='none' for foreign shards)")
        try:
            sums = json.loads(_as_bytes(m["sums.json"]))
        except ValueError as e:
            raise ShardError(url, raw.key, f"sums.json is corrupt: {e}") from None
        for name, want in sorted(sums.items()):
            data = m.get(name)
            if data is None:
                raise ShardError(url, raw.key, f"{name} listed in sums.json is missing")
            if len(data) != want.get("bytes") or hashlib.sha256(data).hexdigest() != want.get("sha256"):
                raise ShardError(url, raw.key, f"{name} does not match its sha256/size in sums.json (corrupt)")
    try:
        frames = _load_npy(m["frames.npy"])
    except (ValueError, OSError, EOFError) as e:
        raise ShardError(url, raw.key, f"frames.npy is not a readable npy array: {e}") from None
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ShardError(url, raw.key, f"frames.npy is {frames.dtype} {frames.shape}, expected uint8 [T, H, W, 3]")
    try:
        meta = json.loads(_as_bytes(m["meta.json"]))
        qras = json.loads(_as_bytes(m["qras.json"]))
    except ValueError as e:
        raise ShardError(url, raw.key, f"json member is corrupt: {e}") from None
    if not isinstance(qras, list):
        raise ShardError(url, raw.key, "qras.json is not a list")
    if meta.get("num_frames") not in (None, frames.shape[0]):
        raise ShardError(url, raw.key, f"meta says {meta.get('num_frames')} frames, frames.npy has {frames.shape[0]}")
    return {"key": raw.key, "frames": frames, "meta": meta, "qras": qras}


@dataclass
class LoaderStats:
    samples: int = 0
    items: int = 0
    shards: int = 0
    bytes: int = 0
    skipped_samples: int = 0
    skipped_shards: int = 0
    errors: list[str] = field(default_factory=list)
    #: each skip under on_error=skip: {"url", "key", "reason", "whole_shard", "lost"} (what a result records)
    skips: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"samples": self.samples, "items": self.items, "shards": self.shards, "bytes": self.bytes,
                "skipped_samples": self.skipped_samples, "skipped_shards": self.skipped_shards,
                "errors": list(self.errors[-20:])}


class CountingReader(io.RawIOBase):
    """Counts (and optionally hashes) what a tar parser reads from a stream."""

    def __init__(self, fh, hasher=None):
        self.fh, self.n, self.h = fh, 0, hasher

    def readable(self):
        return True

    def readinto(self, b):
        if hasattr(self.fh, "readinto"):
            n = self.fh.readinto(b) or 0
            if self.h is not None:
                self.h.update(memoryview(b)[:n])
        else:
            data = self.fh.read(len(b))
            n = len(data)
            b[:n] = data
            if self.h is not None:
                self.h.update(data)
        self.n += n
        return n

    def read(self, n=-1):
        data = self.fh.read() if n is None or n < 0 else self.fh.read(n)
        self.n += len(data)
        if self.h is not None:
            self.h.update(data)
        return data


# ------------------------------------------------------------------------------------------------ one shard


def open_shard(spec: ShardSpec, verify: str = "none", mmap: bool = True):
    """A readable stream of one shard. With ``verify="shard"`` the whole shard is staged to a temporary file and
    checked against the index's sha256 and size first; with ``mmap`` a local shard is memory-mapped."""
    if verify != "shard":
        local = local_path(spec.url)
        if mmap and local is not None:
            return _MmapStream(local)
        return open_url(spec.url)
    if not spec.sha256:
        raise ShardError(spec.url, None, "verify='shard' needs an index with sha256 per shard")
    tmp = tempfile.TemporaryFile(prefix="longreel-shard-")
    try:
        copy_verified(spec, tmp)
    except BaseException:
        tmp.close()
        raise
    tmp.seek(0)
    return tmp


def copy_verified(spec: ShardSpec, out, stop=None) -> int:
    """Copy the shard at ``spec.url`` into the binary file ``out``, hashing as it streams; raise
    :class:`ShardError` when the index's sha256 or size (those it gives) do not match. Returns the bytes copied.
    Used to stage a shard for ``verify="shard"`` and to fill the trainer's disk cache of remote shards.
    ``stop`` (a ``threading.Event``): once set, the copy ends with ``InterruptedError`` at the next read; a
    :class:`~longreel.task.transfer_stop.StopSignal` also cuts a read that is waiting on a stalled server."""
    h, size = hashlib.sha256(), 0

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    try:
        with open_url(spec.url) as src, cut_on_stop(stop, src):
            announced = announced_length(src)
            # read1 returns what has arrived rather than waiting for a full MB, so `stop` is looked at during a
            # slow transfer too
            read = getattr(src, "read1", src.read)
            while chunk := read(1 << 20):
                if stopped():
                    break
                h.update(chunk)
                size += len(chunk)
                out.write(chunk)
    except Exception:
        if stopped():  # a cut pipe's killed process fails its read or its close: the stop, not a transport error
            raise InterruptedError(f"{spec.url}: download stopped") from None
        raise
    if stopped():  # a cut socket ends the stream as if complete: it is not
        raise InterruptedError(f"{spec.url}: download stopped")
    if announced is not None and size != announced:
        # urllib ends the body without an error when the server closes early: without a sha256 or size from an index
        # this check is all that keeps a cut transfer from passing as the shard (an OSError: a transport failure)
        raise ConnectionError(f"the transfer was cut short: {size} of the {announced} bytes its Content-Length "
                              "announces")
    got = h.hexdigest()
    if (spec.sha256 and got != spec.sha256) or (spec.bytes is not None and size != spec.bytes):
        raise ShardError(spec.url, None, f"shard sha256/size mismatch with the index ({size} bytes read, "
                                         f"{spec.bytes} expected; sha256 {got} does not match the index's "
                                         f"{spec.sha256}): corrupt or truncated")
    return size


def announced_length(src) -> int | None:
    """The Content-Length of an HTTP response (None for other sources, or a response without one)."""
    headers = getattr(src, "headers", None)
    value = headers.get("Content-Length") if hasattr(headers, "get") else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def read_shard(spec: ShardSpec, stats: LoaderStats, fail: Callable[[ShardError, bool], None], *,
               verify: str = "none", mmap: bool = True, pool: _BufferPool | None = None,
               keep: Callable[[int], bool] | None = None) -> Iterator[dict]:
    """The decoded samples of one shard, in tar order.

    ``fail(error, whole_shard)`` gets every error (it may raise to stop); a bad sample is skipped, a broken
    stream ends the shard (the error's ``lost`` counts the samples lost with it). ``keep(i)`` picks samples by
    their position in the shard (for splitting a shard among consumers); ``stats`` counts samples, shards and bytes
    read."""
    try:
        stream = open_shard(spec, verify, mmap)
    except ShardError as e:
        fail(_mark_lost(e, spec, 0, keep), True)
        return
    except OSError as e:
        err = ShardError(spec.url, None, f"cannot open: {e}")
        err.__cause__ = e  # what a caller that reads again looks at (an HTTP 4xx will not pass)
        fail(_mark_lost(err, spec, 0, keep), True)
        return
    check_sums = verify != "none"
    counter = stream if isinstance(stream, _MmapStream) else CountingReader(stream)
    index = -1
    broken: ShardError | None = None  # the tar stream itself failed: the rest of the shard is lost
    try:
        try:
            for raw in iter_tar_samples(counter, spec.url, pool):
                index += 1
                if keep is not None and not keep(index):
                    continue
                if isinstance(raw, ShardError):
                    fail(raw, False)
                    continue
                try:
                    sample = decode_sample(raw, spec.url, check_sums)
                except ShardError as e:
                    fail(e, False)
                    continue
                stats.samples += 1
                yield sample
        except ShardError as e:
            broken = e
        except (OSError, http.client.HTTPException) as e:  # the transport failed mid-stream
            broken = ShardError(spec.url, None, f"reading failed: {type(e).__name__}: {e}")
        try:
            stream.close()  # a pipe reports its command's exit status here
        except (OSError, http.client.HTTPException) as e:
            # the source failing is the cause of whatever the parser saw
            broken = ShardError(spec.url, broken.key if broken else None,
                                f"reading failed: {type(e).__name__}: {e}"
                                + (f" (parser: {broken.detail})" if broken else ""))
        if broken is not None:
            fail(_mark_lost(broken, spec, index + 1, keep), True)
            return
        stats.shards += 1
    finally:
        stats.bytes += counter.pos if isinstance(counter, _MmapStream) else counter.n
        if broken is None:
            try:
                stream.close()
            except Exception:  # noqa: BLE001 - closing early (consumer stopped): nothing to report
                pass


def _mark_lost(err: ShardError, spec: ShardSpec, first: int, keep: Callable[[int], bool] | None) -> ShardError:
    """Set ``err.lost`` / ``err.lost_note``: the samples from tar position ``first`` on (those ``keep`` picks), which
    the error that ends the shard takes with it. Only the index says how many a shard holds; without it, the sample
    the error names as cut is the one known to be lost."""
    wanted = keep or (lambda i: True)
    if spec.nsamples is not None:
        err.lost = sum(1 for i in range(first, spec.nsamples) if wanted(i))
        err.lost_note = f"{err.lost} sample(s) lost with the rest of the shard, of the {spec.nsamples} its index lists"
        return err
    err.lost = int(err.key is not None and wanted(first))
    lost = "the cut sample and any after it are" if err.lost else "any samples after the break are"
    err.lost_note = f"{lost} lost: no index gives the shard's sample count"
    return err
