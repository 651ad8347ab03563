"""Dealing expensive elements to a local runner's workers by their estimated cost, not by their count.

Beam's local runner (the FnApiRunner, with our forked workers or its own multi-process mode) runs each stage as
one bundle per worker: it cuts a stage's input into ``workers`` fixed parts and waits for the slowest. After a
``Reshuffle`` the parts come from random keys dealt round-robin, so each worker gets the same *number* of decode
tasks, however long each one is: on the 4x shared corpus one worker decoded for 36.9 s while the other finished
its half after 34.3 s and sat idle (a 2-worker timeline of ``benchmarks/scale.py``'s corpus).

:class:`SpreadByCost` gathers the elements, deals them into ``workers`` shares by longest-processing-time-first
(:func:`lpt_shares`) and groups them under one key per share. The runner's grouping buffer hands each key to one
part, so each worker gets one share of about equal cost. A runner we did not start (Dataflow, Flink) splits work
its own way and needs a plain ``Reshuffle``: gathering everything under one key there would make one hot key.

The elements and their meaning are unchanged: only which worker runs them, so outputs stay byte-identical.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence

import apache_beam as beam


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
    """``(None, elements)`` -> ``(share, element)`` pairs, share by share (so the keys reach the grouping buffer in
    share order)."""
    _, elements = keyed
    items = sorted(elements, key=order)  # the input order is the runner's: sort first, so the deal is repeatable
    share_of = lpt_shares([cost(x) for x in items], shares)
    for s in range(shares):
        for x, k in zip(items, share_of):
            if k == s:
                yield s, x


class SpreadByCost(beam.PTransform):
    """A fusion break that gives each of a local runner's ``workers`` one share of the elements, of about equal
    estimated ``cost`` (see the module docstring). ``order``: a key that sorts the elements the same way on
    every run (ties in cost are dealt in that order). With one worker it is a plain ``Reshuffle``."""

    def __init__(self, workers: int, cost: Callable[[Any], float], order: Callable[[Any], Any]):
        super().__init__()
        self.workers, self.cost, self.order = workers, cost, order

    def expand(self, pcoll):
        if self.workers <= 1:
            return pcoll | "Reshuffle" >> beam.Reshuffle()
        return (pcoll
                | "OneKey" >> beam.Map(lambda x: (None, x))
                | "Gather" >> beam.GroupByKey()
                | "Deal" >> beam.FlatMap(_deal, self.workers, self.cost, self.order)
                | "ByShare" >> beam.GroupByKey()
                | "Unpack" >> beam.FlatMap(lambda kv: kv[1]))
