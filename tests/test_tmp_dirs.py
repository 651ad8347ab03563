"""Scratch directories: a run that does not end normally (Ctrl-C, SIGKILL) leaves none behind, or the next run
removes them; Ctrl-C is one line and exit 130 with one worker or several."""
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longreel.cli import interrupt_inside
from longreel.pipelines import tmp_dirs
from longreel.pipelines.tmp_dirs import make_tmpdir, remove_made_here, sweep_stale

#: runs the CLI with Ctrl-C raising KeyboardInterrupt, as in a terminal (a test runner's process may ignore SIGINT,
#: and a child inherits that)
CLI = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
       "from longreel.cli import console_main; sys.argv[0] = 'longreel'; console_main()")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _ours(tmp: Path) -> list[str]:
    return sorted(n for n in os.listdir(tmp) if n.startswith("longreel-"))


def test_names_say_host_and_pid_and_only_own_directories_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = make_tmpdir("worker")
    assert Path(path).parent == tmp_path
    m = tmp_dirs._NAME.match(Path(path).name)
    assert m and m["kind"] == "worker" and int(m["pid"]) == os.getpid() and m["host"] == tmp_dirs._host()
    other = tmp_path / "not-ours"
    other.mkdir()
    (Path(path) / "frames.npy").write_bytes(b"x" * 10)
    remove_made_here()
    assert not Path(path).exists() and other.exists()
    with pytest.raises(ValueError):
        make_tmpdir("Worker-1")


@pytest.mark.parametrize("end", ["raise RuntimeError('a failed run')", "raise SystemExit(2)"])
def test_a_process_that_ends_without_teardown_removes_its_directories(tmp_path, end):
    code = ("import pathlib\nfrom longreel.pipelines.tmp_dirs import make_tmpdir\n"
            "pathlib.Path(make_tmpdir('ingest'), 'copy.mp4').write_bytes(b'x')\n" + end + "\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode != 0
    assert _ours(tmp_path) == []


def test_the_sweep_removes_what_dead_processes_of_this_host_left(tmp_path, caplog):
    host, dead = tmp_dirs._host(), _dead_pid()
    stale = tmp_path / f"longreel-worker-{host}-{dead}-abc12345"
    stale.mkdir()
    (stale / "frames.npy").write_bytes(b"x" * 2_000_000)
    (stale / "sub").mkdir()
    live = tmp_path / f"longreel-ingest-{host}-{os.getpid()}-abc12345"  # a run going on now
    other_host = tmp_path / f"longreel-worker-elsewhere.example-{dead}-abc12345"  # a /tmp shared by containers
    old_style = tmp_path / "longreel-worker-abc12345"  # made before names had an owner: whose, is not known
    for d in (live, other_host, old_style):
        d.mkdir()
    a_file = tmp_path / f"longreel-cut-{host}-{dead}-abc12345"
    a_file.write_text("not a directory")
    with caplog.at_level(logging.INFO, logger="longreel"):
        removed = sweep_stale(str(tmp_path))
    assert removed == [str(stale)]
    assert not stale.exists() and live.exists() and other_host.exists() and old_style.exists() and a_file.exists()
    assert "removed 1 scratch directory (2.0 MB)" in caplog.text
    assert sweep_stale(str(tmp_path)) == []


def test_every_pipeline_sweeps_first(tmp_path, monkeypatch):
    from longreel.pipelines.runner import make_pipeline

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / f"longreel-caption-{tmp_dirs._host()}-{_dead_pid()}-abc12345"
    stale.mkdir()
    make_pipeline([])
    assert not stale.exists()


def test_a_decode_worker_ends_with_its_owner_and_removes_its_directory(tmp_path):
    # the owner is killed while the worker is busy (a decode no one will read): the worker notices, cleans, ends
    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib\n"
        "from longreel.pipelines.media.worker import IsolatedWorker\n"
        "w = IsolatedWorker()\n"
        "pathlib.Path(w.tmpdir, 'frames.npy').write_bytes(b'x' * 1000)\n"
        "w.call('sleep', seconds=0.01)\n"
        "print(w._proc.pid, w.tmpdir, flush=True)\n"
        "w.call('sleep', timeout=120, seconds=60)\n")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    child, tmpdir = owner.stdout.readline().split()
    time.sleep(0.5)  # the second request is in the worker
    assert Path(tmpdir, "frames.npy").exists()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_running_in_session(int(child)) or Path(tmpdir).exists()):
        time.sleep(0.1)
    assert not Path(tmpdir).exists()
    assert not _running_in_session(int(child))  # the worker's own session


