"""Chat completions from an OpenAI-compatible server (``vllm serve``, SGLang, a hosted API), for eval and data.

    settings = ServerSettings(base_url="http://127.0.0.1:8000/v1", model="Qwen2.5-7B-Instruct")
    client = ChatClient(settings)                        # the key comes from $OPENAI_API_KEY, if set
    client.complete([{"role": "user", "content": "2+2?"}], max_tokens=8)
        -> Completion(text='4', finish_reason='stop', prompt_tokens=14, completion_tokens=1)
    client.complete_many([{"messages": [...]}, {"messages": [...]}], progress="judging")
        -> [Completion(...), CallFailure(error='500 from the server: ...', status=500)]   # in input order
    client.stats
        -> CallStats(calls=3, succeeded=2, failed=1, retried=5, prompt_tokens=..., completion_tokens=...)

What can go wrong, and where it shows:

- a 429 or 5xx answer, a refused connection or a timeout: the request is tried again, up to ``max_retries``
  times, after 1, 2, 4, ... seconds (at most ``BACKOFF_CAP``), or after the seconds the server's
  ``Retry-After`` asks for;
- a 429, 5xx or timeout that lasts past the retries: that request's result is a ``CallFailure``, counted in
  ``stats.failed``; the other requests go on;
- a 400 answer (one request the server rejects, e.g. a prompt longer than the served model's context):
  that request's result is a ``CallFailure`` at once, without retries; the other requests go on;
- no connection after the retries, or any other 4xx answer (a refused key, no such model or URL):
  ``ServerError``, one line naming the URL. Those are the settings' fault, not one request's, so the run
  stops there.

The API key is read from the environment variable the settings name. It is never kept in the settings, and
never put in an error message, a ``repr`` or a record.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from tqdm import tqdm

from longalign.arguments import at_least
from longalign.errors import ConfigError, LongAlignError
from longalign.redact import redact_text

BACKOFF_BASE = 1.0  # seconds before the first retry; each next retry waits twice as long
BACKOFF_CAP = 30.0  # the longest wait of our own; a server's Retry-After is honoured as it is
NO_KEY = "EMPTY"  # sent when the key's variable is unset: a local server without a key accepts any
DETAIL_CHARS = 300  # how much of a server's error message goes into ours


class ServerError(LongAlignError):
    """The server cannot be used with these settings: unreachable, key refused, no such model or URL."""


@dataclass(frozen=True)
class ServerSettings:
    """Where a served model is and how to call it: the name of the key's environment variable, never the key.

    ServerSettings(base_url="http://127.0.0.1:8000/v1", model="Qwen2.5-7B-Instruct").record()
    -> {'base_url': 'http://127.0.0.1:8000/v1', 'model': 'Qwen2.5-7B-Instruct',
        'api_key_env': 'OPENAI_API_KEY', 'concurrency': 4, 'max_retries': 5, 'timeout': 600.0}
    """

    base_url: str  # the API root, e.g. http://127.0.0.1:8000/v1
    model: str  # the served model's name, as GET /v1/models lists it
    api_key_env: str = "OPENAI_API_KEY"  # the key is read from this environment variable, never stored
    concurrency: int = 4  # requests in flight at once in complete_many
    max_retries: int = 5  # tries again after a 429, a 5xx, a refused connection or a timeout
    timeout: float = 600.0  # seconds one try may take

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"base URL {redact_text(self.base_url)!r}: expected http:// or https://, "
                "e.g. http://127.0.0.1:8000/v1"
            )
        if not self.model:
            raise ConfigError(f"{redact_text(self.base_url)}: no model named; give the served model's name")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency: expected an integer >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries: expected an integer >= 0, got {self.max_retries}")
        if self.timeout <= 0:
            raise ConfigError(f"timeout: expected seconds > 0, got {self.timeout}")

    def record(self) -> dict[str, Any]:
        """The settings for ``run_config.json`` / ``report.json``: the key's variable named, no key, no URL password."""
        return {
            "base_url": redact_text(self.base_url),
            "model": self.model,
            "api_key_env": self.api_key_env,
            "concurrency": self.concurrency,
            "max_retries": self.max_retries,
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
    """A request whose last try, after all retries, got a 429, a 5xx or no answer in time."""

    error: str  # one line, e.g. "500 from the server: Internal Server Error (tried 6 times)"
    status: int | None  # the last HTTP status; None for a timeout


@dataclass(frozen=True)
class CallStats:
    """What a ``ChatClient`` has done so far; ``dataclasses.asdict(client.stats)`` is the report's part."""

    calls: int = 0  # requests asked for: each complete(), each item of complete_many
    succeeded: int = 0  # answered with a Completion
    failed: int = 0  # answered with a CallFailure
    retried: int = 0  # tries repeated, over all requests
    prompt_tokens: int = 0  # summed over the succeeded requests, as the server reported them
    completion_tokens: int = 0


class ChatClient:
    """Chat completions from one served model, retried and counted; one client serves many threads.

        client = ChatClient(ServerSettings(base_url="http://127.0.0.1:8000/v1", model="m"))
        client.complete([{"role": "user", "content": "Say hi"}], max_tokens=4, seed=0)
        -> Completion(text='Hi!', finish_reason='stop', prompt_tokens=11, completion_tokens=2)

    ``sleep`` waits between tries; tests pass a function that records the waits instead.
    """

    def __init__(self, settings: ServerSettings, *, sleep: Callable[[float], None] = time.sleep) -> None:
        try:
            import openai
        except ImportError:
            raise ConfigError(
                "the serving client needs the openai package: pip install -e '.[eval]'"
            ) from None
        self.settings = settings
        self._openai = openai
        self._key = os.environ.get(settings.api_key_env) or None
        self._client = openai.OpenAI(
            base_url=settings.base_url,
            api_key=self._key or NO_KEY,
            max_retries=0,  # retried here, so that retries are counted and waits can be observed
            timeout=settings.timeout,
        )
        self._sleep = sleep
        self._lock = threading.Lock()
        self._stats = CallStats()

    def __repr__(self) -> str:
        return f"ChatClient({self.settings!r})"

    @property
    def stats(self) -> CallStats:
        """The counts so far, read at one instant."""
        with self._lock:
            return self._stats

    def complete(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        **extra: Any,
    ) -> Completion | CallFailure:
        """One chat completion: a ``Completion``, or a ``CallFailure`` for a 400 or when 429/5xx/timeouts outlast the retries.

        ``extra`` goes to ``openai``'s ``chat.completions.create`` as it is: ``stop=["\\n"]``, ``seed=0``,
        ``extra_body={"top_k": 20}`` for a server's own parameters. Raises ``ServerError`` when the
        server cannot be reached or answers another 4xx (not 400, not 429).
        """
        self._count(calls=1)
        request = {
            "model": self.settings.model,
            "messages": list(messages),
            "temperature": temperature,
            **extra,
        }
        if max_tokens is not None:
            request["max_tokens"] = max_tokens
        for attempt in range(self.settings.max_retries + 1):
            try:
                response = self._client.chat.completions.create(**request)
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
                return self._completion(response)
            if attempt < self.settings.max_retries:
                self._count(retried=1)
                self._sleep(wait)
        if failure is None:
            raise ServerError(
                f"{self._url}: cannot reach the server ({unreachable}; tried {self.settings.max_retries + 1} times)"
            )
        self._count(failed=1)
        return replace(failure, error=f"{failure.error} (tried {self.settings.max_retries + 1} times)")

    def complete_many(
        self, requests: Sequence[dict[str, Any]], *, progress: str | None = None
    ) -> list[Completion | CallFailure]:
        """``complete(**request)`` for each request, ``settings.concurrency`` at a time; results in input order.

            client.complete_many([{"messages": chat, "max_tokens": 512} for chat in chats], progress="judging")
            -> [Completion(...), CallFailure(...), Completion(...)]     # len(chats) results, one per request

        A ``ServerError`` from any request stops the rest (requests not yet sent are dropped) and is raised.
        ``progress`` titles a progress bar on stderr; without it nothing is shown.
        """
        results: list[Completion | CallFailure | None] = [None] * len(requests)
        with (
            ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool,
            tqdm(total=len(requests), desc=progress, disable=progress is None) as bar,
        ):
            futures = {pool.submit(self.complete, **request): i for i, request in enumerate(requests)}
            try:
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    bar.update()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return results

    @property
    def _url(self) -> str:
        return redact_text(self.settings.base_url)

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._stats = replace(
                self._stats, **{name: getattr(self._stats, name) + n for name, n in increments.items()}
            )

    def _completion(self, response: Any) -> Completion:
        choice = response.choices[0]
        usage = response.usage
        completion = Completion(
            text=choice.message.content or "",
            finish_reason=choice.finish_reason,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
        )
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
    trains or evaluates) and ``--{prefix}model`` with one. Also ``--{prefix}concurrency`` and
    ``--{prefix}max-retries``.
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
        help=f"requests in flight at once (default: {ServerSettings.concurrency})",
    )
    group.add_argument(
        f"--{prefix}max-retries",
        type=at_least(0),
        default=ServerSettings.max_retries,
        help="tries again after a 429, a 5xx or a lost connection, waiting 1, 2, 4, ... s or what the "
        f"server's Retry-After asks (default: {ServerSettings.max_retries})",
    )


def server_settings(args: argparse.Namespace, *, prefix: str = "") -> ServerSettings:
    """The ``ServerSettings`` from flags added by ``add_server_arguments(parser, prefix=prefix)``.

        server_settings(parser.parse_args(["--judge-base-url", URL, "--judge-model", "m"]), prefix="judge-")
        -> ServerSettings(base_url=URL, model='m', api_key_env='OPENAI_API_KEY', concurrency=4, ...)

    Raises ``ConfigError`` naming the flags when the URL or the model is missing (flags added with
    ``required=False``).
    """
    dest = prefix.replace("-", "_")
    base_url = getattr(args, f"{dest}base_url")
    model = getattr(args, _model_flag(prefix).lstrip("-").replace("-", "_"))
    missing = [
        flag for flag, value in ((f"--{prefix}base-url", base_url), (_model_flag(prefix), model)) if not value
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
    )


def _model_flag(prefix: str) -> str:
    return f"--{prefix}model" if prefix else "--served-model"
