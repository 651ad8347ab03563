"""``longreel filter``: the pass-rate filter run alone on an existing output directory."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from longreel.pipelines.model_paths import check_model_paths, stage_models
from longreel.pipelines.cli_common import command_line, exit_code, model_stage_config
from longreel.pipelines.filter_config import FilterConfig
from longreel.schemas.config import config_hash, dump_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Pass-rate filter: answer every question of an output directory k times with a VLM and keep the
ones it sometimes gets right.

Reads OUT/videos-*.parquet and OUT/<qra table>-*.parquet (default `qras`). For each question,
n_frames frames are sampled uniformly over its video (decoded once per video in a killable
worker), the answerer samples k completions with the trainer's prompt format
(longreel.task.prompting), and each is scored with the trainer's rewards (longreel.task.rewards.score).
A sample passes when its accuracy is 1 (or its reward >= pass_threshold). Labels: easy (k/k),
hard (0/k), medium. Kept questions (policy `medium`, or a mean-reward band) are split into sft
and rl by a hash of the qra_id (sft_fraction 36/104 by default) or by pass rate.

With --shards (repeatable: wids index .json files, tar URLs or brace patterns) the questions and
their frames are read from packed WebDataset shards instead (OUT need not hold any table; it is
created): the answerer sees exactly the frames the trainer will, e.g. to label the data with the
SFT policy's pass rate before GRPO.

Writes OUT/pass_rate-*.parquet (every scored question, with split sft/rl/drop, the k
completions, rewards and the answerer's provenance), replaces this stage's rows in
OUT/rejects-*.parquet (too_easy, too_hard, out_of_band, and failures by reason), merges a
`passrate` stage into OUT/stats.json (in == kept + rejected) with the pass-count histogram
0..k, and writes OUT/filter_config.yaml. Re-running replaces this stage's outputs.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="Output directory of a curation run (local path or gs://, s3://). Required.")
    p.add_argument("--model", help="Answerer model directory (shortcut for --set model=DIR).")
    p.add_argument("--backend", choices=("transformers", "vllm"),
                   help="Answerer backend (shortcut for --set backend=NAME).")
    p.add_argument("--qra-table", default="qras", help="Name of the questions table in --out (default: qras).")
    p.add_argument("--shards", action="append", default=[], metavar="URL",
                   help="Read questions and frames from packed shards (index .json, tar URL, brace pattern or local "
                        "glob; repeatable) instead of --out's tables.")
    p.add_argument("--config",
                   help="YAML config file (FilterConfig) over the run's own filter settings (OUT/config.yaml); "
                        "see --show-config for every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set k=8 --set policy=band (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")


def check_shard_patterns(shards: list[str]) -> None:
    """``--shards`` must expand (index, brace pattern, local glob) before the run takes ``--out``: a pattern that
    matches nothing is the user's mistake (exit 2), not a failure halfway through the pipeline."""
    from longreel.pipelines.io.inputs import InputError
    from longreel.task.shard_reader import resolve_shards

    try:
        resolve_shards(shards)
    except (ValueError, OSError) as e:
        raise InputError(f"--shards: {e}") from None


def run_filter(out_dir: str, cfg: FilterConfig, beam_args: list[str] | None = None, qra_table: str = "qras",
               handler=None, command: str | None = None, shards: list[str] | None = None) -> dict:
    """Run the filter on ``out_dir``'s tables, or on packed ``shards`` (holding ``out_dir``'s lock; see
    :mod:`longreel.pipelines.io.run_dir`); return the merged stats document."""
    from longreel.pipelines.io.run_dir import ensure_dir
    from longreel.pipelines.stage_session import StageSession

    cfg.check_runnable()
    if shards:
        check_shard_patterns(shards)
        ensure_dir(out_dir)
    with StageSession(out_dir, "filter", config_hash(cfg), command) as session:
        return _run_filter(session, out_dir, cfg, beam_args, qra_table, handler, shards)


def _run_filter(session, out_dir: str, cfg: FilterConfig, beam_args, qra_table: str, handler, shards=None) -> dict:
    import apache_beam as beam
    from apache_beam.io.filesystems import FileSystems

    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stage_rerun import write_rerun_outputs
    from longreel.pipelines.stages.passrate import STAGE, add_filter_stage, finish_filter_stats
    from longreel.pipelines.stats import read_json

    if shards:
        from longreel.pipelines.stages.passrate import ReadShardQuestions
        from longreel.task.shard_reader import resolve_shards

        urls = [spec.url for spec in resolve_shards(shards)]
    else:
        from longreel.pipelines.stage_rerun import check_videos_reachable

        videos = read_table(out_dir, "videos").to_pylist()
        qras = read_table(out_dir, qra_table).to_pylist()
        check_videos_reachable(videos, out_dir, "filter", "pass_rate")
    session.begin_writes()
    with FileSystems.create(FileSystems.join(out_dir, "filter_config.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    if shards:
        log.info("filter: questions of %d packed shards -> %s (k=%d, backend %s; frames as packed)", len(urls),
                 out_dir, cfg.k, cfg.backend)
        read = (p | "ShardUrls" >> beam.Create(urls)
                | "ReadShards" >> beam.ParDo(ReadShardQuestions()).with_outputs("videos", "qras"))
        v, q = read.videos, read.qras
    else:
        log.info("filter: %d questions over %d videos in %s (k=%d, backend %s)", len(qras), len(videos), out_dir,
                 cfg.k, cfg.backend)
        v = p | "Videos" >> beam.Create(videos)
        q = p | "Questions" >> beam.Create(qras)
    res = add_filter_stage(p, v, q, out_dir, cfg, handler=handler)
    k, prov, chash = cfg.k, res["provenance"], config_hash(cfg)
    write_rerun_outputs(p, out_dir, [STAGE], {STAGE: "question"}, res["rejects"], res["counts"], {},
                        cfg.parquet_shards, finish=lambda doc: finish_filter_stats(doc, k, prov, chash))
    stats_path = FileSystems.join(out_dir, "stats.json")
    p.run().wait_until_finish()
    doc = read_json(stats_path)
    session.finish()
    log.info("filter: done in %.1f s: %s", time.monotonic() - t0, json.dumps(doc.get("passrate", {}).get("kept")))
    return doc


def main(args, beam_args: list[str]) -> int:
    cfg, done = model_stage_config("filter", FilterConfig, args, "filter", beam_args)
    if cfg is None:
        return done
    check_model_paths(stage_models("filter", cfg), beam_args or [])  # a missing path: exit 2, nothing written
    try:
        doc = run_filter(args.out, cfg, beam_args, qra_table=args.qra_table, command=command_line(args, "filter"),
                         shards=args.shards)
    except FileNotFoundError as e:
        print(f"longreel filter: {e}", file=sys.stderr)
        return 2
    section = doc.get("passrate", {})
    print(json.dumps({key: section.get(key) for key in ("questions_in", "kept", "kept_by_split", "dropped_by_reason",
                                                         "failed_by_reason", "pass_count_histogram", "balanced")}))
    return exit_code("filter", doc, ["passrate"], args.out)
