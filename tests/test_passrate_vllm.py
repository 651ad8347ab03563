"""The pass-rate filter's vllm backend on a GPU (skipped elsewhere): runs scripts/gpu_check_passrate_vllm.py, which
builds the tiny Qwen2-VL offline and checks k completions per question, same seed -> same samples, a balanced
funnel, and the same prompt and weights hash as the transformers backend."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_vllm_backend_gpu_check(shared_videos):
    import torch
    import vllm  # noqa: F401  (GPU machines with the `gpu` extra; deselected elsewhere by the `gpu` marker)
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: this GPU check ran on a machine without one")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check_passrate_vllm.py"),
                           "--videos", str(shared_videos), "--compare-transformers"],
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
