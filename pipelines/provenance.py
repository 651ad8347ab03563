"""Code version and config identity recorded in every output that describes a run."""
from __future__ import annotations

import functools
import os
import subprocess

import longreel


#: Seconds one git call may take, then the longer retry. Both reads take milliseconds on an idle machine; on a loaded
#: one (other jobs, a cold disk) a single short limit made the recorded version depend on the load: a timed-out
#: ``status`` read as "clean" and a timed-out ``rev-parse`` as "no checkout" (see :func:`code_version`).
GIT_TIMEOUTS_S = (5.0, 60.0)


class _GitUnavailable(Exception):
    """git did not answer (timed out or could not start) after the retry."""


def _git(here: str, *args: str) -> tuple[int, str]:
    """(exit code, stdout) of ``git -C here args``; a timeout is retried once with the longer limit."""
    for limit in GIT_TIMEOUTS_S:
        try:
            proc = subprocess.run(["git", "-C", here, *args], capture_output=True, text=True, timeout=limit,
                                  check=False)
            return proc.returncode, proc.stdout.strip()
        except subprocess.TimeoutExpired:
            continue
        except OSError:  # no git on PATH: nothing to ask
            return -1, ""
    raise _GitUnavailable(" ".join(args))


@functools.lru_cache(maxsize=1)
def code_version(root: str | None = None) -> str:
    """Package version plus the git commit of the checkout when there is one (``0.1.0+g1a2b3c4``), with
    ``.dirty`` when tracked files differ from that commit: outputs made from uncommitted code say so.
    ``root``: the checkout (default: the one this package is in).

    What it records is read when a run starts: committing or editing a tracked file between two runs of the same
    inputs gives them different versions, and so different stats.json and card bytes (that is the point: the code
    differed). What it must not depend on is the machine's load: a git call that times out is retried with a longer
    limit, and one that still does not answer is recorded as such (``+gunknown``, ``.unverified``) rather than
    taken for "no checkout" or "clean", which would be a different, wrong, value in the outputs."""
    here = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        code, rev = _git(here, "rev-parse", "--short=12", "HEAD")
    except _GitUnavailable:
        return f"{longreel.__version__}+gunknown"
    if code != 0 or not rev:  # not a checkout (or no git): the package version alone
        return longreel.__version__
    try:
        code, dirty = _git(here, "status", "--porcelain", "--untracked-files=no")
    except _GitUnavailable:
        return f"{longreel.__version__}+g{rev}.unverified"
    if code != 0:
        return f"{longreel.__version__}+g{rev}.unverified"
    return f"{longreel.__version__}+g{rev}" + (".dirty" if dirty else "")
