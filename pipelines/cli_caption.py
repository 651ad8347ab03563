"""``longreel caption``: caption the clips of an existing curate output directory."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from longreel.pipelines.model_paths import check_model_paths, stage_models
from longreel.pipelines.caption_config import BACKENDS, CaptionConfig
from longreel.pipelines.cli_common import command_line, exit_code, refuse_beam_args, run_settings_base
from longreel.schemas.config import ConfigError, config_hash, describe, dump_yaml, load_yaml

log = logging.getLogger("longreel")

DESCRIPTION = """\
Caption the clips of a `longreel curate` output directory (its videos-* and clips-* tables).

Three counted stages, each clip either passing or becoming a reject with a reason:
clip_facts (N frames per clip decoded in a killable worker, resized to the backend's pixel
budget; motion, black ratio, brightness, shot cuts, dominant colour), clip_filter (optional
static/black filter) and caption (the backend through Beam RunInference; empty, looping and
prompt-echo captions are rejects).

Writes captions-*.parquet and clip_facts-*.parquet into the directory, replaces the caption
stages' rows of rejects-*.parquet (other stages' rejects are kept) and merges the three stages
into stats.json; config_caption.yaml records the resolved config.

Backends: facts (weight-free, default), transformers (a local VLM directory, e.g. Qwen2-VL /
Qwen2.5-VL; NVILA needs --trust-remote-code), openai (any OpenAI-compatible server:
--set caption.openai.base_url=http://host:8000/v1), vllm (GPU, Qwen2.5-VL / Qwen3-VL).
Config keys are under `caption.` (see --show-config), e.g. --set caption.filter.enabled=true.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --out too: the other stage commands name the run directory so
    p.add_argument("--clips-dir", "--out", dest="clips_dir", required=False, metavar="OUT",
                   help="A curate output directory (local path or gs://, s3://). Required.")
    p.add_argument("--backend", choices=BACKENDS, help="Captioner (default: the config's, facts).")
    p.add_argument("--model", help="Shortcut for --set caption.model.path=MODEL.")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="Allow the checkpoint's own Python code (NVILA). Never implied.")
    p.add_argument("--config",
                   help="YAML file with a `caption:` section (or the caption keys at the top level), over the "
                        "run's own caption settings (OUT/config.yaml).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override one key, e.g. --set caption.frames.n=16 (repeatable; the caption. prefix is "
                        "optional).")
    p.add_argument("--show-config", action="store_true", help="Print every caption key with default and help; exit.")


def load_config(args) -> CaptionConfig:
    """The run's ``caption`` settings (OUT/config.yaml) <- the ``caption`` section of ``--config`` (a caption file or a
    whole curate file) <- ``--set`` <- flags."""
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"backend={args.backend}")
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.trust_remote_code:
        overrides.append("model.trust_remote_code=true")
    return load_yaml(CaptionConfig, args.config, overrides, section="caption",
                     base=run_settings_base("caption", args.clips_dir, "caption"))


def run_caption(clips_dir: str, cfg: CaptionConfig, beam_args: list[str] | None = None, handler=None,
                command: str | None = None) -> dict:
    """Caption ``clips_dir`` in place (holding its lock; see :mod:`longreel.pipelines.io.run_dir`); return the merged stats."""
    from longreel.pipelines.stage_session import StageSession

    with StageSession(clips_dir, "caption", config_hash(cfg), command) as session:
        return _run_caption(session, clips_dir, cfg, beam_args, handler)


def _run_caption(session, clips_dir: str, cfg: CaptionConfig, beam_args, handler) -> dict:
    import apache_beam as beam
    from apache_beam.io.filesystems import FileSystems

    from longreel.pipelines.io.parquet_sink import read_table
    from longreel.pipelines.provenance import code_version
    from longreel.pipelines.runner import make_pipeline
    from longreel.pipelines.stages.caption import CAPTION_STAGES, CAPTION_UNITS, add_caption_stage
    from longreel.pipelines.stage_rerun import check_videos_reachable, write_rerun_outputs
    from longreel.pipelines.stats import read_json

    videos = read_table(clips_dir, "videos").to_pylist()
    clips = read_table(clips_dir, "clips").to_pylist()
    check_videos_reachable(videos, clips_dir, "caption", "captions")
    session.begin_writes()
    with FileSystems.create(FileSystems.join(clips_dir, "config_caption.yaml")) as fh:
        fh.write(dump_yaml(cfg).encode())
    log.info("caption: %d clips of %d videos in %s with backend %s (config %s)", len(clips), len(videos), clips_dir,
             cfg.backend, config_hash(cfg)[:12])
    t0 = time.monotonic()
    p = make_pipeline(beam_args)
    v = p | "Videos" >> beam.Create(videos)
    c = p | "Clips" >> beam.Create(clips)
    out = add_caption_stage(p, v, c, clips_dir, cfg, handler=handler)
    meta = {"caption_config_hash": config_hash(cfg), "caption_backend": cfg.backend, "code_version": code_version()}
    write_rerun_outputs(p, clips_dir, CAPTION_STAGES, CAPTION_UNITS, out["rejects"], out["counts"], meta,
                        cfg.parquet_shards)
    p.run().wait_until_finish()
    stats = read_json(FileSystems.join(clips_dir, "stats.json"))
    session.finish()
    log.info("caption: done in %.1f s", time.monotonic() - t0)
    return stats


def main(args, beam_args: list[str]) -> int:
    if args.show_config:
        for key, default, help_text in describe(CaptionConfig, "caption."):
            print(f"{key} = {default}\n    {help_text}")
        return 0
    if refuse_beam_args("caption", args, beam_args):  # first: a stray positional is most likely the --clips-dir
        return 2
    if not args.clips_dir:
        print("longreel caption: --clips-dir is required", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args)
    except (ConfigError, OSError) as e:
        print(f"longreel caption: bad config: {e}", file=sys.stderr)
        return 2
    if args.model and cfg.backend == "facts":  # accepted, recorded in config_caption.yaml, and never read
        log.warning("caption: --model %s is not used by the facts backend (weight-free); give --backend "
                    "transformers, openai or vllm to caption with a model", args.model)
    check_model_paths(stage_models("caption", cfg), beam_args)  # a missing path: exit 2, nothing written
    try:
        stats = run_caption(args.clips_dir, cfg, beam_args, command=command_line(args, "caption"))
    except FileNotFoundError as e:
        from longreel.pipelines.stage_rerun import VideosNotFound

        hint = "" if isinstance(e, VideosNotFound) else f" (run `longreel curate --out {args.clips_dir}` first)"
        print(f"longreel caption: {e}{hint}", file=sys.stderr)
        return 2
    by = {s["stage"]: s for s in stats["stages"]}
    print(json.dumps({s: {k: by[s][k] for k in ("in", "out", "rejected", "balanced")} for s in
                      ("clip_facts", "clip_filter", "caption") if s in by}))
    return exit_code("caption", stats, ["caption"], args.clips_dir)
