"""The trainer's shard loader: longreel WebDataset shards -> per-question training items. Never decodes video.

Input: a list of shard URLs, a brace pattern (``dir/ds-sft-{000000..000011}.tar``), or a wids index
file (``ds-sft.index.json``; its shard URLs are resolved against the index's own location, and its
``sha256`` / ``bytes`` are what ``verify="shard"`` checks). URLs may be local paths, ``file://``,
``http(s)://`` (standard library), ``gs://`` (``gsutil cat``), ``s3://`` (``aws s3 cp URL -``), both
run as argument lists through webdataset's ``Pipe``, or an explicit ``pipe:COMMAND`` (webdataset's
shell pipe: the user's own command, refused when ``WDS_SECURE=1``).

Each tar sample is one video (see ``docs/SHARDS.md``): ``<key>.frames.npy`` (uint8 ``[T, H, W, 3]``),
``<key>.meta.json``, ``<key>.qras.json``, ``<key>.sums.json`` (bytes + sha256 of the others). The
loader yields one item per question (or per video with ``unit="video"``)::

    {"frames": torch.uint8 [T, H, W, 3], "video_metadata": {...VideoMetadata fields...},
     "video_grid_thw": [t, h, w], "question", "options", "answer", "problem_type", "target",
     "category", "reasoning", "qra_id", "video_id", "split", "pass_rate", "meta": {...},
     "key", "shard", "epoch", "position"}

ready for the processor with :func:`processor_inputs` (``do_sample_frames=False, do_resize=False``).
Frames of one video are shared by its questions' items: treat them as read-only.

Safety: members are parsed, never extracted; only ``.npy`` (``allow_pickle=False``), ``.json`` and
``.txt`` are accepted; pickle-style members (``.pyd .pickle .pkl .pth .pt .mp``) and any other
extension are errors, as are member names that are absolute, contain ``..``, backslashes or NUL, and
non-regular members (links, devices, directories).

Errors: a bad sample raises :class:`ShardError` naming the shard URL and the sample key (and the
member), unless ``on_error="skip"``: then the sample (or, when the tar stream itself is broken, the
rest of the shard) is skipped and counted in :attr:`ShardDataset.stats`.

Order and resumption: per epoch the shard list is permuted with ``(seed, epoch)`` (when
``shuffle``), split over consumers (``rank * num_workers + worker``), read in order; inside a shard
items are interleaved from a buffer of ``shuffle_buffer`` videos (flushed at the shard's end) with
an RNG seeded by ``(seed, epoch, shard)``. A consumer's position is therefore ``(epoch, shard
cursor, items taken from that shard)``; :meth:`ShardDataset.state_dict` returns the positions and
:meth:`ShardDataset.load_state_dict` resumes exactly there (replaying at most one shard).
"""
from __future__ import annotations

import hashlib
import http.client
import io
import json
import logging
import os
import random
import re
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

log = logging.getLogger("longreel")

__all__ = ["ShardDataset", "ShardError", "UnsafeMemberError", "ShardSpec", "resolve_shards", "open_url",
           "iter_tar_samples", "processor_inputs", "to_video_metadata", "collate_items"]

PICKLE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "mp", "msgpack", "joblib"})
ALLOWED_EXTS = frozenset({"npy", "json", "txt"})
REQUIRED = ("frames.npy", "meta.json", "qras.json")
BLOCK = 512
STATE_VERSION = 1


class ShardError(RuntimeError):
    """A shard or one of its samples is unreadable, corrupt or unsafe. Names the shard and the key."""

    def __init__(self, shard: str, key: str | None, message: str):
        where = f"{shard}: sample {key!r}" if key else f"{shard}"
        super().__init__(f"{where}: {message}")
        self.shard, self.key, self.detail = shard, key, message


class UnsafeMemberError(ShardError):
    """A tar member whose name or type could escape an extraction directory (never extracted here)."""


# ------------------------------------------------------------------------------------------------ URLs


@dataclass(frozen=True)
class ShardSpec:
    url: str
    sha256: str | None = None
    bytes: int | None = None
    nsamples: int | None = None