def test_interrupt_inside_finds_ctrl_c_that_a_runner_wrapped():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("KeyboardInterrupt [while running 'Ingest/HashAndProbe/ParDo(ProbeVideo)']")
    except RuntimeError as e:
        assert interrupt_inside(e)
    assert not interrupt_inside(RuntimeError("boom"))


@pytest.mark.parametrize("workers, to, signum", [(1, "group", signal.SIGINT), (2, "group", signal.SIGINT),
                                                 (2, "launcher", signal.SIGINT), (1, "launcher", signal.SIGTERM),
                                                 (2, "launcher", signal.SIGTERM)])
def test_ctrl_c_during_curate_is_one_line_and_leaves_nothing(tmp_path, shared_videos, workers, to, signum):
    """``to``: the whole process group, as a terminal's Ctrl-C, or the launcher's pid alone, as ``kill -INT PID``
    from a supervisor (its workers printed Beam's traceback of each bundle they lost). SIGTERM, what ``timeout``, a
    supervisor or a job scheduler sends, killed the launcher where it stood (exit -15, its workers' tracebacks, its
    scratch directory and lock left behind); it now ends the run as Ctrl-C does, exit 143."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI, "curate", str(shared_videos), "--out", str(out), "--workers", str(workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp)})
    deadline = time.monotonic() + 120
    # once a stage holds a decode worker and its scratch directory, the run is in the middle of its work
    while time.monotonic() < deadline and not any(n.startswith("longreel-worker-") for n in os.listdir(tmp)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(1.0)
    if to == "group":
        os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
    else:
        os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert ("longreel curate: interrupted" if signum == signal.SIGINT else
            "longreel curate: terminated (SIGTERM)") in err
    assert "Traceback" not in err and "internal error" not in err, err
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _ours(tmp):
        time.sleep(0.1)
    assert _ours(tmp) == []
    assert _running_in_session(proc.pid) == []
    from longreel.pipelines.io.run_dir import LOCK_NAME

    assert not (out / LOCK_NAME).exists()  # released: the next run needs no stale-lock takeover


def _running_in_session(sid: int) -> list[str]:
    """The processes of session ``sid`` still running (a zombie has ended: in a container whose init does not reap
    orphans it stays listed)."""
    pids = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    running = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            running.append(pid)
    return running


def test_a_sigint_to_the_launcher_alone_reaches_the_workers_zygote(tmp_path, monkeypatch):
    """``kill -INT`` of the launcher's pid reaches no other process; the pool passes it on, so the zygote and its
    workers end quietly instead of losing their bundles under the launcher's feet. The handler it replaced runs
    after (here Python's: KeyboardInterrupt) and is back once the pool closes."""
    from longreel.pipelines.forked_workers import ForkedWorkerPool

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # a module whose import says the zygote serves requests (its handler is set before it reads the first)
        ready = tmp_path / "zygote-ready"
        (tmp_path / "zygote_ready_probe.py").write_text(f"open({str(ready)!r}, 'w').close()\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        pool = ForkedWorkerPool(preload=("zygote_ready_probe",))
        pool.start()
        zygote = pool._zygote
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert time.monotonic() < deadline and zygote.poll() is None
                time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
            assert zygote.wait(timeout=30) == 128 + signal.SIGINT  # zygote_main's quiet end, not EOF's 0
        finally:
            pool.close()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)

