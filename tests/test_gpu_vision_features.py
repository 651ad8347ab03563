"""On a GPU machine: the log-probs the update trains on reach the vision tower (run with ``pytest -m gpu``).

Use the ``pytest`` command, or ``python -m pytest`` from ``tests/``, with longreel installed: ``python -m pytest``
from the repository root puts the root on ``sys.path``, and its bare ``longreel/`` folder (the layer folders are
mapped into ``longreel`` only by the install, setup.py) hides ``longreel.trainer`` unless the install is editable.

transformers 5.17 on a lent H100 dropped the ``mm_encoder_outputs`` keyword these passes use, so every log-prob
there ignored the video and the tower got no gradient, silently (benchmarks/results/grpo_gpu.md, the correction).
The CPU tests of the trainer check the same gradients on this machine's locked transformers; this one checks the
GPU machine's own stack."""
import pytest
import torch

from longreel.testing.tiny_model import build_tiny_qwen2vl
from longreel.trainer.activation_checkpointing import enable_checkpointing
from longreel.trainer.policy import encode_prompt, load_policy, sequence_logprobs, video_token_id

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_update_log_probs_reach_the_vision_tower_on_cuda(tmp_path, checkpointing):
    model, processor = load_policy(build_tiny_qwen2vl(tmp_path / "tiny"), dtype=torch.bfloat16, device="cuda")
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    g = torch.Generator().manual_seed(0)
    item = {"key": "v", "frames": torch.randint(0, 256, (8, 56, 56, 3), dtype=torch.uint8, generator=g),
            "video_metadata": {"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8, "duration": 4.0,
                               "width": 56, "height": 56},
            "question": "What colour?", "options": ["red", "blue"], "answer": "A", "problem_type": "multiple_choice"}
    prompt = encode_prompt(processor, item, video_token_id=video_token_id(model)).to("cuda")
    responses = torch.randint(0, 100, (2, 4), device="cuda")
    logp = sequence_logprobs(model, prompt, responses, torch.ones_like(responses))
    tower = list(model.model.visual.parameters())
    grads = torch.autograd.grad(logp.float().sum(), tower, allow_unused=True)
    missing = sum(x is None for x in grads)
    assert missing == 0, f"{missing} of {len(tower)} tower parameters get no gradient"
