"""What both generators share: samples made concurrently, kept in input order, written as one stage output.

    with generation_stage("out/gen", command="data self-instruct", inputs=["docs/"], client=client) as run:
        results = run.make_all(jobs, make_sample, progress="self-instruct")   # one result per job, in order
        run.finish(results, report={"documents": {...}})
    # out/gen/data.jsonl     {"messages": [...], "meta": {...}} per sample, in job order
    # out/gen/report.json    samples made and dropped by reason, calls, tokens, wall time
    # out/.gen.cache.jsonl   every finished call until out/gen is written, then removed

Each job (a sample) runs its calls one after the other; ``concurrency`` jobs run at once. A sample's
content depends only on its own calls, so the file is the same whatever the concurrency or the order in
which calls finish, and the same after a restart that takes earlier answers from the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from longalign.artifacts import check_output, stage_output, write_report
from longalign.datagen.calls import CachedCalls, CallCache, cache_path
from longalign.serving import CallFailure, ChatClient, Completion

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
    """One generator run: its cached calls, its staging directory and its clock."""

    def __init__(self, *, command: str, client: ChatClient, calls: CachedCalls, staging: Path) -> None:
        self.command = command
        self.client = client
        self.calls = calls
        self.staging = staging
        self.started = time.monotonic()

    def make_all(self, jobs: Sequence[Job], make: Callable[[Job], Result], *, progress: str) -> list[Result]:
        """``make(job)`` for every job, ``concurrency`` at a time; results in job order.

        An exception in one job (a ``ServerError``: the server cannot be used) stops the others before
        their next call and is raised; the calls finished so far stay in the cache.
        """
        results: list[Result | None] = [None] * len(jobs)
        with (
            ThreadPoolExecutor(max_workers=self.client.settings.concurrency) as pool,
            tqdm(total=len(jobs), desc=progress, unit="sample") as bar,
        ):
            futures = {pool.submit(make, job): i for i, job in enumerate(jobs)}
            try:
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update()
            except BaseException:
                self.calls.stop()  # jobs already running end before their next call
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return results

    def finish(self, results: Sequence[Result], report: dict[str, Any]) -> dict[str, Any]:
        """Write ``data.jsonl`` and ``report.json`` (``report`` plus samples, calls, tokens, time) into the staging."""
        samples = [r for r in results if not isinstance(r, Dropped)]
        dropped = [r for r in results if isinstance(r, Dropped)]
        with open(self.staging / DATA_NAME, "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        stats = self.client.stats
        wall = time.monotonic() - self.started
        full = {
            "command": f"longalign {self.command}",
            "server": self.client.settings.record(),
            **report,
            "samples": {
                "planned": len(results),
                "made": len(samples),
                "dropped": dict(sorted(Counter(d.reason for d in dropped).items())),
            },
            "dropped_samples": [asdict(d) for d in dropped],
            "calls": {
                "made": stats.calls,
                "succeeded": stats.succeeded,
                "failed": stats.failed,
                "retried": stats.retried,
                "from_cache": self.calls.counts.hits,
            },
            "tokens": {
                "prompt": stats.prompt_tokens,
                "completion": stats.completion_tokens,
                "from_cache_prompt": self.calls.counts.prompt_tokens,
                "from_cache_completion": self.calls.counts.completion_tokens,
            },
            "wall_seconds": round(wall, 3),
            "seconds_per_sample": round(wall / len(samples), 4) if samples else None,
        }
        write_report(self.staging, full)
        return full


@contextmanager
def generation_stage(
    output_dir: str | os.PathLike, *, command: str, inputs: Sequence[str | os.PathLike], client: ChatClient
) -> Iterator[GenerationRun]:
    """A ``GenerationRun`` writing into the staging directory of ``output_dir``; the cache goes when it is written.

    The output is checked before any call (``check_output``): it may not be or contain an input.
    """
    check_output(output_dir, inputs=inputs)
    cache = CallCache(cache_path(Path(output_dir).resolve()))
    try:
        with stage_output(output_dir, stage=command, inputs=inputs) as staging:
            yield GenerationRun(
                command=command, client=client, calls=CachedCalls(client, cache), staging=staging
            )
    finally:
        cache.close()
    cache.remove()
