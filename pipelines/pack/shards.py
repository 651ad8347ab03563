"""WebDataset shards and their wids index, written deterministically (in the manner of TFDS's BeamWriter).

A *sample descriptor* (one element of the input PCollection) describes one tar sample::

    {"split": "sft", "key": "<no dots>", "bytes": <tar bytes of the sample>, "nquestions": 3,
     "files": [{"name": "frames.npy", "path": <cache .npy>, "size": n, "sha256": h},
               {"name": "meta.json", "text": "..."}, ...]}

Large members travel by reference (``path``) and are streamed from the frame cache into the tar,
their sha256 checked on the way; small ones travel inline (``text``).

:class:`WriteWebDatasetShards` is a small composite of named steps:

1. ``SizeSamples`` -> ``PlanShards``: a first sizing pass over (sha256 of key, tar bytes) of every
   sample of a split: ``n = min(samples, ceil(total bytes / target))`` shards, each a contiguous range
   of the hash space holding about ``total / n`` bytes (:func:`plan_shards`), so the shard count and
   assignment are a pure function of the data and the target and no shard is empty;
2. ``AssignShards``: each sample to the shard whose hash range holds its key's hash (plus one marker
   per shard, so that every planned shard is written);
3. ``GroupShards`` -> ``WriteShards``: samples sorted by key, members by name, each tar header with
   mtime 0, uid/gid 0, empty user/group names, mode 0644 (ustar); written under a temporary name and
   renamed; a duplicate key is an error;
4. ``WriteIndex``: one ``{dataset}-{split}.index.json`` per split in the wids format
   (``__kind__: wids-shard-index-v1``, ``shardlist: [{url, nsamples, bytes, sha256}]``), URLs relative
   to the index; shards of the split left by an earlier run with another count are removed;
5. ``OtherSplits``: the shards and index of a split of this dataset that this run did not write (a pack after the
   pass-rate filter writes ``sft``/``rl``; the unfiltered ``train`` of the pack before would otherwise stay beside
   them, and a card or a trainer globbing the directory would take rejected questions for data) are removed from a
   directory the run owns (``OUT/shards``), and named in a warning in one it shares (``pack.shards_dir``, where
   another run's split of the same dataset may be).

A retried bundle or a re-run rewrites the same bytes, so two runs (or a killed run and its re-run)
give sha256-identical shards and index.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import logging
import os
import posixpath

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.schemas.atomic import temp_target, write_atomic
from longreel.task.shard_format import build_index, index_name, shard_name, tar_member_bytes, write_shard_atomic

log = logging.getLogger("longreel")


class _WriteShard(beam.DoFn):
    def __init__(self, shards_dir: str, dataset: str):
        self.shards_dir, self.dataset = shards_dir, dataset

    def process(self, element):
        (split, index, num_shards), group = element
        samples = sorted((s for s in group if s is not None), key=lambda s: s["key"])
        for a, b in zip(samples, samples[1:]):
            if a["key"] == b["key"]:
                raise ValueError(f"duplicate sample key {a['key']!r} in split {split!r}")
        name = shard_name(self.dataset, split, index)
        nbytes, sha = write_shard_atomic(FileSystems.join(self.shards_dir, name), samples)
        yield {"split": split, "index": index, "num_shards": num_shards, "url": name, "nsamples": len(samples),
               "nquestions": sum(int(s.get("nquestions", 0)) for s in samples), "bytes": nbytes, "sha256": sha}


def _write_index(split_infos, shards_dir: str, dataset: str, extra: dict | None):
    split, infos = split_infos
    infos = list(infos)
    if callable(extra):  # computed where the index is written (see WriteWebDatasetShards)
        extra = extra()
    doc = build_index(dataset, split, infos, extra)
    path = FileSystems.join(shards_dir, index_name(dataset, split))
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=False) + "\n")
    # Shards of this split from an earlier run with another shard count, and temp files of killed runs.
    keep = {i["url"] for i in infos}
    pattern = FileSystems.join(shards_dir, f"{dataset}-{split}-*.tar")
    stale = [m.path for r in FileSystems.match([pattern]) for m in r.metadata_list
             if posixpath.basename(m.path) not in keep]
    own = (f"{dataset}-{split}-", index_name(dataset, split))

    def is_own_temp(path: str) -> bool:
        target = temp_target(posixpath.basename(path)) or ""
        return target.startswith(own[0]) and target.endswith(".tar") or target == own[1]

    temps = [m.path for r in FileSystems.match([FileSystems.join(shards_dir, ".tmp-*")]) for m in r.metadata_list
             if is_own_temp(m.path)]
    if stale or temps:
        FileSystems.delete(sorted(set(stale + temps)))
    return {"split": split, "index": path, "doc": doc}


def _other_splits(written: list[str], shards_dir: str, dataset: str, remove: bool) -> list[str]:
    """The splits of ``dataset`` in ``shards_dir`` other than ``written``, their index and shards deleted when
    ``remove`` (else only named in a warning); returns them. A split is the dataset's by its index's own record
    (``longreel.dataset``), not by its file name: the name of another dataset can start with this one's (``ds`` and
    ``ds-v2``)."""
    if not remove:
        others = _other_splits_found(written, shards_dir, dataset)
        if others:
            log.warning("pack: %s also holds split(s) %s of %s, which this run did not write (it wrote %s); left "
                        "alone, as pack.shards_dir may be shared: remove them if they are an earlier pack's",
                        shards_dir, ", ".join(sorted(s for s, _ in others)), dataset,
                        ", ".join(sorted(written)) or "none")
        return sorted(s for s, _ in others)
    _warn_other_datasets(shards_dir, dataset)
    removed = []
    for split, index_path in _other_splits_found(written, shards_dir, dataset):
        tars = [t.path for t in FileSystems.match([FileSystems.join(shards_dir, f"{dataset}-{split}-*.tar")])[0]
                .metadata_list if posixpath.basename(t.path) == shard_name_of(t.path, dataset, split)]
        FileSystems.delete(sorted(tars) + [index_path])
        removed.append(split)
    if removed:
        log.warning("pack: removed the shards and index of split(s) %s of %s in %s, which this run did not write "
                    "(it wrote %s)", ", ".join(sorted(removed)), dataset, shards_dir,
                    ", ".join(sorted(written)) or "none")
    return sorted(removed)


def _warn_other_datasets(shards_dir: str, dataset: str) -> None:
    """Name the indexes of other datasets in the run's own shards directory (an earlier pack with another
    ``pack.dataset``): they are not this pack's to remove, but a reader given the directory reads them too."""
    others = set()
    for r in FileSystems.match([FileSystems.join(shards_dir, "*.index.json")]):
        for m in r.metadata_list:
            try:
                with FileSystems.open(m.path) as fh:
                    other = (json.loads(fh.read()).get("longreel") or {}).get("dataset")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(other, str) and other != dataset:
                others.add(other)
    if others:
        log.warning("pack: %s also holds dataset(s) %s (an earlier pack with another pack.dataset?): the card "
                    "describes %s only, but a reader given the directory reads them all; remove them, or point "
                    "readers at %s", shards_dir, ", ".join(sorted(others)), dataset, index_name(dataset, "SPLIT"))