def _brace_expand(pattern: str) -> list[str]:
    """``a-{000..002}.tar`` / ``{a,b}`` expansion (numeric ranges keep the zero padding)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    head, body, tail = pattern[:m.start()], m.group(1), pattern[m.end():]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") else 0
        parts = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        parts = body.split(",")
    return [x for part in parts for x in _brace_expand(head + part + tail)]


def _is_url(s: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s))


def _join(base: str, rel: str) -> str:
    if _is_url(rel) or rel.startswith(("/", "pipe:")):
        return rel
    if base.startswith(("http://", "https://")):
        return urllib.parse.urljoin(base, rel)
    if _is_url(base):
        return base.rsplit("/", 1)[0] + "/" + rel
    return os.path.join(os.path.dirname(base), rel)


def resolve_shards(source) -> list[ShardSpec]:
    """URLs, brace patterns or wids index files (``*.json``) -> shard specs, in the given order."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    out: list[ShardSpec] = []
    for item in items:
        if isinstance(item, ShardSpec):
            out.append(item)
            continue
        s = os.fspath(item)
        if s.endswith(".json"):
            with open_url(s) as fh:
                doc = json.loads(fh.read())
            if doc.get("__kind__") != "wids-shard-index-v1" or not isinstance(doc.get("shardlist"), list):
                raise ValueError(f"{s} is not a wids shard index (__kind__ wids-shard-index-v1 with a shardlist)")
            for e in doc["shardlist"]:
                out.append(ShardSpec(_join(s, e["url"]), e.get("sha256"), e.get("bytes"), e.get("nsamples")))
        else:
            out.extend(ShardSpec(u) for u in _brace_expand(s))
    if not out:
        raise ValueError(f"no shards in {source!r}")
    return out


