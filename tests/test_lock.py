"""The environment the tests run in is the lock, package for package.

tox names the lock files of its env in ``LONGREEL_LOCK_FILES`` (requirements/test.txt and weights.txt for py311,
vllm.txt and weights.txt for vllm); ``pip freeze`` of that env must list exactly the pinned packages at the pinned
versions. pip, setuptools and wheel are the venv's seed packages, which ``pip freeze`` leaves out on its own, so
they are left out of the comparison on both sides; the project itself (an editable install) is too.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SEED = {"pip", "setuptools", "wheel", "distribute", "longreel"}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;#]+)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines (comments, options and editable lines ignored) -> {normalised name: version}."""
    pins = {}
    for line in lines:
        m = PIN.match(line.strip())
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    return {k: v for k, v in pins.items() if k not in SEED}


def test_parse_pins_reads_pip_compile_and_freeze_lines():
    lines = ["# header", "torch==2.14.1             # via longreel (setup.cfg)", "Typing_Extensions==4.1",
             "-e git+https://x/y@abc#egg=longreel", "pip==26.3", "    # via foo"]
    assert parse_pins(lines) == {"torch": "2.14.1", "typing-extensions": "4.1"}


def test_pip_freeze_equals_the_lock():
    files = os.environ.get("LONGREEL_LOCK_FILES", "").split()
    if not files:
        pytest.skip("not a locked environment: run through tox (./scripts/test.sh), which names its lock files")
    locked: dict[str, str] = {}
    for f in files:
        locked.update(parse_pins(Path(f).read_text().splitlines()))
    frozen = parse_pins(subprocess.run([sys.executable, "-m", "pip", "freeze"], check=True, capture_output=True,
                                       text=True).stdout.splitlines())
    extra = {k: v for k, v in frozen.items() if k not in locked}
    missing = {k: v for k, v in locked.items() if k not in frozen}
    moved = {k: (locked[k], frozen[k]) for k in locked.keys() & frozen.keys() if locked[k] != frozen[k]}
    assert not (extra or missing or moved), (
        f"this env is not the lock ({' '.join(files)}): installed but not locked {extra}; locked but not installed "
        f"{missing}; other version (lock, installed) {moved}. Regenerate with ./scripts/lock.sh and recreate the env")
