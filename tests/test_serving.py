"""The serving client against a local OpenAI-compatible stub: order, retries, rate limits, failures, errors, key hygiene."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import traceback

import pytest
from openai_stub import OpenAIStub

from longalign.errors import ConfigError
from longalign.serving import (
    CallFailure,
    CallStats,
    ChatClient,
    Completion,
    ServerError,
    ServerSettings,
    _Window,
    add_server_arguments,
    server_settings,
)

KEY_ENV = "LONGALIGN_TEST_SERVING_KEY"
KEY = "sk-test-7f3a9c"


@pytest.fixture(autouse=True)
def key_in_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def client_for(server: OpenAIStub, sleeps: list[float] | None = None, **settings) -> ChatClient:
    """A client of ``server`` whose waits are appended to ``sleeps`` instead of slept."""
    waits = [] if sleeps is None else sleeps
    return ChatClient(
        ServerSettings(base_url=server.base_url, model=server.model, api_key_env=KEY_ENV, **settings),
        sleep=waits.append,
    )


class FakeClock:
    """A clock that a client's ``sleep`` moves on: waits are recorded, none is slept."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def everything_said(err: BaseException) -> str:
    """The message, the repr and the whole printed traceback of ``err``."""
    return f"{err}\n{err!r}\n{''.join(traceback.format_exception(type(err), err, err.__traceback__))}"


def test_results_in_input_order_with_four_in_flight(capsys):
    in_flight, most = 0, 0
    lock = threading.Lock()
    first_four = threading.Barrier(4, timeout=60)  # passes only if four requests are in flight together

    def reply(body):
        nonlocal in_flight, most
        i = int(body["messages"][-1]["content"])
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        if i < 4:
            first_four.wait()
        with lock:
            in_flight -= 1
        return f"answer {i * i}"

    with OpenAIStub(reply, key=KEY) as server:
        client = client_for(server, concurrency=4)
        results = client.complete_many([{"messages": user(str(i))} for i in range(12)], progress="squaring")
    assert [r.text for r in results] == [f"answer {i * i}" for i in range(12)]
    assert most == 4
    assert client.stats == CallStats(
        calls=12, succeeded=12, prompt_tokens=12, completion_tokens=24, lowest_concurrency=4
    )
    assert "squaring" in capsys.readouterr().err


def test_request_fields_and_usage_tokens_summed():
    with OpenAIStub(key=KEY) as server:
        client = client_for(server)
        results = client.complete_many(
            [
                {"messages": user("one two three"), "max_tokens": 100},
                {"messages": [{"role": "system", "content": "be brief"}, *user("a b")], "temperature": 0.7},
                {"messages": user("w x y z"), "max_tokens": 2},
            ]
        )
        bodies = sorted(server.requests, key=lambda body: body["messages"][-1]["content"])
    assert results == [
        Completion(text="echo: one two three", finish_reason="stop", prompt_tokens=3, completion_tokens=4),
        Completion(text="echo: a b", finish_reason="stop", prompt_tokens=4, completion_tokens=3),
        Completion(text="echo: w", finish_reason="length", prompt_tokens=4, completion_tokens=2),
    ]
    assert client.stats.prompt_tokens == 11
    assert client.stats.completion_tokens == 9
    assert [(b["model"], b.get("max_tokens"), b["temperature"]) for b in bodies] == [
        ("stub-model", None, 0.7),
        ("stub-model", 100, 0.0),
        ("stub-model", 2, 0.0),
    ]


def test_a_raw_prompt_goes_to_the_completions_endpoint_with_the_same_rules():
    """``prompt`` instead of ``messages``: ``/v1/completions`` (the client applied the template), retried as a chat."""
    with OpenAIStub(key=KEY, fail_every=2) as server:
        client = client_for(server)
        body = client.request(prompt="<s>[INST] hi [/INST] Answer:", max_tokens=8, seed=0)
        results = client.complete_many(
            [
                {"prompt": "<s>[INST] hi [/INST] Answer:", "max_tokens": 8, "seed": 0},
                {"messages": user("a b")},
            ]
        )
        bodies = server.requests
    assert body == {"model": "stub-model", "prompt": "<s>[INST] hi [/INST] Answer:", "temperature": 0.0,
                    "seed": 0, "max_tokens": 8}  # fmt: skip
    assert results[0] == Completion("echo: <s>[INST] hi [/INST] Answer:", "stop", 4, 5)
    assert results[1].text == "echo: a b" and client.stats.retried == 1
    assert sum("prompt" in b for b in bodies) in (1, 2) and all(
        ("prompt" in b) != ("messages" in b) for b in bodies
    )


