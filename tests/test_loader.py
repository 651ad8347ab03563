"""trainer/data.py: the shard loader, on shards written by the pack writer (synthetic frames, no Beam)."""
from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from longreel.pipelines.media.decode import DecodedFrames
from longreel.pipelines.pack.frame_cache import FrameCache, FrameParams, load_video_processor
from longreel.task.shard_format import build_index, index_name, shard_name, write_shard_atomic
from longreel.pipelines.stages.pack import sample_descriptor
from longreel.trainer.data import ShardDataset, ShardError, UnsafeMemberError, processor_inputs, resolve_shards

N_VIDEOS = 6
QUESTIONS = (1, 2, 3, 2, 1, 3)


def _video(i: int) -> dict:
    sha = hashlib.sha256(f"video-{i}".encode()).hexdigest()
    return {"video_id": sha[:16], "sha256": sha, "uri": f"/nowhere/{i}.mp4", "bytes": 1000, "duration_s": 10.0 + i,
            "fps_avg": 25.0, "n_frames": 250 + 25 * i, "width": 320 + 16 * i, "height": 240, "video_codec": "h264",
            "container": "mp4", "license": f"CC-BY-{i}", "attribution": f"maker {i}"}


def _qras(v: dict, n: int, split: str) -> list[dict]:
    out = []
    for j in range(n):
        qid = hashlib.sha256(f"{v['video_id']}:{j}".encode()).hexdigest()[:20]
        out.append({"qra_id": qid, "video_id": v["video_id"], "category": "temporal", "problem_type": "multiple_choice",
                    "question": f"q{j} of {v['video_id']}?", "options": ["a", "b", "c", "d"], "answer": "B",
                    "reasoning": "r", "target": "<think>r</think><answer>B</answer>", "split": split,
                    "pass_rate": None})
    return sorted(out, key=lambda q: q["qra_id"])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards of split ``train`` (3 videos each), frames made by FrameCache.build with a synthetic decoder."""
    root = tmp_path_factory.mktemp("loader")
    vp = load_video_processor(None, min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    cache = FrameCache(str(root / "cache"), FrameParams(fps=1.0, max_frames=8), vp)

    def decode(path, timestamps, i, rotation=0):
        rng = np.random.default_rng(i)
        v = _video(i)
        frames = rng.integers(0, 256, size=(len(timestamps), v["height"], v["width"], 3), dtype=np.uint8)
        return DecodedFrames(frames, list(timestamps), [round(t * 25) for t in timestamps], 25.0)

    samples = []
    for i in range(N_VIDEOS):
        v = _video(i)
        entry = cache.build(v, v["uri"], functools.partial(decode, i=i))
        samples.append(sample_descriptor("train", v, entry, _qras(v, QUESTIONS[i], "train")))
    out = root / "shards"
    out.mkdir()
    infos = []
    for idx, part in enumerate((samples[:3], samples[3:])):
        part = sorted(part, key=lambda s: s["key"])
        name = shard_name("toy", "train", idx)
        nbytes, sha = write_shard_atomic(str(out / name), part)
        infos.append({"index": idx, "url": name, "nsamples": len(part), "bytes": nbytes, "sha256": sha,
                      "nquestions": sum(s["nquestions"] for s in part)})
    (out / index_name("toy", "train")).write_text(json.dumps(build_index("toy", "train", infos)))
    return {"dir": out, "index": str(out / index_name("toy", "train")), "vp": vp, "cache": cache,
            "tars": [str(out / i["url"]) for i in infos]}


def _ids(ds) -> list[str]:
    return [it["qra_id"] for it in ds]


def test_items_carry_frames_metadata_and_question(shards):
    items = list(ShardDataset(shards["index"]))
    assert len(items) == sum(QUESTIONS)
    by_video = {}
    for it in items:
        assert it["frames"].dtype == torch.uint8 and it["frames"].ndim == 4 and it["frames"].shape[-1] == 3
        for k in ("question", "options", "answer", "problem_type", "target", "category", "qra_id"):
            assert it[k] is not None
        assert it["meta"]["license"].startswith("CC-BY-")
        by_video.setdefault(it["video_id"], it)
    for i in range(N_VIDEOS):
        v = _video(i)
        it = by_video[v["video_id"]]
        entry, state = shards["cache"].lookup(v["sha256"])
        assert state == "hit"
        assert np.array_equal(it["frames"].numpy(), np.asarray(entry.load()))
        out = shards["vp"](**processor_inputs(it), return_tensors="pt")
        assert out["video_grid_thw"].tolist() == [it["video_grid_thw"]]
        assert it["video_metadata"]["frames_indices"] == entry.meta["frames_indices"]


def test_mmap_and_streamed_reads_agree(shards):
    a = list(ShardDataset(shards["index"], verify="sample"))
    b = list(ShardDataset(shards["index"], verify="sample", mmap=False))
    assert [x["qra_id"] for x in a] == [x["qra_id"] for x in b]
    for x, y in zip(a, b):
        assert torch.equal(x["frames"], y["frames"]) and x["meta"] == y["meta"]
    a[0]["frames"][0, 0, 0, 0] += 1  # frames are private copies-on-write: the shard file is untouched
    assert [x["qra_id"] for x in ShardDataset(shards["index"], verify="sample")] == [x["qra_id"] for x in a]


def test_brace_pattern_and_list_equal_index(shards):
    d = shards["dir"]
    a = _ids(ShardDataset(shards["index"]))
    b = _ids(ShardDataset(f"{d}/toy-train-{{000000..000001}}.tar"))
    c = _ids(ShardDataset(shards["tars"]))
    g = _ids(ShardDataset(f"{d}/toy-train-*.tar"))
    assert a == b == c == g
    # an index given by a glob is still read as an index (its sha256s kept)
    assert resolve_shards(f"{d}/*.json") == resolve_shards(shards["index"])
    assert [s.sha256 for s in resolve_shards(shards["index"])] == [
        hashlib.sha256(open(t, "rb").read()).hexdigest() for t in shards["tars"]]


def test_shuffle_is_seeded_and_epochs_cover_everything(shards):
    plain = _ids(ShardDataset(shards["index"]))
    s1 = _ids(ShardDataset(shards["index"], shuffle=True, seed=1, shuffle_buffer=3))
    s1b = _ids(ShardDataset(shards["index"], shuffle=True, seed=1, shuffle_buffer=3))
    s2 = _ids(ShardDataset(shards["index"], shuffle=True, seed=2, shuffle_buffer=3))
    assert s1 == s1b and sorted(s1) == sorted(plain)
    assert s1 != s2 or s1 != plain
    two = list(ShardDataset(shards["index"], shuffle=True, seed=1, epochs=2, shuffle_buffer=3))
    e0 = [it["qra_id"] for it in two if it["epoch"] == 0]
    e1 = [it["qra_id"] for it in two if it["epoch"] == 1]
    assert e0 == s1 and sorted(e1) == sorted(plain) and e0 != e1


@pytest.mark.parametrize("split_by", ["shard", "sample"])
def test_ranks_partition_the_data(shards, split_by):
    parts = [_ids(ShardDataset(shards["index"], rank=r, world_size=2, split_by=split_by)) for r in range(2)]
    assert parts[0] and parts[1]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(_ids(ShardDataset(shards["index"])))


def test_resume_continues_exactly(shards):
    kw = dict(shuffle=True, seed=7, epochs=2, shuffle_buffer=2)
    full = [(it["epoch"], it["qra_id"]) for it in ShardDataset(shards["index"], **kw)]
    for cut in (1, 3, sum(QUESTIONS), sum(QUESTIONS) + 4):
        ds = ShardDataset(shards["index"], **kw)
        it = iter(ds)
        head = [(x["epoch"], x["qra_id"]) for x in (next(it) for _ in range(cut))]
        state = json.loads(json.dumps(ds.state_dict()))  # survives a JSON checkpoint
        ds2 = ShardDataset(shards["index"], **kw)
        ds2.load_state_dict(state)
        tail = [(x["epoch"], x["qra_id"]) for x in ds2]
        assert head + tail == full, cut
    other = ShardDataset(shards["index"], shuffle=True, seed=8, epochs=2)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_dataloader_workers_split_and_resume(shards):
    ds = ShardDataset(shards["index"], shuffle=True, seed=3)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda x: x)
    seen = []
    for item in dl:
        ds.observe(item)
        seen.append(item["qra_id"])
    assert sorted(seen) == sorted(_ids(ShardDataset(shards["index"])))
    state = ds.state_dict()
    assert state["consumers"] == 2 and set(state["positions"]) == {"0", "1"}


def _flip(path: str, offset: int, out: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0xFF
    open(out, "wb").write(bytes(data))


def _member_offsets(path: str) -> dict[str, tuple[int, int]]:
    with tarfile.open(path) as tf:
        return {m.name: (m.offset, m.offset_data) for m in tf.getmembers()}


def test_corrupt_byte_in_frames_names_shard_and_key_or_is_skipped(shards, tmp_path):
    src = shards["tars"][0]
    offs = _member_offsets(src)
    frames = sorted(n for n in offs if n.endswith(".frames.npy"))
    victim = frames[1]
    key = victim.split(".")[0]
    bad = str(tmp_path / "toy-train-000000.tar")
    _flip(src, offs[victim][1] + 5000, bad)
    with pytest.raises(ShardError) as e:
        list(ShardDataset(bad, verify="sample"))
    assert e.value.shard == bad and e.value.key == key
    assert bad in str(e.value) and key in str(e.value) and "frames.npy" in str(e.value)
    with pytest.raises(ShardError, match=key):  # the streaming (non-mmap) path says the same
        list(ShardDataset(bad, verify="sample", mmap=False))
    ds = ShardDataset(bad, verify="sample", on_error="skip")
    got = _ids(ds)
    assert ds.stats.skipped_samples == 1 and ds.stats.samples == 2
    good = _ids(ShardDataset(src))
    assert len(got) < len(good) and set(got) < set(good)
    # without the sha256 check (the default) a flipped pixel goes unnoticed: the check is what catches it
    assert len(_ids(ShardDataset(bad))) == len(good)


def test_corrupt_tar_header_names_shard(shards, tmp_path):
    src = shards["tars"][1]
    offs = _member_offsets(src)
    names = sorted(offs)
    victim = names[5]  # a header in the middle of the shard
    bad = str(tmp_path / "toy-train-000001.tar")
    _flip(src, offs[victim][0] + 10, bad)  # inside the member's name field -> header checksum fails
    for mmap in (True, False):
        with pytest.raises(ShardError) as e:
            list(ShardDataset(bad, mmap=mmap))
        assert bad in str(e.value) and "corrupt tar stream" in str(e.value)
        assert e.value.key == names[4].split(".")[0]
    ds = ShardDataset([bad, shards["tars"][0]], on_error="skip")
    got = _ids(ds)
    assert ds.stats.skipped_shards == 1 and len(got) >= sum(QUESTIONS[:3])


def test_verify_shard_checks_the_index_sha256(shards, tmp_path):
    d = tmp_path / "copy"
    d.mkdir()
    for t in shards["tars"]:
        (d / os.path.basename(t)).write_bytes(open(t, "rb").read())
    idx = json.loads(open(shards["index"]).read())
    (d / "toy-train.index.json").write_text(json.dumps(idx))
    assert len(_ids(ShardDataset(str(d / "toy-train.index.json"), verify="shard"))) == sum(QUESTIONS)
    victim = d / os.path.basename(shards["tars"][1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="sha256/size mismatch") as e:
        list(ShardDataset(str(d / "toy-train.index.json"), verify="shard"))
    assert e.value.shard.endswith("toy-train-000001.tar")
    ds = ShardDataset(str(d / "toy-train.index.json"), verify="shard", on_error="skip")
    assert len(_ids(ds)) == sum(QUESTIONS[:3]) and ds.stats.skipped_shards == 1


def _tar_with(path, members: list[tuple[str, bytes]], kind=tarfile.REGTYPE):
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.type = kind
            tf.addfile(ti, io.BytesIO(data))


@pytest.mark.parametrize("name", ["../evil.json", "/abs/evil.json", "a/../../evil.json", "..\\evil.json"])
def test_path_escaping_members_are_rejected(tmp_path, name):
    bad = str(tmp_path / "evil.tar")
    _tar_with(bad, [(name, b"{}")])
    with pytest.raises(UnsafeMemberError, match="rejected member"):
        list(ShardDataset(bad, verify="none"))
    ds = ShardDataset(bad, verify="none", on_error="skip")
    assert list(ds) == [] and ds.stats.skipped_samples == 1
    assert not (tmp_path.parent / "evil.json").exists() and not os.path.exists("/abs/evil.json")


def test_links_and_pickles_are_rejected(tmp_path):
    link = str(tmp_path / "link.tar")
    with tarfile.open(link, "w") as tf:
        ti = tarfile.TarInfo("k.frames.npy")
        ti.type = tarfile.SYMTYPE
        ti.linkname = "/etc/passwd"
        tf.addfile(ti)
    with pytest.raises(UnsafeMemberError, match="not a regular file"):
        list(ShardDataset(link, verify="none"))
    pick = str(tmp_path / "pick.tar")
    _tar_with(pick, [("k.data.pyd", b"\x80\x04N."), ("k.meta.json", b"{}")])
    with pytest.raises(ShardError, match="pickle-style"):
        list(ShardDataset(pick, verify="none"))


def test_http_yields_exactly_what_the_local_path_yields(shards):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(shards["dir"]))

    class Quiet(handler.func):
        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(shards["dir"])))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{os.path.basename(shards['index'])}"
        kw = dict(shuffle=True, seed=5, verify="shard")
        remote = list(ShardDataset(url, **kw))
        local = list(ShardDataset(shards["index"], **kw))
        streamed = list(ShardDataset(url))  # no staging: the HTTP body is parsed as it arrives
    finally:
        server.shutdown()
        server.server_close()
    assert [r["qra_id"] for r in streamed] == _ids(ShardDataset(shards["index"]))
    assert [r["qra_id"] for r in remote] == [x["qra_id"] for x in local]
    for r, x in zip(remote, local):
        assert torch.equal(r["frames"], x["frames"])
        assert r["meta"] == x["meta"] and r["target"] == x["target"]
        assert r["shard"].startswith("http://") and r["shard"].endswith(os.path.basename(x["shard"]))


def test_huggingface_datasets_reads_the_shards(shards):
    import datasets

    ds = datasets.load_dataset("webdataset", data_files={"train": shards["tars"]}, split="train")
    assert len(ds) == N_VIDEOS
    row = ds[0]
    assert set(row) >= {"__key__", "frames.npy", "meta.json", "qras.json"}
    frames = np.asarray(row["frames.npy"], dtype=np.uint8)
    assert frames.ndim == 4 and frames.shape[-1] == 3
    meta = row["meta.json"]
    assert meta["key"] == row["__key__"] and len(row["qras.json"]) == meta["nquestions"]


def test_truncated_shard_is_an_error_even_at_a_member_boundary(shards, tmp_path):
    src = shards["tars"][0]
    offs = _member_offsets(src)
    cut_at = sorted(o for o, _ in offs.values())[4]  # the header of the second sample: a clean block boundary
    bad = tmp_path / "toy-train-000000.tar"
    bad.write_bytes(open(src, "rb").read()[:cut_at])
    for mmap in (True, False):
        with pytest.raises(ShardError, match="truncated tar stream"):
            list(ShardDataset(str(bad), mmap=mmap))
    mid = tmp_path / "mid.tar"
    mid.write_bytes(open(src, "rb").read()[:cut_at - 700])  # inside a member's data
    with pytest.raises(ShardError, match="truncated|corrupt"):
        list(ShardDataset(str(mid)))
    # the trainer reads its items up front: there the same error is the input's (InputCheckError: `longreel train`
    # prints it in one line and exits 2), naming the shard, and the skip setting counts it instead
    from longreel.trainer.config import DataConfig
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.runtime import load_items

    with pytest.raises(InputCheckError, match=f"{mid}.*data.on_error=skip"):
        load_items(DataConfig(train_urls=[str(mid)]), "train")
    assert load_items(DataConfig(train_urls=[str(mid), src], on_error="skip"), "train")


def test_s3_gs_and_pipe_urls_go_through_argument_list_subprocesses(shards, tmp_path, monkeypatch):
    """Stand-ins for the aws / gsutil CLIs (the real ones need credentials and network) prove that
    s3:// and gs:// URLs are handed to them as argument lists and streamed from their stdout."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    root = str(shards["dir"])
    (bindir / "aws").write_text(f'#!/bin/sh\n[ "$1 $2 $4" = "s3 cp -" ] || exit 3\n'
                                f'exec cat "{root}/${{3#s3://bucket/ds/}}"\n')
    (bindir / "gsutil").write_text(f'#!/bin/sh\n[ "$1" = "cat" ] || exit 3\nexec cat "{root}/${{2#gs://bucket/ds/}}"\n')
    for f in ("aws", "gsutil"):
        os.chmod(bindir / f, 0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    names = [os.path.basename(t) for t in shards["tars"]]
    want = _ids(ShardDataset(shards["tars"]))
    assert _ids(ShardDataset([f"s3://bucket/ds/{n}" for n in names])) == want
    assert _ids(ShardDataset([f"gs://bucket/ds/{n}" for n in names])) == want
    assert _ids(ShardDataset([f"pipe:cat {t}" for t in shards["tars"]])) == want
    with pytest.raises(ShardError, match="missing-000000.tar"):  # the CLI fails: a clear error naming the shard
        list(ShardDataset(["s3://bucket/ds/missing-000000.tar"]))
    ds = ShardDataset(["s3://bucket/ds/missing-000000.tar", f"s3://bucket/ds/{names[0]}"], on_error="skip")
    assert len(_ids(ds)) == sum(QUESTIONS[:3]) and ds.stats.skipped_shards == 1


def test_the_shard_writer_imports_beam_without_its_gcp_warning():
    # the trainer's benchmarks write shards through longreel.task.shard_format without the CLI's logging set-up;
    # Beam's import warned there that optional GCP libraries are absent (a line in every benchmark's output)
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO); import longreel.task.shard_format; "
            "logging.getLogger().warning('after the import')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "after the import" in run.stderr  # other records still pass
    assert "apitools" not in run.stderr


