"""A one-worker run imports its last stages' modules in a background thread while it decodes (curate._warm_imports)."""
from __future__ import annotations

import subprocess
import sys

from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import worker_warm_modules
from longreel.schemas.config import load_yaml


def test_warm_modules_follow_the_stages():
    both = load_yaml(CurateConfig, None, ["stages=[caption,qra,filter,pack]", "qra.backend=template",
                                         "filter.model=scripted"])
    assert worker_warm_modules(both) == ("rouge_score.rouge_scorer",)  # the QRA counter needs no transformers
    assert worker_warm_modules(load_yaml(CurateConfig, None, ["stages=[caption]"])) == ()


def test_warm_imports_run_in_a_thread_and_swallow_failures():
    """In a fresh interpreter (so the modules are not imported yet): the thread imports what it can and ends."""
    code = ("import sys\nfrom longreel.pipelines.curate import _warm_imports\n"
            "assert 'rouge_score.rouge_scorer' not in sys.modules\n"
            "t = _warm_imports(['no_such_module_longreel', 'rouge_score.rouge_scorer'])\n"
            "t.join(120)\n"
            "print(t.is_alive(), 'rouge_score.rouge_scorer' in sys.modules, _warm_imports(['sys']))\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert got.split() == ["False", "True", "None"]
