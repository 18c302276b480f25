"""Needle in a haystack: a fact hidden at a chosen depth of a long text, asked about at the end.

A prompt is the chat template rendered around the text and encoded once (as pre-tokenize encodes a training
chat), and is exactly ``length`` tokens, chat template included::

    [template before the user text][intro][haystack ... | needle | ... haystack][question][template after]
                                          ^ needle_start: the sentence boundary nearest depth% of the haystack

The haystack is sentences, each encoded once to count them, cut to the count that makes up ``length``;
the whole chat is then encoded in one pass, and the cut moves by the few tokens that merge at its edges.
By default each prompt hides its own random key and 7-digit value ("The special magic number for
amber-otter is 4812397."), so no answer can be learned by heart.

    cases = build_cases(tokenizer, haystack_pool(tokenizer, None, seed=0),
                        lengths=[1000, 4000], depths=[0, 50, 100], samples=2, seed=0)
    replies = generator.generate([case.prompt for case in cases])
    rows = [generation_row(case, reply) for case, reply in zip(cases, replies)]
    summary(rows)  -> {'overall': 66.7, 'by_depth': {'0': 100.0, ...}, 'by_length': {...}, 'n': 12, ...}

``score_answers`` is the teacher-forced alternative: the answer's mean log-probability after the prompt
(ending in an answer prefix), several prompts packed into one row of the varlen-patched model;
``score_answers_across_ranks`` deals the same rows over the ranks of ``accelerate launch`` (or of a
training run, ``longalign.eval.in_training``).
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from longalign.errors import ConfigError, InputError, PathError
from longalign.eval.models import ChatFrame, Prompt, Reply, chat_frame, fit_length
from longalign.eval.ranks import across_ranks

INTRO = "Read the text below. A question about it follows at the end.\n\n"
QUESTION_FORM = "\n\n{question} Answer with the fact from the text."

_SUBJECTS = ["The river", "A lantern", "The old road", "Our neighbour", "The orchard", "A small boat",
             "The library", "The north wind", "A grey heron", "The market", "The baker", "A quiet valley"]  # fmt: skip
_VERBS = ["passes", "waits beside", "looks over", "turns toward", "leans against", "follows", "circles",
          "drifts past", "rests near", "watches"]  # fmt: skip
_OBJECTS = ["the stone bridge", "a field of barley", "the harbour wall", "the chapel", "the long hedge",
            "a row of poplars", "the mill pond", "the hill farm", "the station", "an empty square"]  # fmt: skip
_TAILS = ["in the morning", "after the rain", "every autumn", "at dusk", "without a sound", "as it always has",
          "before the bells", "on market days"]  # fmt: skip
_KEY_WORDS = ["amber", "cobalt", "velvet", "silent", "copper", "frosty", "hollow", "lunar", "mossy", "rapid",
              "otter", "falcon", "willow", "harbor", "meadow", "lantern", "thistle", "canyon", "ember", "quartz"]  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?\u3002\uff01\uff1f])\s+")


@dataclass(frozen=True)
class Needle:
    """The fact hidden in one prompt, the question asked about it, and the answer that scores."""

    text: str  # "The special magic number for amber-otter is 4812397."
    question: str  # "What is the special magic number for amber-otter?"
    answer: str  # "4812397"
    answer_prefix: str = ""  # how a reply begins before the answer, for teacher-forced scoring


@dataclass(frozen=True)
class NeedleCase:
    """One prompt of the grid, with where its needle went."""

    length: int  # tokens of the whole prompt (answer prefix included when scoring)
    depth: int  # percent of the haystack before the needle, as asked
    sample: int
    prompt: Prompt
    needle_start: int  # token offset of the needle in the prompt
    answer: str
    answer_ids: list[int]  # the answer's tokens as they would follow the prompt


def random_needle(rng: random.Random) -> Needle:
    """A fresh key and 7-digit value: ``Needle('The special magic number for mossy-ember is 5071938.', ...)``."""
    key = f"{rng.choice(_KEY_WORDS[:10])}-{rng.choice(_KEY_WORDS[10:])}"
    value = str(rng.randint(1_000_000, 9_999_999))
    return Needle(
        text=f"The special magic number for {key} is {value}.",
        question=f"What is the special magic number for {key} mentioned in the text?",
        answer=value,
        answer_prefix=f"The special magic number for {key} is",
    )


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    """Plain sentences with nothing to find in them: ``['The river passes the stone bridge at dusk.', ...]``."""
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        for _ in range(count)
    ]


def split_sentences(text: str) -> list[str]:
    """A text's sentences, each on one line of words: ``'A b.  C d?\\nE' -> ['A b.', 'C d?', 'E']``."""
    return [" ".join(part.split()) for part in _SENTENCE_END.split(text) if part.strip()]