def _other_splits_found(written: list[str], shards_dir: str, dataset: str) -> list[tuple[str, str]]:
    """(split, index path) of each index in ``shards_dir`` that records ``dataset`` and a split not in ``written``."""
    found = []
    for r in FileSystems.match([FileSystems.join(shards_dir, index_name(dataset, "*"))]):
        for m in r.metadata_list:
            try:
                with FileSystems.open(m.path) as fh:
                    own = json.loads(fh.read()).get("longreel") or {}
            except (OSError, ValueError, AttributeError):
                continue  # not an index this writer made: not the dataset's
            split = own.get("split")
            if own.get("dataset") == dataset and isinstance(split, str) and split not in written:
                found.append((split, m.path))
    return found


def shard_name_of(path: str, dataset: str, split: str) -> str:
    """``path``'s file name when it is exactly :func:`shard_name`'s of ``dataset``'s ``split`` (a number after the
    split), else '': the glob ``ds-train-*.tar`` also matches ``ds-train-extra-000000.tar``, another dataset's."""
    name = posixpath.basename(path)
    rest = name[len(f"{dataset}-{split}-"):]
    return name if name.startswith(f"{dataset}-{split}-") and rest[:-4].isdigit() and rest.endswith(".tar") else ""


class WriteWebDatasetShards(beam.PTransform):
    """sample descriptors -> shards + one index per split; outputs ``{"shards": infos, "indexes": docs}``.

    ``index_extra``: a dict recorded in every index, or a picklable callable returning it, called when an index is
    written (the pack stage's: it loads the video processor, which the process building the graph need not import).
    """

    def __init__(self, shards_dir: str, dataset: str, target_shard_bytes: int, index_extra: dict | None = None,
                 remove_other_splits: bool = True):
        super().__init__()
        if target_shard_bytes < 1:
            raise ValueError("target_shard_bytes must be >= 1")
        self.shards_dir, self.dataset, self.target = shards_dir, dataset, int(target_shard_bytes)
        self.index_extra, self.remove_other_splits = index_extra, remove_other_splits

    def expand(self, samples):
        target = self.target
        plans = (samples
                 | "SizeSamples" >> beam.Map(lambda s: (s["split"], (hash_key(s["key"]), int(s["bytes"]))))
                 | "GroupSizes" >> beam.GroupByKey()
                 | "PlanShards" >> beam.Map(lambda kv: (kv[0], plan_shards(list(kv[1]), target))))
        plan_by_split = beam.pvalue.AsDict(plans)

        def assign(s, plans):
            starts = plans[s["split"]]
            return (s["split"], bisect.bisect_right(starts, hash_key(s["key"])) - 1, len(starts)), s

        keyed = samples | "AssignShards" >> beam.Map(assign, plan_by_split)
        markers = plans | "AllShards" >> beam.FlatMap(
            lambda kv: [((kv[0], i, len(kv[1])), None) for i in range(len(kv[1]))])
        infos = ((keyed, markers) | "WithMarkers" >> beam.Flatten() | "GroupShards" >> beam.GroupByKey()
                 | "WriteShards" >> beam.ParDo(_WriteShard(self.shards_dir, self.dataset)))
        indexes = (infos
                   | "BySplit" >> beam.Map(lambda i: (i["split"], i))
                   | "GroupSplits" >> beam.GroupByKey()
                   | "WriteIndex" >> beam.Map(_write_index, self.shards_dir, self.dataset, self.index_extra))
        # after every index is written; ToList gives [] when no split was, so a pack that kept nothing removes all
        _ = (indexes | "WrittenSplits" >> beam.Map(lambda r: r["split"]) | "AllWritten" >> beam.combiners.ToList()
             | "OtherSplits" >> beam.Map(_other_splits, self.shards_dir, self.dataset, self.remove_other_splits))
        return {"shards": infos, "indexes": indexes}


