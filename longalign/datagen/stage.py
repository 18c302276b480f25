"""What both generators share: samples made concurrently, kept in input order, written as one stage output.

    with generation_stage("out/gen", command="data self-instruct", inputs=["docs/"], client=client) as run:
        results = run.make_all(jobs, make_sample, progress="self-instruct")   # one result per job, in order
        run.finish(results, report={"documents": {...}})
    # out/gen/data.jsonl     {"messages": [...], "meta": {...}} per sample, in job order
    # out/gen/report.json    samples made and dropped by reason, calls, rate limits, answers reused, time
    # out/gen/calls.jsonl    every answer paid for (longalign.answers), read first by the next run into out/gen
    # out/.gen.calls.jsonl   the work file while the run is in progress, removed once out/gen is written

Each job (a sample) runs its calls one after the other; ``concurrency`` jobs run at once. A sample's
content depends only on its own calls, so the file is the same whatever the concurrency, the order in
which calls finish, or how many of its answers were stored by earlier runs. In the batch modes a job stops
at its first unanswered call; that round's calls go out as one batch, and the jobs run again from the
start, their answers now stored, until none waits.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from longalign.answers import AnswerOptions, AnswerStore, Pending, StoredCalls
from longalign.artifacts import check_output, stage_output, write_report
from longalign.errors import InputError
from longalign.serving import CallFailure, ChatClient, Completion, in_parallel

DATA_NAME = "data.jsonl"
Job = TypeVar("Job")


@dataclass(frozen=True)
class Dropped:
    """A sample that was not made: one of the generator's reasons, and what happened."""

    reason: str  # e.g. "call_failed", "reply_cut", "plan_unparsed"
    detail: str  # one line, e.g. "500 from the server: ... (tried 6 times)"
    source: str  # the document or prompt line it came from


Result = dict[str, Any] | Dropped  # a sample ({"messages": ..., "meta": ...}) or why there is none


def unusable(result: Completion | CallFailure, *, what: str, source: str) -> Dropped | None:
    """Why a reply cannot go into a sample (failed call, cut at the token limit, empty); None when it can.

    unusable(CallFailure("500 from the server: ...", 500), what="plan", source="p.jsonl:3")
    -> Dropped(reason='call_failed', detail='plan: 500 from the server: ...', source='p.jsonl:3')
    """
    if isinstance(result, CallFailure):
        return Dropped("call_failed", f"{what}: {result.error}", source)
    if result.finish_reason == "length":
        return Dropped("reply_cut", f"{what}: the reply reached --max-new-tokens", source)
    if not result.text.strip():
        return Dropped("empty_reply", f"{what}: the server sent an empty reply", source)
    return None


def sample_seed(*parts: object) -> int:
    """A seed for a sample's calls from what identifies it, the same in every run (31 bits).

    sample_seed(0, "docs/a.md", 2) -> 442746907
    """
    digest = hashlib.sha256("/".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") >> 1


class GenerationRun:
    """One generator run: its stored calls, its staging directory and its clock."""

    def __init__(self, *, command: str, calls: StoredCalls, staging: Path) -> None:
        self.command = command
        self.calls = calls
        self.staging = staging
        self.started = time.monotonic()

    def make_all(self, jobs: Sequence[Job], make: Callable[[Job], Result], *, progress: str) -> list[Result]:
        """``make(job)`` for every job, ``concurrency`` at a time; results in job order.

        An exception in one job (a ``ServerError``: the server cannot be used) stops the others before
        their next call and is raised; the answers so far stay in the work file. In the batch modes the
        jobs run in rounds until no call waits for an answer (file mode stops at the first round it writes).
        """
        rounds = 0
        while True:
            results = in_parallel(
                partial(_until_pending, make),
                jobs,
                workers=self.calls.settings.concurrency,
                progress=progress if rounds == 0 else f"{progress} (after batch {rounds})",
                unit="sample",
                on_error=self.calls.stop,
            )
            if not self.calls.pending:
                return results
            rounds += 1
            self.calls.answer_pending(progress=f"{progress} round {rounds}")

    def finish(self, results: Sequence[Result], report: dict[str, Any]) -> dict[str, Any]:
        """Write ``data.jsonl``, ``calls.jsonl`` and ``report.json`` (``report`` plus samples, calls, time) into the staging.

        Raises ``InputError`` when no sample was made: the output is not replaced (the answers stay kept).
        """
        samples = [r for r in results if not isinstance(r, Dropped)]
        dropped = [r for r in results if isinstance(r, Dropped)]
        counts = dict(sorted(Counter(d.reason for d in dropped).items()))
        if not samples:
            reasons = ", ".join(f"{n} {reason}" for reason, n in counts.items())
            first = f"; the first: {dropped[0].detail}" if dropped else ""
            raise InputError(
                f"{self.calls.store.output}: no sample made ({len(results)} planned, dropped: {reasons}{first}); "
                f"left as it was, the {len(self.calls.store)} answers paid for kept for the next run"
            )
        with open(self.staging / DATA_NAME, "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        self.calls.store.write(self.staging)
        wall = time.monotonic() - self.started
        full = {
            "command": f"longalign {self.command}",
            "server": self.calls.settings.record(),
            **report,
            "samples": {"planned": len(results), "made": len(samples), "dropped": counts},
            "dropped_samples": [asdict(d) for d in dropped],
            **self.calls.report(),
            "wall_seconds": round(wall, 3),
            "seconds_per_sample": round(wall / len(samples), 4),
        }
        write_report(self.staging, full)
        return full


def _until_pending(make: Callable[[Job], Result], job: Job) -> Result | None:
    """``make(job)``, or None when one of its calls waits for a batch round."""
    try:
        return make(job)
    except Pending:
        return None


@contextmanager
def generation_stage(
    output_dir: str | os.PathLike,
    *,
    command: str,
    inputs: Sequence[str | os.PathLike],
    client: ChatClient,
    answers: AnswerOptions | None = None,
) -> Iterator[GenerationRun]:
    """A ``GenerationRun`` writing into the staging directory of ``output_dir``, its calls through the answer store.

    The output is checked before any call (``check_output``): it may not be or contain an input. The work
    file goes once the output (with its ``calls.jsonl``) is in place.
    """
    answers = answers or AnswerOptions()
    check_output(output_dir, inputs=inputs)
    store = AnswerStore(output_dir, fresh=answers.fresh)
    with stage_output(output_dir, stage=command, inputs=inputs) as staging:
        yield GenerationRun(command=command, calls=StoredCalls(store, client, answers), staging=staging)
    store.discard_work()
