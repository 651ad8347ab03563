"""Pipeline options: standard Beam options pass through; the local default runner is pinned.

Beam's DirectRunner first tries to download the Prism runner binary, which fails offline and
costs time; when the user names no runner, Beam's FnApiRunner is used instead: in this process for
one worker, or with ``workers`` SDK worker processes (a stage that reads spread elements has its bundles split over
all of them at once; the others run on one of them).
Those processes are forked from the launcher once the pipeline is built (:mod:`longreel.pipelines.forked_workers`:
they start with every module imported, where Beam's own ``multi_processing`` mode starts fresh interpreters that
each import Beam, torch and transformers again); a ``--direct_running_mode`` given by the user selects Beam's own
local modes instead. Any ``--runner`` the user gives (DataflowRunner, FlinkRunner, SparkRunner, DirectRunner...)
is used unchanged, with all its options.
"""
from __future__ import annotations

import logging

import apache_beam as beam
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions, WorkerOptions

from longreel.pipelines.portable import refuse_thread_workers
from longreel.pipelines.tmp_dirs import sweep_stale
from longreel.pipelines.zygote import default_workers  # noqa: F401 - where callers have found it

log = logging.getLogger("longreel")


class ViewCachingOptions(PipelineOptions):
    """Beam's pipeline options, with each :meth:`view_as` class made once per options object.

    Beam asks the pipeline's options for a view at every ``apply`` and at each type-hint check (``view_as
    (TypeOptions)``: about 1,000 times while the curate graph is built), and each view parses the command line
    again with a new argparse parser of that class's options: about a third of the graph's build time here
    (cProfile: 1,001 parsers, 11,683 ``add_argument`` calls). A view holds no values of its own: every view of an
    options object reads and writes that object's one option dict (Beam's documented contract for views), so the
    same view object serves each later call. The cache lives in the instance's ``__dict__`` (Beam's
    ``__setattr__`` only takes option names), and a deep copy (``beam.Pipeline`` copies its options) copies it
    along with the option dict the views share."""

    def view_as(self, cls):
        views = self.__dict__.setdefault("_views", {})
        view = views.get(cls)
        if view is None:
            view = views[cls] = super().view_as(cls)
        return view


def names_runner(beam_args: list[str] | None) -> bool:
    """Whether the Beam arguments pick a runner (then its options, not ``--workers``, decide the parallelism)."""
    return PipelineOptions(list(beam_args or [])).view_as(StandardOptions).runner is not None


def runner_options_error(beam_args: list[str] | None) -> str | None:
    """Why the runner the Beam arguments name cannot take them, or None (no runner named, or it can).

    Beam checks a runner's options (Dataflow's project, region, GCS paths) only when the pipeline object is made,
    after the command has claimed and started writing its output directory: ``--project P`` from an example became
    an internal-error traceback (exit 1), and the corrected command was then refused for the unfinished run it left.
    The same checks run here first, so that such a mistake is a usage error with nothing written."""
    options = PipelineOptions(list(beam_args or []))
    name = options.view_as(StandardOptions).runner
    if name is None:
        return None
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator
    from apache_beam.runners import create_runner

    try:
        runner = create_runner(name)
    except ImportError as e:
        hint = " (install longreel's gcp extra: pip install 'longreel[gcp]')" if "dataflow" in name.lower() else ""
        return f"--runner {name}: {str(e).splitlines()[0]}{hint}"
    except ValueError as e:
        return f"--runner {name}: {str(e).splitlines()[0]}"
    errors = [e.strip() for e in PipelineOptionsValidator(options, runner).validate() if e.strip()]
    return f"--runner {name}: " + "; ".join(errors) if errors else None


def make_pipeline(beam_args: list[str] | None = None, workers: int = 1, preload: tuple[str, ...] = (),
                  in_process: bool = True) -> beam.Pipeline:
    """A pipeline on the user's ``--runner``, or on the local FnApiRunner with ``workers`` processes.

    ``preload``: modules the workers will import (the stages'), imported once by the local workers' zygote while
    the caller builds the graph (see :mod:`longreel.pipelines.forked_workers`).
    ``in_process``: with one worker, run it in this process (the default: what the caller patched or handed in
    in-process reaches it as is); ``False`` forks that one worker from the zygote too, so that its imports (torch,
    the video processor: seconds) overlap the caller's graph build instead of following it."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    sweep_stale()  # the scratch directories that runs which did not end normally left on this machine
    options = ViewCachingOptions(list(beam_args or []))
    refuse_thread_workers(options)
    if options.view_as(StandardOptions).runner is not None:
        if workers > 1:
            log.info("--runner given: the local worker count (%d) does not apply; the runner's options decide",
                     workers)
        return beam.Pipeline(options=options)
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from longreel.pipelines.forked_workers import ForkedWorkersRunner, fork_available
    beam_mode = "direct_running_mode" in options.get_all_options(drop_default=True) or not fork_available()
    if workers == 1 and (in_process or beam_mode):
        return beam.Pipeline(runner=FnApiRunner(), options=options)
    direct = options.view_as(DirectOptions)
    direct.direct_num_workers = workers
    if beam_mode:
        if direct.direct_running_mode == "in_memory":
            direct.direct_running_mode = "multi_processing"
        return beam.Pipeline(runner=FnApiRunner(provision_info=_worker_provision(options)), options=options)
    runner = ForkedWorkersRunner(preload)
    runner.start_zygote()
    return beam.Pipeline(runner=runner, options=options)


def _worker_provision(options: PipelineOptions):
    """What the local runner tells its worker processes (it tells them no pipeline options by default): the log
    level, the user's or else the launcher's, so that ``-q`` also quiets the workers' start-up and shutdown lines.
    (Beam's import-time warnings in a worker come before any option and still show.)
    Only the logging options: the workers parse what they get as command-line options, numbers come as floats."""
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.job.utils import dict_to_struct
    from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo

    harness = options.view_as(WorkerOptions)
    sent = {"default_sdk_harness_log_level": (harness.default_sdk_harness_log_level
                                              or logging.getLevelName(log.getEffectiveLevel())),
            # Beam's harness reports each connection at INFO, and its main module warns on every start that the
            # local runner keeps no state between runs: longreel's own lines are what a user of the CLI reads
            "sdk_harness_log_level_overrides": (harness.sdk_harness_log_level_overrides
                                                or {"apache_beam": "WARNING", "__main__": "ERROR"})}
    return ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(
        retrieval_token="unused-retrieval-token", pipeline_options=dict_to_struct(sent)))
