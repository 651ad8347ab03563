"""The trainer's shard loader: longreel WebDataset shards -> per-question training items. Never decodes video.

Input: a list of shard URLs, a brace pattern (``dir/ds-sft-{000000..000011}.tar``), a local glob, or a wids index
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
     "category", "reasoning", "qra_id", "video_id", "split", "pass_rate", "blind_k", "blind_pass_count" (null
     when the blind filter did not run), "meta": {...},
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

import functools
import hashlib
import logging
import random
from typing import Iterator

from longreel.task.shard_reader import (LoaderStats, ShardError, ShardSpec, UnsafeMemberError, _BufferPool,  # noqa: F401
                                        iter_tar_samples, local_path, open_url, read_shard, resolve_shards)
from longreel.trainer.remote_read import read_remote_shard

log = logging.getLogger("longreel")

__all__ = ["ShardDataset", "ShardError", "UnsafeMemberError", "ShardSpec", "resolve_shards", "open_url",
           "iter_tar_samples", "processor_inputs", "to_video_metadata", "collate_items"]

PICKLE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "mp", "msgpack", "joblib"})
ALLOWED_EXTS = frozenset({"npy", "json", "txt"})
REQUIRED = ("frames.npy", "meta.json", "qras.json")
BLOCK = 512
STATE_VERSION = 1



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
                  "split", "pass_rate", "blind_k", "blind_pass_count"):
            item[k] = q.get(k)
        out.append(item)
    return out



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
        fetch: ``fetch(spec, upcoming)`` returns the spec to read for ``spec`` (a local copy of a remote
            shard), called when the shard is reached; ``upcoming`` is the shard this consumer reads next (or
            None), for a fetcher that downloads ahead. Items and the shuffle still name ``spec``. A
            :class:`ShardError` it raises counts as the shard's (``on_error``).
        retries: a remote shard read straight from the network whose stream breaks is read again from its start,
            up to this many times, skipping the samples already handled (:mod:`longreel.trainer.remote_read`).
    """

    def __init__(self, source, *, shuffle: bool = False, seed: int = 0, epochs: int | None = 1,
                 rank: int | None = None, world_size: int | None = None, split_by: str = "shard",
                 verify: str = "none", on_error: str = "raise", unit: str = "question", shuffle_buffer: int = 4,
                 mmap: bool = True, fetch=None, retries: int = 0):
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
        self.fetch = fetch
        self.retries = int(retries)
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
                source = self._source(spec, mine[cursor + 1] if cursor + 1 < len(mine) else None)
                for item in self._shard_items(spec, epoch, cid, n, source):
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

    def _fail(self, err: ShardError, shard: bool) -> None:
        if self.on_error == "raise":
            raise err
        message = str(err)
        if shard:
            self.stats.skipped_shards += 1
            # the samples the break took with it are skipped too, not just "a shard" that yielded most of its items
            self.stats.skipped_samples += err.lost
            message += f" ({err.lost_note})" if err.lost_note else ""
        else:
            self.stats.skipped_samples += 1
        self.stats.errors.append(message)
        self.stats.skips.append({"url": err.shard, "key": err.key, "reason": err.detail, "whole_shard": shard,
                                 "lost": err.lost if shard else 1})
        log.warning("loader: skipped %s: %s", "rest of shard" if shard else "sample", message)

    def _source(self, spec: ShardSpec, upcoming: ShardSpec | None) -> ShardSpec | None:
        """What to read for ``spec``: itself, or what ``fetch`` made of it (None: the shard failed and is skipped)."""
        if self.fetch is None:
            return spec
        try:
            return self.fetch(spec, upcoming)
        except ShardError as e:
            self._fail(e, shard=True)
            return None

    def _samples(self, spec: ShardSpec, source: ShardSpec | None, cid: int, n: int) -> Iterator[dict]:
        if source is None:
            return
        keep = (lambda i: i % n == cid) if self.split_by == "sample" else None
        fail = self._fail if source.url == spec.url else functools.partial(self._fail_in_copy, spec, source.url)
        if self.retries > 0 and local_path(source.url) is None:
            yield from read_remote_shard(source, self.stats, fail, retries=self.retries, verify=self.verify,
                                         mmap=self.mmap, pool=self._pool, keep=keep)
            return
        yield from read_shard(source, self.stats, fail, verify=self.verify, mmap=self.mmap, pool=self._pool,
                              keep=keep)

    def _fail_in_copy(self, spec: ShardSpec, copy: str, err: ShardError, shard: bool) -> None:
        """An error in what ``fetch`` gave for ``spec`` (its cached copy), said of the shard the user named, with
        where the copy is: a cache file's name alone does not say which of the user's shards it holds. A copy that
        broke as a whole and that nothing could check is dropped from the cache: else every later run would read
        the same bad bytes, also once the server has been fixed."""
        from longreel.trainer.shard_cache import forget_unchecked_copy

        note = forget_unchecked_copy(spec, copy) if shard else ""
        renamed = type(err)(spec.url, err.key, f"{err.detail} (read from its cached copy {copy}"
                                               + (f"; {note})" if note else ")"))
        renamed.__cause__ = err
        renamed.lost, renamed.lost_note = err.lost, err.lost_note
        self._fail(renamed, shard)

    def _shard_items(self, spec: ShardSpec, epoch: int, cid: int, n: int,
                     source: ShardSpec | None) -> Iterator[dict]:
        # seeded by the shard's own name, not its cached copy's: the order does not depend on where it is read from
        rng = random.Random(f"{self.seed}:{epoch}:{spec.url.rsplit('/', 1)[-1]}:{cid}")
        if not self.shuffle:
            for sample in self._samples(spec, source, cid, n):
                yield from _items_of(sample, spec.url, self.unit)
            return
        buf: list[list[dict]] = []
        for sample in self._samples(spec, source, cid, n):
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
