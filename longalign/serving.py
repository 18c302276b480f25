"""Chat completions from an OpenAI-compatible server (``vllm serve``, SGLang, a hosted API), for eval and data.

    settings = ServerSettings(base_url="http://127.0.0.1:8000/v1", model="Qwen2.5-7B-Instruct")
    client = ChatClient(settings)                        # the key comes from $OPENAI_API_KEY, if set
    client.complete([{"role": "user", "content": "2+2?"}], max_tokens=8)
        -> Completion(text='4', finish_reason='stop', prompt_tokens=14, completion_tokens=1)
    client.complete_many([{"messages": [...]}, {"messages": [...]}], progress="judging")
        -> [Completion(...), CallFailure(error='500 from the server: ...', status=500)]   # in input order
    client.stats
        -> CallStats(calls=3, succeeded=2, failed=1, retried=5, rate_limited=4, ..., lowest_concurrency=2)

What can go wrong, and where it shows:

- a 429 (rate limit): the request waits the seconds the server's ``Retry-After`` asks for, else 1, 2, 4, ...
  seconds (at most ``BACKOFF_CAP``), and is sent again; this is not one of its ``max_retries``. While the
  server rate-limits, fewer requests are in flight: the window halves on each 429 (not below 1) and grows by
  one after as many successes in a row as it holds, never above ``concurrency``. A request still refused
  ``max_wait`` seconds after its first 429 is a ``CallFailure``;
- a 5xx answer, a refused connection or a timeout: the request is tried again, up to ``max_retries`` times,
  after 1, 2, 4, ... seconds (or the server's ``Retry-After``);
- a 5xx or timeout that lasts past the retries: that request's result is a ``CallFailure``, counted in
  ``stats.failed``; the other requests go on;
- a 400 answer (one request the server rejects, e.g. a prompt longer than the served model's context):
  that request's result is a ``CallFailure`` at once, without retries; the other requests go on;
- no connection after the retries, or any other 4xx answer (a refused key, no such model or URL):
  ``ServerError``, one line naming the URL. Those are the settings' fault, not one request's, so the run
  stops there.

The batch endpoints (``/v1/files``, ``/v1/batches``) go through the same key, retries and errors:
``upload_batch``, ``submit_batch``, ``batch_status``, ``file_text``.

The API key is read from the environment variable the settings name. It is never kept in the settings, and
never put in an error message, a ``repr`` or a record.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from longalign.arguments import at_least, seconds
from longalign.errors import ConfigError, LongAlignError
from longalign.redact import redact_text

BACKOFF_BASE = 1.0  # seconds before the first retry; each next retry waits twice as long
BACKOFF_CAP = 30.0  # the longest wait of our own; a server's Retry-After is honoured as it is
NO_KEY = "EMPTY"  # sent when the key's variable is unset: a local server without a key accepts any
DETAIL_CHARS = 300  # how much of a server's error message goes into ours
CHAT_ENDPOINT = "/v1/chat/completions"  # what a batch's lines ask for
# A raw prompt, the chat template applied by the client (a body with "prompt")
COMPLETIONS_ENDPOINT = "/v1/completions"
Item = TypeVar("Item")


class ServerError(LongAlignError):
    """The server cannot be used with these settings: unreachable, key refused, no such model or URL."""


@dataclass(frozen=True)
class ServerSettings:
    """Where a served model is and how to call it: the name of the key's environment variable, never the key.

    ServerSettings(base_url="http://127.0.0.1:8000/v1", model="Qwen2.5-7B-Instruct").record()
    -> {'base_url': 'http://127.0.0.1:8000/v1', 'model': 'Qwen2.5-7B-Instruct', 'api_key_env': 'OPENAI_API_KEY',
        'concurrency': 4, 'max_retries': 5, 'max_wait': 3600.0, 'timeout': 600.0}

    ``base_url`` None names a model and no server: batch input files can be written for it (``vllm
    run-batch``), nothing can be asked.
    """

    base_url: str | None  # the API root, e.g. http://127.0.0.1:8000/v1
    model: str  # the served model's name, as GET /v1/models lists it
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this environment variable, never stored
    concurrency: int = 4  # requests in flight at once, at most (fewer while the server rate-limits)
    max_retries: int = 5  # tries again after a 5xx, a refused connection or a timeout (429s wait instead)
    max_wait: float = 3600.0  # seconds a request may stay rate-limited (429) before it fails
    timeout: float = 600.0  # seconds one try may take

    def __post_init__(self) -> None:
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"base URL {redact_text(self.base_url)!r}: expected http:// or https://, "
                "e.g. http://127.0.0.1:8000/v1"
            )
        if not self.model:
            raise ConfigError(f"{self._where}: no model named; give the served model's name")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency: expected an integer >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries: expected an integer >= 0, got {self.max_retries}")
        if self.max_wait <= 0:
            raise ConfigError(f"max_wait: expected seconds > 0, got {self.max_wait}")
        if self.timeout <= 0:
            raise ConfigError(f"timeout: expected seconds > 0, got {self.timeout}")

    @property
    def _where(self) -> str:
        return redact_text(self.base_url) if self.base_url else "no server"

    def record(self) -> dict[str, Any]:
        """The settings for ``run_config.json`` / ``report.json``: the key's variable named, no key, no URL password."""
        return {
            "base_url": redact_text(self.base_url) if self.base_url else None,
            "model": self.model,
            "api_key_env": self.api_key_env,
            "concurrency": self.concurrency,
            "max_retries": self.max_retries,
            "max_wait": self.max_wait,
            "timeout": self.timeout,
        }


