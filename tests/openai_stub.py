"""An OpenAI-compatible chat server on 127.0.0.1 for tests: deterministic replies, a bearer key, failure modes.

    from openai_stub import OpenAIStub

    with OpenAIStub(reply=lambda body: "4", fail_every=3) as server:
        settings = ServerSettings(base_url=server.base_url, model=server.model, api_key_env="TEST_KEY")
        ...                      # with TEST_KEY=sk-test in the environment
        server.requests          # the JSON bodies received, in arrival order
        server.calls             # chat-completion requests received, the failed ones included
        server.batches           # the ids of the batches submitted, in order
        server.batch_requests    # the bodies of every line of every batch run

It serves ``POST /v1/chat/completions``, ``POST /v1/completions`` (a raw ``prompt``; answered by the same
rules, its reply in ``choices[0].text``), ``GET /v1/models`` and the batch API (``POST /v1/files``, ``POST
/v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/files/{id}/content``; same key) on a free port from a
background thread, and stops when the ``with`` block ends. Each chat request is answered by the first rule
that applies:

1. ``Authorization`` is not ``Bearer <key>``: 401, whose message repeats the key it was sent (as careless
   servers do, so tests can check that clients keep it out of their own errors);
2. ``model`` is not the stub's ``model``: 404;
3. ``reject(body)`` returns a message: 400 with that message (a request the server refuses, e.g. too long);
4. call number n (1, 2, ...) with n <= ``fail_first_with_429``, or n a multiple of ``rate_limit_every``:
   429 with ``Retry-After: <retry_after>``;
5. n a multiple of ``fail_every``: 500;
6. otherwise 200 with ``reply(body)`` as it is (line breaks kept), or its first ``max_tokens`` words
   when it has more, the request sets ``max_tokens`` and ``cut_to_max_tokens`` is on (the default;
   finish_reason "length", else "stop"), and
   ``usage`` counting whitespace-separated words: those of every message's content as prompt tokens,
   those of the reply as completion tokens.

A batch stays ``in_progress`` while ``hold_batches`` (a ``threading.Event``) is not set; then each of its
lines is answered by rules 2, 3 and 6 (``fail_batch_line(body)`` true: a line that failed with 500), the
answered lines in the output file and the failed ones in the error file, both in reverse order (a batch's
results come in any order). ``run_batch_file(text)`` answers a batch input file the same way, as
``vllm run-batch`` does offline.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from email import message_from_bytes
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def echo(body: dict[str, Any]) -> str:
    """The default reply: ``"echo: "`` and the last user message's text (a raw completion request: its prompt)."""
    if "prompt" in body:
        return f"echo: {body['prompt']}"
    last_user = [m for m in body["messages"] if m.get("role") == "user"][-1]
    return f"echo: {last_user['content']}"


