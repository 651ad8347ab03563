"""Code version and config identity recorded in every output that describes a run."""
from __future__ import annotations

import functools
import os
import subprocess

import longreel


@functools.lru_cache(maxsize=1)
def code_version(root: str | None = None) -> str:
    """Package version plus the git commit of the checkout when there is one (``0.1.0+g1a2b3c4``), with
    ``.dirty`` when tracked files differ from that commit: outputs made from uncommitted code say so.
    ``root``: the checkout (default: the one this package is in)."""
    here = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=5,
                                  check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    rev = git("rev-parse", "--short=12", "HEAD")
    if not rev:
        return longreel.__version__
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{longreel.__version__}+g{rev}" + (".dirty" if dirty else "")
