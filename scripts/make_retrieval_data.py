"""Generate retrieval chats: a fact hidden in filler text, asked about at the end, answered by the assistant.

    python scripts/make_retrieval_data.py --output out/demo/retrieval.jsonl     # 3000 chats, seed 0

Every line is one conversation, ``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``,
built like a prompt of ``longalign eval needle`` (``longalign.eval.needle``): its introduction, filler
sentences of the same grammar with the needle "The special magic number for amber-otter is 4812397." at
a random sentence boundary, its question; the assistant answers "The special magic number for
amber-otter is 4812397." The values, fillers and depths come from seeds of their own (``--seed``), so
the needle prompts of an eval are never among them (the keys come from the same 100 word pairs). ``scripts/demo_retrieval.sh`` trains the demo model on
these chats next to the shipped sample and logs the needle score as it learns.

Deterministic: the same arguments write the same bytes (``random.Random`` seeded per chat).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from longalign.eval.needle import INTRO, QUESTION_FORM, filler_sentences, random_needle


def retrieval_chat(rng: random.Random, sentences: int) -> list[dict[str, str]]:
    """One chat whose user message hides a random needle among ``sentences`` filler sentences."""
    fact = random_needle(rng)
    haystack = filler_sentences(rng, sentences)
    haystack.insert(rng.randint(0, sentences), fact.text)
    text = INTRO + "".join(" " + s for s in haystack) + QUESTION_FORM.format(question=fact.question)
    return [
        {"role": "user", "content": text},
        {"role": "assistant", "content": f"{fact.answer_prefix} {fact.answer}."},
    ]


def generate(count: int, *, seed: int, min_sentences: int, max_sentences: int) -> list[list[dict[str, str]]]:
    """``count`` chats, each with between ``min_sentences`` and ``max_sentences`` filler sentences."""
    chats = []
    for i in range(count):
        rng = random.Random(f"retrieval:{seed}:{i}")
        chats.append(retrieval_chat(rng, rng.randint(min_sentences, max_sentences)))
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=3000, help="number of chats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-sentences", type=int, default=2, help="filler sentences per chat, at least")
    parser.add_argument("--max-sentences", type=int, default=60, help="filler sentences per chat, at most")
    args = parser.parse_args()
    if not 0 <= args.min_sentences <= args.max_sentences or args.count < 1:
        parser.error("expected --count >= 1 and 0 <= --min-sentences <= --max-sentences")
    chats = generate(
        args.count, seed=args.seed, min_sentences=args.min_sentences, max_sentences=args.max_sentences
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8", newline="\n") as out:
        for chat in chats:
            out.write(json.dumps({"messages": chat}, ensure_ascii=False) + "\n")
    print(f"wrote {len(chats)} retrieval chats to {args.output}")


if __name__ == "__main__":
    main()
