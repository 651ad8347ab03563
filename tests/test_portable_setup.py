"""The guards around Beam's portable path (:mod:`longreel.pipelines.portable`): a worker pool whose ``python`` cannot run
SDK workers is refused, and ``longreel curate`` fails fast (exit 2, one line, its output directory untouched) where a
portable run on this machine has no pool to talk to, instead of hanging or failing after taking the directory."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from longreel.pipelines import portable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _fake_python(tmp_path, script: str):
    """A directory whose ``python`` runs ``script`` (a shell script body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "python"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_pool_env_puts_this_interpreter_first_on_path():
    env = portable.pool_env({"PATH": f"/usr/bin{os.pathsep}{os.path.dirname(sys.executable)}"})
    parts = env["PATH"].split(os.pathsep)
    assert parts[0] == os.path.dirname(sys.executable)
    assert parts.count(parts[0]) == 1 and "/usr/bin" in parts
    assert portable.worker_python_problem(env) is None


def test_a_python_without_apache_beam_is_named(tmp_path):
    bin_dir = _fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'apache_beam'\" >&2\nexit 1\n")
    problem = portable.worker_python_problem({"PATH": str(bin_dir)})
    assert problem and str(bin_dir / "python") in problem and "No module named 'apache_beam'" in problem


def test_another_beam_version_is_named(tmp_path):
    bin_dir = _fake_python(tmp_path, "echo 0.0.1\n")
    problem = portable.worker_python_problem({"PATH": str(bin_dir)})
    assert problem and "apache_beam 0.0.1" in problem


def test_only_an_embedded_job_with_an_external_environment_is_checked():
    ext = ["--environment_type=EXTERNAL", "--environment_config=localhost:5"]
    assert portable.external_endpoint(["--runner=PortableRunner", "--job_endpoint=embed", *ext]) == ("localhost", 5)
    # a Flink/Spark job server elsewhere sees the pool from its own machines, not from this one
    assert portable.external_endpoint(["--runner=FlinkRunner", "--flink_master=host:8081", *ext]) is None
    assert portable.external_endpoint(["--runner=PortableRunner", "--job_endpoint=embed",
                                       "--environment_type=LOOPBACK"]) is None
    assert portable.external_endpoint([]) is None
    with pytest.raises(portable.PortableSetupError, match="HOST:PORT"):
        portable.external_endpoint(["--job_endpoint=embed", "--environment_type=EXTERNAL",
                                    "--environment_config=localhost"])


def test_curate_without_a_pool_fails_fast_and_leaves_out_alone(tmp_path, shared_videos):
    port = _free_port()  # nothing listens there
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "longreel", "-q", "curate", str(shared_videos / "opencv__vtest.avi"), "--out", str(out),
         "--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=EXTERNAL",
         f"--environment_config=localhost:{port}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"no Beam worker pool answers at localhost:{port}" in proc.stderr
    assert "-m longreel.pipelines.portable" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_the_pool_launcher_refuses_a_python_that_cannot_run_workers(tmp_path, monkeypatch):
    bin_dir = _fake_python(tmp_path, "exit 1\n")
    # as if this interpreter's own directory held that python: the pool would start workers with it
    monkeypatch.setattr(portable, "pool_env", lambda environ=None: {"PATH": str(bin_dir)})
    monkeypatch.setattr(portable.os, "execve", lambda *a: pytest.fail("the pool was started"))
    assert portable.main(["--service_port=1"]) == 2


def test_relative_paths_are_refused_where_workers_have_their_own_working_directory(tmp_path):
    pool = ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=EXTERNAL",
            f"--environment_config=localhost:{_free_port()}"]
    with pytest.raises(portable.PortableSetupError, match="absolute paths .* instead of out, videos/a.mp4"):
        portable.preflight(pool, ["out", "/abs/in.mp4", "videos/a.mp4", "gs://b/x.mp4"])
    for local in ([], ["--runner=DirectRunner", "--direct_running_mode=multi_processing"],
                  ["--runner=PortableRunner", "--job_endpoint=embed", "--environment_type=LOOPBACK"]):
        portable.preflight(local, ["out", "videos/a.mp4"])  # the workers share this working directory
    assert portable.workers_elsewhere(["--runner=DataflowRunner"]) == "DataflowRunner"
