"""``--setup_file ./setup.py`` (the README's Dataflow command) ships the whole project to the workers.

Beam's stager builds a source distribution from the setup file (``python -m build --sdist``, or ``python setup.py
sdist`` where ``build`` is absent) and every worker ``pip install``s it. Here the stager's own function builds it from a
copy of the checkout; the sdist must hold every source and package-data file of the folders setup.py maps, and what
installs from it must be the one ``longreel`` namespace with those folders under it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: repository folder -> where it installs (setup.py's package_dir)
MAPPED = {"longreel": "longreel", "pipelines": "longreel/pipelines", "trainer": "longreel/trainer",
          "schemas": "longreel/schemas", "data_cards": "longreel/data_cards"}
IGNORE = shutil.ignore_patterns(".git", ".tox", ".venv", ".demo-venv", ".lock-venv", "demo_out", "build", "dist",
                                "*.egg-info", "__pycache__", "out", "bench_out")


def _shipped_files(src: Path) -> set[str]:
    """The files of the mapped folders a worker needs: Python sources and the package data setup.cfg declares."""
    data = ("*.py", "prompts/*.j2", "configs/*.yaml", "sample_data/*", "*.j2", "*.md", "demo/*", "testing/*.json")
    found = set()
    for folder in MAPPED:
        for pattern in data:
            found |= {str(p.relative_to(src)) for p in (src / folder).rglob(pattern) if p.is_file()
                      and (pattern == "*.py" or p.relative_to(src / folder).match(pattern))}
    return found


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> tuple[Path, Path]:
    from apache_beam.runners.portability.stager import Stager

    work = tmp_path_factory.mktemp("setup_file")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    staged = work / "staged"
    staged.mkdir()
    return Path(Stager._build_setup_package(str(src / "setup.py"), str(staged))), src


def test_the_staged_sdist_holds_every_mapped_folder(sdist):
    tarball, src = sdist
    with tarfile.open(tarball) as tf:
        top = tf.getnames()[0].split("/")[0]
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"setup.py", "setup.cfg"} <= names
    wanted = _shipped_files(src)
    assert "pipelines/curate.py" in wanted and "pipelines/configs/demo.yaml" in wanted  # the listing itself works
    missing = sorted(wanted - names)
    assert not missing, f"{tarball.name} ({top}) lacks {missing[:20]}"


def test_a_worker_installs_one_longreel_namespace_from_it(sdist, tmp_path):
    tarball, _ = sdist
    # what a worker's `pip install workflow.tar.gz` builds (without the dependencies, which the image holds)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(tarball)], check=True, capture_output=True, text=True, cwd=tmp_path)
    (whl,) = tmp_path.glob("longreel-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"longreel"}
    for needed in ("longreel/pipelines/curate.py", "longreel/pipelines/portable.py",
                   "longreel/pipelines/configs/demo.yaml", "longreel/trainer/__init__.py",
                   "longreel/schemas/config.py", "longreel/data_cards/card.md.j2"):
        assert needed in names, needed
