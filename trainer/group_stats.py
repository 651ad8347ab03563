"""What a GRPO step's groups can teach: how many carry signal, and the reward per category.

A group whose rewards are all equal has zero advantage everywhere, so it moves the policy only through the KL term:
a step where most groups are solved by every rollout, or by none, learns little whatever its mean reward says
(the reason for the pass-rate filter and for DAPO's dynamic sampling). The per-category means show which kinds of
question the reward is rising on: on a mixed dataset the overall mean can climb on one easy kind while another stays
flat (the learning benchmark's colour and time kinds).
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

__all__ = ["has_signal", "tally_group", "merge_tallies", "group_metrics", "metric_name"]


def has_signal(rewards: Iterable[float]) -> bool:
    """Whether a group's rewards are not all equal (else every advantage is zero)."""
    r = [float(x) for x in rewards]
    return len(r) > 1 and max(r) > min(r)


def tally_group(tally: dict, rewards: Iterable[float], category: str | None) -> None:
    """Add one group's ``rewards`` (G floats) to ``tally`` (a dict, empty at first; plain numbers only, so ranks
    can gather it as an object): groups, groups with signal (not all rewards equal), and per ``category`` the
    reward sum and count. ``category`` None or empty is left out of the per-category part; others are named by
    :func:`metric_name` ("Goal and Purpose" -> "goal_and_purpose"), fit for a TensorBoard tag."""
    r = [float(x) for x in rewards]
    tally["groups"] = tally.get("groups", 0) + 1
    tally["signal_groups"] = tally.get("signal_groups", 0) + int(has_signal(r))
    name = metric_name(category) if category else ""
    if name:
        row = tally.setdefault("by_category", {}).setdefault(name, [0.0, 0])
        row[0] += sum(r)
        row[1] += len(r)


def metric_name(category) -> str:
    """A category as a metric name: lower case, runs of anything but letters, digits, ``.`` and ``-`` as one ``_``."""
    return re.sub(r"[^0-9a-z.-]+", "_", str(category).lower()).strip("_")


def merge_tallies(tallies: Iterable[Mapping]) -> dict:
    """The sum of several ranks' tallies (see :func:`tally_group`)."""
    out: dict = {}
    for t in tallies:
        out["groups"] = out.get("groups", 0) + t.get("groups", 0)
        out["signal_groups"] = out.get("signal_groups", 0) + t.get("signal_groups", 0)
        for cat, (s, n) in t.get("by_category", {}).items():
            row = out.setdefault("by_category", {}).setdefault(cat, [0.0, 0])
            row[0] += s
            row[1] += n
    return out


def group_metrics(tally: Mapping) -> dict[str, float]:
    """``groups_with_signal`` (the share of groups whose rewards differ; 0.0 when there were none) and one
    ``reward_mean/<category>`` per category seen, in sorted order."""
    groups = tally.get("groups", 0)
    out = {"groups_with_signal": tally.get("signal_groups", 0) / groups if groups else 0.0}
    for cat in sorted(tally.get("by_category", {})):
        s, n = tally["by_category"][cat]
        out[f"reward_mean/{cat}"] = s / n if n else 0.0
    return out
