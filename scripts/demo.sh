#!/usr/bin/env bash
# The whole pipeline on the shipped sample, on CPU: chat JSONL -> tokens -> packs -> a short training run.
# Uses the interpreter in $PYTHON (default: .venv/bin/python); writes everything under out/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=out/demo

echo "== 1. pre-tokenize data/sample.jsonl"
"$PY" scripts/pre_tokenize.py --input data/sample.jsonl --tokenizer data/tokenizer \
    --output "$OUT/tokenized" --max-seq-len 8192
