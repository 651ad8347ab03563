"""The README's main command, as a newcomer runs it: ``./scripts/demo.sh`` on a clean copy of the checkout, with no
``.demo-venv`` or ``demo_out`` to reuse, in a new virtualenv built from the lock.

Checks what the demo promises: it exits 0, ``longreel card verify`` passes on its card and shards, the training
curves exist, and the env it built is the lock (``requirements/main.txt`` + ``weights.txt``). Slow (a new
virtualenv with torch, then the demo): a few minutes on 2 cores. Its own tox env and its own part of
``scripts/test.sh`` (``tox -e demo``, after the main suite), not the py311 run: the venv it builds holds a CUDA build
of torch (7 GB) and must not sit on disk beside py311's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_lock import parse_pins

pytestmark = [pytest.mark.slow, pytest.mark.demo]

REPO = Path(__file__).resolve().parents[1]


def clean_copy(dest: Path) -> Path:
    """The checkout's tracked and not-ignored files (what a clone of it holds, uncommitted edits included)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("test_demo_script needs a git checkout of longreel (it copies the tracked files)")
    work = clean_copy(tmp_path_factory.mktemp("clone") / "longreel")
    assert not (work / ".demo-venv").exists() and not (work / "demo_out").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PIP_CONSTRAINT", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.prefix))))
    # The interpreter this venv was made from: a newcomer's `python3`, not tox's env.
    env["PYTHON"] = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run(["bash", "scripts/demo.sh"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=2400)
    yield work, proc
    shutil.rmtree(work / ".demo-venv", ignore_errors=True)  # several GB; the outputs are kept for a post-mortem


def test_demo_script_exits_0(demo_run):
    work, proc = demo_run
    assert proc.returncode == 0, f"scripts/demo.sh exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "demo done" in proc.stdout


def test_demo_card_verifies_against_its_shards(demo_run):
    work, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = work / "demo_out" / "shards" / "longreel_demo-train.index.json"
    card = work / "demo_out" / "card"
    assert index.is_file() and (card / "README.md").is_file() and (card / "card.json").is_file()
    ver = subprocess.run([str(work / ".demo-venv" / "bin" / "longreel"), "card", "verify", str(card), str(index)],
                         cwd=work, capture_output=True, text=True, timeout=600)
    assert ver.returncode == 0, f"card verify failed:\n{ver.stdout[-4000:]}\n{ver.stderr[-4000:]}"


def test_demo_trains_and_draws_its_curves(demo_run):
    work, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    curves = work / "demo_out" / "runs" / "curves.png"
    assert curves.is_file() and curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and curves.stat().st_size > 5000
    for run in ("sft", "grpo"):
        assert (work / "demo_out" / "runs" / run / "final").is_dir(), f"no final checkpoint of the {run} run"


def test_demo_env_is_the_lock(demo_run):
    work, proc = demo_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    locked = {}
    for f in ("requirements/main.txt", "requirements/weights.txt"):
        locked.update(parse_pins((work / f).read_text().splitlines()))
    frozen = parse_pins(subprocess.run([str(work / ".demo-venv" / "bin" / "python"), "-m", "pip", "freeze"],
                                       check=True, capture_output=True, text=True).stdout.splitlines())
    assert frozen == locked, {k: (locked.get(k), frozen.get(k)) for k in locked.keys() | frozen.keys()
                              if locked.get(k) != frozen.get(k)}
