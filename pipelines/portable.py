"""Beam's portable path (how Dataflow Runner v2, Flink and Spark run Python): a worker pool that cannot hang silently.

With ``--environment_type=EXTERNAL --environment_config=HOST:PORT`` the runner asks a worker pool
(``apache_beam.runners.worker.worker_pool_main``) to start each SDK worker, and the pool starts it as ``python -c ...``
found on *its* PATH. When that ``python`` cannot import apache_beam (or longreel, whose DoFns the workers unpickle),
the worker dies at once, its error goes to the pool's stderr, and the job waits for it forever: no error, no timeout.

Two guards:

* ``python -m longreel.pipelines.portable --service_port=PORT`` starts Beam's pool with this interpreter's directory
  first on PATH, after checking that the ``python`` the pool will find imports apache_beam and longreel (exit 2 and
  a message otherwise). It then *becomes* the pool (``exec``), so its pid is the pool's.
* :func:`preflight` (``longreel curate``, before the run takes its output directory): where SDK workers are processes
  of their own, every local input and output path must be absolute (a relative one would be resolved in the
  workers' working directory: a pool started elsewhere writes the tables there). When the job runs on this
  machine (``--job_endpoint=embed``) with an EXTERNAL environment, a pool must answer at HOST:PORT within a few
  seconds; and when the ``python`` on this shell's PATH lacks apache_beam, a warning says why a pool started the
  plain way from this shell would hang. (A pool on another machine, e.g. a Flink task manager's sidecar, is seen
  from there, not from here: then nothing is checked.)
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys

from longreel.schemas.config import ConfigError

log = logging.getLogger("longreel")

POOL_MODULE = "apache_beam.runners.worker.worker_pool_main"
#: what an SDK worker must import: Beam itself, and longreel (the pipeline's DoFns are longreel classes)
WORKER_IMPORTS = "import apache_beam, longreel; print(apache_beam.__version__)"
CONNECT_TIMEOUT_S = 5.0
#: runners whose SDK workers are the launcher's own threads or child processes (same working directory)
LOCAL_RUNNERS = {"DirectRunner", "FnApiRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner"}


class PortableSetupError(ConfigError):
    """The portable runner's options point at something that cannot work (a usage error: exit 2, one line)."""


def pool_env(environ: dict | None = None) -> dict:
    """``environ`` with this interpreter's directory first on PATH: the ``python`` a worker pool starts is this one."""
    env = dict(os.environ if environ is None else environ)
    here = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([here, *[p for p in env.get("PATH", "").split(os.pathsep) if p and p != here]])
    return env


