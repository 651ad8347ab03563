"""The vLLM request builders for cached video embeddings (no vLLM needed; the GPU path is
scripts/gpu_check_mrsp_vllm.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import torch

from longreel.trainer.mrsp.vllm_embeds import embeds_request, video_embeds_item  # noqa: E402


def test_item_carries_embeds_and_grid_on_cpu():
    feats = torch.randn(60, 64, requires_grad=True)
    item = video_embeds_item(feats * 2, torch.tensor([[2, 10, 12]]), second_per_grid_ts=torch.tensor([1.0]))
    assert item["video_embeds"].shape == (60, 64) and not item["video_embeds"].requires_grad
    assert item["video_grid_thw"].tolist() == [[2, 10, 12]] and item["video_grid_thw"].dtype == torch.long
    assert item["second_per_grid_ts"].tolist() == [1.0]
    assert video_embeds_item(feats, torch.tensor([[2, 10, 12]]), dtype=torch.bfloat16)["video_embeds"].dtype \
        == torch.bfloat16


def test_mismatched_features_and_prompts_are_refused():
    with pytest.raises(ValueError, match="do not match grid"):
        video_embeds_item(torch.zeros(59, 64), torch.tensor([[2, 10, 12]]))
    with pytest.raises(ValueError, match="one video per item"):
        video_embeds_item(torch.zeros(120, 64), torch.tensor([[2, 10, 12], [2, 10, 12]]))
    with pytest.raises(ValueError, match="exactly one"):
        embeds_request("no placeholder here", torch.zeros(60, 64), torch.tensor([[2, 10, 12]]))
    req = embeds_request("<|vision_start|><|video_pad|><|vision_end|>hi", torch.zeros(60, 64),
                         torch.tensor([[2, 10, 12]]))
    assert set(req) == {"prompt", "multi_modal_data"} and set(req["multi_modal_data"]) == {"video"}


def test_module_does_not_import_vllm():
    code = "import sys, longreel.trainer.mrsp.vllm_embeds, longreel.trainer.mrsp.sp_prefill; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
