"""A judge model rates answers 1-10 against a reference, writing the rating as ``[[n]]``; the last one counts.

    judge = Judge(ChatClient(settings), retries=2)
    judge.rate([JudgeCase(question="Who wrote it?", reference="Ada", answer="It was Ada.")])
    -> [Rating(rating=9.0, judge_output='The answer names Ada, as the reference does. Rating: [[9]]', tries=1)]

A reply without a rating is asked for again (``retries`` times, with ``seed`` 1, 2, ...: each a request of
its own, so that a kept answer is not given back for it), then left unrated (``rating`` None): an
unrated case is counted, never turned into a number. A call that fails after the client's own retries is
unrated too, with its error kept.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from longalign.answers import StoredCalls
from longalign.serving import CallFailure, ChatClient

RATING = re.compile(r"\[\[\s*(\d+(?:\.\d+)?)\s*\]\]")
LOWEST, HIGHEST = 1.0, 10.0

JUDGE_SYSTEM = (
    "You grade answers written by an AI assistant. For each case you get the user's question, a reference "
    "answer written by an expert, and the assistant's answer. Use the reference as the standard of what is "
    "correct and complete. Judge correctness first, then whether the answer covers what the reference "
    "covers, then clarity. Do not reward length for its own sake, and do not let the order or style of the "
    "answer sway you.\n\n"
    "First explain your judgement in a few sentences. Then give a rating from 1 (wrong or useless) to 10 "
    "(as good as the reference or better), written in double square brackets, for example: Rating: [[6]]"
)

QUALITY_SYSTEM = (
    "You grade long texts written by an AI assistant on request. For each case you get the user's request "
    "and the assistant's text. Judge how well the text does what was asked: relevance, accuracy, coherence, "
    "depth and clarity. Ignore whether it has the length asked for; that is measured separately.\n\n"
    "First explain your judgement in a few sentences. Then give a rating from 1 (useless) to 10 (excellent), "
    "written in double square brackets, for example: Rating: [[6]]"
)


@dataclass(frozen=True)
class JudgeCase:
    """What the judge sees of one case; ``reference`` None rates the answer on its own (quality)."""

    question: str
    answer: str
    reference: str | None = None


@dataclass(frozen=True)
class Example:
    """A graded answer shown to the judge before the case, to set its scale (LongBench-Chat's few-shots)."""

    question: str
    reference: str
    answer: str
    rating: float
    explanation: str = ""


@dataclass(frozen=True)
class Rating:
    """The judge's verdict on one case."""

    rating: float | None  # 1-10, or None when no try gave one
    judge_output: str  # the last reply (or the failed call's error)
    tries: int


def parse_rating(text: str) -> float | None:
    """The last ``[[n]]`` in ``text`` with n in 1-10, or None.

    >>> parse_rating("Compared with [[3]] ... final: [[7]]"), parse_rating("Rating: 7"), parse_rating("[[11]]")
    (7.0, None, None)
    """
    found = RATING.findall(text)
    if not found:
        return None
    value = float(found[-1])
    return value if LOWEST <= value <= HIGHEST else None


def judge_message(case: JudgeCase, examples: Sequence[Example] = ()) -> str:
    """The user message for one case: the graded examples first, then the case to rate."""
    parts = []
    for n, ex in enumerate(examples, 1):
        parts.append(
            f"[Example {n}]\n[Question]\n{ex.question}\n\n[Reference answer]\n{ex.reference}\n\n"
            f"[Assistant's answer]\n{ex.answer}\n\n[Grade]\n{ex.explanation} Rating: [[{ex.rating:g}]]"
        )
    reference = f"[Reference answer]\n{case.reference}\n\n" if case.reference is not None else ""
    parts.append(
        f"[Question]\n{case.question}\n\n{reference}[Assistant's answer]\n{case.answer}\n\n"
        "Explain your judgement, then end with the rating as [[n]]."
    )
    return "\n\n".join(parts)


class Judge:
    """Rates cases through a chat client, retrying replies that hold no rating."""

    def __init__(
        self,
        client: ChatClient | StoredCalls,
        *,
        retries: int = 2,
        max_tokens: int = 1024,
        system: str = JUDGE_SYSTEM,
    ) -> None:
        self.client = client
        self.retries = retries
        self.max_tokens = max_tokens
        self.system = system

    def rate(
        self,
        cases: Sequence[JudgeCase],
        examples: Sequence[Sequence[Example]] | None = None,
        *,
        progress: str | None = None,
    ) -> list[Rating]:
        """One ``Rating`` per case, in order; ``examples[i]`` are case i's graded examples."""
        requests = [
            {
                "messages": [
                    {"role": "system", "content": self.system},
                    {"role": "user", "content": judge_message(case, examples[i] if examples else ())},
                ],
                "max_tokens": self.max_tokens,
            }
            for i, case in enumerate(cases)
        ]
        ratings: list[Rating | None] = [None] * len(cases)
        pending = list(range(len(cases)))
        for attempt in range(self.retries + 1):
            again = {"seed": attempt} if attempt else {}
            replies = self.client.complete_many([requests[i] | again for i in pending], progress=progress)
            still = []
            for i, reply in zip(pending, replies, strict=True):
                text = reply.error if isinstance(reply, CallFailure) else reply.text
                value = None if isinstance(reply, CallFailure) else parse_rating(reply.text)
                ratings[i] = Rating(value, text, attempt + 1)
                if value is None and not isinstance(reply, CallFailure):
                    still.append(i)
            pending = still
            if not pending:
                break
        return ratings
