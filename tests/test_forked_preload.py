"""The launcher's modules go to the workers' zygote once per run, and a caller can send them early, before it
imports what the workers do not need (the card's libraries: pipelines/curate.py)."""
import pytest

from longreel.pipelines import forked_workers
from longreel.pipelines.forked_workers import ForkedWorkersRunner


class _Stop(Exception):
    pass


class _FakePool:
    """Records what the runner asks of the zygote; stops the run where it would start the workers."""

    sent: list = []

    def __init__(self, preload=(), started=None):
        pass

    def start(self):
        return "localhost:0"

    def preload(self, modules):
        _FakePool.sent.append(list(modules))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @property
    def endpoint(self):
        raise _Stop


@pytest.fixture
def runner(monkeypatch):
    _FakePool.sent = []
    monkeypatch.setattr(forked_workers, "ForkedWorkerPool", _FakePool)
    monkeypatch.setattr(forked_workers, "launcher_modules", lambda: ["longreel.a"])
    return ForkedWorkersRunner()


def test_the_run_sends_the_launcher_modules_when_it_starts(runner):
    with pytest.raises(_Stop):
        runner.run_pipeline(None, None)
    assert _FakePool.sent == [["longreel.a"]]


def test_modules_sent_early_are_not_sent_again_by_the_run(runner, monkeypatch):
    runner.preload_launcher_modules()
    runner.preload_launcher_modules()
    monkeypatch.setattr(forked_workers, "launcher_modules", lambda: ["longreel.a", "matplotlib_imported_later"])
    with pytest.raises(_Stop):
        runner.run_pipeline(None, None)
    assert _FakePool.sent == [["longreel.a"]]
    # the next run of the same runner sends its own
    with pytest.raises(_Stop):
        runner.run_pipeline(None, None)
    assert _FakePool.sent[-1] == ["longreel.a", "matplotlib_imported_later"]


def test_the_card_imports_wait_until_the_run_asks_for_its_workers(runner, monkeypatch):
    """The card's libraries are imported in a thread of the launcher, but only once the runner starts its first
    worker: before that the launcher translates the graph, on the path to the first bundle."""
    import threading

    from longreel.pipelines import curate
    from longreel.pipelines.card import build
    from longreel.pipelines.config import CurateConfig
    from longreel.schemas.config import load_yaml

    called = threading.Event()
    monkeypatch.setattr(build, "import_ahead", called.set)
    cfg = load_yaml(CurateConfig, None, ["stages=[caption,qra,pack,card]"])
    t = curate._card_imports_ahead(cfg, workers=2, remote=False, runner=runner)
    assert t is not None and not called.wait(0.5)
    runner.workers_started.set()
    t.join(10)
    assert called.is_set()
    # no runner event to wait for (another runner): the imports start at once
    t = curate._card_imports_ahead(cfg, workers=2, remote=False, runner=None)
    t.join(10)
    assert not t.is_alive()
