"""Every paid answer kept with the output it went into, and chat calls that ask only what has no answer yet.

    store = AnswerStore("out/gen")        # reads out/gen/calls.jsonl and out/.gen.calls.jsonl if they exist
    calls = StoredCalls(store, client)    # ChatClient's complete / complete_many, through the store
    calls.complete([{"role": "user", "content": "..."}], max_tokens=512, temperature=0.7, seed=17)
        -> Completion(...)                # asked, then in the work file (flushed and synced) before it returns
    calls.complete(...the same request...)
        -> Completion(...)                # from the store: nothing is sent
    store.write(staging)                  # staging/calls.jsonl: every answer, sorted by key
    store.discard_work()                  # once the output holding calls.jsonl is in place

An answer is keyed by the SHA-256 of its request body as sent (model, messages, sampling settings, seed):
the same request in a later run into the same output finds it, a request that differs in anything is asked
anew. The files, JSON Lines:

    OUTPUT/calls.jsonl      {"key", "model", "completion"} per answer: what the run that wrote OUTPUT knew
    .OUTPUT.calls.jsonl     the work file of a run in progress: its answers as they come, and the ids of
                            the batches it submitted, failed batch lines, batch input files it wrote

A run reads both (a line cut short by a killed process is skipped) and appends to the work file. Failed
calls are not kept, so a later run asks them again. ``--fresh`` starts a work file that reads neither. The
API key is part of no request body, so it is in no file.

Answering modes (``AnswerOptions.mode``):

- ``online``: each unanswered request is sent as it comes, ``ChatClient`` rules (retries, rate limits);
- ``batch``: unanswered requests are noted (``complete`` raises ``Pending``) and sent as one batch of
  the batch API (``answer_pending``); the batch id is in the work file as soon as it is submitted, and a
  later run reads a batch it never finished reading instead of submitting another. A failed line goes into
  the next batch, up to ``max_retries`` times; a 400 fails its request at once;
- ``file``: as ``batch``, but the noted requests are written to ``OUTPUT.batch-N.jsonl`` for ``vllm
  run-batch`` (``BatchFileWritten`` is raised); ``results`` is the output file of the last one written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from longalign.arguments import seconds
from longalign.batches import batch_input, batch_results, read_results, wait_for
from longalign.errors import ConfigError, InputError, PathError
from longalign.redact import redact_text
from longalign.serving import (
    CallFailure,
    CallStats,
    ChatClient,
    Completion,
    ServerError,
    ServerSettings,
    endpoint,
    in_parallel,
)

CALLS_NAME = "calls.jsonl"
ONLINE, BATCH, FILE = "online", "batch", "file"


def request_key(body: dict[str, Any]) -> str:
    """The store's key of a request body: SHA-256 of its canonical JSON."""
    canonical = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def work_path(output_dir: str | os.PathLike) -> Path:
    """Where the work file of an output directory lives: a hidden sibling.

    work_path("out/gen") -> PosixPath('out/.gen.calls.jsonl')
    """
    output = Path(output_dir)
    return output.parent / f".{output.name}.{CALLS_NAME}"


