"""AgentWrite: a long answer planned as numbered paragraphs with word counts, then written one at a time.

    call 1     plan.txt(instruction, length)                      -> "1. [300 words] The setting ...\\n2. [500 words] ..."
    call 1+k   write.txt(instruction, plan, text so far, step k)  -> paragraph k
    sample     {"messages": [{"role": "user", "content": instruction},
                             {"role": "assistant", "content": paragraph 1 + "\\n\\n" + paragraph 2 + ...}],
                "meta": {"source": "prompts.jsonl:3", "task": "agentwrite", "plan_steps": 2, ...}}

A plan is read line by line; lines shaped ``N. [W words] what it covers`` are its steps, numbered 1, 2,
3, ... in order. A plan with no steps or a gap in the numbers is dropped as ``plan_unparsed``, one with
more than ``max_steps`` steps as ``plan_too_many_steps``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from longalign.answers import AnswerOptions, StoredCalls
from longalign.datagen.prompts import AGENTWRITE_TEMPLATES, load_templates, render
from longalign.datagen.stage import Dropped, Result, generation_stage, sample_seed, unusable
from longalign.errors import ConfigError, InputError, PathError
from longalign.serving import ChatClient
from longalign.sources import read_lines

_STEP = re.compile(r"^\s*(\d+)\s*[.):]\s*\[\s*(\d+)\s*words?\s*\]\s*(.+?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Job:
    """One writing prompt: where it came from, the instruction, the length asked for (words) and its seed."""

    source: str  # "prompts.jsonl:LINE"
    instruction: str
    length: int | None
    seed: int


@dataclass(frozen=True)
class Step:
    """One paragraph of a plan."""

    number: int
    words: int
    content: str


@dataclass(frozen=True)
class Settings:
    """What every sample's calls share."""

    templates: dict[str, str]
    model: str
    temperature: float
    max_new_tokens: int
    max_steps: int


def read_prompts(path: str | os.PathLike, *, seed: int) -> list[Job]:
    """The writing prompts of a JSONL file: ``{"prompt": "...", "length": 5000}`` rows (``length`` optional).

    Raises ``InputError`` naming the line of a row that is not such an object, and when there is none.
    """
    file = Path(path)
    if not file.is_file():
        raise PathError(f"{path}: prompts file not found")
    jobs = []
    for number, line in read_lines(file):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise InputError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InputError(f"{where}: expected an object with a non-empty 'prompt' string")
        length = row.get("length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise InputError(f"{where}: 'length' must be a positive number of words, got {length!r}")
        jobs.append(Job(f"{path}:{number}", row["prompt"].strip(), length, sample_seed(seed, path, number)))
    if not jobs:
        raise InputError(f"{path}: no prompts (JSONL rows with a 'prompt' field)")
    return jobs


def parse_plan(text: str) -> list[Step] | None:
    """The steps of a plan, or None when it has none or they are not numbered 1, 2, 3, ...

    parse_plan("Plan:\\n1. [200 words] Open.\\n2. [300 words] Argue.")
    -> [Step(number=1, words=200, content='Open.'), Step(number=2, words=300, content='Argue.')]
    """
    steps = [Step(int(m[1]), int(m[2]), m[3]) for m in map(_STEP.match, text.splitlines()) if m]
    if not steps or [s.number for s in steps] != list(range(1, len(steps) + 1)):
        return None
    return steps


def make_sample(job: Job, *, calls: StoredCalls, settings: Settings) -> Result:
    """The long answer to ``job``'s instruction, planned then written paragraph by paragraph, or why not."""
    length = (
        f"The whole answer should be about {job.length} words long."
        if job.length
        else "Choose the length the task calls for."
    )
    ask = render(settings.templates["plan"], instruction=job.instruction, length=length)
    planned = calls.complete([{"role": "user", "content": ask}], **_sampling(settings, job.seed))
    if (dropped := unusable(planned, what="plan", source=job.source)) is not None:
        return dropped
    steps = parse_plan(planned.text)
    if steps is None:
        first = " ".join(planned.text.split())[:120]
        return Dropped(
            "plan_unparsed", f"no numbered '1. [N words] ...' steps in the plan: {first!r}", job.source
        )
    if len(steps) > settings.max_steps:
        return Dropped(
            "plan_too_many_steps",
            f"{len(steps)} steps, at most {settings.max_steps} (--max-steps)",
            job.source,
        )
    plan = "\n".join(f"{s.number}. [{s.words} words] {s.content}" for s in steps)
    paragraphs: list[str] = []
    for step in steps:
        ask = render(
            settings.templates["write"],
            instruction=job.instruction,
            plan=plan,
            text_so_far="\n\n".join(paragraphs),
            step_number=step.number,
            step=step.content,
            words=step.words,
        )
        written = calls.complete(
            [{"role": "user", "content": ask}], **_sampling(settings, job.seed + step.number)
        )
        if (dropped := unusable(written, what=f"paragraph {step.number}", source=job.source)) is not None:
            return dropped
        paragraphs.append(written.text.strip())
    answer = "\n\n".join(paragraphs)
    return {
        "messages": [{"role": "user", "content": job.instruction}, {"role": "assistant", "content": answer}],
        "meta": {
            "source": job.source,
            "task": "agentwrite",
            "requested_length": job.length,
            "plan_steps": len(steps),
            "planned_words": sum(s.words for s in steps),
            "words": len(answer.split()),
            "model": settings.model,
        },
    }


def _sampling(settings: Settings, seed: int) -> dict:
    return {"max_tokens": settings.max_new_tokens, "temperature": settings.temperature, "seed": seed}


def generate(
    prompts: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    client: ChatClient,
    templates_dir: str | os.PathLike | None = None,
    max_steps: int = 20,
    seed: int = 0,
    temperature: float = 0.7,
    max_new_tokens: int = 4096,
    answers: AnswerOptions | None = None,
) -> dict:
    """AgentWrite samples for the writing prompts in ``prompts`` into ``output_dir``; returns its report.

        generate("prompts.jsonl", "out/write", client=client, max_steps=20)
        -> {"prompts": {"read": 120}, "samples": {"planned": 120, "made": 117,
            "dropped": {"plan_too_many_steps": 2, "plan_unparsed": 1}}, "calls": {...}, ...}

    The templates and every prompt row are checked before the first call.
    """
    for name, value in (("--max-steps", max_steps), ("--max-new-tokens", max_new_tokens)):
        if value < 1:
            raise ConfigError(f"{name}: expected an integer >= 1, got {value}")
    templates = load_templates(AGENTWRITE_TEMPLATES, templates_dir)
    jobs = read_prompts(prompts, seed=seed)
    settings = Settings(templates, client.settings.model, temperature, max_new_tokens, max_steps)
    with generation_stage(
        output_dir, command="data agentwrite", inputs=[prompts], client=client, answers=answers
    ) as run:
        results = run.make_all(
            jobs, partial(make_sample, calls=run.calls, settings=settings), progress="agentwrite"
        )
        return run.finish(
            results,
            {
                "settings": {
                    "prompts": str(prompts),
                    "templates": str(templates_dir) if templates_dir is not None else None,
                    "max_steps": max_steps,
                    "seed": seed,
                    "temperature": temperature,
                    "max_new_tokens": max_new_tokens,
                },
                "prompts": {"read": len(jobs)},
            },
        )
