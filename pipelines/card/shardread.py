"""Reading WebDataset shards and their wids index back, for ``card verify`` and ``card build``.

Nothing here trusts the pipeline: a shard is streamed once, its bytes hashed on the way, and parsed by the same
reader the trainer's loader uses (:mod:`longreel.task.shard_reader`: members grouped into samples by key, unsafe
members refused); JSON members are parsed and ``.npy`` members only *described* from their header (shape, dtype),
never unpickled (``allow_pickle`` plays no part: the array data is not loaded as an array). Paths may be local or
URLs: ``http(s)://`` through urllib, ``gs://`` / ``s3://`` through Beam's FileSystems.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import posixpath
import urllib.error
import urllib.parse
import urllib.request

from longreel.task import shard_reader

INDEX_SUFFIX = ".index.json"
CHUNK = 1 << 20


def is_url(path: str) -> bool:
    return "://" in path


def as_local(path: str) -> str:
    """A ``file://`` URL as the local path it names (the trainer reads them so; Beam's FileSystems has no ``file``
    scheme and refused them); anything else as given."""
    return shard_reader.local_path(path) if path.startswith("file://") else path


def open_bytes(path: str):
    """A readable binary stream for a local path or URL."""
    path = as_local(path)
    if path.startswith(("http://", "https://")):
        return _open_url(path)
    if is_url(path):
        from apache_beam.io.filesystems import FileSystems
        return FileSystems.open(path, compression_type="uncompressed")
    return open(path, "rb")


def _open_url(url: str):
    """``urlopen``, its failures said in one line naming the URL: an error status (404, a missing index, is a
    FileNotFoundError like a missing local path) or a server that cannot be reached. urllib's own HTTPError reached
    the CLI as "internal error (HTTPError): this is a bug"."""
    try:
        return urllib.request.urlopen(url, timeout=120)  # noqa: S310 - the user names the URL
    except urllib.error.HTTPError as e:
        e.close()
        missing = e.code in (404, 410)
        raise (FileNotFoundError if missing else OSError)(f"{url}: HTTP {e.code} {e.reason}") from None
    except OSError as e:  # URLError (refused, unknown host) or a timeout
        raise OSError(f"{url}: cannot be reached ({getattr(e, 'reason', None) or e})") from None


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
    shards = as_local(shards)
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
        text = fh.read()
    try:
        doc = json.loads(text)
    except ValueError as e:  # an HTML error page at the URL, say: the error names the index
        raise ValueError(f"{path}: not a wids shard index (not JSON: {e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a wids shard index (a JSON {type(doc).__name__})")
    if doc.get("__kind__") != "wids-shard-index-v1" or not isinstance(doc.get("shardlist"), list):
        raise ValueError(f"{path}: not a wids shard index (__kind__ {doc.get('__kind__')!r})")
    return doc


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


def read_shard(url: str, *, hashes: bool = True) -> dict:
    """Stream one shard: ``{"bytes", "sha256", "samples": [{"key", "members": {name: size}, "sha256": {name: hex},
    "json": {name: obj}, "npy": {name: header}, "errors": [...]}]}``.

    ``hashes=False`` skips every digest (the shard's ``sha256`` is None, the samples' ``sha256`` empty): the card
    reads shards for their JSON members and ``.npy`` headers only, and hashing a frame-cache shard twice over (the
    stream and each member) was most of its cost; the verifier, which checks digests, keeps them.

    The tar is parsed by the trainer loader's own reader (:func:`longreel.task.shard_reader.iter_tar_samples`), so
    what the card counts is what training reads: a member that reader refuses (unsafe name, link, pickle-style or
    unknown extension), a sample whose members are not contiguous, and a damaged stream are error entries here,
    not exceptions. ``.npy`` members are described from their header, never loaded."""
    samples: list[dict] = []
    errors: list[str] = []
    seen: set[str] = set()
    with open_bytes(url) as raw:
        counted = shard_reader.CountingReader(raw, hashlib.sha256() if hashes else None)
        try:
            for item in shard_reader.iter_tar_samples(counted, url):
                if isinstance(item, shard_reader.ShardError):
                    errors.append(str(item))
                    continue
                if item.key in seen:
                    errors.append(f"sample {item.key!r} appears twice (members not contiguous)")
                seen.add(item.key)
                samples.append(_describe(item, hashes))
        except shard_reader.ShardError as e:
            errors.append(f"not a readable tar: {e}")
        while counted.read(CHUNK):  # the tar end blocks and padding count in the shard's bytes and hash
            pass
    return {"url": url, "bytes": counted.n, "sha256": counted.h.hexdigest() if hashes else None, "samples": samples,
            "errors": errors}


def sample_keys(url: str) -> set[str]:
    """The keys of a shard's samples from its member names, by the loader's own rule
    (:func:`longreel.task.shard_reader.member_key`). A local shard is read by its tar headers only, its data
    skipped: the card lists the released videos without reading every frame of a large dataset, which
    :func:`read_shard` (the loader's reader, every member's bytes) would."""
    import tarfile

    with open_bytes(url) as fh, tarfile.open(fileobj=fh, mode="r|" if is_url(url) else "r:") as tf:
        return {k for k in (shard_reader.member_key(m.name) for m in tf) if k}


def _describe(raw, hashes: bool = True) -> dict:
    """Sizes (and sha256) of a sample's members, its JSON members parsed, its ``.npy`` headers."""
    s = {"key": raw.key, "members": {}, "sha256": {}, "json": {}, "npy": {}, "errors": []}
    for ext, data in raw.members.items():
        s["members"][ext] = len(data)
        if hashes:
            s["sha256"][ext] = hashlib.sha256(data).hexdigest()
        if ext.endswith(".json"):
            try:
                s["json"][ext] = json.loads(bytes(data))
            except ValueError as e:
                s["errors"].append(f"{ext}: not JSON ({e})")
        elif ext.endswith(".npy"):
            try:
                s["npy"][ext] = npy_header(bytes(data[:4096]))
            except (ValueError, SyntaxError, KeyError) as e:
                s["errors"].append(f"{ext}: bad .npy header ({e})")
    return s


def sample_descriptor(split: str, s: dict) -> dict:
    """A shard sample as the ``{"split", "key", "files": [{"name", "text"}]}`` descriptor that
    :func:`longreel.pipelines.distributions.released_pairs` reads."""
    files = [{"name": name, "text": json.dumps(obj)} for name, obj in sorted(s["json"].items())]
    return {"split": split, "key": s["key"], "files": files}
