#!/usr/bin/env bash
# Rebuilds the embedded demo's data card (data_cards/demo/: README.md, card.json, plots) from the sample corpus:
# runs the README's main command into a temporary directory, then `card build`. Commit the result;
# tests/test_card_demo.py fails when the committed card drifts from what the code produces.
# Usage: ./scripts/build_demo_card.sh [OUT_DIR]   (default: data_cards/demo)
set -euo pipefail
cd "$(dirname "$0")/.."
# The card must be built in the locked env (the one the drift test runs in): tox -e py311 makes it.
PY=${PYTHON:-.tox/py311/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PY" -m longreel.demo_card "$@"