@dataclass(frozen=True)
class Completion:
    """The server's answer to one request; token counts as the server reported them (None if it did not)."""

    text: str  # the assistant message's content ("" when the server sent none)
    finish_reason: str | None  # "stop", "length", ...
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass(frozen=True)
class CallFailure:
    """A request that got no answer: a 400, a 5xx or timeout past the retries, a 429 past ``max_wait``."""

    error: str  # one line, e.g. "500 from the server: Internal Server Error (tried 6 times)"
    status: int | None  # the last HTTP status; None for a timeout


@dataclass(frozen=True)
class CallStats:
    """What a ``ChatClient`` has done so far; ``dataclasses.asdict(client.stats)`` is the report's part."""

    calls: int = 0  # requests asked for: each complete(), each item of complete_many
    succeeded: int = 0  # answered with a Completion
    failed: int = 0  # answered with a CallFailure
    retried: int = 0  # tries repeated after a 5xx, a lost connection or a timeout, over all requests
    rate_limited: int = 0  # 429 answers, each waited out and sent again
    rate_limit_wait_seconds: float = 0.0  # the waits after those 429s, summed over all requests
    prompt_tokens: int = 0  # summed over the succeeded requests, as the server reported them
    completion_tokens: int = 0
    lowest_concurrency: int | None = None  # the smallest window of requests in flight (None: nothing asked)


@dataclass(frozen=True)
class BatchStatus:
    """Where a submitted batch stands (``GET /v1/batches/{id}``)."""

    status: str  # validating, in_progress, finalizing, completed, failed, expired, cancelling, cancelled
    total: int  # requests in the batch, as the server counts them (0 until it has read the file)
    completed: int
    failed: int
    output_file_id: str | None  # the answered lines, once there are any
    error_file_id: str | None  # the failed lines
    errors: str  # why a batch failed as a whole (its input file refused), on one line; "" otherwise

    @property
    def done(self) -> bool:
        """No more lines will be answered: ``completed``, ``failed``, ``expired`` or ``cancelled``."""
        return self.status in ("completed", "failed", "expired", "cancelled")


