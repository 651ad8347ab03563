"""The pipeline options ``make_pipeline`` builds (``longreel.pipelines.runner.ViewCachingOptions``) make each view
class once, and behave as Beam's views do: one option dict behind every view, values set through one seen through
the others and in the serialized options, a deep copy independent of the original, and the same job graph as plain
options."""
import copy

import apache_beam as beam
from apache_beam.options.pipeline_options import (DebugOptions, PipelineOptions, StandardOptions, TypeOptions,
                                                  WorkerOptions)

from longreel.pipelines.runner import ViewCachingOptions, make_pipeline

ARGS = ["--experiments=a", "--default_sdk_harness_log_level=WARNING", "--no_pipeline_type_check"]


def test_a_view_class_is_made_once_and_reads_the_flags():
    opts = ViewCachingOptions(ARGS)
    assert opts.view_as(TypeOptions) is opts.view_as(TypeOptions)
    assert opts.view_as(TypeOptions).pipeline_type_check is False
    assert opts.view_as(WorkerOptions).default_sdk_harness_log_level == "WARNING"
    assert opts.get_all_options() == PipelineOptions(ARGS).get_all_options()


def test_views_share_one_option_dict():
    opts = ViewCachingOptions(ARGS)
    opts.view_as(DebugOptions).add_experiment("b")
    opts.view_as(StandardOptions).streaming = True
    assert opts.view_as(DebugOptions).experiments == ["a", "b"]
    assert opts.view_as(StandardOptions).streaming is True
    assert opts.get_all_options()["streaming"] is True and opts.get_all_options()["experiments"] == ["a", "b"]


def test_a_deep_copy_is_independent_and_keeps_its_views_coherent():
    opts = ViewCachingOptions(ARGS)
    opts.view_as(StandardOptions)  # a cached view, copied along
    other = copy.deepcopy(opts)
    other.view_as(StandardOptions).streaming = True
    assert other.view_as(StandardOptions).streaming is True and other.get_all_options()["streaming"] is True
    assert opts.view_as(StandardOptions).streaming is False and opts.get_all_options()["streaming"] is False


def _graph(options) -> list:
    with beam.Pipeline(options=options) as p:
        (p | beam.Create([1, 2, 3]) | beam.Map(lambda x: (x % 2, x)) | beam.GroupByKey()
         | beam.MapTuple(lambda k, vs: (k, sorted(vs))))
        proto = p.to_runner_api()
    return sorted((t.unique_name, t.spec.urn, tuple(sorted(t.outputs))) for t in proto.components.transforms.values())


def test_the_same_graph_as_plain_options():
    plain = PipelineOptions(["--runner=FnApiRunner"] + ARGS[:2])
    cached = ViewCachingOptions(["--runner=FnApiRunner"] + ARGS[:2])
    assert _graph(plain) == _graph(cached)


def test_make_pipeline_uses_it():
    p = make_pipeline([], workers=1)
    assert isinstance(p.options, ViewCachingOptions)
    assert p.options.view_as(TypeOptions) is p.options.view_as(TypeOptions)