class OpenAIStub:
    """The server; a context manager that starts it on entry and stops it (and its thread) on exit."""

    def __init__(
        self,
        reply: Callable[[dict[str, Any]], str] = echo,
        *,
        key: str | None = "sk-test",  # None: no key checked
        model: str = "stub-model",
        fail_every: int | None = None,
        fail_first_with_429: int = 0,
        rate_limit_every: int | None = None,
        retry_after: int = 0,  # the Retry-After seconds of those 429 answers
        reject: Callable[[dict[str, Any]], str | None] | None = None,  # a message: answer 400 with it
        hold_batches: threading.Event | None = None,
        fail_batch_line: Callable[[dict[str, Any]], bool] | None = None,
        cut_to_max_tokens: bool = True,  # False: the whole reply whatever max_tokens says (an echo of a long prompt)
    ) -> None:
        self.reply = reply
        self.cut_to_max_tokens = cut_to_max_tokens
        self.key = key
        self.model = model
        self.fail_every = fail_every
        self.fail_first_with_429 = fail_first_with_429
        self.rate_limit_every = rate_limit_every
        self.retry_after = retry_after
        self.reject = reject
        self.hold_batches = hold_batches
        self.fail_batch_line = fail_batch_line
        self._lock = threading.Lock()
        self._requests: list[dict[str, Any]] = []
        self._files: dict[str, bytes] = {}
        self._batches: dict[str, dict[str, Any]] = {}
        self._batch_requests: list[dict[str, Any]] = []
        self._http: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> OpenAIStub:
        self._http = _Server(self)
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """A copy of the chat-completion bodies received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def calls(self) -> int:
        """How many chat-completion requests have arrived."""
        with self._lock:
            return len(self._requests)

    @property
    def batches(self) -> list[str]:
        """The ids of the batches submitted so far, in order."""
        with self._lock:
            return list(self._batches)

    @property
    def batch_requests(self) -> list[dict[str, Any]]:
        """The request bodies of the lines of every batch run so far."""
        with self._lock:
            return list(self._batch_requests)

    def refusal(self, authorization: str | None) -> tuple[int, dict[str, str], dict] | None:
        """The 401 answer when ``authorization`` is not ``Bearer <key>``; None when it is (or no key is set)."""
        if self.key is None or authorization == f"Bearer {self.key}":
            return None
        return 401, {}, _error(f"Incorrect API key provided: {authorization}", "invalid_api_key")

    def answer(self, body: dict[str, Any], authorization: str | None) -> tuple[int, dict[str, str], dict]:
        """``(status, extra headers, JSON body)`` for one chat-completion request, by the rules above."""
        with self._lock:
            self._requests.append(body)
            n = len(self._requests)
        if refused := self.refusal(authorization):
            return refused
        if body.get("model") != self.model:
            return 404, {}, _error(f"The model `{body.get('model')}` does not exist.", "model_not_found")
        if self.reject is not None and (message := self.reject(body)):
            return 400, {}, _error(message, "invalid_request")
        if n <= self.fail_first_with_429 or (self.rate_limit_every and n % self.rate_limit_every == 0):
            return 429, {"Retry-After": str(self.retry_after)}, _error("Rate limit reached", "rate_limit")
        if self.fail_every and n % self.fail_every == 0:
            return 500, {}, _error("The server had an error", "server_error")
        return 200, {}, self.completion(body, f"chatcmpl-stub-{n}")

    def completion(self, body: dict[str, Any], id_: str) -> dict[str, Any]:
        """The chat-completion body of rule 6 for ``body``."""
        reply = self.reply(body)
        words = reply.split()
        limit = body.get("max_tokens")
        cut = self.cut_to_max_tokens and limit is not None and len(words) > limit
        text = " ".join(words[:limit]) if cut else reply
        if "prompt" in body:
            prompt_words = len(body["prompt"].split())
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length" if cut else "stop",
            }
        else:
            prompt_words = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length" if cut else "stop",
            }
        return {
            "id": id_,
            "object": "text_completion" if "prompt" in body else "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_words,
                "completion_tokens": len(text.split()),
                "total_tokens": prompt_words + len(text.split()),
            },
        }

    def upload(self, content: bytes, filename: str) -> dict[str, Any]:
        """``POST /v1/files``: keep the file, answer its file object."""
        with self._lock:
            file_id = f"file-stub-{len(self._files) + 1}"
            self._files[file_id] = content
        return {"id": file_id, "object": "file", "bytes": len(content), "created_at": 0, "filename": filename,
                "purpose": "batch", "status": "processed"}  # fmt: skip

    def file_content(self, file_id: str) -> bytes | None:
        with self._lock:
            return self._files.get(file_id)

    def submit(self, request: dict[str, Any]) -> tuple[int, dict]:
        """``POST /v1/batches``: a batch over an uploaded file, ``in_progress``."""
        with self._lock:
            if request.get("input_file_id") not in self._files:
                return 404, _error(f"No such file: {request.get('input_file_id')}", "not_found")
            batch_id = f"batch_stub_{len(self._batches) + 1}"
            self._batches[batch_id] = {"input_file_id": request["input_file_id"], "done": None}
        return 200, self.batch_object(batch_id)

    def batch_object(self, batch_id: str) -> dict[str, Any]:
        """``GET /v1/batches/{id}``: the batch, run once ``hold_batches`` allows."""
        held = self.hold_batches is not None and not self.hold_batches.is_set()
        with self._lock:
            batch = self._batches[batch_id]
            lines = self._files[batch["input_file_id"]].decode().splitlines()
            if not held and batch["done"] is None:
                answered, failed = [], []
                for result in self._run_lines(lines):
                    (answered if result["response"]["status_code"] == 200 else failed).append(result)
                for name, rows in (("output", answered), ("error", failed)):
                    if rows:
                        file_id = f"file-stub-{batch_id}-{name}"
                        self._files[file_id] = "".join(json.dumps(r) + "\n" for r in reversed(rows)).encode()
                        batch[f"{name}_file_id"] = file_id
                batch["done"] = (len(answered), len(failed))
            done = batch["done"]
        return {
            "id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions", "input_file_id": batch["input_file_id"],
            "completion_window": "24h", "created_at": 0, "status": "in_progress" if done is None else "completed",
            "output_file_id": batch.get("output_file_id"), "error_file_id": batch.get("error_file_id"),
            "request_counts": {"total": len(lines), "completed": done[0] if done else 0, "failed": done[1] if done else 0},
        }  # fmt: skip

    def run_batch_file(self, text: str) -> str:
        """What ``vllm run-batch`` writes for a batch input file: one results line per request, in reverse order."""
        with self._lock:
            return "".join(json.dumps(r) + "\n" for r in reversed(self._run_lines(text.splitlines())))

    def _run_lines(self, lines: list[str]) -> list[dict[str, Any]]:
        """The results lines of a batch's input lines, each body counted in ``batch_requests`` (the lock is held)."""
        results = []
        for line in map(json.loads, lines):
            self._batch_requests.append(line["body"])
            results.append(self._batch_line(line))
        return results

    def _batch_line(self, line: dict[str, Any]) -> dict[str, Any]:
        """One results line for one input line (the lock is held)."""
        body, custom_id = line["body"], line["custom_id"]
        if body.get("model") != self.model:
            status, payload = (
                404,
                _error(f"The model `{body.get('model')}` does not exist.", "model_not_found"),
            )
        elif self.reject is not None and (message := self.reject(body)):
            status, payload = 400, _error(message, "invalid_request")
        elif self.fail_batch_line is not None and self.fail_batch_line(body):
            status, payload = 500, _error("The server had an error", "server_error")
        else:
            status, payload = 200, self.completion(body, f"chatcmpl-stub-batch-{custom_id[:8]}")
        return {"id": f"line-{custom_id[:8]}", "custom_id": custom_id,
                "response": {"status_code": status, "request_id": custom_id[:8], "body": payload}, "error": None}  # fmt: skip


