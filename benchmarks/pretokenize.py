"""Pre-tokenization throughput: ``pre_tokenize`` vs naive one-sample-at-a-time loops, same data, one run.

    python benchmarks/pretokenize.py [--repeat 5] [--num-proc 2]

Rows:
- naive prefix loop: per sample, tokenize every growing prefix rendering and diff the token lists (a
  common way to find assistant tokens), appending Python lists, then build the dataset at the end;
- per-sample loop: this project's ``process_line`` one sample at a time in one process, same ending;
- pre_tokenize: the stage itself (batched ``datasets.map``, Arrow output, report), 1 and K processes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import datasets
from transformers import AutoTokenizer

from longalign.chat_template import profile_tokenizer
from longalign.config import IGNORE_INDEX
from longalign.records import parse_record
from longalign.tokenize import pre_tokenize, process_line

ROOT = Path(__file__).resolve().parents[1]


def naive_prefix_loop(lines: list[str], tokenizer, max_seq_len: int) -> int:
    rows = []
    for text in lines:
        messages = parse_record(json.loads(text))
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        labels = [IGNORE_INDEX] * len(ids)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(
                tokenizer.apply_chat_template(
                    messages[:k], tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            end = len(tokenizer.apply_chat_template(messages[: k + 1], tokenize=True, return_dict=False))
            labels[start:end] = ids[start:end]
        rows.append({"input_ids": ids[:max_seq_len], "labels": labels[:max_seq_len]})
    datasets.Dataset.from_list(rows)
    return sum(len(r["input_ids"]) for r in rows)


def per_sample_loop(lines: list[str], tokenizer, max_seq_len: int) -> int:
    profile = profile_tokenizer(tokenizer)  # learned once, as the stage does
    rows = [
        process_line(t, tokenizer, max_seq_len=max_seq_len, truncation="right", profile=profile)
        for t in lines
    ]
    datasets.Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    return sum(len(r["input_ids"]) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", type=Path, default=ROOT / "data" / "sample.jsonl")
    parser.add_argument("--tokenizer", default=str(ROOT / "data" / "tokenizer"))
    parser.add_argument("--repeat", type=int, default=5, help="copies of the input, to get a bigger workload")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=16384)
    args = parser.parse_args()

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lines = args.input.read_text(encoding="utf-8").splitlines() * args.repeat
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("\n".join(lines) + "\n", encoding="utf-8")

        def stage(num_proc: int) -> int:
            report = pre_tokenize(
                src, tokenizer, Path(tmp) / "out", max_seq_len=args.max_seq_len, num_proc=num_proc
            )
            return report["total_tokens"]

        runs = [
            ("naive prefix loop", lambda: naive_prefix_loop(lines, tokenizer, args.max_seq_len)),
            ("per-sample loop", lambda: per_sample_loop(lines, tokenizer, args.max_seq_len)),
            ("pre_tokenize, 1 proc", lambda: stage(1)),
            (f"pre_tokenize, {args.num_proc} proc", lambda: stage(args.num_proc)),
        ]
        results = []
        for name, fn in runs:
            start = time.perf_counter()
            tokens = fn()
            results.append((name, tokens, time.perf_counter() - start))

    base = results[0][1] / results[0][2]
    print(f"{len(lines)} conversations, {results[-1][1]} tokens each run")
    print(f"{'method':<24}{'tokens':>12}{'seconds':>10}{'tokens/s':>12}{'vs naive':>10}")
    for name, tokens, seconds in results:
        rate = tokens / seconds
        print(f"{name:<24}{tokens:>12}{seconds:>10.2f}{rate:>12.0f}{rate / base:>9.2f}x")


if __name__ == "__main__":
    main()
