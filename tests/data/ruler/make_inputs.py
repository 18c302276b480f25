"""Write the stand-in inputs of the RULER reference instances: essays.json, squad.json and hotpot.json.

    python tests/data/ruler/make_inputs.py

RULER reads Paul Graham's essays and the SQuAD and HotpotQA dev files; none of them can be downloaded
here, so these stand in for them, in the same formats: ``{"text": ...}`` essays (sentences ending in
".", "?" and "!", paragraphs and runs of spaces, about 4,000 words, so that a 16k prompt wraps around
them), SQuAD 2.0 JSON (50 articles of 5 paragraphs, each with an answerable question whose second
answer keeps a trailing space, and an impossible one) and HotpotQA distractor JSON (40 questions of 10
paragraphs, 2 of them supporting facts). Deterministic: the same files every run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = ["The river", "A lantern", "The old road", "Our neighbour", "The orchard", "A small boat", "The miller",
            "An engineer", "The committee", "My grandmother", "The startup", "A good essay"]  # fmt: skip
VERBS = ["passes", "waits beside", "looks over", "turns toward", "leans against", "follows", "circles",
         "remembers", "ignores", "measures"]  # fmt: skip
OBJECTS = ["the stone bridge", "a field of barley", "the harbour wall", "the chapel", "the long hedge",
           "the market square", "an unfinished draft", "the quiet library"]  # fmt: skip
TAILS = ["in the morning", "after the rain", "every autumn", "at dusk", "without a sound", "as it always has",
         "for no clear reason", "while the town sleeps"]  # fmt: skip


def sentence(rng: random.Random) -> str:
    end = rng.choice([".", ".", ".", ".", "?", "!"])
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}{end}"


def essays(rng: random.Random, words: int) -> str:
    parts, count = [], 0
    while count < words:
        paragraph = [sentence(rng) for _ in range(rng.randint(3, 8))]
        count += sum(len(s.split()) for s in paragraph)
        parts.append(rng.choice([" ", "  "]).join(paragraph))
    return "\n\n".join(parts) + "\n"


def code(n: int) -> str:
    return f"{n * 7919 % 100000:05d}"


def squad(rng: random.Random) -> dict:
    articles = []
    for a in range(50):
        paragraphs = []
        for p in range(5):
            n = 10 * a + p
            fact = f"The passcode of vault {n} is {code(n)}."
            text = " ".join([sentence(rng) for _ in range(2)] + [fact] + [sentence(rng) for _ in range(2)])
            qas = [{"id": f"q{n}", "question": f"What is the passcode of vault {n}?", "is_impossible": False,
                    "answers": [{"text": code(n), "answer_start": text.index(code(n))},
                                {"text": f"{code(n)} ", "answer_start": text.index(code(n))}]},
                   {"id": f"x{n}", "question": f"Which vault does hall {a} forget?", "is_impossible": True,
                    "answers": [], "plausible_answers": []}]  # fmt: skip
            paragraphs.append({"context": text, "qas": qas})
        articles.append({"title": f"Hall {a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": articles}


def hotpot(rng: random.Random) -> list:
    rows = []
    for q in range(40):
        first, second = 1000 + 2 * q, 1001 + 2 * q
        context = [
            [f"Vault {first}", [f"Vault {first} is kept by vault {second}'s keeper. ", sentence(rng)]],
            [f"Vault {second}", [f"The passcode of vault {second} is {code(second)}. ", sentence(rng)]],
        ]
        context += [[f"Hall {q}-{k}", [sentence(rng) + " ", sentence(rng)]] for k in range(8)]  # fmt: skip
        rng.shuffle(context)
        rows.append({"_id": f"h{q}", "question": f"What is the passcode of the vault that keeps vault {first}?",
                     "answer": code(second), "context": context, "type": "bridge", "level": "easy",
                     "supporting_facts": [[f"Vault {first}", 0], [f"Vault {second}", 0]]})  # fmt: skip
    return rows


def main() -> None:
    rng = random.Random("ruler-reference-inputs")
    (HERE / "essays.json").write_text(json.dumps({"text": essays(rng, 4000)}) + "\n")
    (HERE / "squad.json").write_text(json.dumps(squad(rng)) + "\n")
    (HERE / "hotpot.json").write_text(json.dumps(hotpot(rng)) + "\n")


if __name__ == "__main__":
    main()