def hash_key(key: str) -> int:
    """Where a sample sits in hash order (128 bits of sha256 of its key)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:16], "big")


def plan_shards(sizes: list[tuple[int, int]], target: int) -> list[int]:
    """First sizing pass: ``(hash_key, bytes)`` of every sample of a split -> the first hash key of each shard.

    ``n = min(samples, max(1, ceil(total / target)))`` shards; samples in hash order are cut into
    ``n`` contiguous ranges of about equal bytes (sample ``j`` goes to ``floor(bytes before j * n /
    total)``, kept non-decreasing by steps of at most one so that no shard is empty). A pure function
    of the multiset of (key, size) pairs and the target.
    """
    sizes = sorted(sizes)
    if not sizes:
        return [0]
    total = sum(b for _, b in sizes)
    count = len(sizes)
    n = min(count, max(1, math.ceil(total / target)))
    starts, cum, prev = [], 0, -1
    for j, (h, b) in enumerate(sizes):
        want = (cum * n) // total if total else 0
        idx = min(max(want, n - (count - j)), prev + 1)
        if idx != prev:
            starts.append(h)
        prev = idx
        cum += b
    assert len(starts) == n, (len(starts), n)
    starts[0] = 0  # the first shard starts at the bottom of hash space
    return starts


def sample_bytes(files: list[dict]) -> int:
    total = 0
    for f in files:
        size = len(f["text"].encode("utf-8")) if "text" in f else int(f["size"])
        total += tar_member_bytes(size)
    return total


def ensure_dir(path: str) -> None:
    if "://" not in path:
        os.makedirs(path, exist_ok=True)
