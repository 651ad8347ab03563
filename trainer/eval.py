"""Evaluation (``longreel eval``): greedy answers on held-out items, scored with the trainer's reward code.

Reports accuracy overall, per ``category`` and per ``problem_type``, each with a 95% confidence interval
(``accuracy_ci95``: how far the accuracy on these items may be from the model's accuracy on the population they were
drawn from), plus the format rate and how many items could not be evaluated (placeholder mismatch, bad reference),
each with its reason.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Iterable

import torch

from longreel.trainer.policy import VideoTokenMismatch, encode_prompt, video_token_id
from longreel.task.rewards import score
from longreel.trainer.rollout import SamplingConfig, TransformersEngine

__all__ = ["evaluate", "score_items", "summarize", "ci95"]

log = logging.getLogger("longreel.trainer")


def evaluate(model, processor, items: Iterable[dict], *, max_new_tokens: int = 256, max_items: int = 0,
             progress: bool = False, keep_outputs: bool = False, batch_size: int = 8) -> dict[str, Any]:
    """Greedy-decode every item and score it; return ``{"accuracy", "format_rate", "n", "per_category",
    "per_problem_type", "skipped", ...}`` (``accuracy`` and ``format_rate`` None when no item could be scored).
    ``batch_size`` items are decoded together (each prompt's K/V kept once; the answers are each item's own greedy
    answer, whatever it is batched with)."""
    items = list(items)
    if max_items:
        items = items[:max_items]
    records = score_items(model, processor, items, max_new_tokens=max_new_tokens, progress=progress,
                          keep_outputs=keep_outputs, batch_size=batch_size)
    return summarize(records, keep_outputs=keep_outputs)


@torch.no_grad()
def score_items(model, processor, items: list[dict], *, indices: list[int] | None = None, max_new_tokens: int = 256,
                progress: bool = False, keep_outputs: bool = False, batch_size: int = 8) -> list[dict]:
    """One record per item: its place (``indices``, default 0..n-1: where the item stands in the whole evaluation
    when ``items`` is one rank's share of it), and its accuracy, format, category and problem type, or why it was
    skipped. Records of several shares put together give :func:`summarize` what one process's would."""
    engine = TransformersEngine(model, processor)
    sampling = SamplingConfig(n=1, max_new_tokens=max_new_tokens, greedy=True)
    device = next(model.parameters()).device
    vt = video_token_id(model)
    indices = list(range(len(items))) if indices is None else list(indices)
    if len(indices) != len(items):
        raise ValueError(f"{len(indices)} indices for {len(items)} items")
    records = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="eval", dynamic_ncols=True)
    step = max(1, batch_size)
    for lo in range(0, len(items), step):
        batch, prompts = [], []
        for index, item in zip(indices[lo:lo + step], items[lo:lo + step]):
            try:
                prompts.append(encode_prompt(processor, item, video_token_id=vt).to(device))
                batch.append((index, item))
            except (VideoTokenMismatch, ValueError, KeyError) as e:
                records.append(_skipped(index, item, e))
        groups = engine.generate(prompts, sampling, [0] * len(prompts)) if prompts else []
        for (index, item), group in zip(batch, groups):
            text = group.texts[0]
            try:
                r = score(text, item["problem_type"], item["answer"], item.get("options"))
            except (ValueError, KeyError) as e:
                records.append(_skipped(index, item, e))
                continue
            record = {"index": index, "key": item.get("key"), "accuracy": r.accuracy, "format": r.format,
                      "category": str(item.get("category") or "none"), "problem_type": str(item["problem_type"])}
            if keep_outputs:
                record.update(output=text, answer=item["answer"], reason=r.reason)
            records.append(record)
        if bar is not None:
            bar.update(len(items[lo:lo + step]))
    if bar is not None:
        bar.close()
    return records


def _skipped(index: int, item: dict, e: Exception) -> dict:
    return {"index": index, "key": item.get("key"), "skipped": {"reason": type(e).__name__, "message": str(e)}}


def ci95(scores: list[float]) -> list[float] | None:
    """A 95% confidence interval ``[low, high]`` for the mean of per-item scores in [0, 1], or None with no items.

    All scores 0 or 1 (the usual case: right or wrong): the Wilson score interval, which stays inside [0, 1] and is
    not of width 0 at 0 or n right answers (the normal approximation is, and is too narrow for the 50-200 items a
    category often has). Partial scores (an open-ended answer's ROUGE): the normal interval of the mean, clipped to
    [0, 1]; [0, 1] for a single item. Written here rather than imported: scipy's ``binomtest`` has it, but scipy is
    not one of longreel's dependencies, and it is three lines."""
    n = len(scores)
    if n == 0:
        return None
    z = 1.959963984540054
    mean = sum(scores) / n
    if all(x in (0, 1) for x in scores):
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    elif n == 1:
        return [0.0, 1.0]
    else:
        centre = mean
        half = z * math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - 1) / n)
    return [round(max(0.0, centre - half), 6), round(min(1.0, centre + half), 6)]


def summarize(records: Iterable[dict], *, keep_outputs: bool = False) -> dict[str, Any]:
    """:func:`evaluate`'s result from :func:`score_items`' records, taken in item order (so the means add up in the
    same order as in one process, whichever ranks scored which items)."""
    records = sorted(records, key=lambda r: r["index"])
    scored = [r for r in records if "skipped" not in r]
    # with no item scored there is no accuracy: None (JSON null), not 0.0, which reads as a model that got all wrong
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    by: dict[str, dict[str, list[float]]] = {"category": defaultdict(list), "problem_type": defaultdict(list)}
    for r in scored:
        by["category"][r["category"]].append(r["accuracy"])
        by["problem_type"][r["problem_type"]].append(r["accuracy"])
    skipped = [{"key": r["key"], **r["skipped"]} for r in records if "skipped" in r]
    result = {
        "n": len(scored),
        "accuracy": mean([r["accuracy"] for r in scored]),
        "accuracy_ci95": ci95([r["accuracy"] for r in scored]),
        "format_rate": mean([r["format"] for r in scored]),
        "per_category": {k: {"n": len(v), "accuracy": mean(v), "accuracy_ci95": ci95(v)}
                         for k, v in sorted(by["category"].items())},
        "per_problem_type": {k: {"n": len(v), "accuracy": mean(v), "accuracy_ci95": ci95(v)}
                             for k, v in sorted(by["problem_type"].items())},
        "skipped": len(skipped),
        "skipped_items": skipped,
    }
    if keep_outputs:
        result["outputs"] = [{"key": r["key"], "output": r["output"], "answer": r["answer"],
                              "accuracy": r["accuracy"], "reason": r["reason"]} for r in scored]
    return result
