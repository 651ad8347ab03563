"""``longreel cache list|prune``: the trainer's shard cache is pruned least recently used first, by size or age,
never under a download in progress, and never without being asked."""
from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from longreel.cli import main
from longreel.trainer.shard_cache import CachedShard, choose_evictions, scan

NOW = 2_000_000_000.0
DAY = 86400.0


def shard(name: str, nbytes: int, days_ago: float) -> CachedShard:
    return CachedShard(Path(name), nbytes, NOW - days_ago * DAY)


def test_choose_evictions_takes_the_least_recently_used_until_the_rest_fits():
    lru = [shard("a.tar", 40, 9), shard("b.tar", 30, 5), shard("c.tar", 20, 1), shard("d.tar", 10, 0)]
    names = lambda cs: [c.path.name for c in cs]  # noqa: E731
    assert names(choose_evictions(lru, max_bytes=100, now=NOW)) == []
    assert names(choose_evictions(lru, max_bytes=60, now=NOW)) == ["a.tar"]
    assert names(choose_evictions(lru, max_bytes=59, now=NOW)) == ["a.tar", "b.tar"]
    assert names(choose_evictions(lru, max_bytes=0, now=NOW)) == ["a.tar", "b.tar", "c.tar", "d.tar"]
    assert names(choose_evictions(lru, older_than_s=4 * DAY, now=NOW)) == ["a.tar", "b.tar"]
    assert names(choose_evictions(lru, older_than_s=30 * DAY, now=NOW)) == []
    # both: the stale ones go, then the least recently used of the rest until it fits
    assert names(choose_evictions(lru, max_bytes=15, older_than_s=6 * DAY, now=NOW)) == ["a.tar", "b.tar", "c.tar"]


@pytest.fixture
def cache(tmp_path) -> Path:
    root = tmp_path / "shards"
    root.mkdir()
    for name, size, days_ago in (("old.tar", 3000, 40), ("mid.tar", 2000, 10), ("new.tar", 1000, 0)):
        (root / name).write_bytes(b"x" * size)
        (root / f"{name}.lock").write_bytes(b"")
        t = time.time() - days_ago * DAY
        os.utime(root / name, (t, t))
    (root / ".new.tar.abc123").write_bytes(b"partial")  # a download in progress: not a cached shard
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_list_shows_the_shards_least_recently_used_first(cache, capsys):
    code, out, _ = run(capsys, "list", "--dir", str(cache), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [r["file"] for r in doc["shards"]] == ["old.tar", "mid.tar", "new.tar"]
    assert doc["bytes"] == 6000 and not any(r["pruned"] for r in doc["shards"])
    code, out, _ = run(capsys, "list", "--dir", str(cache))
    assert code == 0 and "3 shard(s)" in out and out.index("old.tar") < out.index("new.tar")


def test_prune_by_size_and_age_and_dry_run(cache, capsys):
    code, out, _ = run(capsys, "prune", "--dir", str(cache), "--max-gb", "0.000004", "--dry-run")
    assert code == 0 and "would remove 1 shard(s)" in out
    assert sorted(p.name for p in cache.glob("*.tar")) == ["mid.tar", "new.tar", "old.tar"]  # nothing removed
    code, out, _ = run(capsys, "prune", "--dir", str(cache), "--max-gb", "0.000004")
    assert code == 0 and "removed 1 shard(s)" in out
    assert sorted(p.name for p in cache.glob("*.tar")) == ["mid.tar", "new.tar"]
    assert not (cache / "old.tar.lock").exists() and (cache / "mid.tar.lock").exists()
    code, out, _ = run(capsys, "prune", "--dir", str(cache), "--older-than-days", "5", "--json")
    assert code == 0 and [r["file"] for r in json.loads(out)["shards"] if r["pruned"]] == ["mid.tar"]
    assert [c.path.name for c in scan(str(cache))] == ["new.tar"]
    assert (cache / ".new.tar.abc123").exists()  # never a download in progress


def test_prune_keeps_a_shard_being_downloaded(cache, capsys):
    fd = os.open(cache / "mid.tar.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a rank holds mid.tar's download lock
        code, out, _ = run(capsys, "prune", "--dir", str(cache), "--all")
    finally:
        os.close(fd)
    assert code == 0 and "removed 2 shard(s)" in out
    assert [p.name for p in cache.glob("*.tar")] == ["mid.tar"]


@pytest.mark.parametrize("argv, message", [
    (["prune"], "give one of --max-gb, --older-than-days or --all"),
    (["prune", "--all", "--max-gb", "1"], "give one of"),
    (["prune", "--max-gb", "-1"], "--max-gb must be >= 0"),
    (["list", "--all"], "belong to `prune`"),
])
def test_usage_errors_exit_2_in_one_line(cache, capsys, argv, message):
    code, out, err = run(capsys, *argv, "--dir", str(cache))
    assert code == 2 and message in err and "Traceback" not in err
    assert len(list(cache.glob("*.tar"))) == 3


def test_an_absent_cache_lists_empty(tmp_path, capsys):
    code, out, _ = run(capsys, "list", "--dir", str(tmp_path / "none"))
    assert code == 0 and "0 shard(s)" in out


def test_help_says_where_the_cache_is_and_how_to_prune_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "data.cache_dir" in out and "--max-gb" in out and "least recently used" in out


def test_a_cached_shard_whose_mtime_cannot_be_set_is_still_used(tmp_path, monkeypatch):
    # a shared cache directory whose files another user owns: utime is refused, the shard is read all the same
    from longreel.task.shard_reader import ShardSpec
    from longreel.trainer import shard_cache

    spec = ShardSpec("http://host/ds-000000.tar", "ab" * 32, None, None)
    (tmp_path / shard_cache.cached_name(spec)).write_bytes(b"tar")

    def refuse(*a, **k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(shard_cache.os, "utime", refuse)
    [local] = shard_cache.cache_remote_shards([spec], str(tmp_path))
    assert local.url == str(tmp_path / f"{'ab' * 32}.tar") and local.sha256 == spec.sha256
