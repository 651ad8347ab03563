"""The CLI starts the local workers' zygote before it imports Beam (issue 17: segment start-up), and the run adopts
that process instead of starting another; one nobody adopts does not outlive the CLI."""
import json
import os
import subprocess
import sys


def _fresh(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip().splitlines()[-1]


def test_cli_parser_imports_no_beam():
    """Everything `longreel curate` runs before its prestart: the parser of every command, without Beam."""
    got = _fresh("import sys\nfrom longreel.cli import build_parser\nbuild_parser()\n"
                 "print('apache_beam' in sys.modules)")
    assert got == "False"


def test_pool_adopts_the_prestarted_zygote():
    from longreel.pipelines import zygote
    from longreel.pipelines.forked_workers import ForkedWorkerPool

    zygote.prestart()
    started = zygote._prestarted
    assert started is not None
    pool = ForkedWorkerPool()
    try:
        pool.start()
        assert pool._zygote is started
        assert zygote.take() is None  # adopted: nothing left to stop at exit
    finally:
        pool.close()
    assert started.returncode == 0


def test_unadopted_zygote_stops_with_the_process():
    pid = int(_fresh("from longreel.pipelines import zygote\nzygote.prestart()\nprint(zygote._prestarted.pid)"))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"zygote {pid} still runs after its launcher exited")


def test_cli_input_error_leaves_no_zygote(tmp_path):
    """A run refused after the prestart (a glob that matches nothing): exit 2, the zygote stopped at once."""
    code = ("import json, sys\nfrom longreel.pipelines import zygote\nfrom longreel.cli import main\n"
            "seen = []\norig = zygote.spawn\n"
            "def spawn():\n    p = orig()\n    seen.append(p)\n    return p\n"
            "zygote.spawn = spawn\n"
            f"rc = main(['-q', 'curate', {str(tmp_path / '*.mp4')!r}, '--out', {str(tmp_path / 'out')!r}, "
            "'--workers', '2'])\n"
            "print(json.dumps({'rc': rc, 'spawned': len(seen), 'stopped': [p.poll() is not None for p in seen]}))")
    got = json.loads(_fresh(code))
    assert got["rc"] == 2 and got["spawned"] == 1 and all(got["stopped"]), got
