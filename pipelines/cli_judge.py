"""``longreel judge``: the LLM judge run alone on an existing output directory."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from longreel.pipelines.model_paths import check_model_paths, stage_models
from longreel.pipelines.blind_config import BACKENDS
from longreel.pipelines.cli_common import command_line, exit_code, model_stage_config
from longreel.pipelines.judge_config import JudgeConfig
from longreel.schemas.config import config_hash, dump_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Judge: an LLM checks every question of an output directory against the timestamped captions it was
written from, with a JSON-schema verdict (answer follows from the captions, unique among the options,
needs more than one clip for the temporal and plot categories); the times the reasoning cites are
checked against the captions' spans.

Reads OUT/<qra table>-*.parquet (default `qras`) and OUT/captions-*.parquet. Writes
OUT/qras_judged-*.parquet (kept questions with judge_verdict: the verdict, the judge's model, revision
and prompt hash), replaces this stage's rows in OUT/rejects-*.parquet (judge_answer_unsupported,
judge_answer_not_unique, judge_timestamp_missing, judge_single_clip, judge_unparseable,
judge_failed), merges a `judge` stage into OUT/stats.json, and writes OUT/judge_config.yaml.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="Output directory of a curation run. Required.")
    p.add_argument("--model", help="Judge model (shortcut for --set model=NAME).")
    p.add_argument("--backend", choices=BACKENDS, help="Judge engine (shortcut for --set backend=NAME).")
    p.add_argument("--qra-table", default="qras", help="Name of the questions table in --out (default: qras).")
    p.add_argument("--config",
                   help="YAML config file (JudgeConfig) over the run's own judge settings (OUT/config.yaml: the "
                        "question writer's engine and model where its judge followed them); see --show-config for "
                        "every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")


def run_judge(out_dir: str, cfg: JudgeConfig, beam_args: list[str] | None = None, qra_table: str = "qras",
              engine_factory=None, command: str | None = None) -> dict:
    """Run the judge on ``out_dir``'s questions (holding its lock); return the merged stats document."""
    import apache_beam as beam
    from apache_beam.io.filesystems import FileSystems

    from longreel.pipelines.io.parquet_sink import WriteSortedParquet, read_table
    from longreel.pipelines.stage_session import StageSession
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stage_rerun import write_rerun_outputs
    from longreel.pipelines.stages.judge import STAGE, JudgeQRAs, finish_judge_stats
    from longreel.pipelines.stats import read_json

    cfg.check()
    with StageSession(out_dir, "judge", config_hash(cfg), command) as session:
        qras = read_table(out_dir, qra_table).to_pylist()
        captions = read_table(out_dir, "captions").to_pylist()
        session.begin_writes()
        with FileSystems.create(FileSystems.join(out_dir, "judge_config.yaml")) as fh:
            fh.write(dump_yaml(cfg).encode())
        p = make_pipeline(beam_args)
        transform = JudgeQRAs(cfg, engine_factory)
        out = {"qras": p | "Questions" >> beam.Create(qras),
               "captions": p | "Captions" >> beam.Create(captions)} | "Judge" >> transform
        out["main"] | "WriteJudged" >> WriteSortedParquet(out_dir, "qras_judged", "qra", cfg.parquet_shards)
        prov = transform.provenance()
        write_rerun_outputs(p, out_dir, [STAGE], {STAGE: "question"}, out["rejects"], out["counts"], {},
                            cfg.parquet_shards, finish=lambda doc: finish_judge_stats(doc, prov))
        p.run().wait_until_finish()
        doc = read_json(FileSystems.join(out_dir, "stats.json"))
        session.finish()
    return doc


def main(args, beam_args: list[str]) -> int:
    cfg, done = model_stage_config("judge", JudgeConfig, args, "judge", beam_args)
    if cfg is None:
        return done
    check_model_paths(stage_models("judge", cfg), beam_args or [])  # a missing path: exit 2, nothing written
    try:
        doc = run_judge(args.out, cfg, beam_args, qra_table=args.qra_table, command=command_line(args, "judge"))
    except FileNotFoundError as e:
        print(f"longreel judge: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc.get("judge", {})))
    return exit_code("judge", doc, ["judge"], args.out)
