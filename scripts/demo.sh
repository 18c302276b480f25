#!/usr/bin/env bash
# The whole pipeline on the shipped sample, on CPU: chat JSONL -> tokens -> packs -> a short training run.
# Uses the interpreter in $PYTHON (default: .venv/bin/python); writes everything under out/demo/.
# Arguments are overrides of configs/demo.toml for the training run: bash scripts/demo.sh training.num_train_epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=out/demo
MAX_LEN=4096

echo "== 1. pre-tokenize data/sample.jsonl (Llama-3-style template, assistant-only labels)"
"$PY" scripts/pre_tokenize.py --input data/sample.jsonl --tokenizer data/tokenizer \
    --output "$OUT/tokenized" --max-seq-len "$MAX_LEN" --truncation right

echo "== 2. pack into rows of $MAX_LEN tokens (best-fit decreasing, 1D cu_seqlens)"
"$PY" scripts/sort_and_group.py --input "$OUT/tokenized" --output "$OUT/packed" --max-seq-len "$MAX_LEN"

echo "== 3. train a tiny random Llama on the packs (CPU, sequence-level loss)"
rm -rf "$OUT/run"  # a fresh run each time (a run refuses an output_dir that holds another run's checkpoints)
"$PY" -m accelerate.commands.launch --num_processes 1 --cpu train.py --config configs/demo.toml \
    data.train_file="\"$OUT/packed\"" data.eval_file="\"$OUT/packed\"" training.disable_tqdm=true "$@"