class Gate:
    """A reply function: ``reply(body)`` for the first ``open_for`` requests, then every later one held until ``release``.

    A test holds a client mid-work with it (the held requests are in flight), and kills the client there.
    """

    def __init__(self, reply: Callable[[dict[str, Any]], str], open_for: int) -> None:
        self.reply = reply
        self.open_for = open_for
        self.answered: list[dict[str, Any]] = []  # the bodies answered, in order
        self.held: list[dict[str, Any]] = []  # the bodies held
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> str:
        with self._lock:
            hold = len(self.answered) >= self.open_for
            (self.held if hold else self.answered).append(body)
        if hold:
            self.release.wait(timeout=600)
        return self.reply(body)


def finished_lines(path: Path) -> int:
    """How many whole lines a file has (0 when it does not exist): a sign that a client got so far."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, stub: OpenAIStub) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.stub = stub

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet about a client that hung up before its answer (a client timeout); loud about the rest."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        stub = self.server.stub
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path in ("/v1/chat/completions", "/v1/completions"):
            self._send(*stub.answer(json.loads(raw), self.headers.get("Authorization")))
        elif refused := stub.refusal(self.headers.get("Authorization")):
            self._send(*refused)
        elif self.path == "/v1/files":
            form = message_from_bytes(
                f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + raw, policy=HTTP
            )
            part = next(
                p for p in form.iter_parts() if p.get_param("name", header="content-disposition") == "file"
            )
            self._send(
                200, {}, stub.upload(part.get_payload(decode=True), part.get_filename() or "input.jsonl")
            )
        elif self.path == "/v1/batches":
            status, payload = stub.submit(json.loads(raw))
            self._send(status, {}, payload)
        else:
            self._send(404, {}, _error(f"no route {self.path}", "not_found"))

    def do_GET(self) -> None:
        stub = self.server.stub
        if refused := stub.refusal(self.headers.get("Authorization")):
            self._send(*refused)
        elif self.path == "/v1/models":
            model = {"id": stub.model, "object": "model", "created": 0, "owned_by": "stub"}
            self._send(200, {}, {"object": "list", "data": [model]})
        elif self.path.startswith("/v1/batches/") and self.path.removeprefix("/v1/batches/") in stub.batches:
            self._send(200, {}, stub.batch_object(self.path.removeprefix("/v1/batches/")))
        elif (
            self.path.startswith("/v1/files/")
            and self.path.endswith("/content")
            and (content := stub.file_content(self.path.split("/")[3])) is not None
        ):
            self._send(200, {}, content, content_type="application/octet-stream")
        else:
            self._send(404, {}, _error(f"no route {self.path}", "not_found"))

    def _send(
        self,
        status: int,
        headers: dict[str, str],
        payload: dict | bytes,
        content_type: str = "application/json",
    ) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a test's output shows only what the test prints."""
