"""Decode tasks dealt out to a local run's workers by estimated cost (pipelines/cost_shares.py)."""
import itertools
import json
import os
import random
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.util import assert_that, equal_to

from longreel.pipelines.cost_shares import ClaimOnce, SpreadByCost, _deal, lpt_shares
from longreel.pipelines.stages.caption import TASK_OVERHEAD_PX, DecodeTask, decode_cost, task_order


def test_lpt_puts_each_item_on_the_least_loaded_share_longest_first():
    # 5 -> A; 4 -> B; 3 -> B (4 < 5); 3 -> A (5 < 7); 3 -> B (7 < 8)
    assert lpt_shares([5, 4, 3, 3, 3], 2) == [0, 1, 1, 0, 1]
    assert lpt_shares([], 3) == []
    assert lpt_shares([1.0, 2.0], 1) == [0, 0]
    with pytest.raises(ValueError):
        lpt_shares([1.0], 0)


def test_lpt_stays_within_four_thirds_of_the_best_split():
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.choice((rng.uniform(0, 1), rng.uniform(0, 30))) for _ in range(rng.randint(1, 10))]
        got = lpt_shares(costs, 2)
        makespan = max(sum(c for c, s in zip(costs, got) if s == k) for k in range(2))
        best = min(max(sum(c for c, s in zip(costs, pick) if s == k) for k in range(2))
                   for pick in itertools.product((0, 1), repeat=len(costs)))
        assert makespan <= 4 / 3 * best + 1e-9
        assert lpt_shares(costs, 2) == got  # a function of the costs alone


class _RecordBundle(beam.DoFn):
    """Writes the elements of each bundle it runs to a file of its own."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def start_bundle(self):
        self.seen = []

    def process(self, x):
        self.seen.append(x)
        yield x

    def finish_bundle(self):
        if self.seen:
            path = os.path.join(self.out_dir, f"{os.getpid()}-{id(self)}-{len(os.listdir(self.out_dir))}.json")
            with open(path, "w") as fh:
                json.dump(sorted(self.seen), fh)


def _bundles(tmp_path, costs, workers, slow=False):
    out = tmp_path / "bundles"
    out.mkdir()
    options = PipelineOptions(["--direct_num_workers", str(workers), "--direct_running_mode", "multi_threading"])
    with beam.Pipeline(runner=FnApiRunner(), options=options) as p:
        spread = p | beam.Create(costs) | SpreadByCost(workers, cost=float, order=lambda x: x)
        if slow:
            spread = spread | beam.ParDo(_SlowShort())
        got = spread | beam.ParDo(_RecordBundle(str(out)))
        assert_that(got, equal_to(costs))  # every element once, unchanged
    return sorted(json.load(open(out / n)) for n in os.listdir(out))


def test_each_worker_starts_on_its_own_share_then_takes_the_others_tail():
    # one long task and seven short ones: dealt by count (a Reshuffle), each worker would get four
    costs = [100, 1, 2, 3, 4, 5, 6, 7]
    deal = list(_deal((None, costs), 2, float, lambda x: x))
    lists = {s: [x for k, (_, x) in deal if k == s] for s in (0, 1)}
    assert lists[0] == [100, 1, 2, 3, 4, 5, 6, 7]  # its share, then the other's smallest first
    assert lists[1] == [7, 6, 5, 4, 3, 2, 1, 100]  # its share, largest first, then the other's
    # one index per element, the same under every share
    assert sorted({i for _, (i, _) in deal}) == list(range(8))
    assert {(i, x) for k, (i, x) in deal if k == 0} == {(i, x) for k, (i, x) in deal if k == 1}


def test_an_element_runs_once_whichever_worker_claims_it(tmp_path):
    a, b = ClaimOnce(str(tmp_path)), ClaimOnce(str(tmp_path))
    assert list(a.process((3, "x"))) == ["x"]
    assert list(b.process((3, "x"))) == []
    assert list(a.process((3, "x"))) == []
    assert list(b.process((4, "y"))) == ["y"]


class _SlowShort(beam.DoFn):
    """The estimates are wrong: the 'long' element is instant, each short one takes 0.3 s."""

    def process(self, x):
        if x != 100:
            time.sleep(0.3)
        yield x


def test_a_worker_done_with_its_share_takes_the_others_unstarted_elements(tmp_path):
    costs = [100, 1, 2, 3, 4, 5, 6, 7]
    bundles = _bundles(tmp_path, costs, workers=2, slow=True)
    assert sorted(x for b in bundles for x in b) == sorted(costs)  # every element once
    with_long = next(b for b in bundles if 100 in b)
    # without taking work, the worker with the mis-estimated long task would have run it alone
    assert len(with_long) > 1, bundles


def test_one_worker_gets_everything(tmp_path):
    assert _bundles(tmp_path, [3, 1, 2], workers=1) == [[1, 2, 3]]


def _video(vid="v", w=1280, h=720, duration=600.0, n_frames=15000):
    return {"video_id": vid, "width": w, "height": h, "duration_s": duration, "n_frames": n_frames}


def _clip(i, start, end):
    return {"index": i, "clip_id": f"c{i}", "start_frame": start, "end_frame": end, "start_s": start / 25,
            "end_s": end / 25}


def test_a_decode_task_costs_its_source_frames_times_their_size():
    long_chunk = DecodeTask(_video(), [_clip(0, 0, 250), _clip(1, 250, 500)])
    assert decode_cost(long_chunk) == TASK_OVERHEAD_PX + 500 * 1280 * 720
    small = DecodeTask(_video("s", 320, 240, 10.0, 250), [_clip(0, 0, 250)])
    assert decode_cost(small) < decode_cost(long_chunk) / 3
    # without frame numbers the clip's seconds at the video's rate stand in
    no_frames = DecodeTask(_video(), [{"index": 0, "start_s": 0.0, "end_s": 20.0}])
    assert decode_cost(no_frames) == TASK_OVERHEAD_PX + 500 * 1280 * 720
    # a task that only builds the frame cache: its sparse frames, two seconds of decoding each, at most the video
    cache_only = DecodeTask(_video(), [], cache=True)
    assert decode_cost(cache_only, sparse_frames=16) == TASK_OVERHEAD_PX + 16 * 2 * 25 * 1280 * 720
    assert decode_cost(DecodeTask(_video(n_frames=10, duration=0.4), [], cache=True), 16) == \
        TASK_OVERHEAD_PX + 10 * 1280 * 720
    # a probe that found no size or rate still gets a cost (its overhead), never an error
    assert decode_cost(DecodeTask({"video_id": "x"}, [], cache=True), 16) == TASK_OVERHEAD_PX


def test_decode_tasks_sort_the_same_way_on_every_run():
    tasks = [DecodeTask(_video("b"), [_clip(3, 0, 1)]), DecodeTask(_video("a"), [], cache=True),
             DecodeTask(_video("a"), [_clip(0, 0, 1)])]
    assert [task_order(t) for t in sorted(tasks, key=task_order)] == [("a", -1, True), ("a", 0, False),
                                                                      ("b", 3, False)]
