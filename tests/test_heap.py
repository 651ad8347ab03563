"""The collector around a run (longreel.pipelines.heap): off during start-up, start-up's objects frozen during the
run, everything as it was afterwards."""
import gc

import pytest

from longreel.pipelines import heap


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_paused_turns_collection_off_and_restores_it_even_on_error():
    gc.enable()
    with pytest.raises(RuntimeError):
        with heap.paused():
            assert not gc.isenabled()
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    with heap.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # a caller's choice is kept


def test_frozen_collects_only_what_is_made_inside_and_unfreezes_after():
    before = [object() for _ in range(10)]  # noqa: F841 - alive when the freeze happens
    with heap.paused():
        with heap.frozen():
            assert gc.isenabled()
            assert gc.get_freeze_count() > 0
            assert len(gc.get_objects()) < gc.get_freeze_count()
        assert not gc.isenabled()  # back to the paused start-up's state
    assert gc.get_freeze_count() == 0


def test_a_curate_run_freezes_start_up_and_leaves_nothing_frozen(tmp_path, copy_video, monkeypatch):
    from longreel.pipelines import curate
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.io.inputs import plan_inputs
    from longreel.schemas.config import load_yaml

    seen = {}
    run_and_card = curate._run_and_card

    def spy(*a, **k):
        seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
        return run_and_card(*a, **k)

    monkeypatch.setattr(curate, "_run_and_card", spy)
    copy_video("opencv__cup.mp4", "in/cup.mp4")
    gc.enable()
    with heap.paused():
        curate.run_curate(plan_inputs([str(tmp_path / "in")]), str(tmp_path / "out"),
                          load_yaml(CurateConfig, None, ["stages=[]"]), workers=1)
    assert seen["enabled"] and seen["frozen"] > 10_000, seen
    assert gc.isenabled() and gc.get_freeze_count() == 0