class AnswerStore:
    """The answers (and batch records) of one output directory: read at start, appended as they come."""

    def __init__(self, output_dir: str | os.PathLike, *, fresh: bool = False) -> None:
        self.output = Path(output_dir).resolve()
        self.kept_path = self.output / CALLS_NAME
        self.work_path = work_path(self.output)
        self._lock = threading.Lock()
        self._answers: dict[str, tuple[str, Completion]] = {}  # key -> (model, completion)
        self._failures: dict[str, list[CallFailure]] = {}  # batch lines that failed, by key
        self._batches: dict[str, dict[str, Any]] = {}  # submitted and not yet read, by id
        self._files = 0  # batch input files written
        self.results_read = False  # file mode: --batch-results taken in, by the first calls that wait
        self._cut_short = False  # the work file's last line has no newline: a killed run was writing it
        if fresh:
            self.work_path.unlink(missing_ok=True)
            self._append({"fresh": True})
            return
        lines = self._read(self.work_path)
        if not (lines and lines[0].get("fresh")):
            lines = self._read(self.kept_path) + lines
        for line in lines:
            self._load(line)

    def __len__(self) -> int:
        with self._lock:
            return len(self._answers)

    def answer(self, key: str) -> Completion | None:
        """The kept answer to the request with ``key``, if there is one."""
        with self._lock:
            kept = self._answers.get(key)
        return kept[1] if kept else None

    def put(self, key: str, model: str, completion: Completion) -> None:
        """Keep ``completion``; it is on disk (flushed and synced) when this returns."""
        with self._lock:
            self._append({"key": key, "model": model, "completion": asdict(completion)})
            self._answers[key] = (model, completion)

    def failures(self, key: str) -> list[CallFailure]:
        """The failed batch lines of ``key`` so far (this run and the unfinished one before it)."""
        with self._lock:
            return list(self._failures.get(key, ()))

    def put_failure(self, key: str, failure: CallFailure) -> None:
        """Note a failed batch line, so that the number of tries survives a restart."""
        with self._lock:
            self._append({"failed": key, "error": failure.error, "status": failure.status})
            self._failures.setdefault(key, []).append(failure)

    def unread_batches(self, server: str | None, model: str) -> list[str]:
        """The ids of batches submitted to ``server`` for ``model`` whose results were never read."""
        with self._lock:
            return [
                batch_id
                for batch_id, record in self._batches.items()
                if record["server"] == server and record["model"] == model
            ]

    def put_batch(self, batch_id: str, *, server: str | None, model: str, requests: int) -> None:
        """Note a batch as soon as it is submitted."""
        record = {"batch": batch_id, "server": server, "model": model, "requests": requests}
        with self._lock:
            self._append(record)
            self._batches[batch_id] = record

    def batch_read(self, batch_id: str) -> None:
        """Note that a batch's results are in the store."""
        with self._lock:
            self._append({"batch_read": batch_id})
            self._batches.pop(batch_id, None)

    def next_batch_file(self) -> Path:
        """The path of the next batch input file: ``OUTPUT.batch-1.jsonl``, ``OUTPUT.batch-2.jsonl``, ..."""
        with self._lock:
            return self.output.parent / f"{self.output.name}.batch-{self._files + 1}.jsonl"

    def put_batch_file(self, path: Path, requests: int) -> None:
        """Note a batch input file written for an offline runner."""
        with self._lock:
            self._append({"batch_file": str(path), "requests": requests})
            self._files += 1

    def write(self, directory: str | os.PathLike) -> Path:
        """``directory/calls.jsonl``: every answer, one line each, sorted by key (the same answers, the same file).

        The work file is read again first: other processes writing into the same output (the ranks of
        ``accelerate launch``) append their answers to it too.
        """
        path = Path(directory) / CALLS_NAME
        with self._lock:
            for line in self._read(self.work_path):
                if "key" in line:
                    self._load(line)
            items = sorted(self._answers.items())
        with open(path, "w", encoding="utf-8") as f:
            for key, (model, completion) in items:
                line = {"key": key, "model": model, "completion": asdict(completion)}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        return path

    def discard_work(self) -> None:
        """Remove the work file, once an output that holds its answers is in place."""
        self.work_path.unlink(missing_ok=True)

    def _read(self, path: Path) -> list[dict[str, Any]]:
        """The JSON objects of a store file, one a line; a line cut short or not JSON is skipped."""
        if not path.exists():
            return []
        text = path.read_text(encoding="utf-8", errors="replace")
        if path == self.work_path:
            self._cut_short = bool(text) and not text.endswith("\n")
        lines = []
        for line in text.splitlines():
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                lines.append(value)
        return lines

    def _load(self, line: dict[str, Any]) -> None:
        try:
            if "key" in line:
                self._answers[line["key"]] = (line.get("model", ""), Completion(**line["completion"]))
            elif "failed" in line:
                self._failures.setdefault(line["failed"], []).append(
                    CallFailure(line["error"], line["status"])
                )
            elif "batch" in line:
                self._batches[line["batch"]] = line
            elif "batch_read" in line:
                self._batches.pop(line["batch_read"], None)
            elif "batch_file" in line:
                self._files += 1
        except (KeyError, TypeError):
            pass  # a line of another shape: not ours to read

    def _append(self, line: dict[str, Any]) -> None:
        """One line onto the work file, on disk when this returns (the caller holds the lock)."""
        text = json.dumps(line, ensure_ascii=False) + "\n"
        try:
            self.work_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.work_path, "a", encoding="utf-8") as f:
                f.write(("\n" if self._cut_short else "") + text)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            raise PathError(
                f"{self.work_path}: cannot write the answers there ({err.strerror or err})"
            ) from None
        self._cut_short = False


