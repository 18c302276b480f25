"""The files an eval task writes, the same from ``longalign eval`` and from a training run's ``[eval_tasks]``.

    write_outputs("out/eval/needle", rows, summary, record, stage="eval needle",
                  extra_files={"summary.csv": csv}, plot=lambda d: plot_heatmap(summary, d / "heatmap.png", ...))
    -> out/eval/needle/results.jsonl    one row per prompt or case
                       summary.json     the task's summary
                       run_config.json  every setting
                       summary.csv, heatmap.png

The directory is written atomically by the rules of every stage's output (``longalign.artifacts``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from longalign.artifacts import stage_output


def write_outputs(
    output: str | os.PathLike,
    rows: Sequence[dict[str, Any]],
    summary: dict[str, Any],
    record: dict[str, Any],
    *,
    stage: str,
    inputs: Sequence[str] = (),
    extra_files: dict[str, str] | None = None,
    plot: Callable[[Path], None] | None = None,
    calls: Callable[[Path], None] | None = None,
) -> None:
    """Write ``results.jsonl``, ``summary.json``, ``run_config.json``, ``extra_files`` and the plot into ``output``.

    ``calls`` writes what a served model's answers add (``calls.jsonl``, ``report.json``) into the same
    staging directory, so that they land with the results or not at all.
    """
    with stage_output(output, stage=stage, inputs=[i for i in inputs if i]) as staging:
        with open(staging / "results.jsonl", "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        (staging / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        (staging / "run_config.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        if plot is not None:
            plot(staging)
        if calls is not None:
            calls(staging)
