"""The wheel installs one import name, ``longreel``, and sits beside PyPI packages that own the folder names
(``trainer`` is Coqui's, in the test lock for this test; PyPI also has ``pipelines`` and ``schemas``).

The wheel is built from this checkout and installed (without dependencies) into a fresh virtualenv that borrows
the locked dependencies, Coqui's ``trainer`` among them, from this environment through a path entry. Imports run
in that virtualenv's own interpreter, from a neutral directory, so nothing of the checkout is on ``sys.path``.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import importlib.util, json
    import longreel, longreel.pipelines, longreel.trainer, longreel.schemas, longreel.task, longreel.data_cards
    import longreel.pipelines.stages.segment, longreel.trainer.data, longreel.task.rewards
    import trainer  # Coqui's
    print(json.dumps({
        "longreel": longreel.__file__, "pipelines": longreel.pipelines.__file__, "trainer_ours": longreel.trainer.__file__,
        "trainer_pypi": trainer.__file__, "trainer_pypi_has": hasattr(trainer, "Trainer"),
        "bare": {n: getattr(importlib.util.find_spec(n), "origin", None) for n in ("pipelines", "schemas", "data_cards")},
    }))
""")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy: setuptools writes build/ and *.egg-info into the source tree
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".tox", ".demo-venv", ".lock-venv", "demo_out",
                                                              "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, cwd=out)
    (whl,) = out.glob("longreel-*.whl")
    return whl


def test_the_wheel_holds_one_top_level_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"longreel"}
    for sub in ("pipelines", "trainer", "schemas", "data_cards", "task", "testing"):
        assert f"longreel/{sub}/__init__.py" in names, sub
    # package data travels with the mapped folders
    assert "longreel/pipelines/configs/demo.yaml" in names and "longreel/data_cards/card.md.j2" in names


def test_installed_beside_pypi_trainer_both_import(wheel, tmp_path):
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the locked dependencies (and Coqui's trainer) from this environment, after the venv's own site-packages
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    run = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, cwd=neutral)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["longreel"].startswith(str(site)) and got["pipelines"].startswith(str(site / "longreel" / "pipelines"))
    assert got["trainer_ours"].startswith(str(site / "longreel" / "trainer"))
    # `import trainer` is Coqui's package from the borrowed site-packages, not a folder of this project
    assert Path(got["trainer_pypi"]).parent == Path(sysconfig.get_paths()["purelib"]) / "trainer"
    assert got["trainer_pypi_has"]
    assert got["bare"] == {"pipelines": None, "schemas": None, "data_cards": None}
