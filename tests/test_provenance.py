"""code_version: the package version, the checkout's commit, and whether tracked files differ from it."""
import shutil
import subprocess

import pytest

import longreel
from longreel.pipelines.provenance import code_version


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on PATH")
def test_commit_and_dirty_marker(tmp_path):
    repo, rev = _checkout(tmp_path, dirty=False)
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}"
    (repo / "untracked.txt").write_text("scratch\n")  # untracked files do not make the code differ
    code_version.cache_clear()
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}"
    (repo / "a.py").write_text("x = 2\n")
    code_version.cache_clear()
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}.dirty"
    code_version.cache_clear()
    assert code_version(str(tmp_path)) == longreel.__version__  # not a checkout: the version alone


def _flaky_git(monkeypatch, fail_first: int | None, fail_args=()):
    """subprocess.run in provenance: each git call (or only those whose args contain ``fail_args``) times out on its
    first ``fail_first`` tries (None: always), as on a loaded machine, then runs for real."""
    import longreel.pipelines.provenance as prov

    real = subprocess.run
    tries: dict[tuple, int] = {}

    def run(cmd, *a, **kw):
        key = tuple(cmd)
        tries[key] = tries.get(key, 0) + 1
        if all(x in cmd for x in fail_args) and (fail_first is None or tries[key] <= fail_first):
            raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
        return real(cmd, *a, **kw)

    monkeypatch.setattr(prov.subprocess, "run", run)
    return tries


def _checkout(tmp_path, dirty: bool):
    repo = tmp_path / "checkout"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    if dirty:
        (repo / "a.py").write_text("x = 2\n")
    return repo, _git(repo, "rev-parse", "--short=12", "HEAD")


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on PATH")
def test_a_git_call_that_times_out_once_is_retried(tmp_path, monkeypatch):
    """A loaded machine must not change the recorded version: a git call that times out once (the short limit) is
    asked again, so a dirty checkout still reads dirty and a checkout still reads as one (before: the bare package
    version, or a dirty tree recorded clean)."""
    repo, rev = _checkout(tmp_path, dirty=True)
    tries = _flaky_git(monkeypatch, fail_first=1)
    code_version.cache_clear()
    try:
        assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}.dirty"
    finally:
        code_version.cache_clear()
    assert sorted(tries.values()) == [2, 2]  # rev-parse and status, each retried once


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on PATH")
def test_git_that_never_answers_is_recorded_as_unknown(tmp_path, monkeypatch):
    repo, rev = _checkout(tmp_path, dirty=True)
    _flaky_git(monkeypatch, fail_first=None, fail_args=("status",))
    code_version.cache_clear()
    try:
        assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}.unverified"  # not "clean"
        code_version.cache_clear()
        _flaky_git(monkeypatch, fail_first=None)
        assert code_version(str(repo)) == f"{longreel.__version__}+gunknown"  # not "no checkout"
    finally:
        code_version.cache_clear()
