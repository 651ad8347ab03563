"""The embedded demo's data card (``data_cards/demo/``): rebuilt from the sample corpus by the README's main
command, then ``card build``.

``python -m longreel.demo_card [OUT_DIR]`` (or ``scripts/build_demo_card.sh``) runs the demo pipeline into a
temporary directory and writes the card to ``OUT_DIR`` (default: ``data_cards/demo``). The test
``tests/test_card_demo.py`` does the same into a temporary directory and fails when the committed card
drifts from what the code produces.

The one claim that cannot match byte for byte is the code version: a committed file cannot contain the hash
of the commit that contains it. :func:`pin_code_version` carries the committed card's value over before the
comparison; everything else (README.md, card.json and the PNGs) is compared byte for byte.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from longreel import data_cards

DEMO_CARD_DIR = os.path.join(os.path.dirname(os.path.abspath(data_cards.__file__)), "demo")
DEMO_NAME = "longreel_demo"
DEMO_PRETTY_NAME = "longreel demo: the embedded sample corpus"
# The README's main command (scripts/demo.sh). Update both when the demo runs more stages.
DEMO_COMMAND = "longreel curate --demo --out demo_out"


def demo_argv(run_dir: str) -> list[str]:
    """:data:`DEMO_COMMAND` as arguments of ``longreel``, writing into ``run_dir``."""
    import shlex
    argv = shlex.split(DEMO_COMMAND)
    if argv[0] != "longreel" or "--out" not in argv:
        raise ValueError(f"DEMO_COMMAND must be a longreel command with --out: {DEMO_COMMAND!r}")
    argv[argv.index("--out") + 1] = run_dir
    return argv[1:]


def run_demo(run_dir: str) -> str:
    """Run the README's main command (:data:`DEMO_COMMAND`, through the real CLI) into ``run_dir``."""
    from longreel.cli import main
    rc = main(["-q", *demo_argv(run_dir)])
    if rc != 0:
        raise RuntimeError(f"{DEMO_COMMAND} exited {rc}")
    return run_dir


def demo_card(run_dir: str) -> dict:
    from longreel.pipelines.card.build import collect
    return collect(run_dir, name=DEMO_NAME, pretty_name=DEMO_PRETTY_NAME, command=DEMO_COMMAND)


def pin_code_version(card: dict, code_version: str) -> dict:
    for c in card["claims"]:
        if c["id"] == "reproduction/code_version":
            c["value"] = code_version
    return card


def build_demo_card(out_dir: str = DEMO_CARD_DIR, work_dir: str | None = None) -> dict:
    """Run the demo and write its card into ``out_dir``; return the card."""
    from longreel.pipelines.card.build import write_card
    with tempfile.TemporaryDirectory(prefix="longreel-demo-card-") as tmp:
        run_dir = run_demo(work_dir or os.path.join(tmp, "demo_out"))
        card = demo_card(run_dir)
    write_card(card, out_dir)
    return card


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=DEMO_CARD_DIR, help="Card directory (default: data_cards/demo).")
    args = ap.parse_args(argv)
    card = build_demo_card(args.out)
    print(f"demo card: {args.out} ({len(card['claims'])} claims)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
