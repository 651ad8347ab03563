"""A frozen tower's video features on disk (``mrsp.frozen_feature_dir``, trainer.mrsp.feature_dir): a later run
reads them bitwise instead of a tower pass; another tower never does; a damaged file is encoded again."""
from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.schemas.config import ConfigError, load_yaml  # noqa: E402
from longreel.trainer.config import TrainConfig  # noqa: E402
from longreel.trainer.mrsp.embed_cache import VisionCallCounter, encode_video_features  # noqa: E402
from longreel.trainer.mrsp.feature_dir import FeatureDir, tower_digest  # noqa: E402
from longreel.trainer.mrsp.frozen_cache import FrozenFeatureCache, pixel_digest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import free_port, tiny_reference_with_video  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_videos):
    ref, enc = tiny_reference_with_video(tmp_path_factory.mktemp("featdir"), shared_videos)
    return ref, enc["pixel_values_videos"], enc["video_grid_thw"]


def _cache(ref, root):  # a run's reference cache: no memory store, the directory only
    return FrozenFeatureCache(ref, max_bytes=0, directory=FeatureDir(root, tower_digest(ref)))


def test_a_later_run_reads_the_features_bitwise_without_a_tower_pass(setup, tmp_path):
    ref, pv, grid = setup
    first = _cache(ref, tmp_path)
    first.begin_step()
    written = first.features("vtest", pv, grid)
    assert (first.encodes, first.directory.writes) == (1, 1)
    assert first.directory.path(pixel_digest(pv, grid)).is_file()
    later = _cache(ref, tmp_path)  # another run (or a restart) on the same directory
    with VisionCallCounter(ref) as calls:
        later.begin_step()
        read = later.features("vtest_q1", pv.clone(), grid)
    assert calls.calls == 0 and (later.encodes, later.dir_hits, later.directory.reads) == (0, 1, 1)
    with torch.no_grad():
        fresh = encode_video_features(ref, pv, grid)
    assert read.dtype == fresh.dtype and read.device == fresh.device
    assert torch.equal(read, fresh) and torch.equal(read, written)


def test_another_tower_never_reads_them(setup, tmp_path):
    ref, pv, grid = setup
    _cache(ref, tmp_path).features("vtest", pv, grid)
    tuned = copy.deepcopy(ref)
    with torch.no_grad():
        next(tuned.model.visual.parameters()).view(-1)[0] += 1e-3  # one weight of the tower
    assert tower_digest(tuned) != tower_digest(ref)
    # nor the same weights computing in another precision or kernel (the trainer's context string)
    assert tower_digest(ref, "cpu|torch.float32|sdpa") != tower_digest(ref, "cpu|torch.bfloat16|sdpa")
    assert tower_digest(ref, "cpu|torch.float32|sdpa") == tower_digest(copy.deepcopy(ref), "cpu|torch.float32|sdpa")
    other = _cache(tuned, tmp_path)
    with VisionCallCounter(tuned) as calls:
        got = other.features("vtest", pv, grid)
    assert calls.calls == 1 and other.dir_hits == 0 and other.directory.writes == 1
    with torch.no_grad():
        assert torch.equal(got, encode_video_features(tuned, pv, grid))


def test_a_damaged_or_misfiled_file_is_encoded_again_and_replaced(setup, tmp_path, caplog):
    ref, pv, grid = setup
    flipped = pv.flip(0)
    seed = _cache(ref, tmp_path)
    seed.features("a", pv, grid)
    seed.features("b", flipped, grid)
    fdir = seed.directory
    path_a, path_b = fdir.path(pixel_digest(pv, grid)), fdir.path(pixel_digest(flipped, grid))
    shutil.copyfile(path_b, path_a)  # another video's features under this video's name
    with torch.no_grad():
        fresh = encode_video_features(ref, pv, grid)
    cache = _cache(ref, tmp_path)
    with caplog.at_level("WARNING"):
        got = cache.features("a", pv, grid)
    assert torch.equal(got, fresh) and cache.encodes == 1 and cache.directory.bad_files == 1
    assert "metadata names another video" in caplog.text
    path_a.write_bytes(b"\x00" * 40)  # a truncated write from outside, say
    cache = _cache(ref, tmp_path)
    assert torch.equal(cache.features("a", pv, grid), fresh) and cache.directory.bad_files == 1
    again = _cache(ref, tmp_path)  # replaced by the re-encode: read from now on
    assert torch.equal(again.features("a", pv, grid), fresh) and again.dir_hits == 1 and again.encodes == 0
    assert not [p for p in path_a.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary files left behind


@pytest.mark.parametrize("extra, message", [
    (["mrsp.sp_size=2"], "not supported with mrsp.sp_size > 1"),
    (["mrsp.enabled=false"], "needs mrsp.enabled=true"),
])
def test_the_config_refuses_what_the_directory_cannot_serve(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_yaml(TrainConfig, None, [f"mrsp.frozen_feature_dir={tmp_path}", *extra])


def test_a_directory_that_cannot_be_written_only_costs_the_keeping(setup, tmp_path, caplog):
    ref, pv, grid = setup
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the feature directory should be")  # mkdir fails under it, even for root
    cache = _cache(ref, blocked)
    with caplog.at_level("WARNING"):
        for name, video in (("a", pv), ("b", pv.flip(0))):
            with torch.no_grad():
                assert torch.equal(cache.features(name, video, grid), encode_video_features(ref, video, grid))
    assert (cache.encodes, cache.directory.writes, cache.directory.write_errors) == (2, 0, 2)
    assert caplog.text.count("cannot write") == 1  # logged once


_FSDP_DIGEST = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from longreel.trainer.mrsp.feature_dir import tower_digest

class Inner(torch.nn.Module):  # the shape base_model() looks for: get_rope_index and a visual tower
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.visual = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))
    def get_rope_index(self):
        pass

dist.init_process_group("gloo")
plain = Inner()
sharded = Inner()
fully_shard(sharded.visual)
assert type(next(sharded.visual.parameters())).__name__ == "DTensor"
print(tower_digest(plain) == tower_digest(sharded), flush=True)
dist.destroy_process_group()
"""


def test_a_tower_sharded_by_fsdp_has_the_digest_of_the_whole_tower(tmp_path):
    import os
    import subprocess

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    out = subprocess.run([sys.executable, "-c", _FSDP_DIGEST], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
