"""Pipeline options: standard Beam options pass through; the local default runner is pinned.

Beam's DirectRunner first tries to download the Prism runner binary, which fails offline and
costs time; when the user names no runner, the in-process FnApiRunner is used instead. Any
``--runner`` the user gives (DataflowRunner, FlinkRunner, SparkRunner, DirectRunner with
``--direct_running_mode=multi_processing``...) is used unchanged, with all its options.
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions


def make_pipeline(beam_args: list[str] | None = None) -> beam.Pipeline:
    options = PipelineOptions(list(beam_args or []))
    if options.view_as(StandardOptions).runner is None:
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner
        return beam.Pipeline(runner=FnApiRunner(), options=options)
    return beam.Pipeline(options=options)

