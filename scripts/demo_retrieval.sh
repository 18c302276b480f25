#!/usr/bin/env bash
# The demo model learns a retrieval task on CPU while [eval_tasks] scores the needle grid as it trains:
# generated retrieval chats next to a quarter of the shipped sample -> a short run -> the curve.
# Uses the interpreter in $PYTHON (default: .venv/bin/python); writes everything under out/demo-retrieval/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=out/demo-retrieval

echo "== 1. generate retrieval chats: a needle among 0-6 filler sentences, asked about at the end"
"$PY" scripts/make_retrieval_data.py --output "$OUT/retrieval.jsonl" --count 8000 --min-sentences 0 --max-sentences 6

echo "== 2. train the tiny random Llama on them (prepared and packed by the run), scoring the needle grid every 200 steps"
rm -rf "$OUT/run"  # a fresh run each time (a run refuses an output_dir that holds another run's checkpoints)
"$PY" -m accelerate.commands.launch --num_processes 1 --cpu train.py --config configs/demo_retrieval.toml \
    training.disable_tqdm=true

echo "== 3. the logged scores against the step"
"$PY" scripts/plot_eval_tasks.py "$OUT/run" --output "$OUT/run/eval_tasks.png" \
    --title "demo model on retrieval chats: the needle grid while it trains"
