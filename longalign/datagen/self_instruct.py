"""Self-instruct over long documents: the model asks for a task about the whole document, then does it.

Two calls per turn of a sample; the chat that is kept is the second call's request plus its answer::

    call 1   user: instruction.txt(document, task)              -> "Which two methods does section 4 ..."
    call 2   user: user_turn.txt(document, instruction)          -> "Section 4 compares ..."
    sample   {"messages": [{"role": "user", "content": <document + instruction>},
                           {"role": "assistant", "content": "Section 4 compares ..."}],
              "meta": {"document": "docs/a.md", "task": "multi_hop", ...}}

With ``turns`` > 1, each further turn asks for the user's next message (follow_up.txt, given the
conversation so far) and answers it with the whole conversation in context.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from longalign.answers import AnswerOptions, StoredCalls
from longalign.datagen.documents import Skipped, fit_document, read_documents
from longalign.datagen.prompts import (
    SELF_INSTRUCT_TEMPLATES,
    choose_tasks,
    load_tasks,
    load_templates,
    render,
)
from longalign.datagen.stage import Result, generation_stage, sample_seed, unusable
from longalign.errors import ConfigError, InputError
from longalign.serving import ChatClient


@dataclass(frozen=True)
class Job:
    """One sample to make: which document, which task type for each turn, and its seed."""

    document: str  # the document's name
    text: str  # the document as it goes into the sample (cut to the token range)
    tokens: int  # its token count with the training tokenizer
    cut: bool
    number: int  # 0, 1, ... among the samples of this document
    tasks: tuple[str, ...]  # the task type of each turn
    seed: int  # sent with the sample's first call; the next calls get seed + 1, seed + 2, ...


@dataclass(frozen=True)
class Settings:
    """What every sample's calls share."""

    templates: dict[str, str]
    task_descriptions: dict[str, str]
    model: str  # the served model's name, for the samples' meta
    temperature: float
    max_new_tokens: int


def plan_jobs(
    documents: Sequence[tuple[str, str, int, bool]],
    tasks: Sequence[str],
    *,
    per_doc: int,
    turns: int,
    seed: int,
) -> list[Job]:
    """``per_doc`` jobs for each ``(name, text, tokens, cut)`` document, task types drawn from ``seed``.

    Each document's samples go through the task types in a shuffled order (so ``per_doc`` >= the number
    of types covers every type); follow-up turns draw their type at random, from a draw of each sample's
    own, so that a sample's first turns are the same with more ``per_doc`` or ``turns`` (and so are its calls).

        plan_jobs([("a.md", "...", 900, False)], ["summary", "multi_hop"], per_doc=2, turns=1, seed=0)
        -> [Job(document='a.md', number=0, tasks=('multi_hop',), ...), Job(..., number=1, tasks=('summary',))]
    """
    jobs = []
    for name, text, tokens, cut in documents:
        rng = random.Random(f"{seed}/{name}")
        order = list(tasks)
        rng.shuffle(order)
        for number in range(per_doc):
            follow_ups = random.Random(f"{seed}/{name}/{number}")
            turn_tasks = (order[number % len(order)], *(follow_ups.choice(tasks) for _ in range(turns - 1)))
            jobs.append(Job(name, text, tokens, cut, number, turn_tasks, sample_seed(seed, name, number)))
    return jobs


def make_sample(job: Job, *, calls: StoredCalls, settings: Settings) -> Result:
    """The chat for ``job`` (every turn asked for and answered), or why it could not be made."""
    templates = settings.templates
    messages: list[dict[str, str]] = []
    instructions: list[str] = []
    seed = job.seed
    source = f"{job.document} #{job.number}"
    for turn, task in enumerate(job.tasks):
        values = {"document": job.text, "task": task, "task_description": settings.task_descriptions[task]}
        if turn == 0:
            ask = render(templates["instruction"], **values)
        else:
            ask = render(templates["follow_up"], **values, conversation=_conversation(instructions, messages))
        reply = calls.complete([{"role": "user", "content": ask}], **_sampling(settings, seed))
        if (dropped := unusable(reply, what=f"turn {turn + 1} instruction", source=source)) is not None:
            return dropped
        asked = reply.text.strip()
        instructions.append(asked)
        user = render(templates["user_turn"], document=job.text, instruction=asked) if turn == 0 else asked
        messages.append({"role": "user", "content": user})
        reply = calls.complete(messages, **_sampling(settings, seed + 1))
        if (dropped := unusable(reply, what=f"turn {turn + 1} answer", source=source)) is not None:
            return dropped
        messages.append({"role": "assistant", "content": reply.text.strip()})
        seed += 2
    return {
        "messages": messages,
        "meta": {
            "document": job.document,
            "document_tokens": job.tokens,
            "document_cut": job.cut,
            "task": job.tasks[0],
            "turn_tasks": list(job.tasks),
            "sample": job.number,
            "model": settings.model,
        },
    }


