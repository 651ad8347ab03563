"""Input tables for running pack without the upstream stages (tests, benchmarks, demos).

:func:`video_rows` probes real files (in the killable worker) into valid VIDEO rows;
:func:`qra_rows` / :func:`pass_rate_rows` make valid QRA / PASS_RATE rows about them (plain
template questions: they exercise the packing, not question quality); :func:`write_tables`
writes them as the stage tables ``longreel pack`` reads.
"""
from __future__ import annotations

import hashlib
import json
import os

from longreel.schemas import to_table, validate_row


def video_rows(paths: list[str], license: str | None = None, attribution: str | None = None) -> list[dict]:
    from longreel.pipelines.media.worker import IsolatedWorker
    from longreel.pipelines.stages.ingest import hash_and_localize

    rows = []
    with IsolatedWorker(default_timeout=300) as w:
        for p in paths:
            local, sha, size, _ = hash_and_localize(str(p), "/tmp")
            info = w.call("probe", path=local)
            row = {"video_id": sha[:16], "sha256": sha, "uri": str(p), "bytes": size,
                   "license": license or "CC-BY-3.0", "attribution": attribution or f"fixture: {os.path.basename(p)}",
                   **info}
            rows.append(validate_row("video", row))
    return rows


def qra_rows(videos: list[dict], per_video: int = 3) -> list[dict]:
    rows = []
    types = ("multiple_choice", "open_ended", "numerical", "boolean")
    cats = ("temporal", "goal_purpose", "spatial", "plot_narrative")
    for v in videos:
        for i in range(per_video):
            qid = hashlib.sha256(f"{v['video_id']}:{i}".encode()).hexdigest()[:20]
            ptype = types[i % len(types)]
            options = ["the start", "the middle", "the end", "never"] if ptype == "multiple_choice" else None
            answer = {"multiple_choice": "B", "open_ended": "a hand moves", "numerical": str(i + 2),
                      "boolean": "yes"}[ptype]
            reasoning = f"Looking at the frames of video {v['video_id']}, question {i}."
            rows.append(validate_row("qra", {
                "qra_id": qid, "video_id": v["video_id"], "category": cats[i % len(cats)], "problem_type": ptype,
                "question": f"Question {i} about what happens in the video ({v['duration_s']:.1f} s)?",
                "options": options, "answer": answer, "reasoning": reasoning,
                "target": f"<think>{reasoning}</think><answer>{answer}</answer>", "generator": "template",
                "model": "none", "model_revision": None, "prompt_hash": "0" * 16,
                "sampling": json.dumps({"temperature": 0.0}), "seed": i, "source_caption_ids": [],
                "refined": False}))
    return rows


def pass_rate_rows(qras: list[dict], k: int = 4) -> list[dict]:
    """Deterministic pass counts spread over easy (sft) / medium (rl) / hard (drop)."""
    rows = []
    for q in qras:
        n = int(hashlib.sha256(q["qra_id"].encode()).hexdigest()[:4], 16) % (k + 1)
        label = "easy" if n == k else "hard" if n == 0 else "medium"
        split = {"easy": "sft", "medium": "rl", "hard": "drop"}[label]
        rewards = [1.0] * n + [0.0] * (k - n)
        rows.append(validate_row("pass_rate", {
            "qra_id": q["qra_id"], "video_id": q["video_id"], "k": k, "pass_count": n,
            "mean_reward": sum(rewards) / k, "rewards": rewards, "label": label, "split": split,
            "answerer": "fixture", "answerer_revision": None, "temperature": 1.0, "seed": 0}))
    return rows


def write_tables(out_dir: str, tables: dict[str, tuple[str, list[dict]]]) -> None:
    """``{"videos": ("video", rows), "qras": ("qra", rows), ...}`` -> ``<out_dir>/<table>-00000-of-00001.parquet``."""
    from longreel.pipelines.io.parquet_sink import shard_name, write_parquet_atomic

    os.makedirs(out_dir, exist_ok=True)
    for table, (kind, rows) in tables.items():
        write_parquet_atomic(shard_name(out_dir, table, 0, 1), to_table(kind, rows))
