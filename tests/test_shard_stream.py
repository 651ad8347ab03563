"""data.stream: the trainer reads its shards as a stream (trainer/shard_stream.py) instead of loading every item
before step 1. The order is seeded and resumable, remote shards are cached as they are reached, and training from
the stream resumes bitwise."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tarfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from safetensors.torch import load_file  # noqa: E402

from longreel.schemas.config import ConfigError, load_yaml  # noqa: E402
from longreel.trainer.config import DataConfig, TrainConfig  # noqa: E402
from longreel.trainer.data import ShardError  # noqa: E402
from longreel.trainer.logging_utils import read_metrics  # noqa: E402
from longreel.trainer.preflight import InputCheckError, check_resume  # noqa: E402
from longreel.trainer.runtime import load_items  # noqa: E402
from longreel.trainer.shard_stream import ShardItemStream  # noqa: E402
from longreel.trainer.synthetic_task import make_items, write_shards  # noqa: E402
from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402
from conftest import QuietFiles, file_server  # noqa: E402

N_ITEMS, PER_SHARD = 18, 4  # five shards, the last one short


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    index = write_shards(make_items(N_ITEMS, seed=5, kinds=("colour", "count")), str(root / "shards"),
                         per_shard=PER_SHARD)
    return {"index": index, "dir": Path(index).parent, "model": build_tiny_qwen2vl(root / "m", seed=0)}


def _index(data) -> list[dict]:
    return json.loads(Path(data["index"]).read_text())["shardlist"]


def _ids(batch) -> list[str]:
    return [it["qra_id"] for _, it in batch]


def test_every_epoch_holds_every_item_once_in_an_order_the_seed_fixes(data):
    loaded = [it["qra_id"] for it in load_items(DataConfig(train_urls=[data["index"]]), "train")]
    s = ShardItemStream([data["index"]], seed=3)
    first, second = s.next_batch(N_ITEMS), s.next_batch(N_ITEMS)
    assert Counter(_ids(first)) == Counter(loaded) == Counter(_ids(second))
    assert [i for i, _ in first + second] == list(range(2 * N_ITEMS))  # the index is the draw's place in the stream
    assert _ids(first) != _ids(second) and _ids(first) != loaded  # shards and items permuted, anew each epoch
    assert _ids(ShardItemStream([data["index"]], seed=3).next_batch(2 * N_ITEMS)) == _ids(first + second)
    assert _ids(ShardItemStream([data["index"]], seed=4).next_batch(N_ITEMS)) != _ids(first)
    # without shuffle: the shards' own order, which is the loaded order
    assert _ids(ShardItemStream([data["index"]], seed=3, shuffle=False).next_batch(N_ITEMS)) == loaded


@pytest.mark.parametrize("stop", [1, 7, N_ITEMS, N_ITEMS + 5])
def test_a_stream_resumes_where_it_stopped(data, stop):
    straight = _ids(ShardItemStream([data["index"]], seed=3).next_batch(2 * N_ITEMS + 3))
    s = ShardItemStream([data["index"]], seed=3)
    head = s.next_batch(stop)
    state = json.loads(json.dumps(s.state_dict()))  # it goes through trainer_state.json
    again = ShardItemStream([data["index"]], seed=3)
    again.load_state_dict(state)
    tail = again.next_batch(2 * N_ITEMS + 3 - stop)
    assert _ids(head) + _ids(tail) == straight
    assert [i for i, _ in tail] == list(range(stop, 2 * N_ITEMS + 3))
    # another seed is another order: its position means nothing here
    other = ShardItemStream([data["index"]], seed=4)
    with pytest.raises(InputCheckError, match="the shard stream cannot resume: seed differs"):
        other.load_state_dict(state)


def test_a_stream_without_items_is_an_input_error_not_a_hang(data, tmp_path):
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()  # a well-formed tar without a sample
    with pytest.raises(InputCheckError, match="no training items"):
        ShardItemStream([str(empty)], seed=0).next_batch(1)
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"x" * 1024)  # not a tar
    with pytest.raises(InputCheckError, match="data.on_error=skip"):
        ShardItemStream([str(broken)], seed=0).next_batch(1)
    with pytest.raises(InputCheckError, match="no training items"):
        ShardItemStream([str(broken)], seed=0, on_error="skip").next_batch(1)


def test_remote_shards_are_cached_as_the_stream_reaches_them(data, tmp_path):
    cache = tmp_path / "cache"
    with file_server(data["dir"]) as (base, served):
        s = ShardItemStream([f"{base}/{os.path.basename(data['index'])}"], seed=3, cache_dir=str(cache))
        first = s.next_batch(1)
        # the first shard, and at most the one being downloaded ahead: not the whole dataset before the first item
        assert 1 <= len(list(cache.glob("*.tar"))) <= 2
        rest = s.next_batch(N_ITEMS - 1)
        s.close()
    assert len(list(cache.glob("*.tar"))) == 5 and s.fetcher.downloaded == 5
    tars = [p for p in served if p.endswith(".tar")]
    assert len(tars) == len(set(tars)) == 5  # each shard downloaded once
    local = ShardItemStream([data["index"]], seed=3).next_batch(N_ITEMS)
    got = first + rest
    assert _ids(got) == _ids(local)  # the order does not depend on where a shard is read from
    for (_, r), (_, x) in zip(got, local):
        assert torch.equal(r["frames"], x["frames"])
        assert r["shard"] == f"{base}/{os.path.basename(x['shard'])}"  # the URL given, not the cache file


def test_the_stream_names_the_cache_only_for_remote_shards(data, tmp_path, caplog):
    """Local shards are read where they are: the log said they were "cached in" the remote-shard cache."""
    with caplog.at_level(logging.INFO, logger="longreel"):
        ShardItemStream([data["index"]], seed=3, cache_dir=str(tmp_path / "cache")).close()
        with file_server(data["dir"]) as (base, _):
            ShardItemStream([f"{base}/{os.path.basename(data['index'])}"], seed=3,
                            cache_dir=str(tmp_path / "cache")).close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.stream:")]
    assert len(lines) == 2 and "cached" not in lines[0]
    assert "5 remote shard(s) cached in" in lines[1]


def _train_cfg(data, out: Path, stage: str, *extra: str) -> TrainConfig:
    sets = [f"model.path={data['model']}", f"run.out_dir={out}", "data.source=shards",
            f"data.train_urls=[{data['index']}]", "data.stream=true", "data.shuffle_buffer=2", "data.batch_size=2",
            "run.steps=6", "run.save_every=3", "run.progress=false", "run.tensorboard=false", "run.seed=3",
            "optim.lr=3e-3", "rollout.n=3", "rollout.max_new_tokens=6"]
    if stage == "grpo":
        sets += ["grpo.mix_policy=true", "grpo.beta=0.05"]
    return load_yaml(TrainConfig, None, [*sets, *extra])


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_training_from_a_stream_resumes_bitwise(data, tmp_path, stage):
    from longreel.trainer.grpo import run_grpo
    from longreel.trainer.sft import run_sft

    run = run_grpo if stage == "grpo" else run_sft
    keys = ("loss", "grad_norm", "lr") + (("reward_mean", "kl") if stage == "grpo" else ())
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(_train_cfg(data, straight, stage))
    assert run(_train_cfg(data, resumed, stage, "run.stop_after=4"))["stopped"]
    state = json.loads((resumed / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["loader"]["kind"] == "shard_stream" and state["loader"]["drawn"] == 8
    # the position is saved: a run that would read the shards in another way is refused, naming the key
    with pytest.raises(InputCheckError, match="data.stream: True there, False in this run"):
        check_resume(_train_cfg(data, resumed, stage, "data.stream=false"), stage,
                     resumed / "checkpoints" / "step-000004")
    assert run(_train_cfg(data, resumed, stage))["step"] == 6
    a, b = load_file(str(straight / "final" / "model.safetensors")), load_file(str(resumed / "final" /
                                                                                   "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[tuple(r.get(k) for k in ("step", *keys)) for r in read_metrics(d / "metrics.jsonl")]
            for d in (straight, resumed)]
    assert [r[0] for r in rows[0]] == [1, 2, 3, 4, 5, 6] and rows[0] == rows[1]
    base = load_file(str(Path(data["model"]) / "model.safetensors"))
    assert any(not torch.equal(base[k], v) for k, v in a.items())


@pytest.mark.parametrize("sets, message", [
    (["data.source=synthetic"], "data.stream needs data.source=shards"),
    (["run.steps=0"], "data.stream needs run.steps > 0"),
    (["data.shuffle_buffer=0"], "data.shuffle_buffer must be >= 1"),
])
def test_stream_settings_that_cannot_work_are_config_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_yaml(TrainConfig, None, ["data.stream=true", "data.train_urls=[a.tar]", *sets]).check()


def test_stream_with_sft_max_items_is_refused_for_sft_only():
    """A GRPO run never reads sft.max_items: refusing it there broke the one config file both stages share."""
    from longreel.trainer.preflight import InputCheckError, check_topology

    cfg = load_yaml(TrainConfig, None, ["data.stream=true", "data.train_urls=[a.tar]", "sft.max_items=4"])
    with pytest.raises(InputCheckError, match="data.stream cannot take the first sft.max_items"):
        check_topology(cfg, "sft", 1)
    check_topology(cfg, "grpo", 1)
    with pytest.raises(ConfigError, match="run.out_dir must name a directory"):
        load_yaml(TrainConfig, None, ["run.out_dir="])


def test_remote_shards_that_would_not_fit_in_the_cache_stop_the_run_before_it_starts(data, tmp_path, capsys):
    # the index gives each shard's size: loading needs all of them on the cache's disk before step 1, the stream the
    # largest two; a run that would have filled the disk partway is one line and exit 2 naming the way out
    from longreel.cli import main
    from longreel.trainer.preflight import check_cache_space, check_shards

    def sha(name: str, i: int) -> str:
        return hashlib.sha256(f"{name}-{i}".encode()).hexdigest()

    def index(name: str, sizes: list[int]) -> str:
        doc = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": name,
               "shardlist": [{"url": f"http://127.0.0.1:9/{name}-{i}.tar", "bytes": b, "nsamples": 1,
                              "sha256": sha(name, i)} for i, b in enumerate(sizes)]}
        (tmp_path / f"{name}.index.json").write_text(json.dumps(doc))
        return str(tmp_path / f"{name}.index.json")

    free = shutil.disk_usage(tmp_path).free
    cache = str(tmp_path / "cache" / "not-made-yet")
    many = index("many", [free // 3] * 4)  # more than the disk holds, though any two fit
    specs = check_shards([many], "data.train_urls")
    with pytest.raises(InputCheckError, match="need .* GB, .* GB is free there: set data.stream=true"):
        check_cache_space(DataConfig(train_urls=[many], cache_dir=cache), specs)
    check_cache_space(DataConfig(train_urls=[many], cache_dir=cache, stream=True), specs)
    check_cache_space(DataConfig(train_urls=[many], cache_dir=cache, cache_remote=False), specs)
    huge = index("huge", [free, free])
    with pytest.raises(InputCheckError, match=r"\(the largest two\).*data.cache_dir to a larger disk"):
        check_cache_space(DataConfig(train_urls=[huge], cache_dir=cache, stream=True),
                          check_shards([huge], "data.train_urls"))
    # a shard already in the cache is not counted again
    Path(cache).mkdir(parents=True)
    for i in range(3):
        (Path(cache) / f"{sha('many', i)}.tar").write_bytes(b"")
    check_cache_space(DataConfig(train_urls=[many], cache_dir=cache), specs)
    # from the command line, before the model loads
    rc = main(["train", "grpo", "--set", f"model.path={data['model']}", "--set", f"data.train_urls=[{huge}]",
               "--set", f"data.cache_dir={cache}", "--set", f"run.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "remote training shard(s) not yet cached need" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("stream", [False, True])
def test_a_shard_read_without_the_cache_is_read_again_when_its_transfer_breaks(data, tmp_path, monkeypatch, caplog,
                                                                                stream):
    # data.cache_remote=false reads shards straight from the network: a transfer cut short is read again from the
    # start, skipping what was read, so the items and their order are an unbroken read's; a 404 is not read again
    from longreel.trainer import transfer_retry

    monkeypatch.setattr(transfer_retry, "RETRY_BASE_S", 0.0)
    first = sorted(p.name for p in Path(data["dir"]).glob("*.tar"))[0]
    cuts = {"n": 1}

    class Cut(QuietFiles):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[-1]
            if name == first and cuts["n"]:
                cuts["n"] -= 1
                body = Path(data["dir"], name).read_bytes()
                self.send_start(len(body), body[:len(body) * 3 // 5])  # past the first samples, then it closes
                return
            super().do_GET()

    def read(index, **kw):
        cfg = DataConfig(train_urls=[index], cache_remote=False, cache_dir=str(tmp_path / "unused"), **kw)
        if not stream:
            return [it["qra_id"] for it in load_items(cfg, "train")]
        s = ShardItemStream([index], seed=3, shuffle=False, cache_dir=None, retries=cfg.fetch_retries)
        return _ids(s.next_batch(N_ITEMS))

    want = [it["qra_id"] for it in load_items(DataConfig(train_urls=[data["index"]]), "train")]
    missing_index = Path(data["dir"], "with-missing-direct.index.json")
    with file_server(data["dir"], Cut) as (base, served):
        gets = lambda name: sum(p.endswith("/" + name) for p in served)  # noqa: E731
        index = f"{base}/{os.path.basename(data['index'])}"
        try:
            with caplog.at_level("WARNING", logger="longreel"):
                assert read(index) == want
            assert gets(first) == 2
            assert sum("reading it again" in r.getMessage() for r in caplog.records) == 1
            cuts["n"] = 5  # out of tries: the shard's error, after 1 + fetch_retries reads
            with pytest.raises((InputCheckError, ShardError), match=rf"{first}"):
                read(index, fetch_retries=1)
            assert gets(first) == 4
            cuts["n"] = 0
            doc = json.loads(Path(data["index"]).read_text())
            doc["shardlist"][0]["url"] = "missing.tar"
            missing_index.write_text(json.dumps(doc))
            with pytest.raises((InputCheckError, ShardError), match="missing.tar.*404"):
                read(f"{base}/{missing_index.name}")
            assert gets("missing.tar") == 1
        finally:
            missing_index.unlink(missing_ok=True)
    assert not (tmp_path / "unused").exists()


def test_a_read_again_skips_what_was_handled_and_reports_a_bad_sample_once(monkeypatch):
    # the first read gives samples 0 and 1, reports 2 bad and breaks at 3; the second read must start at 3
    from longreel.task.shard_reader import LoaderStats, ShardSpec
    from longreel.trainer import remote_read, transfer_retry

    monkeypatch.setattr(transfer_retry, "RETRY_BASE_S", 0.0)
    reads = []

    def scripted(spec, stats, fail, *, keep, **kw):
        reads.append([])
        for i in range(5):
            if not keep(i):
                continue
            reads[-1].append(i)
            if len(reads) == 1 and i == 2:
                fail(ShardError(spec.url, f"k{i}", "bad json"), False)
                continue
            if len(reads) == 1 and i == 3:
                fail(ShardError(spec.url, None, "reading failed: ConnectionResetError"), True)
                return
            yield {"i": i}

    monkeypatch.setattr(remote_read, "read_shard", scripted)
    failed = []
    got = list(remote_read.read_remote_shard(ShardSpec("http://x/a.tar"), LoaderStats(),
                                             lambda e, whole: failed.append((e.detail, whole)), retries=2))
    assert [s["i"] for s in got] == [0, 1, 3, 4]
    assert reads == [[0, 1, 2, 3], [3, 4]]
    assert failed == [("bad json", False)]  # once, and the break that was read again is not reported


def test_closing_the_stream_stops_the_download_ahead(data, tmp_path):
    # a run that ends (or is interrupted) while the next shard downloads must not wait for a shard it will not read,
    # nor for a stalled server: the server sends half of the second shard, then stalls until the stream's close has
    # returned (or 10 s pass). Before the close cut the socket, the copy sat in its read until the stall ended.
    first, second = sorted(p.name for p in Path(data["dir"]).glob("*.tar"))[:2]
    cache = tmp_path / "cache"
    closed, stall = threading.Event(), {}

    class Stalled(QuietFiles):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[-1]
            if name != second:
                return super().do_GET()
            body = Path(data["dir"], name).read_bytes()
            self.send_start(len(body), body[:len(body) // 2])
            stall["ended_by_close"] = closed.wait(10)
            try:
                self.wfile.write(body[len(body) // 2:])
            except OSError:  # the client has gone
                pass

    with file_server(data["dir"], Stalled) as (base, served):
        s = ShardItemStream([f"{base}/{os.path.basename(data['index'])}"], seed=3, shuffle=False,
                            cache_dir=str(cache))
        s.next_batch(1)  # reads the first shard; the second starts downloading ahead
        while not any(p.endswith("/" + second) for p in served):
            time.sleep(0.01)
        s.close()
        closed.set()
    assert stall["ended_by_close"] is True  # the close returned while the server still stalled
    assert sorted(p.name for p in cache.glob("*.tar")) == [f"{e['sha256']}.tar" for e in _index(data)[:1]]
    assert not [p for p in cache.iterdir() if not p.name.endswith((".tar", ".lock"))]  # no partial download left


@pytest.mark.parametrize("stream", [False, True])
def test_a_download_that_fails_in_transport_is_tried_again(data, tmp_path, monkeypatch, caplog, stream):
    # an object store drops connections and answers 503 now and then: hours into a run that must not stop it. A 404
    # is not passing, and is not tried again.
    from longreel.trainer import transfer_retry

    monkeypatch.setattr(transfer_retry, "RETRY_BASE_S", 0.0)
    failures = {"drop": 2, "503": 1}  # the first shard's first two GETs are cut off, the second's first is a 503
    first, second = sorted(p.name for p in Path(data["dir"]).glob("*.tar"))[:2]

    class Flaky(QuietFiles):
        def do_GET(self):
            name = self.path.rsplit("/", 1)[-1]
            if name == first and failures["drop"]:
                failures["drop"] -= 1
                self.send_start(100000, b"\0" * 100)  # then the connection closes: a truncated transfer
                return
            if name == second and failures["503"]:
                failures["503"] -= 1
                self.served.append(self.path)
                self.send_error(503)
                return
            super().do_GET()

    missing_index = Path(data["dir"], "with-missing.index.json")
    with file_server(data["dir"], Flaky) as (base, served):
        gets = lambda name: sum(p.endswith("/" + name) for p in served)  # noqa: E731
        index = f"{base}/{os.path.basename(data['index'])}"
        cfg = DataConfig(train_urls=[index], cache_dir=str(tmp_path / "cache"), stream=stream)
        try:
            with caplog.at_level("WARNING", logger="longreel"):
                if stream:
                    s = ShardItemStream([index], seed=3, shuffle=False, cache_dir=cfg.cache_dir)
                    got = _ids(s.next_batch(N_ITEMS))
                    s.close()
                else:
                    got = [it["qra_id"] for it in load_items(cfg, "train")]
            assert got == [it["qra_id"] for it in load_items(DataConfig(train_urls=[data["index"]]), "train")]
            assert (gets(first), gets(second)) == (3, 2)
            assert sum("trying again" in r.getMessage() for r in caplog.records) == 3
            # out of tries: the shard's URL, the cause and the count, as the input's error (exit 2 from the CLI)
            failures["503"] = 5
            with pytest.raises(InputCheckError, match=rf"{second}: cannot download .*503.*after 2 tries"):
                load_items(DataConfig(train_urls=[index], cache_dir=str(tmp_path / "again"), fetch_retries=1),
                           "train")
            # a missing shard is not tried again
            doc = json.loads(Path(data["index"]).read_text())
            doc["shardlist"][0]["url"] = "missing.tar"
            missing_index.write_text(json.dumps(doc))
            with pytest.raises(InputCheckError, match="missing.tar: cannot download .*404"):
                load_items(DataConfig(train_urls=[f"{base}/{missing_index.name}"], cache_dir=str(tmp_path / "m")),
                           "train")
            assert gets("missing.tar") == 1
        finally:
            missing_index.unlink(missing_ok=True)


def test_a_stop_cuts_a_pipe_that_waits_on_its_source(tmp_path, monkeypatch):
    # gs:// and s3:// shards come through a gsutil / aws process: a stop kills it, so a copy waiting on a source that
    # sends nothing more ends with the stop, not when the source does (the child below would take 60 s)
    import sys

    from webdataset.gopen import Pipe

    from longreel.task.shard_reader import ShardSpec, copy_verified
    from longreel.task.transfer_stop import StopSignal

    child = "import sys, time; sys.stdout.buffer.write(b'x' * 100); sys.stdout.flush(); time.sleep(60)"
    pipes, first_bytes = [], threading.Event()

    def open_pipe(url):
        pipe = Pipe([sys.executable, "-c", child], mode="rb", bufsize=0, ignore_status=[141])
        read = pipe.read

        def read_and_tell(n):
            chunk = read(n)
            first_bytes.set()
            return chunk

        pipe.read = read_and_tell
        pipes.append(pipe)
        return pipe

    stop, result = StopSignal(), {}

    def copy():
        try:
            with open(tmp_path / "out", "wb") as out:
                copy_verified(ShardSpec("gs://bucket/a.tar"), out, stop)
        except BaseException as e:  # noqa: BLE001 - the test reads what ended the copy
            result["error"] = e

    import longreel.task.shard_reader as shard_reader

    monkeypatch.setattr(shard_reader, "open_url", open_pipe)
    t = threading.Thread(target=copy, daemon=True)
    t.start()
    assert first_bytes.wait(30)  # the copy has the first bytes and waits on the source for more
    stop.set()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(result.get("error"), InterruptedError), result
    assert pipes[0].proc.returncode == -9  # killed by the stop, not ended by its source