def _sampling(settings: Settings, seed: int) -> dict:
    return {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature, "seed": seed}


def _conversation(instructions: list[str], messages: list[dict[str, str]]) -> str:
    """The conversation so far for the follow-up prompt, with the user's questions without the document."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return "\n\n".join(f"User: {q}\n\nAssistant: {a}" for q, a in zip(instructions, answers, strict=True))


def generate(
    docs: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    tokenizer,
    client: ChatClient,
    max_tokens: int,
    min_tokens: int = 0,
    tasks: str | None = None,
    per_doc: int = 1,
    turns: int = 1,
    seed: int = 0,
    prompts_dir: str | os.PathLike | None = None,
    temperature: float = 0.7,
    max_new_tokens: int = 4096,
    answers: AnswerOptions | None = None,
) -> dict:
    """Self-instruct samples from the documents at ``docs`` into ``output_dir``; returns its report.

        generate("docs/", "out/gen", tokenizer=tok, client=client, min_tokens=2000, max_tokens=30000, per_doc=3)
        -> {"documents": {"read": 40, "used": 37, "cut": 9, "skipped": {"too_short": 3}}, "samples": {...}, ...}

    Everything is checked (prompts, tasks, the token range, every document) before the first call.
    """
    templates = load_templates(SELF_INSTRUCT_TEMPLATES, prompts_dir)
    chosen = choose_tasks(load_tasks(templates["tasks"]), tasks)
    for name, value in (("--per-doc", per_doc), ("--turns", turns), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, got {value}")

    def count_tokens(text: str) -> int:
        return len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)

    empty_prompt = render(templates["instruction"], document="", task="", task_description="")
    overhead = count_tokens(empty_prompt)
    if min_tokens > max_tokens:
        raise ConfigError(f"--min-tokens {min_tokens} > --max-tokens {max_tokens}: no document length fits")
    if max_tokens <= overhead:
        raise ConfigError(
            f"--max-tokens {max_tokens}: cannot hold the prompt, whose own text is {overhead} tokens "
            "before any document"
        )
    documents = read_documents(docs)
    fitted, skipped, cut = [], Counter(), 0
    for document in documents:
        fit = fit_document(document.text, count_tokens, min_tokens=min_tokens, max_tokens=max_tokens)
        if isinstance(fit, Skipped):
            skipped[fit.reason] += 1
            continue
        cut += fit.cut
        fitted.append((document.name, fit.text, fit.tokens, fit.cut))
    if not fitted:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
        raise InputError(
            f"{docs}: no document within --min-tokens {min_tokens} .. --max-tokens {max_tokens} "
            f"({len(documents)} read: {reasons})"
        )
    jobs = plan_jobs(fitted, list(chosen), per_doc=per_doc, turns=turns, seed=seed)
    settings = Settings(templates, chosen, client.settings.model, temperature, max_new_tokens)
    with generation_stage(
        output_dir, command="data self-instruct", inputs=[docs], client=client, answers=answers
    ) as run:
        results = run.make_all(
            jobs, partial(make_sample, calls=run.calls, settings=settings), progress="self-instruct"
        )
        made = Counter(r["meta"]["task"] for r in results if isinstance(r, dict))
        return run.finish(
            results,
            {
                "settings": {
                    "docs": str(docs),
                    "tokenizer": getattr(tokenizer, "name_or_path", None),
                    "min_tokens": min_tokens,
                    "max_tokens": max_tokens,
                    "tasks": list(chosen),
                    "per_doc": per_doc,
                    "turns": turns,
                    "seed": seed,
                    "prompts": str(prompts_dir) if prompts_dir is not None else None,
                    "temperature": temperature,
                    "max_new_tokens": max_new_tokens,
                },
                "documents": {
                    "read": len(documents),
                    "used": len(fitted),
                    "cut": cut,
                    "skipped": dict(sorted(skipped.items())),
                },
                "samples_by_task": {task: made[task] for task in chosen},
            },
        )