def test_extra_arguments_reach_the_server():
    with OpenAIStub(key=KEY) as server:
        client_for(server).complete(user("hi"), seed=3, stop=["\n"], extra_body={"top_k": 20})
        (body,) = server.requests
    assert (body["seed"], body["stop"], body["top_k"]) == (3, ["\n"], 20)


def test_500_every_third_call_is_retried_until_all_succeed():
    sleeps: list[float] = []
    with OpenAIStub(key=KEY, fail_every=3) as server:
        client = client_for(server, sleeps, concurrency=4)
        results = client.complete_many([{"messages": user(f"q{i}")} for i in range(9)])
        calls = server.calls
    # 9 requests + r retries = T calls of which T // 3 fail and are retried: T = 13, r = 4, in any order
    assert [r.text for r in results] == [f"echo: q{i}" for i in range(9)]
    assert calls == 13
    assert client.stats == CallStats(
        calls=9, succeeded=9, retried=4, prompt_tokens=9, completion_tokens=18, lowest_concurrency=4
    )
    assert len(sleeps) == 4
    assert min(sleeps) == 1.0
    assert set(sleeps) <= {1.0, 2.0, 4.0, 8.0}  # a retry that meets another multiple of 3 waits longer


def test_a_429_waits_what_retry_after_asks_and_is_not_a_retry():
    sleeps: list[float] = []
    with OpenAIStub(key=KEY, fail_first_with_429=8, retry_after=7) as server:
        client = client_for(server, sleeps, max_retries=0)
        result = client.complete(user("hello"))
        calls = server.calls
    assert result == Completion(
        text="echo: hello", finish_reason="stop", prompt_tokens=1, completion_tokens=2
    )
    assert sleeps == [7.0] * 8  # eight 429s waited out although no retry is allowed
    assert calls == 9
    stats = client.stats
    assert (stats.retried, stats.rate_limited, stats.rate_limit_wait_seconds) == (0, 8, 56.0)


def test_a_429_without_retry_after_backs_off():
    sleeps: list[float] = []
    with OpenAIStub(key=KEY, fail_first_with_429=3) as server:
        server.retry_after = "soon"  # not a number of seconds: the backoff decides
        client = client_for(server, sleeps)
        assert client.complete(user("hello")).text == "echo: hello"
    assert sleeps == [1.0, 2.0, 4.0]


def test_every_other_request_rate_limited_all_succeed_with_fewer_in_flight():
    with OpenAIStub(key=KEY, rate_limit_every=2) as server:
        client = client_for(server, concurrency=4, max_retries=0)
        results = client.complete_many([{"messages": user(f"q{i}")} for i in range(12)])
        calls = server.calls
    assert [r.text for r in results] == [f"echo: q{i}" for i in range(12)]
    # arrivals 2, 4, ... are refused and the last is answered: 12 answers + 11 refusals
    assert calls == 23
    stats = client.stats
    assert (stats.succeeded, stats.failed, stats.rate_limited) == (12, 0, 11)
    assert stats.lowest_concurrency <= 2  # halved at the first 429


def test_the_window_halves_on_a_429_and_grows_by_one_after_a_run_of_successes():
    window = _Window(8)
    sizes = []
    for event in ["429", "429", "429", "429", "ok", "ok", "ok", "ok", "ok", "429"] + ["ok"] * 30:
        window.rate_limited() if event == "429" else window.succeeded()
        sizes.append(window.size)
    assert sizes[:10] == [4, 2, 1, 1, 2, 2, 3, 3, 3, 1]
    assert sizes[-1] == 8 and max(sizes) == 8  # back to the ceiling, never above it
    assert window.lowest == 1


def test_a_request_rate_limited_longer_than_max_wait_fails():
    clock = FakeClock()
    with OpenAIStub(key=KEY, rate_limit_every=1, retry_after=2) as server:
        client = ChatClient(
            ServerSettings(base_url=server.base_url, model=server.model, api_key_env=KEY_ENV, max_wait=5),
            sleep=clock.sleep,
            clock=clock,
        )
        result = client.complete(user("hello"))
        calls = server.calls
    assert result == CallFailure(
        "429 from the server: Rate limit reached (rate-limited for 6 s, longer than the 5 s max wait)", 429
    )
    assert clock.sleeps == [2.0, 2.0] and calls == 3
    assert (client.stats.failed, client.stats.rate_limited) == (1, 3)


def test_persistent_500_is_a_counted_call_failure():
    sleeps: list[float] = []
    with OpenAIStub(key=KEY, fail_every=1) as server:
        client = client_for(server, sleeps, max_retries=3)
        result = client.complete(user("hello"))
        calls = server.calls
    assert isinstance(result, CallFailure)
    assert result.status == 500
    assert result.error == "500 from the server: The server had an error (tried 4 times)"
    assert sleeps == [1.0, 2.0, 4.0]  # exponential backoff from 1 s
    assert calls == 4
    assert client.stats == CallStats(calls=1, failed=1, retried=3, lowest_concurrency=4)