def test_local_globs_expand_sorted_and_must_match(tmp_path):
    # what the README's `data.train_urls=[OUT/shards/*-sft-*.tar]` relies on
    for name in ("ds-sft-000001.tar", "ds-sft-000000.tar", "ds-rl-000000.tar"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ds-sft-dir.tar").mkdir()  # a directory is not a shard
    want = [str(tmp_path / "ds-sft-000000.tar"), str(tmp_path / "ds-sft-000001.tar")]
    assert [s.url for s in resolve_shards(f"{tmp_path}/*-sft-*.tar")] == want
    assert [s.url for s in resolve_shards(f"file://{tmp_path}/ds-sft-00000[01].tar")] == want
    # braces first, then each alternative globbed
    assert [s.url for s in resolve_shards(f"{tmp_path}/ds-{{rl,sft}}-*.tar")] == [str(tmp_path / "ds-rl-000000.tar"),
                                                                                  *want]
    with pytest.raises(ValueError, match="matches no file"):
        resolve_shards(f"{tmp_path}/*-test-*.tar")
    with pytest.raises(ValueError, match="local paths only"):
        resolve_shards("s3://bucket/ds-*.tar")
    # an http(s) URL is not a glob: '?' starts its query
    signed = "https://host/ds-000000.tar?sig=a*b"
    assert [s.url for s in resolve_shards(signed)] == [signed]


def test_remote_shards_are_read_from_a_verified_disk_cache(shards, tmp_path):
    # the trainer's load_items: an http shard is downloaded once into data.cache_dir (content-addressed by the
    # index's sha256), then memory-mapped like a local one; the items are those of the local shards
    from longreel.trainer.config import DataConfig
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.runtime import load_items

    from conftest import file_server

    doc = json.loads(open(shards["index"]).read())
    cache = tmp_path / "cache"
    tampered = Path(shards["dir"]) / "tampered.index.json"
    with file_server(shards["dir"]) as (base, served):
        try:
            url = f"{base}/{os.path.basename(shards['index'])}"
            local = load_items(DataConfig(train_urls=[shards["index"]]), "train")
            remote = load_items(DataConfig(train_urls=[url], cache_dir=str(cache)), "train")
            n_get = len(served)
            for f in cache.glob("*.tar"):
                os.utime(f, (1e9, 1e9))  # last used in 2001
            again = load_items(DataConfig(train_urls=[url], cache_dir=str(cache)), "train")
            assert len(served) == n_get + 1  # only the index again: the shards came from the cache
            # a reuse is a use: `longreel cache prune` evicts the least recently used by mtime
            assert all(f.stat().st_mtime > 1.5e9 for f in cache.glob("*.tar"))
            streamed = load_items(DataConfig(train_urls=[url], cache_remote=False, cache_dir=str(tmp_path / "no")),
                                  "train")
            # a cache directory that cannot be made is the input's error, naming the way out
            (tmp_path / "a-file").write_text("")
            with pytest.raises(InputCheckError, match="cannot use the shard cache .*data.cache_remote=false"):
                load_items(DataConfig(train_urls=[url], cache_dir=str(tmp_path / "a-file" / "cache")), "train")
            # an index whose sha256 does not match what the server sends: refused, nothing cached under that name
            doc["shardlist"][0]["sha256"] = "0" * 64
            tampered.write_text(json.dumps(doc))
            with pytest.raises(InputCheckError, match="does not match the index's 0000"):
                load_items(DataConfig(train_urls=[f"{base}/tampered.index.json"], cache_dir=str(cache)), "train")
            # a shard the server does not have: data.on_error=skip cannot skip a download before step 1, and the
            # message says what does (it named data.on_error=skip as the way out, which then failed the same way)
            with pytest.raises(InputCheckError, match=r"404.*stops a run that loads its shards before step 1; with "
                                                      r"data.stream=true, data.on_error=skip skips it"):
                load_items(DataConfig(train_urls=[f"{base}/gone-000000.tar"], cache_dir=str(cache),
                                      on_error="skip"), "train")
        finally:
            tampered.unlink(missing_ok=True)
    want = [e["sha256"] + ".tar" for e in json.loads(open(shards["index"]).read())["shardlist"]]
    assert sorted(p.name for p in cache.glob("*.tar")) == sorted(want)
    assert not (tmp_path / "no").exists()
    for got in (remote, again, streamed):
        assert [r["qra_id"] for r in got] == [x["qra_id"] for x in local]
        for r, x in zip(got, local):
            assert torch.equal(r["frames"], x["frames"]) and r["meta"] == x["meta"]
            assert r["shard"] == f"{base}/{os.path.basename(x['shard'])}"  # the URL given, not the cache file


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_sample_in_a_cached_shard_is_named_by_the_shards_url(shards, tmp_path, stream):
    # a cache file is named by the index's sha256, which does not say which of the user's shards it holds: an error
    # met in the cached copy names the shard's URL, and the copy; the items name the URL too
    import hashlib
    import shutil

    from longreel.trainer.config import DataConfig
    from longreel.trainer.preflight import InputCheckError
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_stream import ShardItemStream

    from conftest import file_server

    served_dir = tmp_path / "served"
    served_dir.mkdir()
    for t in shards["tars"]:
        shutil.copy(t, served_dir)
    victim = served_dir / os.path.basename(shards["tars"][1])
    offs = _member_offsets(str(victim))
    _flip(str(victim), offs[sorted(offs)[5]][0] + 10, str(victim))  # a tar header in the middle of the shard
    doc = json.loads(open(shards["index"]).read())
    for e in doc["shardlist"]:  # the index describes the served bytes: the download verifies, the read does not
        if e["url"].endswith(victim.name):
            e["sha256"], e["bytes"] = hashlib.sha256(victim.read_bytes()).hexdigest(), victim.stat().st_size
    (served_dir / "ds.index.json").write_text(json.dumps(doc))

    def read(url, **kw):
        cfg = DataConfig(train_urls=[url], cache_dir=str(tmp_path / "cache"), **kw)
        if not stream:
            return load_items(cfg, "train")
        s = ShardItemStream([url], seed=0, shuffle=False, cache_dir=cfg.cache_dir, on_error=cfg.on_error)
        try:
            return [it for _, it in s.next_batch(sum(QUESTIONS))]
        finally:
            s.close()

    with file_server(served_dir) as (base, _):
        with pytest.raises((InputCheckError, ShardError)) as e:
            read(f"{base}/ds.index.json")
        good = read(f"{base}/ds.index.json", on_error="skip")
    msg = str(e.value)
    assert f"{base}/{victim.name}: " in msg and "corrupt tar stream" in msg
    assert f"(read from its cached copy {tmp_path / 'cache'}" in msg
    assert good and all(it["shard"].startswith(f"{base}/") for it in good)



def test_shard_cache_benchmark_loads_the_same_items_in_every_mode(tmp_path):
    from conftest import load_benchmark

    bench = load_benchmark("shard_cache")
    out = tmp_path / "shard_cache.json"
    assert bench.main(["--items", "6", "--size", "56", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["items_identical_in_every_mode"] and set(doc["modes"]) == set(bench.MODES)
    assert all(m["items"] == 6 for m in doc["modes"].values())
    assert doc["modes"]["stream_http_nocache"]["cache_mb_at_first_batch"] == 0.0
    assert 0 < doc["cache_mb_at_first_batch"]["stream"] <= doc["cache_mb_at_first_batch"]["load"]