def chat_request(
    model: str,
    messages: Sequence[dict[str, Any]],
    *,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """The body of one chat-completion request, as it is sent and as its answer is kept.

    chat_request("m", [{"role": "user", "content": "Hi"}], max_tokens=8, seed=3)
    -> {'model': 'm', 'messages': [{'role': 'user', 'content': 'Hi'}], 'temperature': 0.0, 'seed': 3, 'max_tokens': 8}
    """
    body = {"model": model, "messages": list(messages), "temperature": temperature, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def endpoint(body: dict[str, Any]) -> str:
    """Where a request body goes: ``/v1/completions`` for a raw ``prompt``, else ``/v1/chat/completions``."""
    return COMPLETIONS_ENDPOINT if "prompt" in body else CHAT_ENDPOINT


def completion_from_json(payload: dict[str, Any]) -> Completion:
    """The ``Completion`` in a chat-completion (or completion: its ``text``) response body, online or one line
    of a batch's results.

    completion_from_json({"choices": [{"message": {"content": "4"}, "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 14, "completion_tokens": 1}})
    -> Completion(text='4', finish_reason='stop', prompt_tokens=14, completion_tokens=1)
    """
    choice = payload["choices"][0]
    usage = payload.get("usage") or {}
    return Completion(
        text=choice["text"] if "text" in choice else (choice.get("message") or {}).get("content") or "",
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )


class _Window:
    """How many requests may be in flight: additive increase, multiplicative decrease.

    Starts at ``ceiling``; a 429 halves it (not below 1); as many successes in a row as the window holds
    raise it by one, never above ``ceiling``. ``slot()`` waits until fewer than the window are in flight.
    """

    def __init__(self, ceiling: int) -> None:
        self.ceiling = self.size = self.lowest = ceiling
        self._in_flight = 0
        self._successes = 0
        self._changed = threading.Condition()

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._in_flight < self.size)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def rate_limited(self) -> None:
        with self._changed:
            self.size = max(1, self.size // 2)
            self.lowest = min(self.lowest, self.size)
            self._successes = 0

    def succeeded(self) -> None:
        with self._changed:
            self._successes += 1
            if self._successes >= self.size and self.size < self.ceiling:
                self.size += 1
                self._successes = 0
                self._changed.notify_all()


def in_parallel(
    work: Callable[[Item], Any],
    items: Sequence[Item],
    *,
    workers: int,
    progress: str | None = None,
    unit: str = "it",
    on_error: Callable[[], None] | None = None,
) -> list[Any]:
    """``work(item)`` for each item, ``workers`` at a time; the results in the items' order.

    An exception in one item stops the rest (items not yet started are dropped, ``on_error`` is called so
    that running ones can stop early) and is raised. ``progress`` titles a progress bar on stderr.
    """
    results: list[Any] = [None] * len(items)
    with (
        ThreadPoolExecutor(max_workers=workers) as pool,
        tqdm(total=len(items), desc=progress, unit=unit, disable=progress is None) as bar,
    ):
        futures = {pool.submit(work, item): i for i, item in enumerate(items)}
        try:
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update()
        except BaseException:
            if on_error is not None:
                on_error()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return results


class ChatClient:
    """Chat completions from one served model, retried and counted; one client serves many threads.

        client = ChatClient(ServerSettings(base_url="http://127.0.0.1:8000/v1", model="m"))
        client.complete([{"role": "user", "content": "Say hi"}], max_tokens=4, seed=0)
        -> Completion(text='Hi!', finish_reason='stop', prompt_tokens=11, completion_tokens=2)

    ``sleep`` waits between tries and ``clock`` tells the time (for ``max_wait``); tests pass a fake clock
    whose ``sleep`` moves it on instead of waiting.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        try:
            import openai
        except ImportError:
            raise ConfigError(
                "the serving client needs the openai package: pip install -e '.[eval]'"
            ) from None
        self.settings = settings
        self._openai = openai
        self._key = os.environ.get(settings.api_key_env) or None
        self._client = None
        if settings.base_url is not None:
            self._client = openai.OpenAI(
                base_url=settings.base_url,
                api_key=self._key or NO_KEY,
                max_retries=0,  # retried here, so that retries are counted and waits can be observed
                timeout=settings.timeout,
            )
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._window = _Window(settings.concurrency)
        self._stats = CallStats()

    def __repr__(self) -> str:
        return f"ChatClient({self.settings!r})"

    @property
    def stats(self) -> CallStats:
        """The counts so far, read at one instant."""
        with self._lock:
            return self._stats

    def request(
        self, messages: Sequence[dict[str, Any]] | None = None, *, prompt: str | None = None, **sampling: Any
    ) -> dict[str, Any]:
        """The body ``complete(messages, **sampling)`` sends: ``chat_request`` with this client's model; with
        ``prompt`` instead of ``messages``, a raw completion request (``/v1/completions``) of that text."""
        if prompt is None:
            return chat_request(self.settings.model, messages, **sampling)
        body = chat_request(self.settings.model, [], **sampling)
        del body["messages"]
        return {"model": body.pop("model"), "prompt": prompt, **body}

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        **extra: Any,
    ) -> Completion | CallFailure:
        """One chat completion: a ``Completion``, or a ``CallFailure`` (a 400, lasting 5xx/timeouts, a 429 past ``max_wait``).

        ``extra`` goes to ``openai``'s ``chat.completions.create`` as it is: ``stop=["\\n"]``, ``seed=0``,
        ``extra_body={"top_k": 20}`` for a server's own parameters. Raises ``ServerError`` when the
        server cannot be reached or answers another 4xx (not 400, not 429).
        """
        return self.send(self.request(messages, max_tokens=max_tokens, temperature=temperature, **extra))

    def send(self, body: dict[str, Any]) -> Completion | CallFailure:
        """``complete`` for a body made by ``request``: tried, waited out and counted as the module says."""
        client = self._connected()
        self._count(calls=1)
        attempt = 0  # failed tries that count toward max_retries
        refused_since = None  # when the first 429 came
        refusals = 0
        while True:
            try:
                with self._window.slot():
                    create = client.completions.create if "prompt" in body else client.chat.completions.create
                    response = create(**body)
            except self._openai.APIStatusError as err:
                if err.status_code == 400:  # this request's fault: asking again gets the same answer
                    self._count(failed=1)
                    return CallFailure(f"400 from the server: {self._detail(err)}", 400)
                if err.status_code != 429 and err.status_code < 500:
                    raise self._refused(err) from None
                failure = CallFailure(
                    f"{err.status_code} from the server: {self._detail(err)}", err.status_code
                )
                wait = _retry_after(err.response.headers.get("retry-after"))
                if err.status_code == 429:
                    self._window.rate_limited()
                    self._count(rate_limited=1)
                    refused_since = self._clock() if refused_since is None else refused_since
                    wait = _backoff(refusals) if wait is None else wait
                    refusals += 1
                    held = self._clock() - refused_since + wait
                    if held > self.settings.max_wait:
                        self._count(failed=1)
                        return replace(
                            failure,
                            error=f"{failure.error} (rate-limited for {held:.0f} s, longer than the "
                            f"{self.settings.max_wait:g} s max wait)",
                        )
                    self._count(rate_limit_wait_seconds=wait)
                    self._sleep(wait)
                    continue
                if wait is None:
                    wait = _backoff(attempt)
            except self._openai.APITimeoutError:
                failure = CallFailure(f"no answer within {self.settings.timeout:g} s", None)
                wait = _backoff(attempt)
            except self._openai.APIConnectionError as err:
                failure = None  # unreachable: a ServerError once the retries are spent
                unreachable = self._one_line(str(err.__cause__ or err))
                wait = _backoff(attempt)
            else:
                self._window.succeeded()
                return self._completion(response)
            if attempt == self.settings.max_retries:
                break
            attempt += 1
            self._count(retried=1)
            self._sleep(wait)
        tries = self.settings.max_retries + 1
        if failure is None:
            raise ServerError(f"{self._url}: cannot reach the server ({unreachable}; tried {tries} times)")
        self._count(failed=1)
        return replace(failure, error=f"{failure.error} (tried {tries} times)")

    def complete_many(
        self, requests: Sequence[dict[str, Any]], *, progress: str | None = None
    ) -> list[Completion | CallFailure]:
        """``complete(**request)`` for each request, ``settings.concurrency`` at a time; results in input order.

            client.complete_many([{"messages": chat, "max_tokens": 512} for chat in chats], progress="judging")
            -> [Completion(...), CallFailure(...), Completion(...)]     # len(chats) results, one per request

        A ``ServerError`` from any request stops the rest (requests not yet sent are dropped) and is raised.
        ``progress`` titles a progress bar on stderr; without it nothing is shown. A request with ``prompt``
        in place of ``messages`` is a raw completion (``request``).
        """
        return in_parallel(
            lambda request: self.send(self.request(**request)),
            requests,
            workers=self.settings.concurrency,
            progress=progress,
        )

    def upload_batch(self, path: Path) -> str:
        """Upload a batch input file (``POST /v1/files``, purpose ``batch``); its file id."""
        client = self._connected()
        with open(path, "rb") as f:
            return self._api(
                "POST /v1/files", lambda: client.files.create(file=(path.name, f), purpose="batch")
            ).id

    def submit_batch(self, file_id: str, *, endpoint: str = CHAT_ENDPOINT) -> str:
        """Start a batch of chat completions (or of ``endpoint``'s requests) over an uploaded input file
        (``POST /v1/batches``); its id."""
        client = self._connected()
        batch = self._api(
            "POST /v1/batches",
            lambda: client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h"),
        )
        return batch.id

    def batch_status(self, batch_id: str) -> BatchStatus:
        """``GET /v1/batches/{id}``: its status and counts."""
        client = self._connected()
        batch = self._api(f"GET /v1/batches/{batch_id}", lambda: client.batches.retrieve(batch_id))
        counts = batch.request_counts
        errors = batch.errors.data if batch.errors and batch.errors.data else []
        return BatchStatus(
            status=batch.status,
            total=counts.total if counts else 0,
            completed=counts.completed if counts else 0,
            failed=counts.failed if counts else 0,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            errors=self._one_line("; ".join(f"{e.code}: {e.message}" for e in errors))[:DETAIL_CHARS],
        )

    def file_text(self, file_id: str) -> str:
        """The content of a file on the server (``GET /v1/files/{id}/content``), e.g. a batch's results."""
        client = self._connected()
        return self._api(f"GET /v1/files/{file_id}/content", lambda: client.files.content(file_id)).text

    @property
    def _url(self) -> str:
        return redact_text(self.settings.base_url or "")

    def _connected(self):
        if self._client is None:
            raise ConfigError(
                f"no server for model {self.settings.model!r}: give --base-url (only batch input files "
                "can be written without one)"
            )
        return self._client

    def _api(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` for one of the batch endpoints, with the chat requests' retries and errors."""
        for attempt in range(self.settings.max_retries + 1):
            try:
                return call()
            except self._openai.APIStatusError as err:
                if err.status_code < 500 and err.status_code != 429:
                    if err.status_code == 404:
                        raise ServerError(
                            f"{self._url}: {what}: 404 from the server: no batch API there? ({self._detail(err)})"
                        ) from None
                    raise self._refused(err) from None
                problem = f"{err.status_code} from the server: {self._detail(err)}"
                wait = _retry_after(err.response.headers.get("retry-after"))
            except (self._openai.APITimeoutError, self._openai.APIConnectionError) as err:
                problem, wait = self._one_line(str(err.__cause__ or err)), None
            if attempt < self.settings.max_retries:
                self._count(retried=1)
                self._sleep(_backoff(attempt) if wait is None else wait)
        raise ServerError(f"{self._url}: {what}: {problem} (tried {self.settings.max_retries + 1} times)")

    def _count(self, **increments: float) -> None:
        with self._lock:
            self._stats = replace(
                self._stats,
                **{name: getattr(self._stats, name) + n for name, n in increments.items()},
                lowest_concurrency=self._window.lowest,
            )

    def _completion(self, response: Any) -> Completion:
        completion = completion_from_json(response.model_dump())
        self._count(
            succeeded=1,
            prompt_tokens=completion.prompt_tokens or 0,
            completion_tokens=completion.completion_tokens or 0,
        )
        return completion

    def _refused(self, err: Any) -> ServerError:
        """The ``ServerError`` for a 4xx other than 429: what the settings got wrong, as far as we can tell."""
        status, detail = err.status_code, self._detail(err)
        env = self.settings.api_key_env
        if status in (401, 403) and self._key is None:
            reason = f"no API key was sent: set {env} ({detail})"
        elif status in (401, 403):
            reason = f"the API key in {env} was refused ({detail})"
        elif status == 404:
            reason = (
                f"no model {self.settings.model!r} there, or not the API root (which usually ends in /v1) "
                f"({detail})"
            )
        else:
            reason = f"request rejected: {detail}"
        return ServerError(f"{self._url}: {status} from the server: {reason}")

    def _detail(self, err: Any) -> str:
        """The server's own message from an error answer, in one short line."""
        body = err.body
        if isinstance(body, dict):
            body = body.get("message") or body.get("detail") or body
        return self._one_line(str(body if body is not None else err.message))[:DETAIL_CHARS]

    def _one_line(self, text: str) -> str:
        """``text`` on one line, with the key masked (servers may repeat the key they refused)."""
        if self._key:
            text = text.replace(self._key, "***")
        return " ".join(text.split())


def _backoff(attempt: int) -> float:
    """Seconds to wait after failed try number ``attempt`` (0, 1, 2, ...): 1, 2, 4, ... up to the cap."""
    return min(BACKOFF_BASE * 2**attempt, BACKOFF_CAP)


def _retry_after(value: str | None) -> float | None:
    """The seconds a ``Retry-After: 7`` header asks for; None when absent or not a number of seconds."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    prefix: str = "",
    default_key_env: str = "OPENAI_API_KEY",
    required: bool = True,
) -> None:
    """The flags that name one served model, for ``server_settings(args, prefix=prefix)`` to read.

        add_server_arguments(parser)                   # --base-url --served-model --api-key-env ...
        add_server_arguments(parser, prefix="judge-")  # --judge-base-url --judge-model --judge-api-key-env ...

    The model flag is ``--served-model`` without a prefix (``--model`` is left to the model a command
    trains or evaluates) and ``--{prefix}model`` with one. Also ``--{prefix}concurrency``,
    ``--{prefix}max-retries`` and ``--{prefix}max-wait``.
    """
    who = f"the {prefix.rstrip('-')} server" if prefix else "the server"
    group = parser.add_argument_group(f"{who} (OpenAI-compatible)")
    group.add_argument(
        f"--{prefix}base-url",
        required=required,
        help=f"the API root of {who}, e.g. http://127.0.0.1:8000/v1",
    )
    group.add_argument(
        _model_flag(prefix), required=required, help=f"the model's name on {who}, as GET /v1/models lists it"
    )
    group.add_argument(
        f"--{prefix}api-key-env",
        default=default_key_env,
        help=f"the environment variable that holds the API key of {who} (default: {default_key_env}); "
        "unset is fine for a local server without a key",
    )
    group.add_argument(
        f"--{prefix}concurrency",
        type=at_least(1),
        default=ServerSettings.concurrency,
        help=f"requests in flight at once, at most: halved on a 429, grown back by one after a run of "
        f"successes (default: {ServerSettings.concurrency})",
    )
    group.add_argument(
        f"--{prefix}max-retries",
        type=at_least(0),
        default=ServerSettings.max_retries,
        help="tries again after a 5xx, a lost connection or a timeout, waiting 1, 2, 4, ... s or what the "
        f"server's Retry-After asks (default: {ServerSettings.max_retries}); a 429 is waited out, not retried",
    )
    group.add_argument(
        f"--{prefix}max-wait",
        type=seconds,
        default=ServerSettings.max_wait,
        help="seconds a request may stay rate-limited (429, waiting what Retry-After asks) before it fails "
        f"(default: {ServerSettings.max_wait:g})",
    )


def server_settings(args: argparse.Namespace, *, prefix: str = "", url_needed: bool = True) -> ServerSettings:
    """The ``ServerSettings`` from flags added by ``add_server_arguments(parser, prefix=prefix)``.

        server_settings(parser.parse_args(["--judge-base-url", URL, "--judge-model", "m"]), prefix="judge-")
        -> ServerSettings(base_url=URL, model='m', api_key_env='OPENAI_API_KEY', concurrency=4, ...)

    Raises ``ConfigError`` naming the flags when the model is missing, or the URL is and ``url_needed``
    (flags added with ``required=False``); without a URL the settings name a model and no server.
    """
    dest = prefix.replace("-", "_")
    base_url = getattr(args, f"{dest}base_url")
    model = getattr(args, _model_flag(prefix).lstrip("-").replace("-", "_"))
    missing = [
        flag
        for flag, value, needed in (
            (f"--{prefix}base-url", base_url, url_needed),
            (_model_flag(prefix), model, True),
        )
        if needed and not value
    ]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)}: missing; a server is named by --{prefix}base-url and {_model_flag(prefix)}"
        )
    return ServerSettings(
        base_url=base_url,
        model=model,
        api_key_env=getattr(args, f"{dest}api_key_env"),
        concurrency=getattr(args, f"{dest}concurrency"),
        max_retries=getattr(args, f"{dest}max_retries"),
        max_wait=getattr(args, f"{dest}max_wait"),
    )


def _model_flag(prefix: str) -> str:
    return f"--{prefix}model" if prefix else "--served-model"
