"""Code version and config identity recorded in every output that describes a run."""
from __future__ import annotations

import functools
import os
import subprocess

import longreel


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus the git commit of the checkout when there is one (``0.1.0+g1a2b3c4``)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{longreel.__version__}+g{rev}" if rev else longreel.__version__
