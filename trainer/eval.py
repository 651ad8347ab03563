"""Evaluation (``longreel eval``): greedy answers on held-out items, scored with the trainer's reward code.

Reports accuracy overall, per ``category`` and per ``problem_type``, plus the format rate and how many items could
not be evaluated (placeholder mismatch, bad reference), each with its reason.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Iterable

import torch

from longreel.trainer.policy import VideoTokenMismatch, encode_prompt, video_token_id
from longreel.task.rewards import score
from longreel.trainer.rollout import SamplingConfig, TransformersEngine

__all__ = ["evaluate"]

log = logging.getLogger("longreel.trainer")


@torch.no_grad()
def evaluate(model, processor, items: Iterable[dict], *, max_new_tokens: int = 256, max_items: int = 0,
             progress: bool = False, keep_outputs: bool = False, batch_size: int = 8) -> dict[str, Any]:
    """Greedy-decode every item and score it; return ``{"accuracy", "format_rate", "n", "per_category",
    "per_problem_type", "skipped", ...}``. ``batch_size`` items are decoded together (each prompt's K/V kept
    once; the answers are each item's own greedy answer, whatever it is batched with)."""
    engine = TransformersEngine(model, processor)
    sampling = SamplingConfig(n=1, max_new_tokens=max_new_tokens, greedy=True)
    device = next(model.parameters()).device
    vt = video_token_id(model)
    acc_by: dict[str, dict[str, list[float]]] = {"category": defaultdict(list), "problem_type": defaultdict(list)}
    accs, fmts, outputs, skipped = [], [], [], []
    items = list(items)
    if max_items:
        items = items[:max_items]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="eval", dynamic_ncols=True)
    step = max(1, batch_size)
    for lo in range(0, len(items), step):
        batch, prompts = [], []
        for item in items[lo:lo + step]:
            try:
                prompts.append(encode_prompt(processor, item, video_token_id=vt).to(device))
                batch.append(item)
            except (VideoTokenMismatch, ValueError, KeyError) as e:
                skipped.append({"key": item.get("key"), "reason": type(e).__name__, "message": str(e)})
        groups = engine.generate(prompts, sampling, [0] * len(prompts)) if prompts else []
        for item, group in zip(batch, groups):
            text = group.texts[0]
            try:
                r = score(text, item["problem_type"], item["answer"], item.get("options"))
            except (ValueError, KeyError) as e:
                skipped.append({"key": item.get("key"), "reason": type(e).__name__, "message": str(e)})
                continue
            accs.append(r.accuracy)
            fmts.append(r.format)
            acc_by["category"][str(item.get("category") or "none")].append(r.accuracy)
            acc_by["problem_type"][str(item["problem_type"])].append(r.accuracy)
            if keep_outputs:
                outputs.append({"key": item.get("key"), "output": text, "answer": item["answer"],
                                "accuracy": r.accuracy, "reason": r.reason})
        if bar is not None:
            bar.update(len(items[lo:lo + step]))
    if bar is not None:
        bar.close()
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    result = {
        "n": len(accs),
        "accuracy": mean(accs),
        "format_rate": mean(fmts),
        "per_category": {k: {"n": len(v), "accuracy": mean(v)} for k, v in sorted(acc_by["category"].items())},
        "per_problem_type": {k: {"n": len(v), "accuracy": mean(v)} for k, v in sorted(acc_by["problem_type"].items())},
        "skipped": len(skipped),
        "skipped_items": skipped,
    }
    if keep_outputs:
        result["outputs"] = outputs
    return result
