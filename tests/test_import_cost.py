"""What a run imports before it needs it: the model libraries stay out of the processes that do not use them.

Each check runs in a fresh interpreter (``sys.modules`` of the test session already holds everything)."""
import json
import os
import subprocess
import sys

import pytest


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which of torch, transformers, torchvision, scipy, nltk it imported."""
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in " \
                   "('torch', 'transformers', 'torchvision', 'scipy', 'nltk')}))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_beam_run_inference_without_torch():
    """Beam's RunInference API through longreel: its ModelManager (torch, scipy) is not imported, and stays
    importable afterwards (the block is lifted after the one import)."""
    got = _modules_after("from longreel.pipelines.inference.beam_ml import ModelHandler, PredictionResult, "
                         "RunInference\nimport sys\nassert 'apache_beam.ml.inference.model_manager' not in sys.modules")
    assert not got["torch"] and not got["scipy"], got


def test_model_manager_importable_after_beam_ml():
    got = _modules_after("import longreel.pipelines.inference.beam_ml\n"
                         "import apache_beam.ml.inference.model_manager as mm\nassert mm.ModelManager")
    assert got["torch"]


def test_run_inference_still_reads_worker_memory_after_beam_ml():
    """The block must not cost Beam's memory reading: without its ``resource`` module, every RunInference warned
    "Resource module is not available" on every worker (in a ``-q`` run too) and reported 0 bytes."""
    code = ("import logging, io\nstream = io.StringIO()\nlogging.basicConfig(stream=stream)\n"
            "import longreel.pipelines.inference.beam_ml\nimport apache_beam.ml.inference.base as b\n"
            "assert b._get_current_process_memory_in_bytes() > 0\n"
            "assert 'Resource module' not in stream.getvalue(), stream.getvalue()")
    got = _modules_after(code)
    assert not got["torch"], got


def test_batch_size_fits_do_not_warn_once_beam_ml_is_imported():
    """RunInference's batch-size fit (numpy polyfit in Beam's BatchElements) warned "Polyfit may be poorly
    conditioned" on degenerate batch sizes, dozens of lines in a -q run; with warnings as errors, it must not raise."""
    code = ("import warnings\nwarnings.simplefilter('error')\nimport longreel.pipelines.inference.beam_ml\n"
            "from apache_beam.transforms.util import _BatchSizeEstimator as E\n"
            "E.linear_regression_numpy([1] * 9 + [2, 4], [.1] * 9 + [.2, 9.0])\n"
            "E.linear_regression_numpy([1] * 10 + [2], [.1] * 10 + [5.0])")
    _modules_after(code)


def test_stage_modules_and_reward_library_import_no_model_library():
    """The stage modules a facts/template/scripted run loads, the reward library and the scripted answerer: no
    torch, transformers, torchvision, scipy or nltk until a stage really uses them."""
    got = _modules_after("import longreel.pipelines.curate, longreel.pipelines.stages.caption, "
                         "longreel.pipelines.stages.qra, longreel.pipelines.stages.passrate, "
                         "longreel.pipelines.stages.pack, longreel.task.rewards, longreel.testing.answerers")
    assert not any(got.values()), got


def test_open_ended_scores_after_lazy_import():
    """The ROUGE scorer still works when rouge_score/nltk are imported on first use (stemming included)."""
    from longreel.task.rewards.open_ended import UnicodeTokenizer, rouge_f

    assert UnicodeTokenizer().tokenize("Running dogs") == ["run", "dog"]
    assert UnicodeTokenizer(use_stemmer=False).tokenize("Running dogs") == ["running", "dogs"]
    assert rouge_f("the dogs are running", "a dog runs") == pytest.approx(rouge_f("the dog is running", "a dog runs"))


def test_frame_cache_versions_match_the_modules():
    """The frame cache key's library versions, read from package metadata, equal the modules' own."""
    import torch
    import torchvision
    import transformers

    from longreel.pipelines.pack.frame_cache import _versions

    v = _versions()
    assert v["torch"] == torch.__version__.split("+")[0]
    assert v["torchvision"] == torchvision.__version__.split("+")[0]
    assert v["transformers"] == transformers.__version__
