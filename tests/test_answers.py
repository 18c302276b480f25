"""The answer store: keys, the output's file and the work file, a line cut short, --fresh, what is reused."""

from __future__ import annotations

import json

import pytest
from openai_stub import OpenAIStub

from longalign.answers import AnswerStore, StoredCalls, request_key, work_path
from longalign.serving import ChatClient, Completion, ServerSettings, chat_request

KEY_ENV = "LONGALIGN_TEST_ANSWERS_KEY"
KEY = "sk-test-answers-81c2"


@pytest.fixture(autouse=True)
def key_in_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def calls_of(server: OpenAIStub, output, **options) -> StoredCalls:
    client = ChatClient(ServerSettings(base_url=server.base_url, model=server.model, api_key_env=KEY_ENV))
    return StoredCalls(AnswerStore(output, **options), client)


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_key_is_the_request_as_sent_and_anything_that_decides_the_answer_changes_it():
    base = chat_request("m", user("hi"), max_tokens=8, temperature=0.7, seed=1)
    assert request_key(base) == request_key(dict(reversed(base.items())))  # key order does not matter
    others = [
        chat_request("other-model", user("hi"), max_tokens=8, temperature=0.7, seed=1),
        chat_request("m", user("hi!"), max_tokens=8, temperature=0.7, seed=1),
        chat_request("m", user("hi"), max_tokens=9, temperature=0.7, seed=1),
        chat_request("m", user("hi"), max_tokens=8, temperature=0.0, seed=1),
        chat_request("m", user("hi"), max_tokens=8, temperature=0.7, seed=2),
    ]
    assert len({request_key(base), *map(request_key, others)}) == 6


def test_each_request_is_asked_once_and_kept_with_the_output_without_the_key(tmp_path):
    out = tmp_path / "out"
    with OpenAIStub(key=KEY) as server:
        calls = calls_of(server, out)
        first = calls.complete_many([{"messages": user(w), "max_tokens": 4} for w in ("a", "b", "a")])
        again = calls_of(server, out).complete_many([{"messages": user(w), "max_tokens": 4} for w in "ab"])
        asked = server.calls
    assert [r.text for r in first] == ["echo: a", "echo: b", "echo: a"] and again == first[:2]
    assert asked == 2  # identical requests are asked once
    store = AnswerStore(out)
    assert len(store) == 2 and store.work_path == work_path(out) == tmp_path / ".out.calls.jsonl"
    store.write(tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [line["key"] for line in lines] == sorted(line["key"] for line in lines)
    assert {line["model"] for line in lines} == {"stub-model"}
    for path in (tmp_path / "calls.jsonl", work_path(out)):
        assert KEY not in path.read_text()


def test_a_line_cut_short_by_a_kill_is_skipped_and_the_next_answer_starts_a_line(tmp_path):
    out = tmp_path / "out"
    answer = Completion("hi", "stop", 1, 1)
    store = AnswerStore(out)
    store.put("k1", "m", answer)
    with open(store.work_path, "a") as f:
        f.write('{"key": "k2", "model": "m", "completion": {"te')  # the process died here
    store = AnswerStore(out)
    assert (store.answer("k1"), store.answer("k2"), len(store)) == (answer, None, 1)
    store.put("k3", "m", answer)
    assert len(AnswerStore(out)) == 2
    assert store.work_path.read_text().count("\n") == 3  # k1, the cut line ended, k3


def test_the_outputs_answers_and_the_work_file_are_read_together_and_fresh_reads_neither(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    kept, working = Completion("kept", "stop", 1, 1), Completion("working", "stop", 1, 1)
    store = AnswerStore(out)
    store.put("k1", "m", kept)
    store.write(out)  # out/calls.jsonl, as a finished run leaves it
    store.discard_work()
    AnswerStore(out).put("k2", "m", working)  # a later run, stopped before it wrote out
    assert (AnswerStore(out).answer("k1"), AnswerStore(out).answer("k2")) == (kept, working)
    fresh = AnswerStore(out, fresh=True)
    assert len(fresh) == 0
    fresh.put("k3", "m", working)
    restarted = AnswerStore(out)  # a restart of the fresh run, without --fresh: still fresh
    assert (restarted.answer("k1"), restarted.answer("k2"), restarted.answer("k3")) == (None, None, working)


def test_reused_counts_answers_of_earlier_runs_once_each_with_their_tokens(tmp_path):
    out = tmp_path / "out"
    with OpenAIStub(key=KEY) as server:
        calls_of(server, out).complete(user("one two"), max_tokens=8)
        calls = calls_of(server, out)
        for _ in range(3):
            calls.complete(user("one two"), max_tokens=8)
        calls.complete(user("three"), max_tokens=8)
        calls.complete(user("three"), max_tokens=8)  # asked in this run: not a reuse
    report = calls.report()
    assert (report["calls"]["made"], report["calls"]["reused"]) == (1, 1)
    assert (report["tokens"]["reused_prompt"], report["tokens"]["reused_completion"]) == (2, 3)
