"""Local SDK workers forked from a zygote: ``longreel curate --workers N`` without N interpreters importing alike.

Beam's local multi-process mode (``--direct_running_mode=multi_processing``) starts every SDK worker as a new
``python -m apache_beam.runners.worker.sdk_worker_main``. Each one then imports Beam, and, when it unpickles the
first DoFns of the caption stage, ``apache_beam.ml.inference.base`` (which pulls in torch and scipy) and what
the frame cache needs: about 6-7 s of CPU per worker on this 2-core machine when that was still the transformers
video processor (``python -X importtime``: caption stage 3.6 s, video processor +3 s, Beam 1.2 s; torch alone
since :mod:`longreel.pipelines.media.qwen_vl_frames`), which the in-process 1-worker run pays once. With two
workers that start-up came on top of the launcher's own, before any video was decoded
(benchmarks/results/scale.json).

Here the workers speak the same portable Fn API, through Beam's ``EXTERNAL`` environment (the worker-pool
protocol that Flink, Spark and Dataflow Runner v2 use), but the pool forks them from a *zygote*: one fresh
interpreter, started when the pipeline object is made (by `longreel curate` before it imports Beam: see
:mod:`longreel.pipelines.zygote`), that imports the modules the run will need while the
launcher is still building the graph (the stage modules the caller names, then every ``longreel`` module and
model library the launcher imported by the time the run starts), and then forks one child per ``StartWorker``
that runs :class:`~apache_beam.runners.worker.sdk_worker.SdkHarness` against the runner's control endpoint.
The zygote is a new process, not a fork of the launcher: a process that has used gRPC (an earlier run in the
same process, as in a test session) cannot be forked safely, and the zygote itself never opens a channel.
The launcher sends it requests on its stdin; the pool's gRPC service runs in the launcher.

Only where ``os.fork`` exists (Linux, macOS); elsewhere, or when the user names a ``--direct_running_mode``,
Beam's own local modes are used (see :func:`longreel.pipelines.runner.make_pipeline`).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.runners.portability.fn_api_runner.fn_runner import BundleManager
from apache_beam.transforms.environments import ExternalEnvironment, python_sdk_capabilities

from longreel.pipelines import zygote
from longreel.pipelines.resources import MODEL_STEPS
from longreel.pipelines.zygote import fork_available  # noqa: F401 - where callers have found it

log = logging.getLogger("longreel")

#: top-level packages whose modules, imported by the launcher when the run starts, the zygote imports too
PRELOAD_ROOTS = ("longreel", "apache_beam", "transformers", "torch", "av", "pyarrow", "numpy", "PIL", "scipy")


#: the steps where a stage's elements are worth spreading over the workers: the read side of Beam's ``Reshuffle``,
#: the claim step of :class:`~longreel.pipelines.cost_shares.SpreadByCost`, and the stages' model steps
SPREAD_STEPS = ("RemoveRandomKeys", "ClaimOnce") + MODEL_STEPS


class ForkedWorkersRunner(FnApiRunner):
    """The FnApiRunner with its SDK workers in a :class:`ForkedWorkerPool`, started when the run starts (after the
    pipeline is built, so with its modules imported) and stopped when it ends. The number of workers is the
    pipeline's ``direct_num_workers``.

    A stage that holds a step named in ``spread_steps`` (a read of elements the pipeline spread out before expensive
    work, or a model step; a name is matched against each part of the step's path) has each bundle split over all
    workers, as in Beam's multi-process mode; every other
    stage runs its bundle whole on one worker (the workers take turns). Splitting costs each bundle one exchange
    with every worker, and a run has dozens of small stages (counts, flattens, the table writer's steps: 10-30 ms
    each): all of them split over two workers, the 14-video demo's stages besides the decode took 2.87 s, against
    2.13 s in a 1-worker run."""

    def __init__(self, preload: tuple[str, ...] = (), spread_steps: tuple[str, ...] = SPREAD_STEPS):
        super().__init__()
        self.preload = tuple(preload)
        self.spread_steps = frozenset(spread_steps)
        self.pool: ForkedWorkerPool | None = None
        self._launcher_modules_sent = False
        #: set when the run asks for its first worker: the graph is translated, and from then on this process
        #: mostly waits on the workers (a caller's background work no longer delays the first bundle)
        self.workers_started = threading.Event()

    def start_zygote(self) -> None:
        """Start the zygote now (its imports overlap what the caller does before the run); idempotent."""
        if self.pool is None:
            self.pool = ForkedWorkerPool(self.preload, started=self.workers_started)
            self.pool.start()

    def preload_launcher_modules(self) -> None:
        """Have the zygote import what this process has imported so far (:func:`launcher_modules`) now rather than
        when the run starts: for a caller about to import what the workers do not need (the card's libraries, in a
        thread, while the run goes), which the zygote would otherwise import too, on the path to the first bundle.
        Once per run."""
        if not self._launcher_modules_sent:
            self.start_zygote()
            self.pool.preload(launcher_modules())
            self._launcher_modules_sent = True

    def splits(self, stage) -> bool:
        """Whether ``stage`` (a fused stage of the runner's plan) has its bundles split over the workers."""
        return any(not self.spread_steps.isdisjoint(t.unique_name.split("/")) for t in stage.transforms)

    def _get_bundle_manager(self, bundle_context_manager):
        # Beam's choice between its one-worker and split bundle managers, made per stage (see the class docstring)
        if self.splits(bundle_context_manager.stage):
            return super()._get_bundle_manager(bundle_context_manager)
        return BundleManager(bundle_context_manager, self._progress_frequency,
                             cache_token_generator=FnApiRunner.get_cache_token_generator(static=False))

    def run_pipeline(self, pipeline, options):
        quiet = _DropModeWarning()
        fn_log = logging.getLogger(FnApiRunner.__module__)
        fn_log.addFilter(quiet)
        self.start_zygote()
        pool, self.pool = self.pool, None
        sent, self._launcher_modules_sent = self._launcher_modules_sent, False
        try:
            with pool:
                if not sent:
                    pool.preload(launcher_modules())
                self._default_environment = ExternalEnvironment(pool.endpoint, capabilities=python_sdk_capabilities())
                return super().run_pipeline(pipeline, options)
        finally:
            fn_log.removeFilter(quiet)


def launcher_modules() -> list[str]:
    """The modules of :data:`PRELOAD_ROOTS` this process has imported (what the pipeline's code needed so far)."""
    return sorted(n for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in PRELOAD_ROOTS
                  and not n.split(".")[-1].startswith("_"))


class _DropModeWarning(logging.Filter):
    """The FnApiRunner warns that several workers want Beam's multi-process or multi-thread mode: it cannot tell
    that the ``EXTERNAL`` environment it is given runs them in processes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("If direct_num_workers is not equal to 1")


class ForkedWorkerPool:
    """A ``BeamFnExternalWorkerPool`` service at :attr:`endpoint` whose workers are forked from a zygote process.

    Use as a context manager around the run; on exit the zygote is told to stop (EOF on its stdin), waits for its
    workers (which end when the runner closes their control channel) and exits."""

    def __init__(self, preload: tuple[str, ...] = (), stop_timeout_s: float = 60.0,
                 started: threading.Event | None = None):
        self._preload = tuple(preload)
        self.stop_timeout_s = stop_timeout_s
        self.started = started if started is not None else threading.Event()  # set by the first StartWorker
        self.endpoint: str | None = None
        self._zygote: subprocess.Popen | None = None
        self._server = None
        self._handlers_before: dict[int, object] = {}

    def __enter__(self) -> "ForkedWorkerPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> str:
        if self._zygote is None:
            self._zygote = zygote.take() or zygote.spawn()  # the CLI may have started it before its imports
            # the workers log as the launcher does (they write to the same stderr)
            self._send({"log_level": logging.getLogger("longreel").getEffectiveLevel()})
            if self._preload:
                self.preload(self._preload)
            self._forward_ctrl_c()
        if self._server is None:
            self.endpoint = self._serve()
        return self.endpoint

    def preload(self, modules) -> None:
        """Have the zygote import ``modules`` before it forks any worker."""
        self._send({"import": list(modules)})

    def _serve(self) -> str:
        from concurrent import futures

        import grpc
        from apache_beam.portability.api import beam_fn_api_pb2, beam_fn_api_pb2_grpc

        pool = self

        class Servicer(beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolServicer):
            def StartWorker(self, request, context):
                try:
                    pool._send({"worker_id": request.worker_id, "control": request.control_endpoint.url})
                except OSError as e:
                    return beam_fn_api_pb2.StartWorkerResponse(error=f"worker pool: {e}")
                pool.started.set()
                return beam_fn_api_pb2.StartWorkerResponse()

            def StopWorker(self, request, context):
                # a worker stops by itself when the runner closes its control channel
                return beam_fn_api_pb2.StopWorkerResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(Servicer(), self._server)
        port = self._server.add_insecure_port("localhost:0")
        self._server.start()
        return f"localhost:{port}"

    def _forward_ctrl_c(self) -> None:
        """Pass a SIGINT or SIGTERM this process gets on to the zygote as SIGINT (which it passes to its workers: all
        end quietly), then handle it as before. Ctrl-C in a terminal signals the whole process group, but ``kill``
        of the launcher's pid (a supervisor, ``timeout``, a job scheduler) reached only the launcher: its runner
        closed the workers' connections under them, and each printed Beam's traceback of the bundle it lost. Only
        in the main thread, where Python runs signal handlers, and only over a Python handler (a signal the caller
        left to its default or chose to ignore is left alone)."""
        if threading.current_thread() is not threading.main_thread():
            return
        pid = self._zygote.pid
        for signum in (signal.SIGINT, signal.SIGTERM):
            before = signal.getsignal(signum)
            if not callable(before):
                continue

            def forward(signum, frame, before=before) -> None:
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:  # the zygote has ended
                    pass
                before(signum, frame)

            signal.signal(signum, forward)
            self._handlers_before[signum] = before

    def _restore_ctrl_c(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, before in self._handlers_before.items():
                signal.signal(signum, before)
        self._handlers_before = {}

    def _send(self, req: dict) -> None:
        self._zygote.stdin.write((json.dumps(req) + "\n").encode())
        self._zygote.stdin.flush()

    def close(self) -> None:
        self._restore_ctrl_c()
        if self._server is not None:
            self._server.stop(None)
            self._server = None
        if self._zygote is None:
            return
        zygote, self._zygote = self._zygote, None
        try:
            zygote.stdin.close()  # EOF: the zygote starts no more workers and waits for those it started
        except OSError:
            pass
        try:
            zygote.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("local workers did not stop within %.0f s of the run's end; stopping them",
                        self.stop_timeout_s)
            zygote.terminate()  # the zygote kills its workers
            zygote.wait()


def _zygote() -> None:
    """Read requests from stdin: ``{"import": [...]}`` imports modules, ``{"worker_id", "control"}`` forks a worker;
    at EOF wait for the workers, then exit.

    The garbage collector is off in the zygote (:mod:`~longreel.pipelines.zygote_main` turns it off before its
    first import), and what the zygote holds is frozen (``gc.freeze``) before each fork. The zygote's imports make
    hundreds of thousands of objects and almost no garbage: with the collector on they took about 0.4 s longer
    (2.15 -> 1.74 s, median of 4 each: the workers' imports in a fresh interpreter). Each worker inherits those objects,
    about 358,000, and a full collection scans every one: each took 140-210 ms, and the runner waited for the worker
    while it ran (two of the four in a 14-video, 2-worker run stalled the last stages, where every other bundle takes
    10-30 ms). Frozen, they are out of every collection of the worker, which still collects what it makes itself
    (:func:`_run_worker` turns the collector back on), and their memory pages are no longer written by the
    collector, so they stay shared between the workers."""
    import gc
    import importlib

    children: list[int] = []

    def stop(*_):
        for c in children:
            try:
                os.kill(c, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    on_ctrl_c = signal.getsignal(signal.SIGINT)  # zygote_main's: end quietly

    def interrupted(signum, frame) -> None:
        # the launcher passes on a SIGINT that reached it alone (see ForkedWorkerPool._forward_ctrl_c)
        for c in children:
            try:
                os.kill(c, signal.SIGINT)
            except OSError:
                pass
        if callable(on_ctrl_c):
            on_ctrl_c(signum, frame)

    signal.signal(signal.SIGINT, interrupted)
    code = 0
    try:
        import apache_beam.runners.worker.sdk_worker  # noqa: F401 - what every worker needs
        for line in sys.stdin.buffer:
            req = json.loads(line)
            if "log_level" in req:
                # force: importing Beam above may have logged through the root logger, which then got Python's
                # default handler, and the workers' lines would not look like the launcher's
                logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                                    datefmt="%H:%M:%S", force=True)
                logging.getLogger("longreel").setLevel(req["log_level"])
                continue
            if "import" in req:
                for name in req["import"]:
                    if name.startswith("apache_beam.ml"):  # Beam's RunInference without torch (see beam_ml)
                        name = "longreel.pipelines.inference.beam_ml"
                    try:
                        importlib.import_module(name)
                    except Exception:  # noqa: BLE001 - a module that does not import alone is left to the worker
                        pass
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, on_ctrl_c)
                _run_worker(req)
            children.append(pid)
        for c in children:
            os.waitpid(c, 0)
    except BaseException:  # noqa: BLE001 - report, then exit
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_worker(req: dict) -> None:
    """The SDK harness of one worker, as Beam's worker processes run it; exits the process when the runner closes
    the control channel.

    Its output is flushed by size only, between elements (``data_buffer_time_limit_ms=0``, the default of Beam's
    ``sdk_worker_main``). The time-based buffer that Beam's in-process gRPC workers use flushes from a timer thread
    wherever the encoder is, and the FnApiRunner decodes each chunk on its own: an element cut in two is read as
    garbage (a garbled length once made a 2-worker curate's launcher grow to 23 GB; tests/test_worker_flush.py)."""
    import gc

    gc.enable()  # off in the zygote, which froze what it holds (see _zygote)
    code = 0
    try:
        sys.stdin.close()
        from apache_beam.runners.portability.fn_api_runner.worker_handlers import (
            FNAPI_RUNNER_CAPABILITIES, STATE_CACHE_SIZE_MB)
        from apache_beam.runners.worker import sdk_worker

        # the runner is in the parent process: connect over loopback whatever host name it put in the address
        control = "localhost:" + req["control"].rsplit(":", 1)[1]
        sdk_worker.SdkHarness(control, worker_id=req["worker_id"], state_cache_size=STATE_CACHE_SIZE_MB << 20,
                              data_buffer_time_limit_ms=0, runner_capabilities=FNAPI_RUNNER_CAPABILITIES).run()
    except BaseException:  # noqa: BLE001 - the worker's process ends here whatever happened
        traceback.print_exc()
        code = 1
    finally:
        from longreel.pipelines.tmp_dirs import remove_made_here

        remove_made_here()  # what a stage's teardown did not get to (the runner gone first)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