def test_400_is_that_requests_call_failure_at_once_and_the_others_go_on():
    sleeps: list[float] = []
    too_long = lambda body: "prompt too long" if "long" in body["messages"][-1]["content"] else None  # noqa: E731
    with OpenAIStub(key=KEY, reject=too_long, reply=lambda body: "ok") as server:
        client = client_for(server, sleeps, max_retries=3)
        results = client.complete_many([{"messages": user("short")}, {"messages": user("a long one")}])
        calls = server.calls
    assert results[0] == Completion(text="ok", finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    assert results[1] == CallFailure(error="400 from the server: prompt too long", status=400)
    assert sleeps == []  # asking again would get the same answer
    assert calls == 2
    assert client.stats == CallStats(
        calls=2, succeeded=1, failed=1, prompt_tokens=1, completion_tokens=1, lowest_concurrency=4
    )


def test_no_answer_within_the_timeout_is_a_call_failure():
    released = threading.Event()
    sleeps: list[float] = []
    with OpenAIStub(lambda body: "late" if released.wait(timeout=60) else "never", key=KEY) as server:
        client = client_for(server, sleeps, timeout=0.1, max_retries=1)
        result = client.complete(user("hello"))
        released.set()
    assert result == CallFailure(error="no answer within 0.1 s (tried 2 times)", status=None)
    assert sleeps == [1.0]
    assert client.stats == CallStats(calls=1, failed=1, retried=1, lowest_concurrency=4)


def test_failures_keep_their_place_among_successes():
    with OpenAIStub(key=KEY, fail_every=2) as server:
        client = client_for(server, concurrency=1, max_retries=1)
        results = client.complete_many([{"messages": user(w)} for w in ("a", "b", "c")])
    # calls 2 and 4 are 500s: "b" fails on call 2, then call 3 answers it; "c" fails on call 4, call 5 answers
    assert [r.text for r in results] == ["echo: a", "echo: b", "echo: c"]
    assert (client.stats.calls, client.stats.succeeded, client.stats.failed, client.stats.retried) == (
        3,
        3,
        0,
        2,
    )
    with OpenAIStub(key=KEY, fail_every=2) as server:
        results = client_for(server, concurrency=1, max_retries=0).complete_many(
            [{"messages": user(w)} for w in ("a", "b", "c")]
        )
    assert results == [
        Completion(text="echo: a", finish_reason="stop", prompt_tokens=1, completion_tokens=2),
        CallFailure(error="500 from the server: The server had an error (tried 1 times)", status=500),
        Completion(text="echo: c", finish_reason="stop", prompt_tokens=1, completion_tokens=2),
    ]


def test_wrong_key_is_one_line_naming_the_url_without_the_key():
    with OpenAIStub(key="sk-the-right-one") as server:
        client = client_for(server)
        with pytest.raises(ServerError) as caught:
            client.complete(user("hello"))
        (body,) = server.requests  # refused at once: not retried
    message = str(caught.value)
    assert message.startswith(f"{server.base_url}: 401 from the server: the API key in {KEY_ENV} was refused")
    assert "\n" not in message
    assert "***" in message  # the stub repeated the key it was sent; the client masked it
    assert KEY not in everything_said(caught.value)
    assert body["messages"] == user("hello")


def test_missing_key_says_which_variable_to_set(monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with OpenAIStub(key=KEY) as server, pytest.raises(ServerError) as caught:
        client_for(server).complete(user("hello"))
    assert str(caught.value).startswith(
        f"{server.base_url}: 401 from the server: no API key was sent: set {KEY_ENV}"
    )


def test_no_key_is_fine_for_a_server_without_one(monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with OpenAIStub(key=None) as server:
        result = client_for(server).complete(user("hello"))
    assert result.text == "echo: hello"


def test_unknown_model_is_a_server_error_naming_model_and_url():
    with OpenAIStub(key=KEY) as server:
        settings = ServerSettings(base_url=server.base_url, model="no-such-model", api_key_env=KEY_ENV)
        with pytest.raises(ServerError) as caught:
            ChatClient(settings, sleep=[].append).complete_many([{"messages": user("hello")}] * 3)
    assert str(caught.value) == (
        f"{server.base_url}: 404 from the server: no model 'no-such-model' there, or not the API root "
        "(which usually ends in /v1) (The model `no-such-model` does not exist.)"
    )


def test_unreachable_server_is_one_line_after_the_retries():
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    sleeps: list[float] = []
    client = ChatClient(
        ServerSettings(base_url=url, model="m", api_key_env=KEY_ENV, max_retries=2), sleep=sleeps.append
    )
    with pytest.raises(ServerError) as caught:
        client.complete_many([{"messages": user("hello")}])
    message = str(caught.value)
    assert message.startswith(f"{url}: cannot reach the server (")
    assert message.endswith("; tried 3 times)")
    assert "\n" not in message
    assert KEY not in everything_said(caught.value)
    assert sleeps == [1.0, 2.0]
    assert (client.stats.calls, client.stats.succeeded, client.stats.failed, client.stats.retried) == (
        1,
        0,
        0,
        2,
    )


def test_the_key_is_in_no_record_or_repr():
    settings = ServerSettings(base_url="http://127.0.0.1:8000/v1", model="m", api_key_env=KEY_ENV)
    client = ChatClient(settings)
    assert settings.record() == {
        "base_url": "http://127.0.0.1:8000/v1",
        "model": "m",
        "api_key_env": KEY_ENV,
        "concurrency": 4,
        "max_retries": 5,
        "max_wait": 3600.0,
        "timeout": 600.0,
    }
    assert KEY not in json.dumps(settings.record()) + repr(settings) + repr(client) + str(vars(settings))


def test_a_url_password_is_masked_in_the_record():
    settings = ServerSettings(base_url="https://user:hunter2@llm.example/v1", model="m")
    assert settings.record()["base_url"] == "https://user:***@llm.example/v1"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("base_url", "127.0.0.1:8000/v1", "base URL '127.0.0.1:8000/v1': expected http:// or https://"),
        ("concurrency", 0, "concurrency: expected an integer >= 1, got 0"),
        ("max_retries", -1, "max_retries: expected an integer >= 0, got -1"),
        ("timeout", 0.0, "timeout: expected seconds > 0, got 0.0"),
        ("max_wait", 0.0, "max_wait: expected seconds > 0, got 0.0"),
    ],
)
def test_settings_that_cannot_work_are_config_errors(field, value, message):
    with pytest.raises(ConfigError) as caught:
        ServerSettings(**{"base_url": "http://127.0.0.1:8000/v1", "model": "m", field: value})
    assert str(caught.value).startswith(message)


def test_without_the_openai_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # makes `import openai` raise ImportError
    with pytest.raises(ConfigError) as caught:
        ChatClient(ServerSettings(base_url="http://127.0.0.1:8000/v1", model="m"))
    assert str(caught.value) == "the serving client needs the openai package: pip install -e '.[eval]'"


def test_server_arguments_with_and_without_a_prefix():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    add_server_arguments(parser, prefix="judge-", default_key_env="JUDGE_API_KEY", required=False)
    args = parser.parse_args(
        ["--base-url", "http://127.0.0.1:8000/v1", "--served-model", "policy", "--concurrency", "8",
         "--judge-base-url", "http://127.0.0.1:9000/v1", "--judge-model", "judge", "--judge-max-retries", "0",
         "--max-wait", "90"]
    )  # fmt: skip
    assert server_settings(args) == ServerSettings(
        base_url="http://127.0.0.1:8000/v1", model="policy", concurrency=8, max_wait=90.0
    )
    assert server_settings(args, prefix="judge-") == ServerSettings(
        base_url="http://127.0.0.1:9000/v1", model="judge", api_key_env="JUDGE_API_KEY", max_retries=0
    )
    help_text = parser.format_help()
    for flag in ("--judge-base-url", "--judge-model", "--judge-api-key-env", "--judge-concurrency",
                 "--judge-max-retries", "--served-model", "--api-key-env", "--max-retries", "--judge-max-wait"):  # fmt: skip
        assert flag in help_text
    assert "--judge-served-model" not in help_text


def test_a_server_flag_missing_is_named():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, prefix="judge-", required=False)
    with pytest.raises(ConfigError) as caught:
        server_settings(parser.parse_args(["--judge-base-url", "http://127.0.0.1:9000/v1"]), prefix="judge-")
    assert str(caught.value) == (
        "--judge-model: missing; a server is named by --judge-base-url and --judge-model"
    )


def test_required_server_flags_and_bad_counts_are_argparse_errors(capsys):
    parser = argparse.ArgumentParser(prog="longalign eval")
    add_server_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--base-url", "http://127.0.0.1:8000/v1"])
    assert "--served-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--base-url", "http://x/v1", "--served-model", "m", "--concurrency", "0"])
    assert "argument --concurrency: expected an integer >= 1, got 0" in capsys.readouterr().err
