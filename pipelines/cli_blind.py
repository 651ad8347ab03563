"""``longreel blind``: the blind (text-only) answerability filter run alone on an existing output directory."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from longreel.pipelines.model_paths import check_model_paths, stage_models
from longreel.pipelines.blind_config import BACKENDS, BlindConfig
from longreel.pipelines.cli_common import command_line, exit_code, model_stage_config
from longreel.schemas.config import config_hash, dump_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Blind filter: answer every question of an output directory k times with a text-only model (no
frames, no captions) and reject the ones it gets right without the video.

Reads OUT/<qra table>-*.parquet (default `qras`). Each question is asked with the trainer's prompt
minus the video; with rotate_options the k samples see the options in rotated orders, so a model's
letter bias cannot pass a question. Samples are scored with the trainer's rewards; a question with
blind pass count / k >= max_pass_rate is rejected `text_answerable`.

Writes OUT/blind-*.parquet (every scored question: k, pass count, samples, rewards, the answerer's
provenance), OUT/qras_blind-*.parquet (the kept questions with blind_k and blind_pass_count: give it
to `longreel filter --qra-table qras_blind`), replaces this stage's rows in OUT/rejects-*.parquet,
merges a `blind` stage into OUT/stats.json (in == kept + rejected) with the blind pass-count
histogram 0..k, and writes OUT/blind_config.yaml. Re-running replaces this stage's outputs.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="Output directory of a curation run (local path or gs://, s3://). Required.")
    p.add_argument("--model", help="Answerer model (shortcut for --set model=NAME).")
    p.add_argument("--backend", choices=BACKENDS, help="Answerer engine (shortcut for --set backend=NAME).")
    p.add_argument("--qra-table", default="qras", help="Name of the questions table in --out (default: qras).")
    p.add_argument("--config",
                   help="YAML config file (BlindConfig) over the run's own blind settings (OUT/config.yaml); "
                        "see --show-config for every key.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one config key, e.g. --set k=8 --set max_pass_rate=0.75 (repeatable).")
    p.add_argument("--show-config", action="store_true", help="Print every config key with default and help; exit.")


def run_blind(out_dir: str, cfg: BlindConfig, beam_args: list[str] | None = None, qra_table: str = "qras",
              engine_factory=None, command: str | None = None) -> dict:
    """Run the blind filter on ``out_dir``'s questions (holding its lock); return the merged stats document."""
    from longreel.pipelines.stage_session import StageSession

    cfg.check()
    with StageSession(out_dir, "blind", config_hash(cfg), command) as session:
        return _run_blind(session, out_dir, cfg, beam_args, qra_table, engine_factory)


def _run_blind(session, out_dir: str, cfg: BlindConfig, beam_args, qra_table: str, engine_factory) -> dict:
    import apache_beam as beam
    from apache_beam.io.filesystems import FileSystems

    from longreel.pipelines.io.parquet_sink import WriteSortedParquet, read_table
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stage_rerun import write_rerun_outputs
    from longreel.pipelines.stages.blind import STAGE, add_blind_stage, finish_blind_stats
    from longreel.pipelines.stats import read_json

    qras = read_table(out_dir, qra_table).to_pylist()
    session.begin_writes()
    with FileSystems.create(FileSystems.join(out_dir, "blind_config.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("blind: %d questions in %s (k=%d, %s %s)", len(qras), out_dir, cfg.k, cfg.backend, cfg.model)
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    q = p | "Questions" >> beam.Create(qras)
    res = add_blind_stage(q, out_dir, cfg, engine_factory)
    res["qras"] | "WriteKept" >> WriteSortedParquet(out_dir, "qras_blind", "qra", cfg.parquet_shards)
    k, prov, chash = cfg.k, res["provenance"], config_hash(cfg)
    write_rerun_outputs(p, out_dir, [STAGE], {STAGE: "question"}, res["rejects"], res["counts"], {},
                        cfg.parquet_shards, finish=lambda doc: finish_blind_stats(doc, k, prov, chash))
    p.run().wait_until_finish()
    doc = read_json(FileSystems.join(out_dir, "stats.json"))
    session.finish()
    log.info("blind: done in %.1f s: %s", time.monotonic() - t0,
             json.dumps(doc.get("blind", {}).get("text_answerable")))
    return doc


def main(args, beam_args: list[str]) -> int:
    cfg, done = model_stage_config("blind", BlindConfig, args, "blind", beam_args)
    if cfg is None:
        return done
    check_model_paths(stage_models("blind", cfg), beam_args or [])  # a missing path: exit 2, nothing written
    try:
        doc = run_blind(args.out, cfg, beam_args, qra_table=args.qra_table, command=command_line(args, "blind"))
    except FileNotFoundError as e:
        print(f"longreel blind: {e}", file=sys.stderr)
        return 2
    section = doc.get("blind", {})
    print(json.dumps({key: section.get(key) for key in ("questions_in", "scored", "text_answerable",
                                                         "text_answerable_share", "kept", "pass_count_histogram",
                                                         "failed_by_reason", "balanced")}))
    return exit_code("blind", doc, ["blind"], args.out)
