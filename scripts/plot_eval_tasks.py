"""Draw what a run's ``[eval_tasks]`` logged: each task's score and mean log-probability against the step.

    python scripts/plot_eval_tasks.py out/demo/retrieval-run --output out/demo/retrieval-run/eval_tasks.png

Reads ``trainer_state.json`` (its ``log_history``) of the run directory or of one of its ``checkpoint-N``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longalign.eval.in_training import PREFIX, plot_scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "run", type=Path, help="a run's output_dir or checkpoint-N (holds trainer_state.json)"
    )
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", help="the figure's title (default: the run directory)")
    args = parser.parse_args()
    state = args.run / "trainer_state.json"
    if not state.is_file():
        print(f"{state}: not found (a run writes it at the end and in every checkpoint)", file=sys.stderr)
        return 2
    history = json.loads(state.read_text(encoding="utf-8"))["log_history"]
    if not any(key.startswith(f"{PREFIX}/") for entry in history for key in entry):
        print(f"{state}: no {PREFIX}/ numbers logged (does the run file have [eval_tasks]?)", file=sys.stderr)
        return 2
    plot_scores(history, args.output, title=args.title or str(args.run))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
