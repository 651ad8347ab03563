"""Remote shards whose server or URL is not what the cache assumed: a bare URL's cached copy is checked with the
server before it is reused; a complete transfer that does not match the index is the file's error, reported once and
not tried again (through the cache and without it); a URL with credentials is refused before anything is fetched,
and no message shows the password."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from longreel.schemas.config import ConfigError
from longreel.task.shard_format import write_shard_atomic
from longreel.task.shard_reader import LoaderStats, ShardError, ShardSpec
from longreel.trainer.config import DataConfig

from conftest import QuietFiles, file_server


def _write_shard(path: Path, n: int, answer: str = "A") -> bytes:
    """A shard of ``n`` samples with one question each (``answer`` changes its bytes, not its size)."""
    samples = []
    for i in range(n):
        key = hashlib.sha256(f"v{i}".encode()).hexdigest()[:16]
        buf = io.BytesIO()
        np.save(buf, np.full((2, 8, 8, 3), i, dtype=np.uint8), allow_pickle=False)
        npy = path.parent / f".{key}.npy"
        npy.write_bytes(buf.getvalue())
        samples.append({"key": key, "files": [
            {"name": "frames.npy", "path": str(npy), "size": len(buf.getvalue()),
             "sha256": hashlib.sha256(buf.getvalue()).hexdigest()},
            {"name": "meta.json", "text": json.dumps({"key": key, "video_id": key, "num_frames": 2})},
            {"name": "qras.json", "text": json.dumps([{"qra_id": f"{key}-0", "question": "q?", "answer": answer}])}]})
    write_shard_atomic(str(path), sorted(samples, key=lambda s: s["key"]))
    for npy in path.parent.glob(".*.npy"):
        npy.unlink()
    return path.read_bytes()


@pytest.fixture
def no_backoff(monkeypatch):
    from longreel.trainer import transfer_retry

    monkeypatch.setattr(transfer_retry, "RETRY_BASE_S", 0.0)


def _load(url: str, cache: Path, stream: bool) -> list[dict]:
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_stream import ShardItemStream

    if not stream:
        return load_items(DataConfig(train_urls=[url], cache_dir=str(cache)), "train")
    s = ShardItemStream([url], seed=0, shuffle=False, cache_dir=str(cache), retries=0)
    try:
        return list(s.ds)
    finally:
        s.close()


# ------------------------------------------------------------------------------------------------ 1: revalidation


@pytest.mark.parametrize("stream", [False, True])
def test_a_bare_urls_cached_copy_is_downloaded_again_once_the_server_file_changed(tmp_path, caplog, stream):
    # http.server gives Last-Modified (to the second) and Content-Length: a shard replaced by a smaller one within
    # the same second differs in size. The old cache kept the 4-sample copy: 4 items where the server now has 2.
    srv, cache = tmp_path / "srv", tmp_path / "cache"
    srv.mkdir()
    served_file = srv / "ds-rl-000000.tar"
    _write_shard(served_file, 4)
    with file_server(srv) as (base, served):
        url = f"{base}/{served_file.name}"
        assert len(_load(url, cache, stream)) == 4 and len(served) == 1
        assert len(_load(url, cache, stream)) == 4 and len(served) == 1  # unchanged: reused after a HEAD
        _write_shard(served_file, 2)
        with caplog.at_level("INFO", logger="longreel"):
            assert len(_load(url, cache, stream)) == 2 and len(served) == 2
        assert any("changed on the server since it was cached" in r.getMessage() for r in caplog.records)
        assert len(_load(url, cache, stream)) == 2 and len(served) == 2
    assert len(list(cache.glob("*.tar"))) == 1
    # the server gone: the copy is used, with a warning that says it could not be checked
    caplog.clear()
    with caplog.at_level("WARNING", logger="longreel"):
        assert len(_load(url, cache, stream)) == 2
    assert any("could not be revalidated" in r.getMessage() for r in caplog.records)


def test_a_changed_etag_brings_the_new_file_even_at_the_same_size(tmp_path):
    from longreel.trainer.shard_cache import cache_remote_shards

    srv, cache = tmp_path / "srv", tmp_path / "cache"
    srv.mkdir()
    served_file = srv / "ds-rl-000000.tar"
    old = _write_shard(served_file, 3, answer="A")
    etag = {"v": '"one"'}

    class Tagged(QuietFiles):
        def end_headers(self):
            self.send_header("ETag", etag["v"])
            super().end_headers()

    with file_server(srv, Tagged) as (base, served):
        url = f"{base}/{served_file.name}"
        [copy] = cache_remote_shards([ShardSpec(url)], str(cache))
        assert Path(copy.url).read_bytes() == old
        new = _write_shard(served_file, 3, answer="B")
        assert len(new) == len(old) and new != old
        cache_remote_shards([ShardSpec(url)], str(cache))
        assert len(served) == 1  # the same ETag: the copy is kept (the server vouches for it)
        etag["v"] = '"two"'
        [copy] = cache_remote_shards([ShardSpec(url)], str(cache))
        assert len(served) == 2 and Path(copy.url).read_bytes() == new


# ------------------------------------------------------------------------------------------------ 2: content errors


def _short_file(tmp_path: Path) -> tuple[Path, bytes, bytes]:
    """The served directory with a shard whose file was cut (served whole: its Content-Length is the cut length);
    the good shard's bytes and the cut ones."""
    srv = tmp_path / "srv"
    srv.mkdir()
    full = _write_shard(srv / "ds-rl-000000.tar", 4)
    cut = full[:len(full) // 3]  # inside a member (the tar ends in a 10240-byte record of padding)
    (srv / "ds-rl-000000.tar").write_bytes(cut)
    return srv, full, cut


@pytest.mark.parametrize("fetcher", [False, True])
def test_a_whole_file_shorter_than_the_index_says_is_not_downloaded_again(tmp_path, caplog, no_backoff, fetcher):
    from longreel.trainer.shard_cache import ShardFetcher, cache_remote_shards

    srv, full, cut = _short_file(tmp_path)
    with file_server(srv) as (base, served):
        spec = ShardSpec(f"{base}/ds-rl-000000.tar", hashlib.sha256(full).hexdigest(), len(full), 4)
        with caplog.at_level("WARNING", logger="longreel"), pytest.raises(ShardError) as e:
            if fetcher:
                f = ShardFetcher(str(tmp_path / "cache"), retries=3)
                try:
                    f(spec)
                finally:
                    f.close()
            else:
                cache_remote_shards([spec], str(tmp_path / "cache"), retries=3)
    assert len(served) == 1  # not 4 (1 + 3 tries, with 1/2/4 s between them)
    assert f"the server's file is {len(cut)} bytes, the index says {len(full)}: the shard or its index is out of " \
           "date" in str(e.value)
    assert not any("trying again" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "cache").glob("*.tar"))


