#!/usr/bin/env bash
# Installs tox (if missing) and runs the whole test suite in its own virtualenv.
# Usage: ./scripts/test.sh [pytest args...]   (default: -q -rs, from tox.ini)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -m tox --version >/dev/null 2>&1; then
  "$PY" -m pip install -q "tox>=4.11"
fi
exec "$PY" -m tox -e py311 -- "$@"
