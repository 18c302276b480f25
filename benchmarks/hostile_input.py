"""Hostile input: what pathological lines cost the pre-tokenize stage, old path vs new, and the hostile corpus.

    python benchmarks/hostile_input.py [--mb 50] [--turns 4000] [--max-seq-len 65536]

Lines, generated here (never committed):
- many turns: one conversation of ``--turns`` short messages (~160 KB);
- huge answer: a short question and a ``--mb`` MB answer that cannot fit, truncation ``drop``;
- huge prompt: a ``--mb`` MB question before a short answer, truncation ``right`` (no target can survive).

Paths: ``old`` splits every conversation by rendering growing prefixes and has no size guard (a profile
without a turn layout or a token-size bound, as the stage was); ``new`` is the stage as it is. Every
(line, path) runs in a fresh process that reads the line from a file, so peak RSS (``getrusage``) is its
own; the time is that of ``process_line`` alone. Then the committed corpus (tests/data/hostile.jsonl)
goes through ``pre_tokenize``, and through ``process_line`` line by line to count crashes.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer"
CORPUS = ROOT / "tests" / "data" / "hostile.jsonl"
SENTENCE = "The quick brown fox jumps over the lazy dog, então 数据 fließt. "


def many_turns(turns: int) -> dict:
    return {
        "messages": [
            {"role": "user" if i % 2 == 0 else "assistant", "content": f"ok {i}"} for i in range(turns)
        ]
    }


def huge_text(megabytes: float) -> str:
    return SENTENCE * int(megabytes * 1e6 / len(SENTENCE.encode("utf-8")))


CASES = {
    "many turns": (lambda a: many_turns(a.turns), "right"),
    "huge answer": (
        lambda a: {
            "messages": [
                {"role": "user", "content": "Write."},
                {"role": "assistant", "content": huge_text(a.mb)},
            ]
        },
        "drop",
    ),
    "huge prompt": (
        lambda a: {
            "messages": [
                {"role": "user", "content": huge_text(a.mb)},
                {"role": "assistant", "content": "Done."},
            ]
        },
        "right",
    ),
}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def worker(line_file: Path, path: str, truncation: str, max_seq_len: int) -> None:
    """Run one line through ``process_line`` on one path; print time, peak RSS and outcome as JSON."""
    from transformers import AutoTokenizer

    from longalign.chat_template import profile_tokenizer
    from longalign.tokenize import process_line

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    profile = profile_tokenizer(tokenizer)
    if path == "old":
        profile = replace(profile, layout=None, max_token_bytes=None)
    line = line_file.read_text(encoding="utf-8")
    before = rss_mb()
    start = time.perf_counter()
    row = process_line(line, tokenizer, max_seq_len=max_seq_len, truncation=truncation, profile=profile)
    seconds = time.perf_counter() - start
    outcome = row["reason"] or f"kept, {len(row['input_ids'])} tokens"
    print(json.dumps({"seconds": seconds, "peak_mb": rss_mb(), "before_mb": before, "outcome": outcome}))


def measure(line_file: Path, path: str, truncation: str, max_seq_len: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(line_file), path, truncation, str(max_seq_len)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def corpus_summary() -> list[str]:
    """Run the hostile corpus through the stage and line by line; count outcomes, crashes, lost lines."""
    import datasets
    from transformers import AutoTokenizer

    from longalign.chat_template import profile_tokenizer
    from longalign.tokenize import pre_tokenize, process_line

    expected = json.loads((CORPUS.parent / "hostile.expected.json").read_text(encoding="utf-8"))
    settings = {"max_seq_len": expected["max_seq_len"], "truncation": expected["truncation"]}
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = expected["chat_template"]
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        report = pre_tokenize(CORPUS, tokenizer, Path(tmp) / "out", **settings)
    profile = profile_tokenizer(tokenizer)
    lines = CORPUS.read_bytes().decode("utf-8").removeprefix("\ufeff").split("\n")[:-1]
    crashes, outcomes = 0, Counter()
    for line in lines:
        try:
            row = process_line(line.rstrip("\r"), tokenizer, profile=profile, **settings)
            outcomes[row["reason"] or "kept"] += 1
        except Exception:
            crashes += 1
    lost = len(lines) - report["samples_kept"] - report["dropped_total"]
    dropped = ", ".join(f"{reason} {n}" for reason, n in report["dropped"].items() if n)
    return [
        f"hostile corpus ({CORPUS.relative_to(ROOT)}, truncation {settings['truncation']}, "
        f"max_seq_len {settings['max_seq_len']})",
        f"  lines tried  {len(lines)}",
        f"  kept         {report['samples_kept']}",
        f"  dropped      {report['dropped_total']}: {dropped}",
        f"  crashes      {crashes}",
        f"  lines lost   {lost}",
        f"  line by line {outcomes['kept']} kept, the same drops: {dict(outcomes) == _counts(report)}",
    ]


def _counts(report: dict) -> dict:
    counts = {reason: n for reason, n in report["dropped"].items() if n}
    return {**counts, "kept": report["samples_kept"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=50, help="size of the huge lines, in MB")
    parser.add_argument("--turns", type=int, default=4000, help="messages in the many-turn line")
    parser.add_argument("--max-seq-len", type=int, default=65536)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        line_file, path, truncation, max_seq_len = args.worker
        worker(Path(line_file), path, truncation, int(max_seq_len))
        return

    header = f"{'line':<34}{'old s':>9}{'new s':>8}{'faster':>8}{'old MB':>9}{'new MB':>8}{'less':>7}   outcome (new)"
    rows = [header, "-" * len(header)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, truncation) in CASES.items():
            line_file = Path(tmp) / "line.jsonl"
            line_file.write_text(json.dumps(make(args), ensure_ascii=False), encoding="utf-8")
            size = line_file.stat().st_size
            label = (
                f"{name} ({size / 1e6:.1f} MB, {truncation})"
                if size > 1e6
                else f"{name} ({size / 1e3:.0f} KB, {truncation})"
            )
            old, new = (measure(line_file, path, truncation, args.max_seq_len) for path in ("old", "new"))
            rows.append(
                f"{label:<34}{old['seconds']:>9.2f}{new['seconds']:>8.2f}{old['seconds'] / new['seconds']:>7.0f}x"
                f"{old['peak_mb']:>9.0f}{new['peak_mb']:>8.0f}{old['peak_mb'] / new['peak_mb']:>6.1f}x   {new['outcome']}"
            )
            if old["outcome"] != new["outcome"]:
                rows.append(f"{'':<34}old path's outcome differs: {old['outcome']}")
    rows.append(
        f"(peak RSS of each process; {new['before_mb']:.0f} MB of it before the call: Python, the tokenizer, the line)"
    )
    print("\n".join(rows + [""] + corpus_summary()))


if __name__ == "__main__":
    main()