def open_url(url: str):
    """A binary read stream for a local path, file://, http(s)://, gs://, s3:// or pipe: URL."""
    if url.startswith("file://"):
        url = urllib.parse.urlparse(url).path
    if not _is_url(url) and not url.startswith("pipe:"):
        return open(url, "rb")
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

    def members(self, key_hint):
        """Yield ``(TarInfo, data: bytearray | None)``; raises ShardError on a damaged/truncated stream."""
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            start = self.offset
            block = self._read_exact(BLOCK)
            if not block:
                raise ShardError(self.url, key_hint(), "truncated tar stream: no end-of-archive blocks")
            if len(block) < BLOCK:
                raise ShardError(self.url, key_hint(), f"truncated tar stream at byte {start}")
            if not block.strip(b"\0"):
                zero, _ = self._rest_is_zero()
                if not zero:
                    raise ShardError(self.url, key_hint(), f"corrupt tar stream: data after an end-of-archive "
                                                           f"block at byte {start}")
                return
            try:
                ti = tarfile.TarInfo.frombuf(bytes(block), "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise ShardError(self.url, key_hint(), f"corrupt tar stream: damaged member header at byte "
                                                       f"{start}: {e}") from None
            ti.offset = start
            size = int(pax.get("size", ti.size)) if ti.type not in (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME) \
                else ti.size
            if size < 0 or size > (1 << 40):
                raise ShardError(self.url, key_hint(), f"corrupt tar stream: member size {size} at byte {start}")
            if ti.type in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE):
                data = self._read_exact(size)
                if len(data) < size or not self._skip_padding(size):
                    raise ShardError(self.url, key_hint(), f"truncated tar stream in an extended header at {start}")
                if ti.type == tarfile.GNUTYPE_LONGNAME:
                    long_name = bytes(data).rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif ti.type == tarfile.XHDTYPE:
                    pax = _parse_pax(bytes(data), self.url, key_hint())
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
                    raise ShardError(self.url, key_hint(), f"member {ti.name!r} is truncated "
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
    it can be trusted)."""
    cur: RawSample | None = None
    bad_key: str | None = None  # a sample already reported bad: its remaining members are dropped
    last_key: str | None = None
    reader = _TarReader(stream, url, pool)
    for ti, data in reader.members(lambda: cur.key if cur else last_key):
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


# ------------------------------------------------------------------------------------------------ items


def to_video_metadata(item: dict):
    """transformers ``VideoMetadata`` of an item (source fps, frame count, sampled indices)."""
    from transformers.video_utils import VideoMetadata
    vm = item["video_metadata"]
    return VideoMetadata(total_num_frames=vm["total_num_frames"], fps=vm["fps"], width=vm["width"],
                         height=vm["height"], duration=vm["duration"], frames_indices=list(vm["frames_indices"]))


def processor_inputs(item: dict) -> dict:
    """Keyword arguments for a Qwen2-VL-family processor call on cached frames (no sampling, no resize)."""
    return {"videos": [item["frames"]], "video_metadata": [to_video_metadata(item)], "do_sample_frames": False,
            "do_resize": False}


def collate_items(items: list[dict]) -> list[dict]:
    """Videos differ in frame count and size: a batch is a list (the processor batches them)."""
    return list(items)


def _items_of(sample: dict, url: str, unit: str):
    import torch

    frames = torch.from_numpy(sample["frames"])
    meta = sample["meta"]
    base = {"frames": frames, "video_metadata": dict(meta.get("video_metadata") or {}, timestamps=meta.get("timestamps")),
            "video_grid_thw": meta.get("video_grid_thw"), "meta": meta, "key": sample["key"],
            "video_id": meta.get("video_id", sample["key"]), "shard": url}
    if unit == "video":
        return [dict(base, qras=sample["qras"])]
    out = []
    for q in sample["qras"]:
        item = dict(base)
        for k in ("qra_id", "question", "options", "answer", "problem_type", "target", "category", "reasoning",
                  "split", "pass_rate"):
            item[k] = q.get(k)
        out.append(item)
    return out


@dataclass
class LoaderStats:
    samples: int = 0
    items: int = 0
    shards: int = 0
    bytes: int = 0
    skipped_samples: int = 0
    skipped_shards: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"samples": self.samples, "items": self.items, "shards": self.shards, "bytes": self.bytes,
                "skipped_samples": self.skipped_samples, "skipped_shards": self.skipped_shards,
                "errors": list(self.errors[-20:])}


class _CountingReader(io.RawIOBase):
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


def _torch_info() -> tuple[int, int, int, int]:
    """(rank, world_size, worker id, num_workers) from torch.distributed and the DataLoader worker."""
    rank, world = 0, 1
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    wid, nw = 0, 1
    try:
        import torch.utils.data
        info = torch.utils.data.get_worker_info()
        if info is not None:
            wid, nw = info.id, info.num_workers
    except ImportError:
        pass
    return rank, world, wid, nw


try:
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - torch is a dependency
    _Base = object


class ShardDataset(_Base):
    """Streams longreel shards as training items (see the module docstring).

    Args:
        source: shard URLs, a brace pattern, a wids index file, or a list mixing them.
        shuffle: permute shards per epoch and interleave items inside a shard.
        seed: the seed of every permutation (same seed, same order, on every machine).
        epochs: passes over the data; ``None`` loops forever. ``set_epoch`` sets the first one.
        rank / world_size: the consumer's place among data-parallel ranks (default: torch.distributed).
        split_by: ``"shard"`` (each consumer reads whole shards: needs at least as many shards as
            consumers to keep everyone busy) or ``"sample"`` (every consumer reads every shard and keeps
            every n-th sample: for few shards).
        verify: ``"none"`` (default: structure is always checked: tar headers and their checksums,
            truncation, npy headers and sizes, JSON), ``"sample"`` (also each sample's members against
            the sha256 in its sums.json: catches a flipped pixel byte, at ~0.5 GB/s of hashing), or
            ``"shard"`` (the whole shard against the index's sha256 and size before any of it is
            used; the shard is staged to a temp file).
        on_error: ``"raise"`` (default) or ``"skip"`` (count in :attr:`stats` and go on).
        unit: ``"question"`` (one item per QRA) or ``"video"`` (one item per video with its ``qras``).
        shuffle_buffer: videos held to interleave items from (per shard).
        mmap: map local shards copy-on-write (frames are zero-copy views of the page cache) instead of
            reading them into (pooled) buffers.
    """

    def __init__(self, source, *, shuffle: bool = False, seed: int = 0, epochs: int | None = 1,
                 rank: int | None = None, world_size: int | None = None, split_by: str = "shard",
                 verify: str = "none", on_error: str = "raise", unit: str = "question", shuffle_buffer: int = 4,
                 mmap: bool = True):
        if split_by not in ("shard", "sample"):
            raise ValueError("split_by must be 'shard' or 'sample'")
        if verify not in ("none", "sample", "shard"):
            raise ValueError("verify must be 'none', 'sample' or 'shard'")
        if on_error not in ("raise", "skip"):
            raise ValueError("on_error must be 'raise' or 'skip'")
        if unit not in ("question", "video"):
            raise ValueError("unit must be 'question' or 'video'")
        self.shards = resolve_shards(source)
        self.shuffle, self.seed, self.epochs = shuffle, int(seed), epochs
        self.rank, self.world_size = rank, world_size
        self.split_by, self.verify, self.on_error, self.unit = split_by, verify, on_error, unit
        self.shuffle_buffer = max(1, int(shuffle_buffer))
        self.mmap = bool(mmap)
        self.start_epoch = 0
        self.stats = LoaderStats()
        self._positions: dict[int, list[int]] = {}  # consumer -> [epoch, shard cursor, items taken]
        self._resume: dict[int, list[int]] = {}
        self._consumers: int | None = None
        self._pool = _BufferPool(max_buffers=self.shuffle_buffer + 4)

    # -- epochs and positions

    def set_epoch(self, epoch: int) -> None:
        self.start_epoch = int(epoch)

    def _consumer(self) -> tuple[int, int]:
        rank, world, wid, nw = _torch_info()
        rank = self.rank if self.rank is not None else rank
        world = self.world_size if self.world_size is not None else world
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world size {world}")
        return rank * nw + wid, world * nw

    def observe(self, item_or_items) -> None:
        """Record items' positions (call it in the training loop when a DataLoader runs workers)."""
        items = item_or_items if isinstance(item_or_items, list) else [item_or_items]
        for it in items:
            cid, n, epoch, cursor, taken = it["position"]
            self._consumers = n
            self._positions[cid] = [epoch, cursor, taken]

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "seed": self.seed, "shuffle": self.shuffle, "split_by": self.split_by,
                "shards": hashlib.sha256("\n".join(s.url.rsplit("/", 1)[-1] for s in self.shards).encode()
                                         ).hexdigest(),
                "consumers": self._consumers, "positions": {str(k): list(v) for k, v in self._positions.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        mine = self.state_dict()
        for k in ("seed", "shuffle", "split_by", "shards"):
            if state.get(k) != mine[k]:
                raise ValueError(f"cannot resume: {k} differs from the saved loader state")
        self._consumers = state.get("consumers")
        self._resume = {int(k): list(v) for k, v in state.get("positions", {}).items()}
        self._positions = {k: list(v) for k, v in self._resume.items()}

    # -- iteration

    def _epoch_shards(self, epoch: int) -> list[ShardSpec]:
        order = list(self.shards)
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}:shards").shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict]:
        cid, n = self._consumer()
        if self._resume and self._consumers not in (None, n):
            raise ValueError(f"cannot resume: saved with {self._consumers} consumers, now {n} (ranks x workers)")
        self._consumers = n
        start = self._resume.pop(cid, None)
        epoch = start[0] if start else self.start_epoch
        while self.epochs is None or epoch < self.start_epoch + self.epochs:
            shards = self._epoch_shards(epoch)
            mine = shards[cid::n] if self.split_by == "shard" else shards
            if self.split_by == "shard" and not mine:
                log.warning("loader: consumer %d of %d has no shard (only %d shards); use split_by='sample'",
                            cid, n, len(shards))
            cursor0, skip0 = (start[1], start[2]) if start and start[0] == epoch else (0, 0)
            for cursor in range(cursor0, len(mine)):
                spec = mine[cursor]
                skip = skip0 if cursor == cursor0 else 0
                taken = 0
                for item in self._shard_items(spec, epoch, cid, n):
                    taken += 1
                    if taken <= skip:
                        continue
                    item["epoch"] = epoch
                    item["position"] = [cid, n, epoch, cursor, taken]
                    self._positions[cid] = [epoch, cursor, taken]
                    self.stats.items += 1
                    yield item
                self._positions[cid] = [epoch, cursor + 1, 0]
            epoch += 1
            self._positions[cid] = [epoch, 0, 0]
            start = None

    def _open_shard(self, spec: ShardSpec):
        """(stream, cleanup). With verify='shard' the whole shard is staged and checked first."""
        if self.verify != "shard":
            local = spec.url[len("file://"):] if spec.url.startswith("file://") else spec.url
            if self.mmap and not _is_url(local) and not local.startswith("pipe:"):
                return _MmapStream(local), None
            return open_url(spec.url), None
        if not spec.sha256:
            raise ShardError(spec.url, None, "verify='shard' needs an index with sha256 per shard")
        tmp = tempfile.TemporaryFile(prefix="longreel-shard-")
        h, size = hashlib.sha256(), 0
        with open_url(spec.url) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
                tmp.write(chunk)
        if h.hexdigest() != spec.sha256 or (spec.bytes is not None and size != spec.bytes):
            tmp.close()
            raise ShardError(spec.url, None, f"shard sha256/size mismatch with the index ({size} bytes read, "
                                             f"{spec.bytes} expected): corrupt or truncated")
        tmp.seek(0)
        return tmp, None

    def _fail(self, err: ShardError, *, shard: bool) -> None:
        if self.on_error == "raise":
            raise err
        if shard:
            self.stats.skipped_shards += 1
        else:
            self.stats.skipped_samples += 1
        self.stats.errors.append(str(err))
        log.warning("loader: skipped %s: %s", "rest of shard" if shard else "sample", err)

    def _samples(self, spec: ShardSpec, cid: int, n: int) -> Iterator[dict]:
        try:
            stream, _ = self._open_shard(spec)
        except ShardError as e:
            self._fail(e, shard=True)
            return
        except OSError as e:
            self._fail(ShardError(spec.url, None, f"cannot open: {e}"), shard=True)
            return
        verify = self.verify != "none"
        counter = stream if isinstance(stream, _MmapStream) else _CountingReader(stream)
        index = -1
        broken: ShardError | None = None  # the tar stream itself failed: the rest of the shard is lost
        try:
            try:
                for raw in iter_tar_samples(counter, spec.url, self._pool):
                    index += 1
                    if self.split_by == "sample" and index % n != cid:
                        continue
                    if isinstance(raw, ShardError):
                        self._fail(raw, shard=False)
                        continue
                    try:
                        sample = decode_sample(raw, spec.url, verify)
                    except ShardError as e:
                        self._fail(e, shard=False)
                        continue
                    self.stats.samples += 1
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
                self._fail(broken, shard=True)
                return
            self.stats.shards += 1
        finally:
            self.stats.bytes += counter.pos if isinstance(counter, _MmapStream) else counter.n
            if broken is None:
                try:
                    stream.close()
                except Exception:  # noqa: BLE001 - closing early (consumer stopped): nothing to report
                    pass


    def _shard_items(self, spec: ShardSpec, epoch: int, cid: int, n: int) -> Iterator[dict]:
        rng = random.Random(f"{self.seed}:{epoch}:{spec.url.rsplit('/', 1)[-1]}:{cid}")
        if not self.shuffle:
            for sample in self._samples(spec, cid, n):
                yield from _items_of(sample, spec.url, self.unit)
            return
        buf: list[list[dict]] = []
        for sample in self._samples(spec, cid, n):
            items = _items_of(sample, spec.url, self.unit)
            rng.shuffle(items)
            if items:
                buf.append(items)
            while len(buf) >= self.shuffle_buffer:
                yield self._pop(buf, rng)
        while buf:
            yield self._pop(buf, rng)

    @staticmethod
    def _pop(buf: list[list[dict]], rng: random.Random) -> dict:
        i = rng.randrange(len(buf))
        item = buf[i].pop()
        if not buf[i]:
            buf.pop(i)
        return item
