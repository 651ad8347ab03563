"""benchmarks/mrsp.py's stage-1 ceiling (issue 19 item 2): the ratio over the shared-prefill baseline that the vision
tower's own forward and backward costs allow when the language model costs nothing."""
import pytest

from conftest import load_benchmark


def _mrsp():
    return load_benchmark("mrsp")


def test_a_backward_twice_a_forward_caps_stage_one_at_one_and_a_half():
    c = _mrsp().tower_ceilings(1.0, 1.0, 2.0)
    assert c["tower_trained"] == 1.5  # (3 + 1 + 2) / (1 + 1 + 2)
    assert c["tower_trained_reference_from_store"] == 2.0  # (3 + 1 + 2) / (1 + 2)
    assert c["tower_frozen"] == 4.0


def test_a_cheaper_backward_or_graph_raises_the_ceiling():
    mrsp = _mrsp()
    assert mrsp.tower_ceilings(1.0, 1.0, 1.0)["tower_trained"] == pytest.approx(5 / 3, abs=1e-3)
    assert mrsp.tower_ceilings(1.0, 1.2, 2.2)["tower_trained"] < 1.5  # a graph-keeping forward that costs more


def test_non_positive_times_are_refused():
    with pytest.raises(ValueError, match="positive"):
        _mrsp().tower_ceilings(0.0, 1.0, 2.0)


def test_micro_batches_add_the_update_encode_to_the_baseline_only():
    # k = 2 micro-batches: the baseline encodes with its graph and backpropagates twice, stage 1 once
    c = _mrsp().tower_ceilings(1.0, 1.0, 2.0, micro_batches=2)
    assert c["tower_trained"] == 2.25  # (3 + 2 * (1 + 2)) / (1 + 1 + 2)
    assert c["tower_trained_reference_from_store"] == 3.0  # 9 / (1 + 2)
    assert c["tower_frozen"] == 5.0  # (3 + 2) F / F
    assert _mrsp().tower_ceilings(1.0, 1.0, 2.0, micro_batches=1) == _mrsp().tower_ceilings(1.0, 1.0, 2.0)


def test_zero_micro_batches_are_refused():
    with pytest.raises(ValueError, match="micro_batches"):
        _mrsp().tower_ceilings(1.0, 1.0, 2.0, micro_batches=0)
