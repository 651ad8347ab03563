"""One GRPO step on real decoded video for tests/test_grpo_mrsp.py, run alone or under torchrun.

``python tests/grpo_mrsp_worker.py OUT_DIR GRADS MODEL_DIR VIDEO_DIR [key=value ...]``
"""
from __future__ import annotations

import sys
from pathlib import Path


def video_items(video_dir) -> list[dict]:
    """Three multiple-choice items on two real videos (two questions share ``opencv__vtest.avi``)."""
    import torch

    from longreel.pipelines.media.decode import decode_frames, sample_timestamps

    out = []
    specs = [("vtest", "opencv__vtest.avi", ["How many people walk to the left?", "Is it indoors?"]),
             ("tree", "opencv__tree.avi", ["What moves in the clip?"])]
    for vid, name, questions in specs:
        dec = decode_frames(str(Path(video_dir) / name), sample_timestamps(0.0, 2.0, 4))
        meta = {"fps": dec.fps, "frames_indices": list(dec.indices), "total_num_frames": len(dec.indices)}
        for q, question in enumerate(questions):
            out.append({"key": f"{vid}_q{q}", "video_id": vid, "frames": torch.from_numpy(dec.frames),
                        "video_metadata": meta, "question": question, "options": ["one", "two", "three", "four"],
                        "answer": "B", "problem_type": "multiple_choice", "category": "test",
                        "target": "<think>look</think><answer>B</answer>"})
    return out


def main(argv: list[str]) -> None:
    out, grads, model, videos, *sets = argv
    from longreel.schemas.config import load_yaml
    from longreel.trainer.config import TrainConfig
    from longreel.trainer.grpo import run_grpo

    cfg = load_yaml(TrainConfig, None, [
        f"model.path={model}", f"run.out_dir={out}", f"run.dump_grads={grads}", "run.steps=1", "run.save_final=false",
        "run.progress=false", "run.tensorboard=false", "run.threads=1", "run.seed=11", "data.batch_size=3",
        "data.shuffle=false", "rollout.n=4", "rollout.max_new_tokens=8", "optim.grad_accum=2",
        "grpo.mix_policy=true", "grpo.beta=0.05", *sets])
    run_grpo(cfg, items=video_items(videos))


if __name__ == "__main__":
    main(sys.argv[1:])
