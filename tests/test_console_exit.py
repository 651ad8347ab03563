"""The ``longreel`` executable exits without the interpreter's teardown (``longreel.cli.console_main``), and loses
nothing a normal exit would have done: the exit code, buffered output, non-daemon threads, atexit handlers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a stand-in for a subcommand: leaves work for the exit to finish, then returns an exit code
SCRIPT = r"""
import atexit, concurrent.futures, sys, threading, time
import longreel.cli as cli

def late_write(path):
    time.sleep(0.3)
    with open(path, "w") as fh:
        fh.write("thread done")

def fake_main():
    out = sys.argv[1]
    threading.Thread(target=late_write, args=(out + ".thread",)).start()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)  # idle threads a plain join would wait on forever
    pool.submit(lambda: None).result()
    atexit.register(lambda: open(out + ".atexit", "w").write("atexit ran"))
    sys.stdout.write("no newline, still buffered")
    return 7

cli.main = fake_main
cli.console_main()
print("not reached")
"""


def _run(tmp_path, *prefix):
    out = str(tmp_path / "probe")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, *prefix, "-c", SCRIPT, out] if not prefix else
                       [sys.executable, *prefix, str(tmp_path / "s.py"), out],
                       capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp_path))
    return r, out


def test_the_fast_exit_keeps_the_code_the_output_the_threads_and_the_atexit_handlers(tmp_path):
    r, out = _run(tmp_path)
    assert r.returncode == 7, r.stderr
    assert r.stdout == "no newline, still buffered"
    assert open(out + ".thread").read() == "thread done"
    assert open(out + ".atexit").read() == "atexit ran"
    assert r.stderr == ""


def test_under_a_profiler_the_normal_exit_is_kept_so_the_profile_is_written(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    prof = tmp_path / "run.prof"
    r, out = _run(tmp_path, "-m", "cProfile", "-o", str(prof))
    # (cProfile's command line swallows SystemExit: its own exit code is 0)
    assert r.returncode == 0, r.stderr
    assert prof.exists() and prof.stat().st_size > 0
    assert open(out + ".atexit").read() == "atexit ran"


@pytest.mark.parametrize("entry", [["-m", "longreel"]])
def test_the_module_entry_point_exits_with_mains_code(entry):
    r = subprocess.run([sys.executable, *entry, "curate", "/no/such/video.mp4", "--out", "/tmp/never-written"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "/no/such/video.mp4" in r.stderr and "Traceback" not in r.stderr


def test_importing_the_main_module_under_another_name_does_not_run_the_cli():
    # what a multiprocessing spawn child does with its parent's main module: runs it as ``__mp_main__``
    code = ("import runpy, sys; sys.argv = ['longreel', '--help']; "
            "runpy.run_module('longreel', run_name='__mp_main__', alter_sys=True); print('imported, not run')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "imported, not run"


@pytest.mark.parametrize("argv", [["train", "sft", "--show-config"], ["curate", "--show-config"]])
def test_output_whose_reader_went_away_ends_quietly(argv):
    """``longreel train sft --show-config | head -2``: the reader closes the pipe; the command printed a
    BrokenPipeError traceback "reported as a bug". Now it ends as other tools do, with SIGPIPE's shell code."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    read_end, write_end = os.pipe()
    os.close(read_end)  # gone before the first write: the outcome does not hang on who is faster
    try:
        proc = subprocess.run([sys.executable, "-m", "longreel", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, timeout=120)
    finally:
        os.close(write_end)
    err = proc.stderr.decode()
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "internal error" not in err, err
