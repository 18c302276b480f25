"""LongBench-Write: how close the length of what the model writes comes to the length asked for.

    response_length("Hello world, 你好")           -> 4      # 2 English words + 2 CJK characters
    length_score(required=1000, produced=1500)   -> 83.33  # over by half: 100 * (1 - 0.5/3)
    length_score(required=1000, produced=500)    -> 50.0   # under by half: 100 * (1 - 1/2)

Rows of ``--data`` carry ``prompt`` and the required ``length``; an optional judge rates quality 1-10.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longalign.errors import InputError
from longalign.eval.chat import read_rows, require
from longalign.eval.judge import Rating
from longalign.eval.models import Reply

# CJK ideographs (with extension A and the compatibility block); each counts as one word.
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_WORD = re.compile(r"[A-Za-z0-9]+(?:['\u2019-][A-Za-z0-9]+)*")


@dataclass(frozen=True)
class WriteCase:
    """One writing request and the length it asks for (CJK characters + English words)."""

    idx: Any
    prompt: str
    length: int


def read_write_cases(path: Path) -> list[WriteCase]:
    """The rows of ``--data``: ``prompt`` and a positive ``length``, optional ``idx``."""
    cases = []
    for number, row in enumerate(read_rows(path), 1):
        length = require(path, number, row, "length", int)
        if length < 1:
            raise InputError(f"{path} row {number}: field 'length' must be at least 1, got {length}")
        cases.append(WriteCase(row.get("idx", number - 1), require(path, number, row, "prompt"), length))
    return cases


def response_length(text: str) -> int:
    """CJK characters plus English words (runs of letters and digits, with inner apostrophes and hyphens)."""
    return len(_CJK.findall(text)) + len(_WORD.findall(_CJK.sub(" ", text)))


def length_score(required: int, produced: int) -> float:
    """100 when ``produced == required``; ``100*max(0, 1-(y/x-1)/3)`` over, ``100*max(0, 1-(x/y-1)/2)`` under."""
    x, y = required, produced
    if y > x:
        return 100 * max(0.0, 1 - (y / x - 1) / 3)
    if y == 0:
        return 0.0
    return 100 * max(0.0, 1 - (x / y - 1) / 2)


def write_row(case: WriteCase, reply: Reply, quality: Rating | None) -> dict[str, Any]:
    """The ``results.jsonl`` row of one request: its length score and, when judged, its quality rating."""
    produced = response_length(reply.text)
    row = {
        "idx": case.idx,
        "required_length": case.length,
        "response_length": produced,
        "length_score": None if reply.error else length_score(case.length, produced),
        "output": reply.text,
    }
    if quality is not None:
        row.update(quality=quality.rating, judge_output=quality.judge_output)
    if reply.error:
        row["error"] = reply.error
    return row


def write_summary(rows: Sequence[dict[str, Any]], *, judged: bool) -> dict[str, Any]:
    """``length_score`` mean, ``n``, ``failed``, and ``quality_score`` (the mean 1-10 rating, None unjudged)."""
    scores = [r["length_score"] for r in rows if r["length_score"] is not None]
    ratings = [r["quality"] for r in rows if r.get("quality") is not None]
    return {
        "length_score": sum(scores) / len(scores) if scores else None,
        "n": len(rows),
        "failed": len(rows) - len(scores),
        "quality_score": sum(ratings) / len(ratings) if judged and ratings else None,
        "quality_unrated": len(rows) - len(ratings) if judged else None,
    }


def plot_scatter(rows: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """``scatter.png``: required vs produced length, log-log, with the line where they are equal."""
    from matplotlib.figure import Figure  # no pyplot, no display

    points = [(r["required_length"], max(r["response_length"], 1)) for r in rows]
    figure = Figure(figsize=(5.5, 5), layout="constrained")
    ax = figure.subplots()
    ax.scatter([x for x, _ in points], [y for _, y in points], s=14, alpha=0.7)
    low = min(min(p) for p in points)
    high = max(max(p) for p in points)
    ax.plot([low, high], [low, high], color="grey", linestyle="--", label="output = required")
    ax.set(xscale="log", yscale="log", xlabel="required length", ylabel="output length (words + CJK characters)",
           title=title)  # fmt: skip
    ax.legend(loc="upper left")
    figure.savefig(path, dpi=100)
