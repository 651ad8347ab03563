"""``weights_hash`` remembers a file's hash under its stat stamp across processes, and never returns a stale one."""
import hashlib
import os

import pytest

from longreel.engines import local_models as lm


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREEL_CACHE", str(tmp_path / "cache"))
    lm.weights_hash.cache_clear()
    yield tmp_path / "cache"
    lm.weights_hash.cache_clear()


def _expected(path) -> str:
    h = hashlib.sha256(os.path.basename(path).encode() + b"\0")
    h.update(open(path, "rb").read())
    return h.hexdigest()[:16]


def _fresh(directory, name):
    lm.weights_hash.cache_clear()  # as a new process: only the memo on disk is left
    return lm.weights_hash(str(directory), name)


def test_the_memo_gives_the_hash_and_is_used(tmp_path, cache, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights" * 1000)
    first = _fresh(tmp_path, "m.gguf")
    assert first == _expected(f)
    assert len(os.listdir(cache / "weights_hash")) == 1

    def no_hashing(files):
        raise AssertionError("hashed again")

    monkeypatch.setattr(lm, "_hash_files", no_hashing)
    assert _fresh(tmp_path, "m.gguf") == first


def test_a_rewritten_file_is_hashed_again(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a" * 100)
    old = _fresh(tmp_path, "m.gguf")
    st = os.stat(f)
    f.write_bytes(b"b" * 100)  # same size
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    new = _fresh(tmp_path, "m.gguf")
    assert new != old and new == _expected(f)


def test_a_damaged_memo_is_ignored(tmp_path, cache):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    good = _fresh(tmp_path, "m.gguf")
    (memo,) = (cache / "weights_hash").iterdir()
    memo.write_text("not a hash\n")
    assert _fresh(tmp_path, "m.gguf") == good
    assert memo.read_text().strip() == good


def test_an_unwritable_cache_still_hashes(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LONGREEL_CACHE", str(blocker / "cache"))  # under a file: cannot be made
    f = tmp_path / "m.gguf"
    f.write_bytes(b"y" * 10)
    try:
        assert _fresh(tmp_path, "m.gguf") == _expected(f)
    finally:
        lm.weights_hash.cache_clear()


def test_a_directory_model_hashes_its_weight_files(tmp_path, cache):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"s" * 50)
    (tmp_path / "README.md").write_text("not a weight file")
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update(name.encode() + b"\0")
        h.update((tmp_path / name).read_bytes())
    assert _fresh(tmp_path, None) == h.hexdigest()[:16]
    assert _fresh(tmp_path, None) == h.hexdigest()[:16]  # from the memo
