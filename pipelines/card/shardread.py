"""Reading WebDataset shards and their wids index back, for ``card verify`` and ``card build``.

Nothing here trusts the pipeline: a shard is streamed once, its bytes hashed on the way, members
grouped into samples by key (the WebDataset rule: the key is the member name up to its first dot),
JSON members parsed, and ``.npy`` members only *described* from their header (shape, dtype), never
unpickled (``allow_pickle`` plays no part: the array data is not loaded at all). Paths may be local or
URLs: ``http(s)://`` through urllib, ``gs://`` / ``s3://`` through Beam's FileSystems.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import posixpath
import tarfile
import urllib.parse
import urllib.request

INDEX_SUFFIX = ".index.json"
CHUNK = 1 << 20


def is_url(path: str) -> bool:
    return "://" in path


def open_bytes(path: str):
    """A readable binary stream for a local path or URL."""
    if path.startswith(("http://", "https://")):
        return urllib.request.urlopen(path, timeout=120)  # noqa: S310 - the user names the URL
    if is_url(path):
        from apache_beam.io.filesystems import FileSystems
        return FileSystems.open(path, compression_type="uncompressed")
    return open(path, "rb")


def join(base: str, rel: str) -> str:
    """``rel`` resolved against the directory of ``base`` (an index path or URL)."""
    if is_url(rel) or rel.startswith("/"):
        return rel
    if base.startswith(("http://", "https://")):
        return urllib.parse.urljoin(base, rel)
    if is_url(base):
        return posixpath.join(posixpath.dirname(base), rel)
    return os.path.join(os.path.dirname(base), rel)


def list_indexes(shards: str) -> list[str]:
    """Index files for ``shards``: an index file/URL itself, or every ``*.index.json`` in a local/FS directory."""
    if shards.endswith(INDEX_SUFFIX):
        return [shards]
    if shards.startswith(("http://", "https://")):
        raise ValueError(f"{shards}: give the URL of an index file (*{INDEX_SUFFIX}), not of a directory")
    if is_url(shards):
        from apache_beam.io.filesystems import FileSystems
        pattern = FileSystems.join(shards, "*" + INDEX_SUFFIX)
        return sorted(m.path for r in FileSystems.match([pattern]) for m in r.metadata_list)
    import glob
    if not os.path.isdir(shards):
        raise FileNotFoundError(f"{shards}: neither an index file nor a directory")
    return sorted(glob.glob(os.path.join(shards, "*" + INDEX_SUFFIX)))


def read_index(path: str) -> dict:
    with open_bytes(path) as fh:
        doc = json.loads(fh.read())
    if doc.get("__kind__") != "wids-shard-index-v1" or not isinstance(doc.get("shardlist"), list):
        raise ValueError(f"{path}: not a wids shard index (__kind__ {doc.get('__kind__')!r})")
    return doc


class _Hashing:
    def __init__(self, fh):
        self.fh, self.h, self.n = fh, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        b = self.fh.read(n)
        self.h.update(b)
        self.n += len(b)
        return b


def npy_header(data_head: bytes) -> dict:
    """Shape and dtype of a ``.npy`` from its first bytes (the header is a Python literal; parsed with
    ``ast.literal_eval``, which evaluates no code)."""
    if data_head[:6] != b"\x93NUMPY":
        raise ValueError("not a .npy file")
    major = data_head[6]
    if major == 1:
        hlen = int.from_bytes(data_head[8:10], "little")
        start = 10
    else:
        hlen = int.from_bytes(data_head[8:12], "little")
        start = 12
    header = ast.literal_eval(data_head[start:start + hlen].decode("latin1"))
    return {"shape": list(header["shape"]), "dtype": str(header["descr"]), "fortran_order": header["fortran_order"]}


def read_shard(url: str) -> dict:
    """Stream one shard: ``{"bytes", "sha256", "samples": [{"key", "members": {name: size}, "sha256": {name: hex},
    "json": {name: obj}, "npy": {name: header}, "errors": [...]}]}``; a sample whose members are not
    contiguous in the tar, or a member name without a key, is an error entry, not an exception."""
    samples: list[dict] = []
    errors: list[str] = []
    seen: set[str] = set()
    with open_bytes(url) as raw:
        hashed = _Hashing(raw)
        try:
            with tarfile.open(fileobj=hashed, mode="r|") as tar:
                for m in tar:
                    if not m.isfile():
                        continue
                    base = posixpath.basename(m.name)
                    if "." not in base:
                        errors.append(f"member {m.name!r} has no extension")
                        continue
                    key, ext = base.split(".", 1)
                    if not samples or samples[-1]["key"] != key:
                        if key in seen:
                            errors.append(f"sample {key!r} appears twice (members not contiguous)")
                        seen.add(key)
                        samples.append({"key": key, "members": {}, "sha256": {}, "json": {}, "npy": {}, "errors": []})
                    s = samples[-1]
                    s["members"][ext] = m.size
                    f = tar.extractfile(m)
                    h = hashlib.sha256()
                    if ext.endswith(".json"):
                        data = f.read()
                        h.update(data)
                        try:
                            s["json"][ext] = json.loads(data)
                        except ValueError as e:
                            s["errors"].append(f"{ext}: not JSON ({e})")
                    else:
                        head = f.read(4096)
                        h.update(head)
                        if ext.endswith(".npy"):
                            try:
                                s["npy"][ext] = npy_header(head)
                            except (ValueError, SyntaxError, KeyError) as e:
                                s["errors"].append(f"{ext}: bad .npy header ({e})")
                        while chunk := f.read(CHUNK):
                            h.update(chunk)
                    s["sha256"][ext] = h.hexdigest()
        except (tarfile.TarError, EOFError, OSError) as e:
            errors.append(f"not a readable tar: {e}")
        while hashed.read(CHUNK):  # the tar end blocks and padding count in the shard's bytes and hash
            pass
    return {"url": url, "bytes": hashed.n, "sha256": hashed.h.hexdigest(), "samples": samples, "errors": errors}


def sample_descriptor(split: str, s: dict) -> dict:
    """A shard sample as the ``{"split", "key", "files": [{"name", "text"}]}`` descriptor that
    :func:`longreel.pipelines.distributions.released_pairs` reads."""
    files = [{"name": name, "text": json.dumps(obj)} for name, obj in sorted(s["json"].items())]
    return {"split": split, "key": s["key"], "files": files}
