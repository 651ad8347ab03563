import pytest

from longreel.pipelines.stages.segment import clip_id, plan_clips

BBB_DURATION = 596.458333  # as probed
BBB_FPS = 24.0


def test_bbb_gives_60_clips_covering_the_video_without_gaps():
    clips, dropped = plan_clips(BBB_DURATION, BBB_FPS, 10.0)
    assert len(clips) == 60 and dropped == 0
    assert clips[0].start_s == 0.0 and clips[-1].end_s == pytest.approx(BBB_DURATION)
    for a, b in zip(clips, clips[1:]):
        assert a.end_s == b.start_s and a.end_frame == b.start_frame
    assert clips[-1].end_s - clips[-1].start_s == pytest.approx(6.458333)
    assert clips[-1].end_frame == round(BBB_DURATION * BBB_FPS)


@pytest.mark.parametrize("policy, expected_ends, dropped", [
    ("merge", [10.0, 22.0], 0.0),
    ("keep", [10.0, 20.0, 22.0], 0.0),
    ("drop", [10.0, 20.0], 2.0),
])
def test_short_tail_policies(policy, expected_ends, dropped):
    clips, d = plan_clips(22.0, 30.0, 10.0, tail_policy=policy, min_tail_s=5.0)
    assert [c.end_s for c in clips] == pytest.approx(expected_ends)
    assert d == pytest.approx(dropped)


def test_long_tail_is_its_own_clip_under_merge():
    clips, _ = plan_clips(26.0, 30.0, 10.0, tail_policy="merge", min_tail_s=5.0)
    assert [c.end_s for c in clips] == pytest.approx([10.0, 20.0, 26.0])


def test_video_shorter_than_a_clip_is_one_clip_even_under_drop():
    clips, d = plan_clips(4.0, 25.0, 10.0, tail_policy="drop")
    assert len(clips) == 1 and clips[0].end_frame == 100 and d == 0.0


def test_overlapping_stride():
    clips, _ = plan_clips(30.0, 10.0, 10.0, stride_s=5.0, tail_policy="keep")
    assert [(c.start_s, c.end_s) for c in clips] == [(0, 10), (5, 15), (10, 20), (15, 25), (20, 30)]


def test_boundaries_snap_to_the_frame_grid():
    clips, _ = plan_clips(10.0, 29.97003, 3.0, tail_policy="keep")
    for c in clips[1:]:
        assert c.start_s == pytest.approx(c.start_frame / 29.97003)


def test_bad_input_is_an_error():
    with pytest.raises(ValueError):
        plan_clips(0.0, 30.0, 10.0)
    with pytest.raises(ValueError):
        plan_clips(10.0, 30.0, 10.0, tail_policy="fold", min_tail_s=20)


def test_clip_ids_are_deterministic_and_have_no_dots():
    a = clip_id("abcdef0123456789", 3, 90, 120)
    assert a == clip_id("abcdef0123456789", 3, 90, 120)
    assert a != clip_id("abcdef0123456789", 3, 90, 121)
    assert "." not in a and a.startswith("abcdef0123456789-00003-")
