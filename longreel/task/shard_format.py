"""The shard format every longreel shard has, written by the pack stage and by the synthetic task: deterministic
ustar members (mtime 0, uid/gid 0, empty names, mode 0644), ``{dataset}-{split}-NNNNNN.tar`` names, sample keys
without dots or slashes, and the wids index (``{dataset}-{split}.index.json``, ``__kind__: wids-shard-index-v1``)
with longreel's summary. It sits below both the pipelines (which plan and write shards in Beam) and the trainer
(which reads them), so that neither imports the other for it.
"""
from __future__ import annotations

import hashlib
import io
import tarfile

from longreel.schemas.atomic import atomic_open
from longreel.task.beam_quiet import quiet_beam_import

quiet_beam_import()  # the trainer's side writes shards without the CLI's logging set-up
from apache_beam.io.filesystems import FileSystems  # noqa: E402 - after the filter, on purpose

INDEX_KIND = "wids-shard-index-v1"
SAMPLE_LAYOUT = "longreel-video-v1"
BLOCK = 512
COPY_CHUNK = 1 << 20


def tar_member_bytes(size: int) -> int:
    """Bytes one regular member takes in a ustar archive: header block + data padded to 512."""
    return BLOCK + ((size + BLOCK - 1) // BLOCK) * BLOCK


def shard_name(dataset: str, split: str, index: int) -> str:
    return f"{dataset}-{split}-{index:06d}.tar"


def index_name(dataset: str, split: str) -> str:
    return f"{dataset}-{split}.index.json"


def check_key(key: str) -> str:
    if not key or "." in key or "/" in key or key.startswith("_"):
        raise ValueError(f"bad sample key {key!r}: keys must be non-empty, without dots or slashes, not start with _")
    return key


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


class _HashingWriter:
    """File-like sink that hashes and counts what passes through."""

    def __init__(self, fh):
        self.fh, self.h, self.n = fh, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        self.fh.write(b)
        return len(b)


class _CheckedReader:
    """Reads a cache file for a tar member, hashing it; a mismatch with the recorded sha256 is an error."""

    def __init__(self, fh, path: str, size: int, sha256: str):
        self.fh, self.path, self.size, self.sha256 = fh, path, size, sha256
        self.h, self.n = hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        b = self.fh.read(n)
        self.h.update(b)
        self.n += len(b)
        return b

    def check(self) -> None:
        if self.n != self.size or self.h.hexdigest() != self.sha256:
            raise IOError(f"{self.path} changed since it was cached ({self.n} bytes, expected {self.size}, "
                          f"sha256 {'ok' if self.h.hexdigest() == self.sha256 else 'differs'}); re-run pack")


def _open_read(path: str):
    if "://" not in path:
        return open(path, "rb")
    return FileSystems.open(path, compression_type="uncompressed")


def write_tar(out, samples: list[dict]) -> None:
    """Write ``samples`` (descriptors, already sorted) as one deterministic ustar stream to ``out``."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for s in samples:
            key = check_key(s["key"])
            for f in sorted(s["files"], key=lambda f: f["name"]):
                name = f"{key}.{f['name']}"
                if "text" in f:
                    data = f["text"].encode("utf-8")
                    tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
                else:
                    with _open_read(f["path"]) as fh:
                        reader = _CheckedReader(fh, f["path"], f["size"], f["sha256"])
                        tar.addfile(_tarinfo(name, f["size"]), reader)
                        reader.check()


def write_shard_atomic(path: str, samples: list[dict]) -> tuple[int, str]:
    """Write a shard under a temporary name, rename it into place; return (bytes, sha256)."""
    with atomic_open(path) as fh:
        w = _HashingWriter(fh)
        write_tar(w, samples)
    return w.n, w.h.hexdigest()


def build_index(dataset: str, split: str, infos: list[dict], extra: dict | None = None) -> dict:
    infos = sorted(infos, key=lambda i: i["index"])
    if [i["index"] for i in infos] != list(range(len(infos))):
        raise ValueError(f"{dataset}-{split}: shard indices are not 0..{len(infos) - 1}")
    return {
        "__kind__": INDEX_KIND,
        "wids_version": 1,
        "name": f"{dataset}-{split}",
        "shardlist": [{"url": i["url"], "nsamples": i["nsamples"], "bytes": i["bytes"], "sha256": i["sha256"],
                       "nquestions": i["nquestions"]} for i in infos],
        "longreel": {"dataset": dataset, "split": split, "sample_layout": SAMPLE_LAYOUT,
                     "samples": sum(i["nsamples"] for i in infos),
                     "questions": sum(i["nquestions"] for i in infos),
                     "bytes": sum(i["bytes"] for i in infos), **(extra or {})},
    }
