"""A long-lived helper process for work on untrusted media that may hang or crash.

Decoders can deadlock while holding the GIL (decord issue #373) or segfault on a hostile
file; neither may take a pipeline down. Each :class:`IsolatedWorker` owns one child
process that answers JSON requests, one per line, on its stdin/stdout. A request that
does not answer within its timeout gets the child killed (and a fresh one started for
the next request); a child that dies mid-request is reported as a crash. Either way the
caller gets an exception for that one input and carries on.

Keeping the child alive between requests matters for speed: starting Python and
importing PyAV costs more than probing a typical file.

Large results (decoded frames) travel as ``.npy`` files in a private temp directory,
never as pickles.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

from longreel.pipelines.tmp_dirs import make_tmpdir


class WorkerError(RuntimeError):
    """The operation failed inside the worker with a clean error (``reason`` is a reject code)."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class WorkerTimeout(WorkerError):
    def __init__(self, op: str, timeout: float):
        super().__init__("timeout", f"{op} did not finish within {timeout:.0f} s; the worker was killed")


class WorkerCrashed(WorkerError):
    def __init__(self, op: str, detail: str):
        super().__init__("worker_crashed", f"{op} crashed the worker process: {detail}")


class IsolatedWorker:
    """One child process running :mod:`longreel.pipelines.media.worker_main`. Thread-safe (one request at a time)."""

    def __init__(self, default_timeout: float = 120.0):
        self.default_timeout = default_timeout
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._buf = b""
        self.tmpdir = make_tmpdir("worker")

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        # One thread per worker: the pipeline already runs several workers side by side.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["LONGREEL_WORKER_PARENT"] = str(os.getpid())  # worker_main.PARENT_ENV: it ends when this process does
        self._buf = b""
        return subprocess.Popen(
            [sys.executable, "-m", "longreel.pipelines.media.worker_main"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(timeout=10)
            except Exception:
                pass
            self._proc = None

    def _readline(self, deadline: float) -> bytes | None:
        proc = self._proc
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def call(self, op: str, timeout: float | None = None, **args):
        timeout = self.default_timeout if timeout is None else timeout
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            request = json.dumps({"op": op, "args": args, "tmpdir": self.tmpdir}).encode() + b"\n"
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
                line = self._readline(time.monotonic() + timeout)
            except (BrokenPipeError, EOFError):
                code = self._proc.poll()
                self._kill()
                raise WorkerCrashed(op, f"exit code {code}") from None
            if line is None:
                self._kill()
                raise WorkerTimeout(op, timeout)
        reply = json.loads(line)
        if reply.get("ok"):
            return reply["result"]
        raise WorkerError(reply.get("reason", "error"), reply.get("message", "unknown error"))

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    self._proc.stdin.close()
                    self._proc.wait(timeout=5)
                except Exception:
                    pass
            self._kill()
        try:
            for name in os.listdir(self.tmpdir):
                os.unlink(os.path.join(self.tmpdir, name))
            os.rmdir(self.tmpdir)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
