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
    repo = tmp_path / "checkout"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    rev = _git(repo, "rev-parse", "--short=12", "HEAD")
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}"
    (repo / "untracked.txt").write_text("scratch\n")  # untracked files do not make the code differ
    code_version.cache_clear()
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}"
    (repo / "a.py").write_text("x = 2\n")
    code_version.cache_clear()
    assert code_version(str(repo)) == f"{longreel.__version__}+g{rev}.dirty"
    code_version.cache_clear()
    assert code_version(str(tmp_path)) == longreel.__version__  # not a checkout: the version alone
