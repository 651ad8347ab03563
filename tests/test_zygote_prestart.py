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


def _prestarts(words: list[str], cores: int = 2) -> bool:
    """Whether the CLI starts the zygote ahead for ``longreel curate WORDS`` (spawn recorded, not run)."""
    from longreel import cli
    from longreel.pipelines import zygote

    started = []
    real_spawn, real_cores = zygote.spawn, zygote.default_workers
    zygote.spawn, zygote.default_workers = (lambda: started.append(1) or _FakeProcess()), (lambda: cores)
    try:
        cli.prestart_curate_workers(words)
        return bool(started)
    finally:
        zygote.spawn, zygote.default_workers = real_spawn, real_cores
        zygote._prestarted = None


class _FakeProcess:
    def poll(self):
        return None


def test_the_cli_starts_the_zygote_before_the_commands_imports_only_when_the_run_will_fork():
    assert _prestarts(["videos/", "--out", "o"])
    assert _prestarts(["videos/", "--out", "o", "--workers", "4"]) and _prestarts(["v", "--workers=3"])
    assert not _prestarts(["videos/", "--out", "o"], cores=1)
    assert not _prestarts(["v", "--workers", "1"]) and not _prestarts(["v", "--workers=1"])
    assert not _prestarts(["v", "--runner", "DataflowRunner"]) and not _prestarts(["v", "--runner=FlinkRunner"])
    assert not _prestarts(["v", "--direct_running_mode=multi_processing"])
    assert not _prestarts(["--help"]) and not _prestarts(["--show-config"])


def test_a_guessed_zygote_is_stopped_when_the_run_takes_one_worker(tmp_path):
    """One video file and no caption stage: one worker, so the zygote the CLI started on a guess is stopped before
    the run, not left importing beside it."""
    video = str(tmp_path / "one.mp4")
    (tmp_path / "one.mp4").write_bytes(b"not decoded: the run itself is replaced below")
    code = ("import json, sys\nfrom longreel.pipelines import zygote\nfrom longreel import cli\n"
            "seen = []\norig = zygote.spawn\n"
            "def spawn():\n    p = orig()\n    seen.append(p)\n    return p\n"
            "zygote.spawn = spawn\nzygote.default_workers = lambda: 2\n"
            "import longreel.pipelines.cli_curate as cc\nreal = cc._run\n"
            "def run(*a, **k):\n"
            "    state.append([p.poll() is not None for p in seen])\n    return 0\n"
            "state = []\ncc._run = run\n"
            f"rc = cli.main(['-q', 'curate', {video!r}, '--out', {str(tmp_path / 'out')!r}, '--set', 'stages=[]'])\n"
            "print(json.dumps({'rc': rc, 'spawned': len(seen), 'stopped_before_run': state}))")
    got = json.loads(_fresh(code))
    assert got["rc"] == 0 and got["spawned"] == 1 and got["stopped_before_run"] == [[True]], got
