"""Beam's ``RunInference`` API (``apache_beam.ml.inference.base``), imported without torch.

Beam 2.77's ``ml.inference.base`` imports ``ml.inference.model_manager`` at module level, inside a
``try/except ImportError`` that sets ``ModelManager = None`` when it fails; ``model_manager`` imports torch and
scipy. ``ModelManager`` only serves ``RunInference(..., use_model_manager=True)``, which longreel never asks for,
yet the import cost every run that has a caption or filter stage about 2 s of CPU before any video was read
(``python -X importtime``: torch 1.4-1.9 s, scipy), even a run whose stages use no model at all (``facts``
captions, ``template`` QRAs, a scripted answerer).

So the first import of ``base`` goes through :func:`_import_base`, which makes ``model_manager`` unimportable
for that one import (a ``None`` entry in ``sys.modules`` raises ImportError, Python's documented way to block a
module) and then removes the block again: ``base`` takes its own fallback (``ModelManager = None``), and code
that imports ``model_manager`` later still can. The same fallback also sets ``base``'s ``resource`` (the standard
library module it reads a worker's peak memory with) to ``None``: without it, every ``RunInference`` logged
"Resource module is not available for current platform" on each worker and reported a memory of 0, so it is put
back. A process that already imported ``base`` (or torch) is left as it is. Every longreel module takes these
names from here, never from Beam directly.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np

# RunInference batches through Beam's BatchElements, which fits batch size against time with numpy's polyfit; while
# the batches so far have (nearly) one size, as when bundles are smaller than the batch size, every fit warned
# "Polyfit may be poorly conditioned" (or divided by zero) on the user's terminal, a -q run's included. The fit
# falls back on its own; the warnings say nothing about the run, so they are silenced for that module only.
for _category in (RuntimeWarning, np.exceptions.RankWarning):
    warnings.filterwarnings("ignore", category=_category, module=r"apache_beam\.transforms\.util")

_BASE = "apache_beam.ml.inference.base"
_MODEL_MANAGER = "apache_beam.ml.inference.model_manager"


def _import_base():
    if _BASE in sys.modules:
        return sys.modules[_BASE]
    blocked = _MODEL_MANAGER not in sys.modules
    if blocked:
        sys.modules[_MODEL_MANAGER] = None  # type: ignore[assignment]
    try:
        import apache_beam.ml.inference.base as base
    finally:
        if blocked and _MODEL_MANAGER in sys.modules and sys.modules[_MODEL_MANAGER] is None:
            del sys.modules[_MODEL_MANAGER]
    if blocked and getattr(base, "resource", None) is None:
        import resource  # not on Windows: there Beam's own fallback stands

        base.resource = resource
    return base


_base = _import_base()
ModelHandler = _base.ModelHandler
PredictionResult = _base.PredictionResult
RunInference = _base.RunInference

__all__ = ["ModelHandler", "PredictionResult", "RunInference"]
