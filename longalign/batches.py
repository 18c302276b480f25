"""Batch APIs: a round of chat requests as one input file, and its results read back by request key.

    batch_input({"3f2a...": body, ...})      # JSONL, one request a line, its custom_id the request's key:
    -> '{"custom_id": "3f2a...", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ...}}\\n'
    read_results(text, where="out/gen.batch-1.results.jsonl")
    -> {"3f2a...": Completion(...), "9b1c...": CallFailure(error='500 from the batch: ...', status=500)}
    wait_for(client, "batch_abc", poll=30)   # polled with a progress bar until it is done -> BatchStatus
    batch_results(client, status)            # its output and error files, read as above

The line formats are those of the OpenAI batch API, which ``vllm run-batch -i IN -o OUT`` reads and writes
offline too: a results line is ``{"custom_id", "response": {"status_code", "body"}, "error"}``, in any
order. ``body`` is a chat-completion response; a line with an ``error``, or a status other than 200, is a
``CallFailure`` with that status.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from longalign.errors import InputError
from longalign.serving import (
    DETAIL_CHARS,
    BatchStatus,
    CallFailure,
    ChatClient,
    Completion,
    completion_from_json,
    endpoint,
)


def batch_input(bodies: dict[str, dict[str, Any]]) -> str:
    """The batch input file of ``{key: request body}``: one line a request, ``custom_id`` its key."""
    lines = []
    for key, body in bodies.items():
        wire = {k: v for k, v in body.items() if k != "extra_body"} | body.get("extra_body", {})
        line = {"custom_id": key, "method": "POST", "url": endpoint(body), "body": wire}
        lines.append(json.dumps(line, ensure_ascii=False) + "\n")
    return "".join(lines)


def read_results(text: str, *, where: str) -> dict[str, Completion | CallFailure]:
    """The answers in a batch's results (or errors) file, by ``custom_id``; ``InputError`` naming a bad line."""
    results: dict[str, Completion | CallFailure] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = row["custom_id"]
            response = row.get("response") or {}
            status = response.get("status_code")
            error = row.get("error")
            if error is None and status == 200:
                results[key] = completion_from_json(response["body"])
            else:
                results[key] = CallFailure(
                    f"{status if status is not None else 'no answer'} from the batch: "
                    f"{_message(error, response.get('body'))}",
                    status,
                )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise InputError(
                f"{where} line {number}: not a batch result line ({type(err).__name__}: {err}); expected "
                '{"custom_id", "response": {"status_code", "body"}, "error"}'
            ) from None
    return results


def _message(error: Any, body: Any) -> str:
    """The one-line reason of a failed line: its ``error``, else the error in its response body."""
    for source in (error, body):
        if isinstance(source, dict) and isinstance(source.get("error"), dict):
            source = source["error"]
        if isinstance(source, dict) and source.get("message"):
            return " ".join(str(source["message"]).split())[:DETAIL_CHARS]
        if isinstance(source, str) and source.strip():
            return " ".join(source.split())[:DETAIL_CHARS]
    return "no reason given"


def wait_for(
    client: ChatClient,
    batch_id: str,
    *,
    poll: float,
    sleep: Callable[[float], None] = time.sleep,
    progress: str | None = None,
) -> BatchStatus:
    """``client.batch_status(batch_id)`` every ``poll`` seconds until the batch is done; a progress bar meanwhile."""
    with tqdm(desc=progress or f"batch {batch_id}", unit="request", disable=progress is None) as bar:
        while True:
            status = client.batch_status(batch_id)
            bar.total = status.total or None
            bar.n = status.completed + status.failed
            bar.set_postfix_str(status.status, refresh=True)
            if status.done:
                return status
            sleep(poll)


def batch_results(client: ChatClient, status: BatchStatus) -> dict[str, Completion | CallFailure]:
    """The answered and the failed lines of a finished batch, by ``custom_id``."""
    results: dict[str, Completion | CallFailure] = {}
    for file_id in (status.error_file_id, status.output_file_id):
        if file_id:
            results.update(read_results(client.file_text(file_id), where=f"batch file {file_id}"))
    return results