@dataclass(frozen=True)
class AnswerOptions:
    """How requests with no stored answer are answered."""

    mode: str = ONLINE  # online, batch (the batch API) or file (batch input files for vllm run-batch)
    fresh: bool = False  # ignore the stored answers: ask everything again
    results: Path | None = None  # file mode: the results of the batch input file written last
    poll_seconds: float = 30.0  # batch mode: seconds between two looks at a submitted batch


def add_answer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--fresh``, ``--batch``, ``--batch-file-only``, ``--batch-results``, ``--batch-poll``, for ``answer_options``."""
    group = parser.add_argument_group("stored answers and batch APIs")
    group.add_argument(
        "--fresh",
        action="store_true",
        help=f"ask every request again, ignoring the answers kept in OUTPUT/{CALLS_NAME} and the work file",
    )
    group.add_argument(
        "--batch",
        action="store_true",
        help="send the requests of each round as one batch of the server's batch API (/v1/files, /v1/batches), "
        "at its batch price",
    )
    group.add_argument(
        "--batch-file-only",
        action="store_true",
        help="write the next round's requests as a batch input file (OUTPUT.batch-N.jsonl, for vllm run-batch) "
        "and stop",
    )
    group.add_argument(
        "--batch-results",
        type=Path,
        metavar="FILE",
        help="the results of the last batch input file written: stored, then the next round's file is written, "
        "or the output once nothing is left to ask",
    )
    group.add_argument(
        "--batch-poll",
        type=seconds,
        default=AnswerOptions.poll_seconds,
        help=f"--batch: seconds between two looks at a submitted batch (default: {AnswerOptions.poll_seconds:g})",
    )


def answer_options(args: argparse.Namespace) -> AnswerOptions:
    """The ``AnswerOptions`` of the flags ``add_answer_arguments`` added; a ``ConfigError`` for a contradiction."""
    offline = args.batch_file_only or args.batch_results is not None
    if args.batch and offline:
        raise ConfigError(
            "--batch with --batch-file-only/--batch-results: choose the batch API (--batch) or files for an "
            "offline runner"
        )
    if args.fresh and args.batch_results is not None:
        raise ConfigError(
            "--fresh with --batch-results: the results answer a round that --fresh would forget"
        )
    if args.batch_results is not None and not args.batch_results.is_file():
        raise PathError(f"--batch-results {args.batch_results}: no such file")
    return AnswerOptions(
        mode=FILE if offline else BATCH if args.batch else ONLINE,
        fresh=args.fresh,
        results=args.batch_results,
        poll_seconds=args.batch_poll,
    )


class Pending(Exception):
    """A request with no answer yet, noted for the next batch round (batch and file modes)."""


class Stopped(Exception):
    """``stop()`` was called (another request's ``ServerError`` ends the run): no further calls."""


class BatchFileWritten(Exception):
    """File mode: the next round's batch input file is written; the command stops here and says what to run."""

    def __init__(self, path: Path, requests: int, model: str) -> None:
        super().__init__(str(path))
        self.path = path
        self.requests = requests
        self.model = model

    def instructions(self) -> str:
        """What to run next: ``vllm run-batch`` on the file, then the same command with its results.

        BatchFileWritten(Path("out/gen.batch-1.jsonl"), 8, "m").instructions().splitlines()[1]
        -> 'run it: vllm run-batch -i out/gen.batch-1.jsonl -o out/gen.batch-1.results.jsonl --model MODEL_DIR --served-model-name m'
        """
        results = self.path.with_name(self.path.name.removesuffix(".jsonl") + ".results.jsonl")
        return (
            f"wrote {self.path}: the next {self.requests} requests to {self.model}, as a batch input file; "
            "the output is not written yet\n"
            f"run it: vllm run-batch -i {self.path} -o {results} --model MODEL_DIR --served-model-name {self.model}\n"
            f"then run this command again with --batch-results {results}"
        )


@dataclass
class BatchCounts:
    """What batches did in this run."""

    submitted: int = 0  # batches submitted to the server
    picked_up: int = 0  # batches an earlier, stopped run had submitted, read by this one
    files_written: int = 0  # batch input files written for an offline runner
    requests: int = 0  # request lines sent in batches or written to files
    answered: int = 0  # lines answered
    failed: int = 0  # lines that failed (asked again in the next batch, up to max_retries times)
    prompt_tokens: int = 0  # of the answered lines, as the server reported them
    completion_tokens: int = 0


@dataclass
class _Reused:
    keys: set[str] = field(default_factory=set)
    prompt_tokens: int = 0
    completion_tokens: int = 0


class StoredCalls:
    """``ChatClient.complete`` / ``complete_many`` through an ``AnswerStore``: only unanswered requests are asked.

    Thread-safe. ``report()`` counts the distinct answers taken from earlier runs and the tokens they saved;
    ``sleep`` waits between two looks at a submitted batch.
    """

    def __init__(
        self,
        store: AnswerStore,
        client: ChatClient,
        options: AnswerOptions = AnswerOptions(),
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        self.client = client
        self.options = options
        self.batch = BatchCounts()
        self._sleep = sleep
        self._lock = threading.Lock()
        self._reused = _Reused()
        self._asked: set[str] = set()  # keys answered in this run
        self._pending: dict[str, dict[str, Any]] = {}
        self._stopped = threading.Event()

    @property
    def settings(self) -> ServerSettings:
        """The served model's ``ServerSettings``."""
        return self.client.settings

    @property
    def stats(self) -> CallStats:
        """The client's ``CallStats``: the requests sent one at a time in this run."""
        return self.client.stats

    @property
    def pending(self) -> int:
        """Requests noted for the next batch round."""
        with self._lock:
            return len(self._pending)

    def complete(self, messages: Sequence[dict[str, Any]], **sampling: Any) -> Completion | CallFailure:
        """The answer to one request: kept, or asked (online) and kept; ``Pending`` in the batch modes."""
        if self._stopped.is_set():
            raise Stopped
        body = self.client.request(messages, **sampling)
        key = request_key(body)
        if self.options.mode == ONLINE:
            return self._answer(key, body)
        kept = self._kept(key)
        if kept is None:
            with self._lock:
                self._pending[key] = body
            raise Pending
        return kept

    def complete_many(
        self, requests: Sequence[dict[str, Any]], *, progress: str | None = None
    ) -> list[Completion | CallFailure]:
        """``complete(**request)`` for each, in input order; identical requests asked once.

        Online ``concurrency`` at a time, else as batch rounds until every request has its answer (or its
        last failure).
        """
        keys, bodies = [], {}
        for request in requests:
            body = self.client.request(**request)
            keys.append(request_key(body))
            bodies.setdefault(keys[-1], body)
        if self.options.mode == ONLINE:
            answers = in_parallel(
                lambda item: self._answer(*item),
                list(bodies.items()),
                workers=self.settings.concurrency,
                progress=progress,
            )
            found = dict(zip(bodies, answers, strict=True))
            return [found[key] for key in keys]
        while waiting := {k: b for k, b in bodies.items() if self._kept(k, count=False) is None}:
            with self._lock:
                self._pending.update(waiting)
            self.answer_pending(progress=progress)
        return [self._kept(key) for key in keys]

    def answer_pending(self, *, progress: str | None = None) -> None:
        """Answer the noted requests: one batch (batch mode), or a results file read / an input file written (file)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        if self.options.mode == BATCH:
            self._run_batch(pending, progress)
        elif self.options.mode == FILE:
            self._file_round(pending)

    def stop(self) -> None:
        """Make every later ``complete`` raise ``Stopped``."""
        self._stopped.set()

    def report(self) -> dict[str, Any]:
        """The ``calls``, ``tokens`` and ``batch`` parts of a report: what was asked, reused and saved."""
        stats = self.stats
        with self._lock:
            reused = (len(self._reused.keys), self._reused.prompt_tokens, self._reused.completion_tokens)
        return {
            "calls": {
                "made": stats.calls,
                "succeeded": stats.succeeded,
                "failed": stats.failed,
                "retried": stats.retried,
                "rate_limited": stats.rate_limited,
                "rate_limit_wait_seconds": round(stats.rate_limit_wait_seconds, 3),
                "lowest_concurrency": stats.lowest_concurrency,
                "reused": reused[0],
            },
            "tokens": {
                "prompt": stats.prompt_tokens + self.batch.prompt_tokens,
                "completion": stats.completion_tokens + self.batch.completion_tokens,
                "reused_prompt": reused[1],
                "reused_completion": reused[2],
            },
            "batch": None
            if self.options.mode == ONLINE
            else {"mode": self.options.mode, **asdict(self.batch)},
        }

    def _kept(self, key: str, *, count: bool = True) -> Completion | CallFailure | None:
        """The stored answer of ``key`` (counted as reused if an earlier run paid for it), or its final failure."""
        answer = self.store.answer(key)
        if answer is not None:
            with self._lock:
                if count and key not in self._asked and key not in self._reused.keys:
                    self._reused.keys.add(key)
                    self._reused.prompt_tokens += answer.prompt_tokens or 0
                    self._reused.completion_tokens += answer.completion_tokens or 0
            return answer
        failures = self.store.failures(key)
        if failures and (failures[-1].status == 400 or len(failures) > self.settings.max_retries):
            tries = "once" if len(failures) == 1 else f"{len(failures)} times"
            return CallFailure(f"{failures[-1].error} (tried {tries} in batches)", failures[-1].status)
        return None

    def _answer(self, key: str, body: dict[str, Any]) -> Completion | CallFailure:
        """Online: the kept answer of ``key``, or ``body`` asked and its answer kept."""
        kept = self._kept(key)
        if kept is not None:
            return kept
        result = self.client.send(body)
        if isinstance(result, Completion):
            self._keep(key, result)
        return result

    def _keep(self, key: str, completion: Completion) -> None:
        self.store.put(key, self.settings.model, completion)
        with self._lock:
            self._asked.add(key)

    def _take(self, results: dict[str, Completion | CallFailure], wanted: dict[str, Any]) -> None:
        """Store a batch's lines; a request of ``wanted`` with no line is a failed one."""
        for key, result in results.items():
            if isinstance(result, Completion):
                self._keep(key, result)
                self.batch.answered += 1
                self.batch.prompt_tokens += result.prompt_tokens or 0
                self.batch.completion_tokens += result.completion_tokens or 0
            else:
                self.store.put_failure(key, result)
                self.batch.failed += 1
        for key in wanted.keys() - results.keys():
            self.store.put_failure(key, CallFailure("no answer in the batch's results", None))
            self.batch.failed += 1

    def _run_batch(self, pending: dict[str, dict[str, Any]], progress: str | None) -> None:
        server = redact_text(self.settings.base_url) if self.settings.base_url else None
        for batch_id in self.store.unread_batches(server, self.settings.model):
            self.batch.picked_up += 1
            self._read_batch(batch_id, {}, progress)
        pending = {k: b for k, b in pending.items() if self.store.answer(k) is None}
        if not pending:
            return
        upload = self.store.work_path.with_name(f"{self.store.work_path.name}.batch-input.jsonl")
        upload.write_text(batch_input(pending), encoding="utf-8")
        try:
            file_id = self.client.upload_batch(upload)
        finally:
            upload.unlink(missing_ok=True)
        batch_id = self.client.submit_batch(file_id, endpoint=endpoint(next(iter(pending.values()))))
        self.store.put_batch(batch_id, server=server, model=self.settings.model, requests=len(pending))
        self.batch.submitted += 1
        self.batch.requests += len(pending)
        self._read_batch(batch_id, pending, progress)

    def _read_batch(self, batch_id: str, wanted: dict[str, Any], progress: str | None) -> None:
        status = wait_for(
            self.client,
            batch_id,
            poll=self.options.poll_seconds,
            sleep=self._sleep,
            progress=f"{progress or 'batch'}: batch {batch_id}",
        )
        results = batch_results(self.client, status)
        if status.status == "failed" and not results:
            self.store.batch_read(batch_id)
            raise ServerError(
                f"{redact_text(self.settings.base_url or '')}: batch {batch_id} failed: "
                f"{status.errors or 'no reason given'}"
            )
        self._take(results, wanted)
        self.store.batch_read(batch_id)

    def _file_round(self, pending: dict[str, dict[str, Any]]) -> None:
        if self.options.results is not None and not self.store.results_read:
            self.store.results_read = True
            where = str(self.options.results)
            results = read_results(self.options.results.read_text(encoding="utf-8"), where=where)
            ours = {key: result for key, result in results.items() if key in pending}
            if results and not ours:
                raise InputError(
                    f"--batch-results {where}: none of its {len(results)} lines answers a request this run "
                    "waits for (the results of another run, or of an earlier round?)"
                )
            self._take(ours, {})
            return  # the caller asks again: what is still unanswered goes into the next file
        path = self.store.next_batch_file()
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(batch_input(pending), encoding="utf-8")
        os.replace(partial, path)
        self.store.put_batch_file(path, len(pending))
        self.batch.files_written += 1
        self.batch.requests += len(pending)
        raise BatchFileWritten(path, len(pending), self.settings.model)