def haystack_texts(source: Path) -> list[str]:
    """The texts of a haystack source: a ``.txt`` file's, every ``.txt`` file's of a directory (sorted by
    name), or the ``text`` of a ``.json`` file (``{"text": "..."}``, as RULER's essay download writes
    ``PaulGrahamEssays.json``). One bad source is one line naming it."""
    if source.suffix == ".json" and source.is_file():
        try:
            data = json.loads(source.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{source}: not a JSON file ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise InputError(
                f'{source}: expected {{"text": "..."}} (RULER\'s PaulGrahamEssays.json), no "text" string'
            )
        texts = [data["text"]]
    elif source.is_dir():
        files = sorted(source.glob("*.txt"))
        if not files:
            raise PathError(f"{source}: no .txt files in this directory")
        texts = [path.read_text(encoding="utf-8") for path in files]
    elif source.is_file():
        texts = [source.read_text(encoding="utf-8")]
    else:
        raise PathError(f"{source}: no haystack file or directory there")
    if not any(text.strip() for text in texts):
        raise InputError(f"{source}: the haystack text is empty")
    return texts


def read_haystack(source: Path) -> list[str]:
    """The sentences of a haystack source (:func:`haystack_texts`), each file's split on its own."""
    sentences = [s for text in haystack_texts(source) for s in split_sentences(text)]
    if not sentences:
        raise InputError(f"{source}: the haystack text is empty")
    return sentences


FILLER_SENTENCES = 16384  # about 160k tokens of generated filler; longer prompts wrap around it


def haystack_pool(tokenizer, source: Path | None, *, seed: int) -> list[list[int]]:
    """Haystack sentences in token ids, each encoded once with its leading space.

    From ``source``, or ``FILLER_SENTENCES`` of generated filler when it is None. The pool does not depend
    on the prompt lengths, so a prompt is the same whichever other lengths are asked for with it (a served
    run extended to longer lengths reuses the stored answers of the shorter ones). ``build_cases`` wraps
    around the pool when a prompt needs more.
    """
    if source is None:
        sentences = filler_sentences(random.Random(f"haystack:{seed}"), FILLER_SENTENCES)
    else:
        sentences = read_haystack(source)
    return tokenizer([" " + s for s in sentences], add_special_tokens=False).input_ids


def nearest_boundary(sentence_lens: Sequence[int], haystack_len: int, depth: float) -> int:
    """The sentence start (or the end) within the first ``haystack_len`` tokens nearest ``depth``% of them.

    >>> nearest_boundary([4, 4, 4], 12, 50)    # starts 0, 4, 8 and the end 12; 50% is token 6
    4
    """
    boundaries, at = [0], 0
    for n in sentence_lens:
        at += n
        if at >= haystack_len:
            break
        boundaries.append(at)
    boundaries.append(haystack_len)
    target = depth / 100 * haystack_len
    return min(boundaries, key=lambda b: (abs(b - target), b))


def build_cases(
    tokenizer,
    pool: list[list[int]],
    *,
    lengths: Sequence[int],
    depths: Sequence[int],
    samples: int,
    seed: int,
    needle: Needle | None = None,
    with_answer_prefix: bool = False,
    lengths_setting: str = "--lengths",
) -> list[NeedleCase]:
    """Every prompt of the grid lengths x depths x samples; raises ``ConfigError`` naming ``lengths_setting``
    if a length cannot fit.

    The same arguments give the same prompts. Each prompt's haystack starts at its own sentence of the
    pool; with ``needle`` None each gets a random needle.
    """
    frame = chat_frame(tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    cases = []
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                rng = random.Random(f"needle:{seed}:{length}:{depth}:{sample}")
                fact = needle or random_needle(rng)
                question = QUESTION_FORM.format(question=fact.question)
                prefix = fact.answer_prefix if with_answer_prefix and fact.answer_prefix else ""
                answer_ids = encode((" " if prefix else "") + fact.answer)
                fixed = len(frame.encode(f"{INTRO} {fact.text}{question}", answer_prefix=prefix)[0])
                if length - fixed < 1:
                    raise ConfigError(
                        f"{lengths_setting} {length}: too short for the needle, question and chat template "
                        f"({fixed} tokens without any haystack)"
                    )
                make = functools.partial(_needle_prompt, frame, pool, rng.randrange(len(pool)), depth,
                                         f" {fact.text}", question, prefix)  # fmt: skip
                made = fit_length(make, lambda made: len(made[0]), length, length - fixed)
                if made is None:
                    raise ConfigError(
                        f"{lengths_setting} {length}: too short for the needle, question and chat template"
                    )
                ids, content, needle_start = made
                cases.append(
                    NeedleCase(
                        length=length,
                        depth=depth,
                        sample=sample,
                        prompt=Prompt(input_ids=ids, messages=[{"role": "user", "content": content}]),
                        needle_start=needle_start,
                        answer=fact.answer,
                        answer_ids=answer_ids,
                    )
                )
    return cases


def _needle_prompt(
    frame: ChatFrame, pool: list[list[int]], start: int, depth: int, needle: str, question: str, prefix: str,
    haystack_len: int,
) -> tuple[list[int], str, int]:  # fmt: skip
    """The prompt with ``haystack_len`` haystack tokens from sentence ``start`` on: its ids, its user text,
    where the needle starts."""
    sentences = sentences_from(pool, start, haystack_len)
    haystack = [t for s in sentences for t in s][:haystack_len]
    cut = nearest_boundary([len(s) for s in sentences], haystack_len, depth)
    text = decode_text(frame.tokenizer, haystack)
    head = decode_text(frame.tokenizer, haystack[:cut])
    content = f"{INTRO}{head}{needle}{text[len(head) :]}{question}"
    ids, offsets = frame.encode(content, answer_prefix=prefix)
    at = len(frame.before) + len(INTRO) + len(head)
    return ids, content, next(i for i, (_, end) in enumerate(offsets) if end > at)


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` as the tokenizer wrote it (no clean-up of spaces before punctuation)."""
    return tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def sentences_from(pool: list[list[int]], start: int, tokens: int) -> list[list[int]]:
    """Sentences of ``pool`` from ``start`` on, wrapping around, until they hold ``tokens`` tokens."""
    taken, total, i = [], 0, start
    while total < tokens:
        taken.append(pool[i % len(pool)])
        total += len(taken[-1])
        i += 1
    return taken


def found(answer: str, output: str) -> bool:
    """Whether the answer appears in the output, ignoring case."""
    return answer.casefold() in output.casefold()


def generation_row(case: NeedleCase, reply: Reply) -> dict:
    """The ``results.jsonl`` row of a generated reply: 100 if the answer is in it, 0 if not, None if it failed."""
    row = _row(case)
    row.update(output=reply.text, score=None if reply.error else 100.0 * found(case.answer, reply.text))
    if reply.error:
        row["error"] = reply.error
    return row


def _row(case: NeedleCase) -> dict:
    return {
        "length": case.length,
        "depth": case.depth,
        "sample": case.sample,
        "prompt_tokens": len(case.prompt.input_ids),
        "needle_start": case.needle_start,
        "answer": case.answer,
    }


@dataclass(frozen=True)
class AnswerScore:
    """Teacher-forced reading of an answer after its prompt."""

    logprob: float  # mean log-probability of the answer's tokens
    greedy: bool  # whether greedy decoding reproduces the answer token by token
    predicted: list[int]  # the most likely token at each answer position


def pack_rows(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Sequences in order, as many per row as fit in ``pack_tokens`` (a longer one gets a row of its own).

    >>> pack_rows([3, 4, 2, 9], 8)
    [[0, 1], [2], [3]]
    """
    rows: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if rows and used + n <= pack_tokens:
            rows[-1].append(i)
            used += n
        else:
            rows.append([i])
            used = n
    return rows


def default_pack_tokens(cases: Sequence) -> int:
    """Tokens per packed row when none are asked: the longest prompt with its answer (cases with ``length``
    and ``answer_ids``: a ``NeedleCase``, a ruler case)."""
    return max(c.length for c in cases) + max(len(c.answer_ids) for c in cases)


def score_answers(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    *,
    pack_tokens: int,
    progress: str | None = None,
) -> list[AnswerScore]:
    """For each ``(prompt_ids, answer_ids)``, the answer's log-probabilities in one teacher-forced forward.

    ``model`` is patched for packed rows (``longalign.patch.apply``): several sequences share a row, each
    attending only to itself, with positions restarting at 0::

        row          [p p p a a | p p a | p p p p a a a]
        position_ids [0 1 2 3 4 | 0 1 2 | 0 1 2 3 4 5 6]
        read at          ^ ^        ^         ^ ^ ^      (the logits that predict each answer token)

    ``progress`` titles a progress bar over the rows on stderr.
    """
    rows = pack_rows(_input_lengths(sequences), pack_tokens)
    scored = [
        score_row(model, sequences, members)
        for members in tqdm(rows, desc=progress, disable=progress is None)
    ]
    return _in_order(len(sequences), rows, scored)


def score_answers_across_ranks(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    *,
    pack_tokens: int,
    lockstep: bool = False,
    every_rank: bool = False,
    device: torch.device | None = None,
    progress: str | None = None,
) -> list[AnswerScore] | None:
    """``score_answers`` with its rows dealt over the ranks (row r to rank r % world); ``None`` on ranks
    other than 0 unless ``every_rank``.

    The rows are packed before they are dealt, so they are the same whatever the number of ranks, and so
    are the scores. ``lockstep``: every rank runs as many forwards, a rank short of rows repeating the
    first one and dropping its result, as a model sharded over the ranks (ZeRO-3, FSDP) needs.
    """
    rows = pack_rows(_input_lengths(sequences), pack_tokens)

    def work(mine: list[list[int]]) -> list[list[AnswerScore]]:
        return [
            score_row(model, sequences, members, device=device)
            for members in tqdm(mine, desc=progress, disable=progress is None)
        ]

    scored = across_ranks(rows, work, lockstep=lockstep, every_rank=every_rank)
    return None if scored is None else _in_order(len(sequences), rows, scored)


def _input_lengths(sequences: Sequence[tuple[list[int], list[int]]]) -> list[int]:
    return [len(p) + len(a) - 1 for p, a in sequences]  # the last answer token is never an input


def _in_order(count: int, rows: list[list[int]], scored: list[list[AnswerScore]]) -> list[AnswerScore]:
    scores: list[AnswerScore | None] = [None] * count
    for members, row in zip(rows, scored, strict=True):
        for i, score in zip(members, row, strict=True):
            scores[i] = score
    return scores


@torch.no_grad()  # not inference_mode: ZeRO-3 may keep parameters it gathers here for training
def score_row(
    model: torch.nn.Module,
    sequences: Sequence[tuple[list[int], list[int]]],
    members: Sequence[int],
    *,
    device: torch.device | None = None,
) -> list[AnswerScore]:
    """The scores of ``sequences[i]`` for each ``i`` of ``members``, packed into one row (one forward)."""
    device = device or next(model.parameters()).device
    ids, positions, reads, seq_lens = [], [], [], []
    for i in members:
        prompt, answer = sequences[i]
        tokens = [*prompt, *answer][:-1]
        reads.extend(len(ids) + len(prompt) - 1 + j for j in range(len(answer)))
        ids.extend(tokens)
        positions.extend(range(len(tokens)))
        seq_lens.append(len(tokens))
    cu_seqlens = torch.tensor([0, *seq_lens], device=device).cumsum(0).to(torch.int32)
    logits = model(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([positions], device=device),
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=max(seq_lens),
        max_length_k=max(seq_lens),
        logits_to_keep=torch.tensor(reads, device=device),
        use_cache=False,
    ).logits[0]
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    scores, at = [], 0
    for i in members:
        answer = sequences[i][1]
        mine = logprobs[at : at + len(answer)]
        targets = torch.tensor(answer, device=device)
        predicted = mine.argmax(-1)
        scores.append(
            AnswerScore(
                logprob=float(mine.gather(1, targets[:, None]).mean()),
                greedy=bool((predicted == targets).all()),
                predicted=predicted.tolist(),
            )
        )
        at += len(answer)
    return scores


def logprob_row(case: NeedleCase, score: AnswerScore, tokenizer) -> dict:
    """The ``results.jsonl`` row of a teacher-forced reading: 100 if greedy decoding gives the answer."""
    row = _row(case)
    row.update(
        output=tokenizer.decode(score.predicted),
        score=100.0 * score.greedy,
        logprob=score.logprob,
    )
    return row


def summary(rows: Sequence[dict]) -> dict:
    """Mean scores overall, by depth, by length and by cell (rows whose call failed are counted apart)."""
    scored = [r for r in rows if r["score"] is not None]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    def by(key: str) -> dict[str, float | None]:
        keys = sorted({r[key] for r in rows})
        return {str(k): mean([r["score"] for r in scored if r[key] == k]) for k in keys}

    cells = []
    for length in sorted({r["length"] for r in rows}):
        for depth in sorted({r["depth"] for r in rows}):
            mine = [r for r in scored if r["length"] == length and r["depth"] == depth]
            cell = {
                "length": length,
                "depth": depth,
                "score": mean([r["score"] for r in mine]),
                "n": len(mine),
            }
            if any("logprob" in r for r in mine):
                cell["logprob"] = mean([r["logprob"] for r in mine])
            cells.append(cell)
    result = {
        "overall": mean([r["score"] for r in scored]),
        "by_depth": by("depth"),
        "by_length": by("length"),
        "n": len(rows),
        "failed": len(rows) - len(scored),
        "cells": cells,
    }
    if any("logprob" in r for r in scored):
        result["mean_logprob"] = mean([r["logprob"] for r in scored])
    return result


def summary_csv(summary_: dict) -> str:
    """The cells of a summary as CSV: ``length,depth,score,n`` (and ``logprob`` when scored that way)."""
    columns = ["length", "depth", "score", "n"] + (["logprob"] if "mean_logprob" in summary_ else [])
    lines = [",".join(columns)]
    for cell in summary_["cells"]:
        lines.append(",".join("" if cell.get(c) is None else f"{cell[c]:.6g}" for c in columns))
    return "\n".join(lines) + "\n"


def plot_heatmap(summary_: dict, path: Path, *, title: str) -> None:
    """``heatmap.png``: score 0-100 by depth (rows) and length (columns); with logprobs, a second panel."""
    from matplotlib.figure import Figure  # no pyplot, no display

    lengths = sorted({c["length"] for c in summary_["cells"]})
    depths = sorted({c["depth"] for c in summary_["cells"]})
    panels = [("score", "score (0-100)", 0.0, 100.0)]
    if "mean_logprob" in summary_:
        values = [c["logprob"] for c in summary_["cells"] if c.get("logprob") is not None]
        panels.append(("logprob", "mean log-probability of the answer", min(values), max(0.0, max(values))))
    figure = Figure(figsize=(1.2 + 0.6 * len(lengths) * len(panels) + 2 * len(panels), 1.5 + 0.4 * len(depths)),
                    layout="constrained")  # fmt: skip
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, label, low, high) in zip(axes, panels, strict=True):
        grid = [[_cell(summary_, length, depth, key) for length in lengths] for depth in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=low, vmax=high, aspect="auto")
        for y, row in enumerate(grid):
            for x, value in enumerate(row):
                if value == value:  # not NaN
                    ax.text(x, y, f"{value:.0f}" if key == "score" else f"{value:.2f}", ha="center", va="center",
                            fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set(xlabel="prompt length (tokens)", ylabel="needle depth", title=label)
        figure.colorbar(image, ax=ax)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


def _cell(summary_: dict, length: int, depth: int, key: str) -> float:
    for cell in summary_["cells"]:
        if cell["length"] == length and cell["depth"] == depth and cell.get(key) is not None:
            return cell[key]
    return float("nan")
