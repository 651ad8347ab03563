"""The forked local workers split a stage's bundle over all of them only where the work is worth spreading.

A stage that reads a ``Reshuffle`` (or the claim step of ``SpreadByCost``) or holds a model step runs on every worker;
any other stage runs whole on one worker, so dozens of small stages do not each pay an exchange with every worker
(``longreel.pipelines.forked_workers.ForkedWorkersRunner``)."""
import json
import os
from types import SimpleNamespace

import apache_beam as beam

from longreel.pipelines.forked_workers import SPREAD_STEPS, ForkedWorkersRunner
from longreel.pipelines.runner import make_pipeline


def _stage(*names):
    return SimpleNamespace(transforms=[SimpleNamespace(unique_name=n) for n in names])


def test_only_stages_with_spread_elements_or_a_model_step_are_split():
    runner = ForkedWorkersRunner()
    assert runner.splits(_stage("Ingest/Reshuffle/ReshufflePerKey/GroupByKey/Read", "Ingest/Reshuffle/RemoveRandomKeys",
                                "Ingest/HashAndProbe/ParDo(ProbeVideo)"))
    assert runner.splits(_stage("CaptionClips/SpreadTasks/ByShare/Read", "CaptionClips/SpreadTasks/ClaimOnce",
                                "CaptionClips/DecodeAndMeasure/ParDo(DecodeClipFrames)"))
    # the write side of a Reshuffle, a grouping, counts: one worker
    assert not runner.splits(_stage("Inputs/Resolve", "Ingest/Reshuffle/AddRandomKeys"))
    assert not runner.splits(_stage("QRA/GroupByVideo/CoGroupByKeyImpl/GroupByKey/Read", "QRABalance/Permute"))
    assert not runner.splits(_stage("IngestFlatten/Read", "AllCounts/Write/0"))
    # the model steps: each stage's expensive part, wherever its input came from
    assert runner.splits(_stage("QRA/GroupByVideo/CoGroupByKeyImpl/GroupByKey/Read",
                                "QRA/WriteQRAs/ParDo(_QRAVideoFn)"))
    assert runner.splits(_stage("Filter/Answer/BeamML_RunInference/BeamML_RunInference"))
    # a step merely named like one is not one: whole path parts are matched
    assert not runner.splits(_stage("RemoveRandomKeysReport/Map", "Captions/Answers"))
    assert ForkedWorkersRunner(spread_steps=("Mine",)).splits(_stage("A/Mine/ParDo(F)"))
    assert not ForkedWorkersRunner(spread_steps=("Mine",)).splits(_stage("Ingest/Reshuffle/RemoveRandomKeys"))


def test_every_model_step_is_named_in_model_steps():
    """The stages apply their model steps as ``"Label" >> on_model_step(...)``: each label must be one the runner
    knows, or that stage would run on one local worker."""
    import re
    from pathlib import Path

    import longreel.pipelines.stages as stages
    from longreel.pipelines.resources import MODEL_STEPS

    found = set()
    for f in Path(stages.__path__[0]).glob("*.py"):
        found |= set(re.findall(r'"(\w+)" >> on_model_step\(', f.read_text()))
    assert found == set(MODEL_STEPS)


class _RecordPid(beam.DoFn):
    def __init__(self, out: str, tag: str):
        self.out, self.tag = out, tag

    def process(self, x):
        with open(os.path.join(self.out, f"{self.tag}-{os.getpid()}-{x[0] if isinstance(x, tuple) else x}"), "w"):
            pass
        yield x


def _pids(tmp_path, tag):
    return {f.name.split("-")[1] for f in tmp_path.glob(f"{tag}-*")}


def test_a_grouping_runs_on_one_worker_and_a_reshuffle_on_both(tmp_path):
    p = make_pipeline([], workers=2)
    pairs = p | beam.Create([(k, k) for k in range(16)], reshuffle=False)
    _ = pairs | "Group" >> beam.GroupByKey() | "AfterGroup" >> beam.ParDo(_RecordPid(str(tmp_path), "group"))
    _ = pairs | beam.Reshuffle() | "AfterReshuffle" >> beam.ParDo(_RecordPid(str(tmp_path), "spread"))
    p.run().wait_until_finish()
    assert len(list(tmp_path.glob("group-*"))) == 16 and len(list(tmp_path.glob("spread-*"))) == 16
    assert os.getpid() not in {int(x) for x in _pids(tmp_path, "group") | _pids(tmp_path, "spread")}
    # 16 groups would be split 8 and 8 over two workers by Beam's parallel bundle manager
    assert len(_pids(tmp_path, "group")) == 1, json.dumps(sorted(f.name for f in tmp_path.iterdir()))
    assert len(_pids(tmp_path, "spread")) == 2, json.dumps(sorted(f.name for f in tmp_path.iterdir()))