def worker_python_problem(env: dict) -> str | None:
    """Why the ``python`` on ``env``'s PATH could not run an SDK worker of this launcher, or None when it can."""
    exe = shutil.which("python", path=env.get("PATH"))
    if exe is None:
        return "no `python` on PATH"
    proc = subprocess.run([exe, "-c", WORKER_IMPORTS], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        return f"{exe} cannot import apache_beam and longreel: {last}"
    import apache_beam
    theirs = proc.stdout.strip()
    if theirs != apache_beam.__version__:
        return f"{exe} has apache_beam {theirs}, this launcher {apache_beam.__version__}"
    return None


def external_endpoint(beam_args: list[str]) -> tuple[str, int] | None:
    """``(host, port)`` of the worker pool when the job runs here (``--job_endpoint=embed``) with an EXTERNAL
    environment; None otherwise (nothing of the pool is visible from here)."""
    from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions

    opts = PipelineOptions(list(beam_args)).view_as(PortableOptions)
    if (opts.environment_type or "").upper() != "EXTERNAL" or opts.job_endpoint != "embed":
        return None
    host, sep, port = (opts.environment_config or "").rpartition(":")
    if not sep or not port.isdigit():
        raise PortableSetupError(f"--environment_config={opts.environment_config!r}: an EXTERNAL environment needs "
                                 "HOST:PORT of a worker pool")
    return host.strip("[]") or "localhost", int(port)


def workers_elsewhere(beam_args: list[str]) -> str | None:
    """The runner's name when its SDK workers are processes of their own (another working directory, maybe another
    machine); None for the local runners and the LOOPBACK environment, whose workers live in the launcher."""
    from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions, StandardOptions

    opts = PipelineOptions(list(beam_args))
    runner = opts.view_as(StandardOptions).runner
    if runner is None or runner.rsplit(".", 1)[-1] in LOCAL_RUNNERS:
        return None
    if (opts.view_as(PortableOptions).environment_type or "").upper() == "LOOPBACK":
        return None
    return runner


def relative_paths(paths: list[str]) -> list[str]:
    """The local paths among ``paths`` that are relative (URLs and absolute paths are the same on every worker)."""
    return [p for p in paths if p and "://" not in p and not os.path.isabs(p)]


def refuse_thread_workers(options) -> None:
    """A :class:`ConfigError` for Beam ``options`` with ``--direct_running_mode=multi_threading`` on a local runner
    (:data:`LOCAL_RUNNERS`, or none named). Its SDK workers are threads that flush their output on a 1-second
    timer, wherever the encoder is, and the FnApiRunner decodes each flushed chunk on its own: an element caught in
    the middle is read as garbage, and the run fails or its launcher grows without bound (tests/test_worker_flush.py
    shows it with a slow encoder).
    The forked workers (the default) and ``multi_processing`` flush between elements."""
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    runner = options.view_as(StandardOptions).runner
    local = runner is None or runner.rsplit(".", 1)[-1] in LOCAL_RUNNERS
    if local and options.view_as(DirectOptions).direct_running_mode == "multi_threading":
        raise ConfigError("--direct_running_mode=multi_threading is not supported: Beam's thread workers flush their "
                          "output on a timer and can cut an element in two, which the local runner then misreads; "
                          "use --workers N (worker processes, the default) or "
                          "--direct_running_mode=multi_processing")


def preflight(beam_args: list[str], paths: list[str] = ()) -> None:
    """Fail fast (:class:`PortableSetupError`) where a run whose workers are processes of their own would hang or
    fail late. ``paths``: the command's input and output paths (a relative one would be resolved in the workers'
    working directory, which is not this shell's). Also refuses Beam's thread workers
    (:func:`refuse_thread_workers`) before the run takes its output directory."""
    from apache_beam.options.pipeline_options import PipelineOptions

    refuse_thread_workers(PipelineOptions(list(beam_args)))
    runner = workers_elsewhere(beam_args)
    if runner is None:
        return
    relative = relative_paths(list(paths))
    if relative:
        raise PortableSetupError(f"{runner} runs SDK workers in processes of their own, which do not share this "
                                 f"shell's working directory: give absolute paths (or URLs) instead of "
                                 f"{', '.join(relative)}")
    endpoint = external_endpoint(beam_args)
    if endpoint is None:
        return
    host, port = endpoint
    start = f"start one with `{sys.executable} -m longreel.pipelines.portable --service_port={port}`"
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise PortableSetupError(f"no Beam worker pool answers at {host}:{port} ({e.strerror or e}); {start}") \
            from None
    problem = worker_python_problem(dict(os.environ))
    if problem:
        log.warning("the worker pool at %s:%d starts SDK workers as the `python` on its own PATH; from this shell "
                    "that would be one that cannot run them (%s), and the job would hang without an error. If the "
                    "pool was started that way, stop it and %s", host, port, problem, start)


def main(argv: list[str] | None = None) -> int:
    """``python -m longreel.pipelines.portable --service_port=PORT [worker_pool_main options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = pool_env()
    problem = worker_python_problem(env)
    if problem:
        print(f"longreel worker pool: {problem}; the SDK workers this pool starts would fail and the job hang",
              file=sys.stderr)
        return 2
    os.execve(sys.executable, [sys.executable, "-m", POOL_MODULE, *argv], env)
    return 0  # not reached: execve replaces this process


if __name__ == "__main__":
    sys.exit(main())
