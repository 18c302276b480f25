"""LongBench-Chat style: the model answers long prompts, a judge rates each answer 1-10 against a reference.

    cases = read_chat_cases(Path("longbench_chat.jsonl"))     # rows with prompt, query, answer (, idx)
    -> [ChatCase(idx=0, prompt='<a long text> ... question', query='question', answer='reference'), ...]
    prompts = [middle_cut_prompt(tokenizer, case.prompt, max_length=32768) for case in cases]
    ... generate, then Judge(...).rate(...)
    chat_summary(rows)  -> {'mean': 6.4, 'n': 50, 'rated': 49, 'unrated': 1}

``--few-shots FILE`` rows are graded example answers, ``{"query", "answer", "output", "rating"}`` with an
optional ``explanation``, and ``idx`` to show an example only with the case of that ``idx``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longalign.errors import InputError, PathError
from longalign.eval.judge import Example, Rating
from longalign.eval.models import ChatFrame, Prompt, Reply, chat_frame


@dataclass(frozen=True)
class ChatCase:
    """One case: what the model reads, the question the judge sees, and the reference answer."""

    idx: Any
    prompt: str
    query: str
    answer: str


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON list or a JSONL file; a one-line error naming the file (and line) when unreadable."""
    if not path.is_file():
        raise PathError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = []
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise InputError(f"{path} line {number}: not JSON ({err.msg})") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(f"{path} row {number}: expected an object, got {type(row).__name__}")
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def require(
    path: Path, number: int, row: dict[str, Any], field: str, kind: type | tuple[type, ...] = str
) -> Any:
    """``row[field]`` if present and of ``kind``; else a one-line ``InputError`` naming the file, row and field."""
    if field not in row:
        raise InputError(f"{path} row {number}: missing field {field!r} (has {sorted(row)})")
    if not isinstance(row[field], kind) or isinstance(row[field], bool):
        raise InputError(
            f"{path} row {number}: field {field!r} has the wrong type ({type(row[field]).__name__})"
        )
    return row[field]


def read_chat_cases(path: Path) -> list[ChatCase]:
    """The cases of a LongBench-Chat style file: rows with ``prompt``, ``query``, ``answer`` and optional ``idx``."""
    return [
        ChatCase(
            idx=row.get("idx", number - 1),
            prompt=require(path, number, row, "prompt"),
            query=require(path, number, row, "query"),
            answer=require(path, number, row, "answer"),
        )
        for number, row in enumerate(read_rows(path), 1)
    ]


def read_examples(path: Path, cases: Sequence[ChatCase]) -> list[list[Example]]:
    """Each case's graded examples from a few-shots file: rows with an ``idx`` go to that case, the rest to all."""
    shared, by_idx = [], {}
    for number, row in enumerate(read_rows(path), 1):
        example = Example(
            question=require(path, number, row, "query"),
            reference=require(path, number, row, "answer"),
            answer=require(path, number, row, "output"),
            rating=float(require(path, number, row, "rating", (int, float))),
            explanation=row.get("explanation", ""),
        )
        (by_idx.setdefault(row["idx"], []) if "idx" in row else shared).append(example)
    return [shared + by_idx.get(case.idx, []) for case in cases]


def middle_cut(ids: list[int], keep: int) -> list[int]:
    """At most ``keep`` tokens: the head and the tail of ``ids``, the middle left out.

    >>> middle_cut(list(range(10)), 4)
    [0, 1, 8, 9]
    """
    if len(ids) <= keep:
        return ids
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head) :]


def middle_cut_prompt(
    tokenizer, text: str, *, max_length: int | None, frame: ChatFrame | None = None
) -> Prompt:
    """The chat prompt of ``text``, whose middle is cut in token space so that the prompt is at most ``max_length``.

    The cut text is decoded and the chat encoded once; where its edges merge into more tokens than counted,
    the cut takes a few more.
    """
    frame = frame or chat_frame(tokenizer)
    prompt = frame.prompt(text)
    if max_length is None or len(prompt.input_ids) <= max_length:
        return prompt
    ids = tokenizer(text, add_special_tokens=False).input_ids
    room = len(ids) - (len(prompt.input_ids) - max_length)
    while True:
        if room < 2:
            raise InputError(
                f"--max-length {max_length}: the chat template alone takes {len(frame.prompt('').input_ids)} tokens"
            )
        prompt = frame.prompt(tokenizer.decode(middle_cut(ids, room), clean_up_tokenization_spaces=False))
        if len(prompt.input_ids) <= max_length:
            return prompt
        room -= len(prompt.input_ids) - max_length


def chat_row(case: ChatCase, prompt: Prompt, reply: Reply, rating: Rating | None) -> dict[str, Any]:
    """The ``results.jsonl`` row of one case."""
    row = {
        "idx": case.idx,
        "prompt_tokens": len(prompt.input_ids) if prompt.input_ids is not None else None,
        "query": case.query,
        "output": reply.text,
        "judge_output": rating.judge_output if rating else None,
        "rating": rating.rating if rating else None,
        "judge_tries": rating.tries if rating else 0,
    }
    if reply.error:
        row["error"] = reply.error
    return row


def chat_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``mean`` rating over the rated cases (None if none), ``n``, ``rated``, ``unrated``."""
    rated = [r["rating"] for r in rows if r["rating"] is not None]
    return {
        "mean": sum(rated) / len(rated) if rated else None,
        "n": len(rows),
        "rated": len(rated),
        "unrated": len(rows) - len(rated),
    }
