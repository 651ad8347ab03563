"""The GRPO step's group statistics: which groups carry signal, and the reward per category."""
import pytest

from longreel.trainer.group_stats import group_metrics, merge_tallies, metric_name, tally_group


def test_signal_is_groups_whose_rewards_differ():
    t: dict = {}
    tally_group(t, [1.0, 1.0, 1.0, 1.0], "colour")   # all solved: no advantage anywhere
    tally_group(t, [0.0, 0.0, 0.0, 0.0], "order")    # none solved: no advantage either
    tally_group(t, [0.0, 1.0, 0.0, 0.0], "order")
    tally_group(t, [0.5], "order")                   # one rollout: nothing to compare
    m = group_metrics(t)
    assert m["groups_with_signal"] == pytest.approx(1 / 4)
    assert m["reward_mean/colour"] == pytest.approx(1.0)
    assert m["reward_mean/order"] == pytest.approx(1.5 / 9)
    assert list(m) == ["groups_with_signal", "reward_mean/colour", "reward_mean/order"]


def test_ranks_tallies_merge_to_the_one_process_figures():
    groups = [([0.0, 1.0], "a"), ([1.0, 1.0], "b"), ([0.2, 0.4], "a"), ([0.0, 0.0], None)]
    whole: dict = {}
    for r, c in groups:
        tally_group(whole, r, c)
    rank0: dict = {}
    rank1: dict = {}
    for k, (r, c) in enumerate(groups):
        tally_group(rank0 if k % 2 == 0 else rank1, r, c)
    assert group_metrics(merge_tallies([rank0, rank1])) == group_metrics(whole)
    m = group_metrics(whole)
    assert m["groups_with_signal"] == pytest.approx(2 / 4)
    assert "reward_mean/None" not in m and m["reward_mean/a"] == pytest.approx(1.6 / 4)


def test_no_groups_gives_zero_signal_and_no_categories():
    assert group_metrics({}) == {"groups_with_signal": 0.0}
    assert group_metrics(merge_tallies([])) == {"groups_with_signal": 0.0}


def test_categories_become_metric_names():
    assert metric_name("Goal and Purpose") == "goal_and_purpose"
    assert metric_name("Plot & Narrative/2") == "plot_narrative_2"
    assert metric_name("count_colours") == "count_colours"
    t: dict = {}
    tally_group(t, [1.0, 0.0], "Goal and Purpose")
    tally_group(t, [1.0, 1.0], "  ")  # nothing left of it: counted as a group, no category
    assert group_metrics(t) == {"groups_with_signal": 0.5, "reward_mean/goal_and_purpose": 0.5}
