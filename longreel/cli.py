"""``longreel``: the command line. Each subcommand lives beside the code it runs."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys


class _DropBeamImportNoise(logging.Filter):
    """Beam warns at import that optional GCP client libraries are absent; irrelevant unless using GCP."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


logging.getLogger().addFilter(_DropBeamImportNoise())

# name -> (module, one-line help). Modules expose add_arguments(parser) and main(args, extra_args) -> int.
COMMANDS = {
    "curate": ("pipelines.cli_curate", "Run the curation pipeline (ingest, probe, segment, ...) on videos."),
    "card": ("pipelines.cli_card", "Data card: build (README.md, card.json, plots) or verify it against shards."),
    "caption": ("pipelines.cli_caption", "Caption the clips of a curate output (facts, transformers, openai, vllm)."),
    "qra": ("pipelines.cli_qra", "Question-reasoning-answer generation from the captions of an output directory."),
    "pack": ("pipelines.cli_pack", "Frame cache + WebDataset shards + wids index from an output directory."),
    "filter": ("pipelines.cli_filter", "Pass-rate filter: answer each question k times, keep the medium ones."),
    "train": ("trainer.cli_train", "Train the policy: CoT-SFT (sft), GRPO (grpo), or plot a run's curves (plot)."),
    "eval": ("trainer.cli_eval", "Greedy accuracy of a model on held-out shards, per category and problem type."),
}

DESCRIPTION = """\
longreel turns long videos into a reasoning dataset (Apache Beam pipelines) and trains a
video-language model on it (CoT-SFT, then GRPO).

Run `longreel COMMAND --help` for a command's options. Pipeline commands accept standard
Beam options after their own, e.g. `--runner DataflowRunner --project P --region R
--temp_location gs://B/tmp --setup_file ./setup.py`; without --runner they run locally.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longreel", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="Debug logging.")
    parser.add_argument("-q", "--quiet", action="store_true", help="Warnings and errors only.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_module=mod)
    return parser


def setup_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("longreel").setLevel(level)
    # Beam is chatty at INFO about its own machinery; its warnings still show.
    logging.getLogger("apache_beam").setLevel(logging.WARNING if not verbose else logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose, args.quiet)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    return int(args._module.main(args, extra) or 0)


if __name__ == "__main__":
    sys.exit(main())
