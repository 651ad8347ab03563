"""Ingest + probe: input items -> ``video`` records; duplicates by content are rejects.

Each input is hashed (sha256 of its bytes, read through Beam FileSystems) and probed by
PyAV inside a killable worker process. The content hash is the video's identity: the same
bytes under two names are one video, and every other name is a ``duplicate`` reject that
names the kept one (the kept one is the smallest uri, so the choice is deterministic). A uri the
inputs list twice is probed once: its later listings are ``duplicate_input`` rejects naming the first.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import urllib.request

import apache_beam as beam
from apache_beam.io.filesystems import FileSystems

from longreel.pipelines.media.worker import IsolatedWorker, WorkerError
from longreel.pipelines.stages.base import MAIN, REJECTS, Progress, checked, rejected
from longreel.pipelines.tmp_dirs import make_tmpdir

STAGE = "ingest"
DEDUP_STAGE = "dedup"
CHUNK = 1 << 20


class NotRegularFile(OSError):
    pass


def _open(uri: str):
    if uri.startswith(("http://", "https://")):
        return urllib.request.urlopen(uri, timeout=60)  # noqa: S310 - the user's own URL list
    return FileSystems.open(uri, compression_type="uncompressed")


def hash_and_localize(uri: str, tmpdir: str) -> tuple[str, str, int, bool]:
    """Return (local path, sha256, size, is_temp). Local files are read in place; remote ones copied once."""
    h = hashlib.sha256()
    size = 0
    if "://" not in uri:
        st = os.stat(uri)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(uri)
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
            raise NotRegularFile(uri)
        with open(uri, "rb") as fh:
            while chunk := fh.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
        return uri, h.hexdigest(), size, False
    fd, local = tempfile.mkstemp(dir=tmpdir, suffix=os.path.splitext(uri)[1][:8])
    with os.fdopen(fd, "wb") as out, _open(uri) as fh:
        while chunk := fh.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
            out.write(chunk)
    return local, h.hexdigest(), size, True


class ProbeVideo(beam.DoFn):
    def __init__(self, probe_timeout_s: float = 120.0, signature_frames: int = 0):
        self.probe_timeout_s = probe_timeout_s
        self.signature_frames = signature_frames

    def setup(self):
        self.worker = IsolatedWorker(default_timeout=self.probe_timeout_s)
        self.tmpdir = make_tmpdir("ingest")
        self.progress = Progress(STAGE, "videos probed")

    def teardown(self):
        self.worker.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def process(self, item: dict):
        uri = item["uri"]
        if item.get("duplicate_of"):  # the same uri listed again (see pipelines.io.inputs.expand_inputs)
            yield rejected(STAGE, uri, "duplicate_input",
                           f"{item.get('source') or 'a later listing'} repeats {uri}, first listed at "
                           f"{item['duplicate_of']}: the first listing is the input",
                           details=json.dumps({"first": item["duplicate_of"], "again": item.get("source")}))
            return
        t0 = time.monotonic()
        try:
            local, sha, size, is_temp = hash_and_localize(uri, self.tmpdir)
        except FileNotFoundError:
            yield rejected(STAGE, uri, "not_found", f"no such file: {uri}")
            return
        except PermissionError as e:
            yield rejected(STAGE, uri, "permission_denied", f"cannot read {uri}: {e}")
            return
        except IsADirectoryError:
            yield rejected(STAGE, uri, "unreadable", f"{uri} is a directory, not a file")
            return
        except NotRegularFile:
            yield rejected(STAGE, uri, "unreadable", f"{uri} is not a regular file (FIFO, socket or device)")
            return
        except OSError as e:
            yield rejected(STAGE, uri, "unreadable", f"cannot read {uri}: {e}")
            return
        try:
            if size == 0:
                yield rejected(STAGE, uri, "empty_file", f"{uri} is empty (0 bytes)")
                return
            try:
                info = self.worker.call("probe", path=local)
            except WorkerError as e:
                yield rejected(STAGE, uri, e.reason, e.message, video_id=sha[:16])
                return
            # a few small frames while the file is local (the near-duplicate test of the dedup stage)
            sig = self._signature(local, info) if self.signature_frames else None
        finally:
            if is_temp:
                os.unlink(local)
        row = {"video_id": sha[:16], "sha256": sha, "uri": uri, "bytes": size,
               "license": item.get("license"), "attribution": item.get("attribution"), **info}
        self.progress.tick(f"{os.path.basename(uri)} ({time.monotonic() - t0:.2f} s)")
        out = checked(STAGE, "video", row, uri)
        # the signature rides along to the dedup stage, which drops it (not a column of the videos table)
        yield {**out, "signature": sig} if sig is not None and isinstance(out, dict) else out


    def _signature(self, local: str, info: dict) -> list[str] | None:
        try:
            return self.worker.call("signature", path=local, duration_s=info["duration_s"],
                                    n=self.signature_frames, rotation=info["rotation"])["signature"]
        except WorkerError:  # a video whose frames do not all decode is not compared, not rejected here
            return None


def _pick_canonical(element):
    sha, rows = element
    rows = sorted(rows, key=lambda r: r["uri"])
    yield rows[0]
    for dup in rows[1:]:
        yield rejected(DEDUP_STAGE, dup["uri"], "duplicate",
                       f"same content (sha256 {sha[:16]}…) as {rows[0]['uri']}", video_id=dup["video_id"])


class ProbeVideos(beam.PTransform):
    """Stage ``ingest``: items ``{"uri", "license", "attribution"}`` -> ``{"main": videos, "rejects"}``."""

    def __init__(self, probe_timeout_s: float = 120.0, signature_frames: int = 0):
        super().__init__()
        self.probe_timeout_s = probe_timeout_s
        self.signature_frames = signature_frames

    def expand(self, items):
        out = (items
               | "Reshuffle" >> beam.Reshuffle()  # spread the expensive probes over workers
               | "HashAndProbe" >> beam.ParDo(ProbeVideo(self.probe_timeout_s, self.signature_frames)).with_outputs(
                   REJECTS, main=MAIN))
        return {MAIN: out[MAIN], REJECTS: out[REJECTS]}


def _slim(row: dict) -> dict:
    return {k: row.get(k) for k in ("sha256", "uri", "width", "height", "duration_s", "bytes", "signature")}


def _near_duplicate_table(slim_rows: list[dict], max_mean_bits: float) -> dict:
    from longreel.pipelines.gates.videodup import near_duplicates

    found = near_duplicates(slim_rows, max_mean_bits)
    return {sha: (kept["uri"], kept["sha256"], d) for sha, (kept, d) in found.items()}


def _drop_near_duplicates(row: dict, table: dict):
    row = {k: v for k, v in row.items() if k != "signature"}  # carried from the probe, not a table column
    hit = table.get(row["sha256"])
    if hit is None:
        yield row
        return
    kept_uri, kept_sha, d = hit
    yield rejected(DEDUP_STAGE, row["uri"], "near_duplicate",
                   f"the same footage as {kept_uri} (mean dHash distance {d:.2f} bits)", video_id=row["video_id"],
                   details=json.dumps({"kept": kept_uri, "kept_sha256": kept_sha, "mean_bits": round(d, 3)},
                                      sort_keys=True))


class DedupVideos(beam.PTransform):
    """Stage ``dedup``: videos -> ``{"main": one video per content hash, "rejects": duplicates}``; with
    ``near_duplicates`` also one video per group of near-identical signatures
    (:mod:`longreel.pipelines.gates.videodup`): the others are ``near_duplicate`` rejects naming the kept one."""

    def __init__(self, near_duplicates: bool = False, max_mean_bits: float = 6.0):
        super().__init__()
        self.near, self.max_mean_bits = near_duplicates, max_mean_bits

    def expand(self, videos):
        out = (videos
               | "KeyBySha" >> beam.Map(lambda r: (r["sha256"], r))
               | "GroupBySha" >> beam.GroupByKey()
               | "PickCanonical" >> beam.FlatMap(_pick_canonical).with_outputs(REJECTS, main=MAIN))
        main, rejects = out[MAIN], out[REJECTS]
        if not self.near:
            return {MAIN: main | "NoSignature" >> beam.Map(lambda r: {k: v for k, v in r.items() if k != "signature"}),
                    REJECTS: rejects}
        # one small record per video meets the others in one place (signatures are n x 16 hex digits)
        table = (main
                 | "Slim" >> beam.Map(_slim)
                 | "AllSignatures" >> beam.combiners.ToList()
                 | "Group" >> beam.Map(_near_duplicate_table, self.max_mean_bits))
        near = main | "DropNear" >> beam.FlatMap(_drop_near_duplicates, beam.pvalue.AsSingleton(table)).with_outputs(
            REJECTS, main=MAIN)
        both = (rejects, near[REJECTS]) | "DedupRejects" >> beam.Flatten()
        return {MAIN: near[MAIN], REJECTS: both}
