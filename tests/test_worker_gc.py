"""The forked local workers collect garbage without scanning what they inherited from the zygote.

The zygote imports with the collector off and freezes what it holds before each fork (``gc.freeze``); a worker
turns the collector back on. A full collection in a worker that scanned the inherited objects (about 358,000 in a
curate run) took 140-210 ms and stalled the runner (see ``longreel.pipelines.forked_workers._zygote``)."""
import gc
import json
import os

import apache_beam as beam

from longreel.pipelines.runner import make_pipeline


class _ReportGC(beam.DoFn):
    """Writes the worker's collector state to ``<out>/<pid>.json``."""

    def __init__(self, out: str):
        self.out = out

    def process(self, _):
        state = {"pid": os.getpid(), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                 "scanned": len(gc.get_objects())}  # what a full collection scans: the permanent generation is not
        with open(os.path.join(self.out, f"{os.getpid()}.json"), "w") as fh:
            json.dump(state, fh)
        yield state["pid"]


def test_a_forked_worker_collects_but_not_what_the_zygote_froze(tmp_path):
    p = make_pipeline([], workers=2)
    _ = p | beam.Create(range(8)) | beam.Reshuffle() | beam.ParDo(_ReportGC(str(tmp_path)))
    p.run().wait_until_finish()
    states = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
    assert states
    for s in states:
        assert s["pid"] != os.getpid()  # ran in a forked worker
        assert s["enabled"], s
        # Beam, the SDK harness and their dependencies were frozen in the zygote; the worker's own objects since are
        # far fewer
        assert s["frozen"] > 100_000 and s["scanned"] < s["frozen"] / 4, s
