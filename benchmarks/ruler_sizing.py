"""RULER's sizing, ours next to RULER's own: prompt plus generation budget per task at 4k and 16k tokens.

    python benchmarks/ruler_sizing.py [--samples 20] [--markdown]

RULER sizes each task's haystack once per length by a binary search, and steps a sample back a whole
step when its own draw overflows, so its prompts are often shorter than the length. This builds
``longalign eval ruler``'s instances (the shipped tokenizer and its template, seed 0) on the stand-in
inputs of ``tests/data/ruler`` (generated essays, SQuAD- and HotpotQA-shaped files) and prints, per task
and length, the prompt plus budget over the samples (min, mean, max) next to what RULER's own
``prepare.py`` wrote for 20 samples on the same inputs, tokenizer and template
(``tests/data/ruler/lengths.json``; how it was made: ``tests/data/ruler/README.md``). The samples
differ (each side draws its own), so the rule is what should match, not each figure.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from longalign.eval import ruler

ROOT = Path(__file__).resolve().parents[1]
INPUTS = ROOT / "tests" / "data" / "ruler"
LENGTHS = (4096, 16384)


def spread(values: list[int]) -> str:
    return f"{min(values)} / {sum(values) / len(values):.0f} / {max(values)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20, help="our samples per task and length")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    theirs = json.loads((INPUTS / "lengths.json").read_text())
    started = time.perf_counter()
    cases = ruler.build_instances(
        tokenizer,
        tasks=list(ruler.TASKS),
        lengths=LENGTHS,
        samples_per_task=args.samples,
        seed=0,
        haystack=INPUTS / "essays.json",
        squad=ruler.read_squad(INPUTS / "squad.json"),
        hotpot=ruler.read_hotpot(INPUTS / "hotpot.json"),
    )
    seconds = time.perf_counter() - started
    header = ["task"] + [
        f"{who} {n // 1024}k (min / mean / max)" for n in LENGTHS for who in ("ours", "RULER")
    ]
    rows = []
    for task in ruler.TASKS:
        cells = [task]
        for length in LENGTHS:
            ours = [
                len(c.prompt.input_ids) + c.new_tokens for c in cases if c.task == task and c.length == length
            ]
            cells += [spread(ours), spread(theirs[task][str(length)])]
        rows.append(cells)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for cells in rows:
            print("| " + " | ".join(cells) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for cells in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"\n{len(cases)} instances built in {seconds:.1f} s; RULER's: 20 samples per task and length")


if __name__ == "__main__":
    main()
