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
from typing import Any, Iterator

import numpy as np

log = logging.getLogger("longreel")

__all__ = ["ShardDataset", "ShardError", "UnsafeMemberError", "ShardSpec", "resolve_shards", "open_url",
           "iter_tar_samples", "processor_inputs", "to_video_metadata", "collate_items"]

PICKLE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "mp", "msgpack", "joblib"})
ALLOWED_EXTS = frozenset({"npy", "json", "txt"})
REQUIRED = ("frames.npy", "meta.json", "qras.json")
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


def iter_tar_samples(stream, url: str) -> Iterator[RawSample | ShardError]:
    """Group a tar stream's members by key. Yields samples, or a :class:`ShardError` for a bad sample
    (the caller decides: raise or skip). A broken tar stream raises :class:`ShardError` (nothing after
    it can be trusted)."""
    cur: RawSample | None = None
    bad_key: str | None = None  # a sample already reported bad: its remaining members are dropped
    last_key: str | None = None
    try:
        tar = tarfile.open(fileobj=stream, mode="r|")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(url, None, f"not a readable tar stream: {e}") from None
    try:
        while True:
            try:
                ti = tar.next()
            except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as e:
                where = f"after sample {last_key!r}" if last_key else "at the start"
                raise ShardError(url, cur.key if cur else last_key,
                                 f"corrupt tar stream {where}: {type(e).__name__}: {e}") from None
            if ti is None:
                # tarfile ends a stream quietly at a damaged header or a cut at a block boundary; a real end
                # is followed by zero blocks only, so anything else is corruption.
                _check_end(tar, url, cur.key if cur else last_key)
                break
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
            if not ti.isreg():
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
            try:
                data = tar.extractfile(ti).read()
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ShardError(url, key, f"member {name!r} is truncated: {e}") from None
            if len(data) != ti.size:
                raise ShardError(url, key, f"member {name!r} is truncated ({len(data)} of {ti.size} bytes)")
            if cur is None:
                cur = RawSample(key, {}, ti.offset)
            if ext in cur.members:
                yield ShardError(url, key, f"duplicate member {name!r}")
                bad_key, cur = key, None
                continue
            cur.members[ext] = data
            tar.members = []  # streaming: do not keep every TarInfo
        if cur is not None:
            yield cur
    finally:
        tar.close()


def _check_end(tar: tarfile.TarFile, url: str, key: str | None) -> None:
    rest_zero, n = True, 0
    try:
        while chunk := tar.fileobj.read(1 << 20):
            n += len(chunk)
            if rest_zero and chunk.strip(b"\0"):
                rest_zero = False
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ShardError(url, key, f"corrupt tar stream after sample {key!r}: {e}") from None
    if not rest_zero:
        raise ShardError(url, key, f"corrupt tar stream after sample {key!r}: a damaged member header "
                                   "(data follows where the archive seems to end)")
    if n == 0:
        raise ShardError(url, key, f"truncated tar stream after sample {key!r}: no end-of-archive blocks")


def _load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


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
            sums = json.loads(m["sums.json"])
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
        meta = json.loads(m["meta.json"])
        qras = json.loads(m["qras.json"])
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
        data = self.fh.read(len(b))
        n = len(data)
        b[:n] = data
        self.n += n
        if self.h is not None:
            self.h.update(data)
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
        verify: ``"sample"`` (default: each sample's members against its sums.json), ``"shard"`` (also the
            whole shard against the index's sha256 before any of it is used; the shard is staged to a
            temp file), or ``"none"``.
        on_error: ``"raise"`` (default) or ``"skip"`` (count in :attr:`stats` and go on).
        unit: ``"question"`` (one item per QRA) or ``"video"`` (one item per video with its ``qras``).
        shuffle_buffer: videos held to interleave items from (per shard).
    """

    def __init__(self, source, *, shuffle: bool = False, seed: int = 0, epochs: int | None = 1,
                 rank: int | None = None, world_size: int | None = None, split_by: str = "shard",
                 verify: str = "sample", on_error: str = "raise", unit: str = "question", shuffle_buffer: int = 4):
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
        self.start_epoch = 0
        self.stats = LoaderStats()
        self._positions: dict[int, list[int]] = {}  # consumer -> [epoch, shard cursor, items taken]
        self._resume: dict[int, list[int]] = {}
        self._consumers: int | None = None

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
        counter = _CountingReader(stream)
        index = -1
        try:
            with stream:
                try:
                    for raw in iter_tar_samples(io.BufferedReader(counter, 1 << 20), spec.url):
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
                    self._fail(e, shard=True)
                    return
            self.stats.shards += 1
        finally:
            self.stats.bytes += counter.n

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