def test_a_whole_file_whose_sha256_differs_is_not_downloaded_again(tmp_path, no_backoff):
    from longreel.trainer.shard_cache import cache_remote_shards

    srv = tmp_path / "srv"
    srv.mkdir()
    full = _write_shard(srv / "ds-rl-000000.tar", 2)
    with file_server(srv) as (base, served):
        spec = ShardSpec(f"{base}/ds-rl-000000.tar", "0" * 64, len(full), 2)
        with pytest.raises(ShardError, match=r"does not match the index's 0{64}: the shard or its index is out"):
            cache_remote_shards([spec], str(tmp_path / "cache"), retries=3)
    assert len(served) == 1


def test_a_short_file_read_without_the_cache_is_not_read_again(tmp_path, caplog, no_backoff):
    # the tar parser meets the end inside a member either way; the server's size tells the file's end from a cut
    from longreel.trainer.data import ShardDataset

    srv, full, cut = _short_file(tmp_path)
    with file_server(srv) as (base, served):
        spec = ShardSpec(f"{base}/ds-rl-000000.tar", None, len(full), 4)
        ds = ShardDataset([spec], retries=3, on_error="skip", rank=0, world_size=1)
        with caplog.at_level("WARNING", logger="longreel"):
            got = list(ds)
        failed = ds.stats.errors
    assert len(served) == 1
    assert not any("reading it again" in r.getMessage() for r in caplog.records)
    assert len(failed) == 1 and ds.stats.skipped_shards == 1
    assert f"the server's file is {len(cut)} bytes, the index says {len(full)}: the shard or its index is out of " \
           "date" in failed[0]
    assert 0 < len(got) < 4  # the whole samples before the end, once each
    assert len({it["qra_id"] for it in got}) == len(got)


def test_a_transfer_cut_before_its_content_length_is_still_read_again(tmp_path, no_backoff):
    from longreel.trainer.data import ShardDataset

    srv = tmp_path / "srv"
    srv.mkdir()
    full = _write_shard(srv / "ds-rl-000000.tar", 4)
    cuts = {"n": 1}

    class Cut(QuietFiles):
        def do_GET(self):  # noqa: N802 - http.server's name
            if cuts["n"]:
                cuts["n"] -= 1
                self.send_start(len(full), full[:len(full) // 3])
                return
            super().do_GET()

    with file_server(srv, Cut) as (base, served):
        spec = ShardSpec(f"{base}/ds-rl-000000.tar", None, len(full), 4)
        got = list(ShardDataset([spec], retries=3, rank=0, world_size=1))
    assert len(served) == 2 and len(got) == 4


# ------------------------------------------------------------------------------------------------ 3: credentials


def test_urls_with_credentials_are_refused_up_front_and_never_echo_the_password(tmp_path, caplog, no_backoff):
    from longreel.trainer import remote_read
    from longreel.trainer.runtime import load_items
    from longreel.trainer.shard_cache import ShardFetcher, cache_remote_shards

    srv = tmp_path / "srv"
    srv.mkdir()
    _write_shard(srv / "ds-rl-000000.tar", 1)
    with file_server(srv) as (base, served), caplog.at_level("DEBUG", logger="longreel"):
        url = base.replace("http://", "http://user:s3cret@") + "/ds-rl-000000.tar"
        redacted = base.replace("http://", "http://user:***@") + "/ds-rl-000000.tar"
        want = (f"credentials in shard URLs are not supported ({redacted}): use a token-free URL or a local "
                "mirror")
        errors = []
        for attempt in (lambda: cache_remote_shards([ShardSpec(url)], str(tmp_path / "cache")),
                        lambda: ShardFetcher(str(tmp_path / "cache"))(ShardSpec(url)),
                        lambda: list(remote_read.read_remote_shard(ShardSpec(url), LoaderStats(), lambda e, w: None,
                                                                   retries=3)),
                        lambda: load_items(DataConfig(train_urls=[url], cache_dir=str(tmp_path / "c")), "train"),
                        lambda: load_items(DataConfig(train_urls=[url], cache_remote=False), "train")):
            with pytest.raises(ConfigError) as e:  # the CLI's one line, exit 2
                attempt()
            errors.append(str(e.value))
    assert all(want in m and "\n" not in m and "s3cret" not in m for m in errors), errors
    assert not any("s3cret" in r.getMessage() for r in caplog.records)
    assert not served and not list((tmp_path / "cache").glob("*.tar"))
    assert remote_read.redact(f"failed on {url} and gs://tok@b/x") == f"failed on {redacted} and gs://***@b/x"
