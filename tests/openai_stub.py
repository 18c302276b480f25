"""An OpenAI-compatible chat server on 127.0.0.1 for tests: deterministic replies, a bearer key, failure modes.

    from openai_stub import OpenAIStub

    with OpenAIStub(reply=lambda body: "4", fail_every=3) as server:
        settings = ServerSettings(base_url=server.base_url, model=server.model, api_key_env="TEST_KEY")
        ...                      # with TEST_KEY=sk-test in the environment
        server.requests          # the JSON bodies received, in arrival order
        server.calls             # chat-completion requests received, the failed ones included

It serves ``POST /v1/chat/completions`` and ``GET /v1/models`` (same key) on a free port from a background thread, and
stops when the ``with`` block ends. Each chat request is answered by the first rule that applies:

1. ``Authorization`` is not ``Bearer <key>``: 401, whose message repeats the key it was sent (as careless
   servers do, so tests can check that clients keep it out of their own errors);
2. ``model`` is not the stub's ``model``: 404;
3. ``reject(body)`` returns a message: 400 with that message (a request the server refuses, e.g. too long);
4. call number n (1, 2, ...) with n <= ``fail_first_with_429``: 429 with ``Retry-After: <retry_after>``;
5. n a multiple of ``fail_every``: 500;
6. otherwise 200 with ``reply(body)`` as it is (line breaks kept), or its first ``max_tokens`` words
   when it has more and the request sets ``max_tokens`` (finish_reason "length", else "stop"), and ``usage`` counting whitespace-separated words: those of every message's
   content as prompt tokens, those of the reply as completion tokens.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def echo(body: dict[str, Any]) -> str:
    """The default reply: ``"echo: "`` and the last user message's text."""
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
        retry_after: int = 0,  # the Retry-After seconds of those 429 answers
        reject: Callable[[dict[str, Any]], str | None] | None = None,  # a message: answer 400 with it
    ) -> None:
        self.reply = reply
        self.key = key
        self.model = model
        self.fail_every = fail_every
        self.fail_first_with_429 = fail_first_with_429
        self.retry_after = retry_after
        self.reject = reject
        self._lock = threading.Lock()
        self._requests: list[dict[str, Any]] = []
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
        if n <= self.fail_first_with_429:
            return 429, {"Retry-After": str(self.retry_after)}, _error("Rate limit reached", "rate_limit")
        if self.fail_every and n % self.fail_every == 0:
            return 500, {}, _error("The server had an error", "server_error")
        reply = self.reply(body)
        words = reply.split()
        limit = body.get("max_tokens")
        cut = limit is not None and len(words) > limit
        text = " ".join(words[:limit]) if cut else reply
        prompt_words = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        return (
            200,
            {},
            {
                "id": f"chatcmpl-stub-{n}",
                "object": "chat.completion",
                "created": 0,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length" if cut else "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_words,
                    "completion_tokens": len(text.split()),
                    "total_tokens": prompt_words + len(text.split()),
                },
            },
        )


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
        if self.path != "/v1/chat/completions":
            self._send(404, {}, _error(f"no route {self.path}", "not_found"))
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self._send(*self.server.stub.answer(body, self.headers.get("Authorization")))

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._send(404, {}, _error(f"no route {self.path}", "not_found"))
            return
        if refused := self.server.stub.refusal(self.headers.get("Authorization")):
            self._send(*refused)
            return
        model = {"id": self.server.stub.model, "object": "model", "created": 0, "owned_by": "stub"}
        self._send(200, {}, {"object": "list", "data": [model]})

    def _send(self, status: int, headers: dict[str, str], payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a test's output shows only what the test prints."""
