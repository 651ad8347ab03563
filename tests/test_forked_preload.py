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

    def __init__(self, preload=()):
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
