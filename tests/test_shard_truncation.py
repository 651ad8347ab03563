"""A shard cut short: the whole samples before the break are kept, the error names the sample that is cut and counts
what is lost; a remote shard cached without a sha256 that turns out cut is not reused for good, and a transfer that
ends before its Content-Length never enters the cache."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from longreel.task.shard_format import write_shard_atomic
from longreel.trainer.data import ShardDataset, ShardError, ShardSpec

from conftest import QuietFiles, file_server

N_SAMPLES = 4
QUESTIONS = (2, 1, 3, 2)


def _sample(i: int, tmp: Path) -> dict:
    """A shard writer descriptor: frames.npy from a file, the JSON members as text, sums.json over them."""
    key = hashlib.sha256(f"v{i}".encode()).hexdigest()[:16]
    frames = np.full((2, 8, 8, 3), i, dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, frames, allow_pickle=False)
    npy = buf.getvalue()
    path = tmp / f"{key}.npy"
    path.write_bytes(npy)
    meta = json.dumps({"key": key, "video_id": key, "num_frames": 2})
    qras = json.dumps([{"qra_id": f"{key}-{j}", "question": f"q{j}?", "answer": "A"} for j in range(QUESTIONS[i])])
    members = {"frames.npy": npy, "meta.json": meta.encode(), "qras.json": qras.encode()}
    sums = json.dumps({n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in members.items()})
    return {"key": key, "files": [{"name": "frames.npy", "path": str(path), "size": len(npy),
                                   "sha256": hashlib.sha256(npy).hexdigest()},
                                  {"name": "meta.json", "text": meta}, {"name": "qras.json", "text": qras},
                                  {"name": "sums.json", "text": sums}]}


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trunc")
    samples = sorted((_sample(i, root) for i in range(N_SAMPLES)), key=lambda s: s["key"])
    path = root / "toy-train-000000.tar"
    write_shard_atomic(str(path), samples)
    with tarfile.open(path) as tf:  # where Python's tarfile says each member lies
        members = {m.name: (m.offset, m.offset_data, m.offset_data + m.size) for m in tf.getmembers()}
    return {"path": path, "bytes": path.read_bytes(), "keys": [s["key"] for s in samples], "members": members}


def _cut(shard: dict, at: int, tmp_path: Path) -> str:
    bad = tmp_path / "cut-000000.tar"
    bad.write_bytes(shard["bytes"][:at])
    return str(bad)


def _questions(shard: dict) -> dict[str, int]:
    by_key = {hashlib.sha256(f"v{i}".encode()).hexdigest()[:16]: QUESTIONS[i] for i in range(N_SAMPLES)}
    return {k: by_key[k] for k in shard["keys"]}


@pytest.mark.parametrize("where", ["frames", "meta", "header"])
@pytest.mark.parametrize("mmap", [True, False])
def test_a_cut_keeps_the_whole_samples_before_it_and_names_the_cut_one(shard, tmp_path, where, mmap):
    keys, m = shard["keys"], shard["members"]
    cut_key = keys[2]
    at = {"frames": m[f"{cut_key}.frames.npy"][1] + 100,  # in the first member of the third sample
          "meta": m[f"{cut_key}.meta.json"][1] + 10,  # in a later member of it
          "header": m[f"{cut_key}.frames.npy"][0] + 100}[where]  # in its first header: no member name says whose
    bad = _cut(shard, at, tmp_path)
    want_keys = keys[:2]
    with pytest.raises(ShardError) as e:
        list(ShardDataset(bad, mmap=mmap))
    if where == "header":  # the break names no member; the sample before it is whole (all its sums.json lists)
        assert e.value.key is None and "truncated tar stream" in str(e.value)
    else:
        assert e.value.key == cut_key and "truncated" in str(e.value)
        assert keys[1] not in str(e.value)  # not the whole sample before it
    ds = ShardDataset(bad, mmap=mmap, on_error="skip")
    got = [it["key"] for it in ds]
    per = _questions(shard)
    assert sorted(set(got)) == sorted(want_keys) and len(got) == sum(per[k] for k in want_keys)
    assert ds.stats.samples == 2 and ds.stats.skipped_shards == 1
    # lost: the cut sample (no index says how many follow it; the message says so)
    assert ds.stats.skipped_samples == (0 if where == "header" else 1)
    assert "no index gives the shard's sample count" in ds.stats.errors[-1]


def test_the_index_count_says_how_many_samples_the_cut_lost(shard, tmp_path):
    m = shard["members"]
    bad = _cut(shard, m[f"{shard['keys'][1]}.frames.npy"][1] + 50, tmp_path)
    ds = ShardDataset([ShardSpec(bad, nsamples=N_SAMPLES)], on_error="skip")
    got = {it["key"] for it in ds}
    assert got == {shard["keys"][0]}
    assert ds.stats.skipped_samples == N_SAMPLES - 1 and ds.stats.skipped_shards == 1
    assert f"{shard['keys'][1]}" in ds.stats.errors[-1] and "3 sample(s) lost" in ds.stats.errors[-1]
    # split by sample over two consumers: each counts its own share of what is lost
    two = [ShardDataset([ShardSpec(bad, nsamples=N_SAMPLES)], on_error="skip", split_by="sample", rank=r,
                        world_size=2) for r in (0, 1)]
    assert [len({it["key"] for it in d}) for d in two] == [1, 0]
    assert [d.stats.skipped_samples for d in two] == [1, 2]


def test_training_and_the_stream_keep_the_whole_samples_too(shard, tmp_path):
    from longreel.trainer.config import DataConfig
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_stream import ShardItemStream

    keys, m = shard["keys"], shard["members"]
    bad = _cut(shard, m[f"{keys[3]}.frames.npy"][1] + 100, tmp_path)  # the last sample is cut
    per = _questions(shard)
    want = sum(per[k] for k in keys[:3])
    items = load_items(DataConfig(train_urls=[bad], on_error="skip"), "train")
    assert {it["key"] for it in items} == set(keys[:3]) and len(items) == want
    s = ShardItemStream([bad], seed=0, shuffle=False, on_error="skip")
    try:
        got = [it for _, it in s.next_batch(want + 1)]  # past the break: the next epoch's first item
    finally:
        s.close()
    assert {it["key"] for it in got[:want]} == set(keys[:3]) and got[want]["key"] == got[0]["key"]
    assert s.ds.stats.skipped_samples == 1 and keys[3] in s.ds.stats.errors[-1]


# ------------------------------------------------------------------------------------------------ the remote cache


def test_a_transfer_cut_before_its_content_length_never_enters_the_cache(shard, tmp_path):
    # urllib ends a body that the server closes early as if it were whole: with no index sha256 or size to check,
    # the Content-Length is what tells the copy is short
    from longreel.trainer.shard_cache import cache_remote_shards

    body = shard["bytes"]

    class Cut(QuietFiles):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_start(len(body), body[:len(body) * 2 // 3])

    cache = tmp_path / "cache"
    with file_server(tmp_path, Cut) as (base, served):
        url = f"{base}/toy-train-000000.tar"
        with pytest.raises(ShardError, match=r"cut short: \d+ of the \d+ bytes its Content-Length"):
            cache_remote_shards([ShardSpec(url)], str(cache), retries=0)
    assert len(served) == 1 and not list(cache.glob("*.tar"))
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]  # no partial download left either


@pytest.mark.parametrize("stream", [False, True])
def test_an_unchecked_cached_copy_that_is_cut_is_downloaded_again(shard, tmp_path, stream):
    # the server sends a cut shard whole (its Content-Length is the cut length); the copy, cached under its URL with
    # no sha256 to check, must not be what every later run reads once the server sends the good shard
    from longreel.trainer.config import DataConfig
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_stream import ShardItemStream

    srv = tmp_path / "srv"
    srv.mkdir()
    served_file = srv / "toy-train-000000.tar"
    served_file.write_bytes(shard["bytes"][:shard["members"][f"{shard['keys'][2]}.frames.npy"][1] + 100])
    cache = tmp_path / "cache"

    def read(url, on_error="skip"):
        if not stream:
            return load_items(DataConfig(train_urls=[url], cache_dir=str(cache), on_error=on_error), "train")
        s = ShardItemStream([url], seed=0, shuffle=False, on_error=on_error, cache_dir=str(cache), retries=0)
        try:
            return list(s.ds)  # one pass, through the stream's fetcher
        finally:
            s.close()

    with file_server(srv) as (base, served):
        url = f"{base}/{served_file.name}"
        with pytest.raises((InputCheckError, ShardError)) as e:
            read(url, on_error="raise")
        msg = str(e.value)
        assert url in msg and shard["keys"][2] in msg and "truncated" in msg
        assert "was removed: the next run downloads it again" in msg
        assert not list(cache.glob("*.tar"))
        items = read(url)  # downloaded again (the server still sends the cut one): skipped, the copy dropped
        assert {it["key"] for it in items} == set(shard["keys"][:2])
        assert not list(cache.glob("*.tar")) and len(served) == 2
        served_file.write_bytes(shard["bytes"])  # the server is fixed
        items = read(url)
        assert len(items) == sum(QUESTIONS) and len(served) == 3
        assert [p.name for p in cache.glob("*.tar")] == [f"url-{hashlib.sha256(url.encode()).hexdigest()[:32]}.tar"]
        read(url)
        assert len(served) == 3  # a whole copy is reused


def test_a_verified_cached_copy_is_kept(shard, tmp_path):
    # a copy whose sha256 matched the index holds what the index describes: another download brings the same bytes
    from longreel.trainer.shard_cache import forget_unchecked_copy

    copy = tmp_path / "abc.tar"
    copy.write_bytes(b"x")
    assert forget_unchecked_copy(ShardSpec("http://h/a.tar", sha256="abc"), str(copy)) == ""
    assert forget_unchecked_copy(ShardSpec("http://h/a.tar"), str(copy)) == ""  # not the cache's name for it
    assert copy.exists()
