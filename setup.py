"""Packaging: the repository's layer folders install under one import name, ``longreel``.

The folders stay at the top of the repository (``pipelines/ trainer/ schemas/ data_cards/``) and install as
``longreel.pipelines``, ``longreel.trainer``, ``longreel.schemas`` and ``longreel.data_cards`` through ``package_dir``,
so that no top-level name but ``longreel`` is installed (PyPI has unrelated ``trainer``, ``pipelines`` and ``schemas``
packages). Metadata and dependencies are in setup.cfg; this file only computes the package list, which setup.cfg
cannot express for a mapped layout. It is also the ``--setup_file`` a Dataflow job ships to its workers.
"""
from setuptools import find_packages, setup

LAYERS = ("pipelines", "trainer", "schemas", "data_cards")


#: folders of data only (no ``__init__.py``) whose files ``[options.package_data]`` ships: listed as packages too,
#: because setuptools otherwise warns, on every build, that Python could import them but the build would ignore them
DATA_FOLDERS = ("pipelines.configs", "pipelines.sample_data", "data_cards.demo")


def _packages() -> list[str]:
    own = find_packages(include=["longreel", "longreel.*"])
    layered = [f"longreel.{p}" for p in find_packages(include=[n for layer in LAYERS for n in (layer, f"{layer}.*")])]
    return sorted(own + layered + [f"longreel.{p}" for p in DATA_FOLDERS])


setup(
    packages=_packages(),
    package_dir={"longreel": "longreel", **{f"longreel.{layer}": layer for layer in LAYERS}},
)
