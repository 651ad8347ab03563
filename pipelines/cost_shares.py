"""Dealing expensive elements to a local runner's workers by their estimated cost, not by their count.

Beam's local runner (the FnApiRunner, with our forked workers or its own multi-process mode) runs each stage as
one bundle per worker: it cuts a stage's input into ``workers`` fixed parts and waits for the slowest. After a
``Reshuffle`` the parts come from random keys dealt round-robin, so each worker gets the same *number* of decode
tasks, however long each one is: on the 4x shared corpus one worker decoded for 36.9 s while the other finished
its half after 34.3 s and sat idle (a 2-worker timeline of ``benchmarks/scale.py``'s corpus).

:class:`SpreadByCost` gathers the elements, deals them into ``workers`` shares by longest-processing-time-first
(:func:`lpt_shares`) and groups them under one key per share. The runner's grouping buffer hands each key to one
part, so each worker starts on one share of about equal estimated cost.

Estimates miss, though: the pixel count of :func:`~longreel.pipelines.stages.caption.decode_cost` priced the 14
sample videos' small tasks at half their time against Big Buck Bunny's chunks, and the two workers' equal shares
ended 0.63-0.75 s apart. So each worker's list also holds the other shares' elements, after its own (its own
largest first, the others' smallest first: the end of the other worker's list), and a worker runs an element only
if it claims it first: an empty file created with ``O_EXCL`` in a directory the launcher made (:class:`ClaimOnce`).
A worker that is done with its share takes what the others have not started. Every element runs once, on whichever
worker claimed it (14 videos, 2 workers, 5 alternating pairs: median 14.56 -> 14.23 s). This needs the workers on
the launcher's machine, as every local runner has them; a worker that died after claiming fails the run, as any
worker's death does on a local runner.

A runner we did not start (Dataflow, Flink) splits work its own way and needs a plain ``Reshuffle``: gathering
everything under one key there would make one hot key.

The elements and their meaning are unchanged: only which worker runs them, so outputs stay byte-identical.
"""
from __future__ import annotations

import heapq
import os
import shutil
import weakref
from typing import Any, Callable, Sequence

import apache_beam as beam
from longreel.pipelines.tmp_dirs import make_tmpdir


def lpt_shares(costs: Sequence[float], shares: int) -> list[int]:
    """Longest-processing-time-first: the share (``0..shares-1``) of each item.

    ``costs``: (N,) non-negative estimates -> (N,) share indices. Items go in decreasing cost (ties: the lower
    index first) to the share with the least cost so far (ties: the lower share), so the result depends only on
    ``costs``. The largest share is within 4/3 of the best possible (Graham, 1969), which is why a plain greedy
    deal is enough here: the estimates themselves are rougher than that."""
    if shares < 1:
        raise ValueError("shares must be >= 1")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, s) for s in range(shares)]  # a heap of (cost so far, share)
    out = [0] * len(costs)
    for i in order:
        load, s = heapq.heappop(loads)
        out[i] = s
        heapq.heappush(loads, (load + costs[i], s))
    return out


def _deal(keyed, shares: int, cost: Callable[[Any], float], order: Callable[[Any], Any]):
    """``(None, elements)`` -> ``(share, (index, element))`` pairs: every element under every share, each share's
    own elements first (largest estimated cost first), then the other shares' (smallest first). ``index`` names the
    element for :class:`ClaimOnce`; it and the lists depend only on the elements, so the deal is repeatable."""
    _, elements = keyed
    items = sorted(elements, key=order)  # the input order is the runner's: sort first, so the deal is repeatable
    costs = [cost(x) for x in items]
    share_of = lpt_shares(costs, shares)
    by_cost = sorted(range(len(items)), key=lambda i: (-costs[i], i))
    for s in range(shares):
        own = [i for i in by_cost if share_of[i] == s]
        others = [i for i in reversed(by_cost) if share_of[i] != s]
        for i in own + others:
            yield s, (i, items[i])


class ClaimOnce(beam.DoFn):
    """``(index, element)`` -> ``element``, for the first worker to claim ``index`` (an empty file created with
    ``O_EXCL`` in ``claim_dir``, which every worker of the run sees); the others drop it."""

    def __init__(self, claim_dir: str):
        self.claim_dir = claim_dir

    def process(self, indexed):
        i, x = indexed
        try:
            fd = os.open(os.path.join(self.claim_dir, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        os.close(fd)
        yield x


class SpreadByCost(beam.PTransform):
    """A fusion break that starts each of a local runner's ``workers`` on one share of the elements, of about equal
    estimated ``cost``, and lets a worker done with its share take the others' unstarted elements; each element
    runs once (see the module docstring). ``order``: a key that sorts the elements the same way on every run (ties
    in cost are dealt in that order). With one worker it is a plain ``Reshuffle``."""

    def __init__(self, workers: int, cost: Callable[[Any], float], order: Callable[[Any], Any]):
        super().__init__()
        self.workers, self.cost, self.order = workers, cost, order

    def expand(self, pcoll):
        if self.workers <= 1:
            return pcoll | "Reshuffle" >> beam.Reshuffle()
        # one directory per pipeline, made where the graph is built (the launcher) and removed when this process
        # exits or drops the transform
        claim_dir = make_tmpdir("claims")
        weakref.finalize(self, shutil.rmtree, claim_dir, True)
        return (pcoll
                | "OneKey" >> beam.Map(lambda x: (None, x))
                | "Gather" >> beam.GroupByKey()
                | "Deal" >> beam.FlatMap(_deal, self.workers, self.cost, self.order)
                | "ByShare" >> beam.GroupByKey()
                | "Unpack" >> beam.FlatMap(lambda kv: kv[1])
                | "ClaimOnce" >> beam.ParDo(ClaimOnce(claim_dir)))
