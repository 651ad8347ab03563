"""Atomic file writes, the one helper every writer of an output uses: the bytes go to a temporary name beside the
target (``.tmp-<32 hex>-<name>``) and are renamed into place, so that a reader, or the next run after a crash,
never sees half a file, and a failed write leaves no temporary behind.

Local paths use ``os.replace`` (atomic on POSIX). Other Beam filesystems (``gs://``, ``s3://``, ...) have no atomic
replace: the temporary object is written whole, the old object deleted, the temporary renamed (a reader between the
last two steps finds no file, never a partial one). Why not a library: Beam's ``FileSystems`` already spans every
store the pipeline writes to, and neither it nor the standard library offers write-then-rename over both.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
import re
import uuid
from typing import BinaryIO, Iterator

#: the temporary names this module writes (a directory's cleanup may remove what a killed writer left)
TEMP_RE = re.compile(r"\.tmp-[0-9a-f]{32}-(?P<target>.+)")


def temp_target(name: str) -> str | None:
    """The file name a temporary name of this module was writing (None: not one of its temporary names)."""
    m = TEMP_RE.fullmatch(name)
    return m.group("target") if m else None


def _remote(path: str) -> bool:
    return "://" in path


def temp_name(path: str) -> str:
    """A fresh temporary name in ``path``'s directory."""
    split = posixpath.split if _remote(path) else os.path.split
    directory, name = split(os.fspath(path))
    tmp = f".tmp-{uuid.uuid4().hex}-{name}"
    return f"{directory.rstrip('/')}/{tmp}" if _remote(path) else os.path.join(directory, tmp)


def _delete_quiet(path: str) -> None:
    try:
        if _remote(path):
            from apache_beam.io.filesystems import FileSystems
            FileSystems.delete([path])
        else:
            os.unlink(path)
    except Exception:  # noqa: BLE001 - cleanup after the real error, which is what gets raised
        pass


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into; published at the end of the ``with`` block, discarded
    if the block raises. ``fsync``: flush a local file to disk before the rename (for files whose loss after a
    power cut matters: markers, locks, checkpoints' metadata)."""
    path = os.fspath(path)
    tmp = temp_name(path)
    if _remote(path):
        from apache_beam.io.filesystems import FileSystems
        opened = FileSystems.create(tmp)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        opened = open(tmp, "wb")
    try:
        with opened as fh:
            yield fh
            if fsync and not _remote(path):
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        _delete_quiet(tmp)
        raise
    try:
        _publish(tmp, path)
    except BaseException:  # e.g. a directory where the file must go: nothing of this write stays behind
        _delete_quiet(tmp)
        raise


def _publish(tmp: str, path: str) -> None:
    if _remote(path):
        from apache_beam.io.filesystems import FileSystems
        if FileSystems.exists(path):
            FileSystems.delete([path])
        FileSystems.rename([tmp], [path])
    else:
        os.replace(tmp, path)  # refuses to replace a directory (IsADirectoryError): never removes one


def write_atomic(path: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> str:
    """Write ``data`` (text is UTF-8 encoded, newlines as given) to ``path`` atomically; return the path."""
    with atomic_open(path, fsync=fsync) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return os.fspath(path)
