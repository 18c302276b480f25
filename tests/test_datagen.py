"""``longalign data``: documents cut to a token range, self-instruct and AgentWrite samples against a local
OpenAI-compatible stub, the answer store (resume, reruns, growing runs, --fresh), report counts under 500s
and rate limits, the batch modes, errors before any call."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, TOKENIZER, killed_once, run_process, train_demo
from openai_stub import Gate, OpenAIStub, finished_lines

from longalign.answers import BATCH, AnswerOptions, AnswerStore, work_path
from longalign.cli import main
from longalign.datagen import agentwrite, self_instruct
from longalign.datagen.agentwrite import Step, parse_plan
from longalign.datagen.documents import Fitted, Skipped, fit_document, read_documents
from longalign.datagen.prompts import render
from longalign.errors import ConfigError, InputError, PathError
from longalign.serving import ChatClient, ServerError, ServerSettings

KEY_ENV = "LONGALIGN_TEST_DATA_KEY"
KEY = "sk-test-data-5e1b77"


@pytest.fixture(autouse=True)
def key_in_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def scripted(body: dict) -> str:
    """A deterministic reply to any request the generators send, shaped like a real model's."""
    prompt = body["messages"][-1]["content"]
    tag = hashlib.sha256(json.dumps(body["messages"]).encode()).hexdigest()[:8]
    if "plan a long piece of writing" in prompt:
        if "epic" in prompt:
            return "\n".join(f"{n}. [100 words] Part {n}." for n in range(1, 31))
        if "haiku" in prompt:
            return "Sure! First I will think about the seasons, then write."
        return (
            "Here is the plan.\n1. [40 words] The setting.\n2. [60 words] The turn.\n3. [30 words] The close."
        )
    if "Now write paragraph" in prompt:
        step = prompt.split("Now write paragraph ")[1].split(" ")[0]
        return f"Paragraph {step} ({tag}) " + " ".join(["word"] * 12) + "."
    if "write one instruction" in prompt:
        return f"Which two sections of the report ({tag}) disagree about the budget, and why?"
    if "Write the user's next message" in prompt:
        return f"And how does that ({tag}) change the conclusion?"
    return f"Answer {tag}: " + " ".join(f"point{i}" for i in range(40)) + "."


def client_for(server: OpenAIStub, sleeps: list[float] | None = None, **settings) -> ChatClient:
    """A client of ``server`` whose retry waits are recorded instead of slept."""
    return ChatClient(
        ServerSettings(base_url=server.base_url, model=server.model, api_key_env=KEY_ENV, **settings),
        sleep=(sleeps if sleeps is not None else []).append,
    )


def paragraphs(doc: int, count: int, words: int = 30) -> str:
    """``count`` paragraphs of about ``words`` words each, separated by blank lines."""
    return "\n\n".join(
        f"Section {doc}.{p}: " + " ".join(f"term{(doc * 7 + p * 3 + w) % 50}" for w in range(words))
        for p in range(count)
    )


@pytest.fixture
def docs(tmp_path) -> Path:
    """Three documents: one of 6 paragraphs (~700 tokens), one long one that must be cut, one too short."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text(paragraphs(1, 6))
    (folder / "b.txt").write_text(paragraphs(2, 60))
    (folder / "c.txt").write_text("Too short to ask anything about.")
    (folder / "ignored.pdf").write_text("not read")
    return folder


def count(tokenizer, text: str) -> int:
    return len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def run_self_instruct(docs, out, server, tokenizer, sleeps=None, concurrency=4, max_retries=5, **options):
    options = {"min_tokens": 200, "max_tokens": 900, "per_doc": 2, **options}
    client = client_for(server, sleeps, concurrency=concurrency, max_retries=max_retries)
    return self_instruct.generate(docs, out, tokenizer=tokenizer, client=client, **options)


def canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True)


def calls(made: int, **counts) -> dict:
    """A report's ``calls`` part: ``made`` calls that all succeeded, unless ``counts`` says otherwise."""
    return {"made": made, "succeeded": made, "failed": 0, "retried": 0, "rate_limited": 0,
            "rate_limit_wait_seconds": 0.0, "lowest_concurrency": 4, "reused": 0, **counts}  # fmt: skip


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- documents and prompts ------------------------------------------------------------------------------


def test_a_long_document_is_cut_after_its_last_paragraph_that_fits(sample_tokenizer):
    text = paragraphs(3, 40)
    fit = fit_document(text, lambda t: count(sample_tokenizer, t), min_tokens=100, max_tokens=500)
    assert isinstance(fit, Fitted) and fit.cut
    assert fit.tokens == count(sample_tokenizer, fit.text) <= 500
    kept = fit.text.split("\n\n")
    assert kept == text.split("\n\n")[: len(kept)]  # whole paragraphs, from the start
    one_more = "\n\n".join(text.split("\n\n")[: len(kept) + 1])
    assert count(sample_tokenizer, one_more) > 500  # the next paragraph would not have fitted


def test_documents_outside_the_range_are_skipped_with_their_reason():
    words = lambda t: len(t.split())  # noqa: E731
    assert fit_document("a b c", words, min_tokens=1, max_tokens=10) == Fitted("a b c", 3, cut=False)
    assert fit_document("a b\n\nc d\n \ne f", words, min_tokens=1, max_tokens=4) == Fitted(
        "a b\n\nc d", 4, True
    )
    assert fit_document(" \n\n ", words, min_tokens=0, max_tokens=4) == Skipped("empty")
    assert fit_document("a b", words, min_tokens=3, max_tokens=4) == Skipped("too_short")
    assert fit_document("a b c d e f", words, min_tokens=1, max_tokens=4) == Skipped("no_boundary_in_range")
    assert fit_document("a b\n\nc d e f g", words, min_tokens=3, max_tokens=4) == Skipped(
        "no_boundary_in_range"
    )


def test_documents_from_files_and_jsonl_rows(tmp_path, docs):
    (docs / "more.jsonl").write_text('{"text": "first row"}\n\n{"text": "second row", "id": 7}\n')
    found = read_documents(docs)
    assert [Path(d.name).name for d in found] == ["a.md", "b.txt", "c.txt", "more.jsonl:1", "more.jsonl:3"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl: line 2: expected an object with a 'text' string"):
        read_documents(tmp_path / "bad.jsonl")


def test_a_value_is_never_searched_for_slots():
    assert render("{document}\n\n{instruction} {other}", document="{instruction}", instruction="Q?") == (
        "{instruction}\n\nQ? {other}"
    )


def test_plans_are_parsed_only_when_numbered_in_order():
    assert parse_plan("Plan:\n1. [200 words] Open.\n2) [1 word] Argue.\n") == [
        Step(1, 200, "Open."),
        Step(2, 1, "Argue."),
    ]
    assert parse_plan("1. [200 words] Open.\n3. [300 words] Skip.") is None
    assert parse_plan("First the opening, then the argument.") is None


# --- self-instruct ---------------------------------------------------------------------------------------


def test_self_instruct_samples_and_report(tmp_path, docs, sample_tokenizer):
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY) as server:
        report = run_self_instruct(docs, out, server, sample_tokenizer, turns=2)
        bodies = server.requests
    samples = lines(out / "data.jsonl")
    assert len(samples) == 4  # 2 documents in range x 2 per document; c.txt is too short
    assert report["documents"] == {"read": 3, "used": 2, "cut": 1, "skipped": {"too_short": 1}}
    assert report["samples"] == {"planned": 4, "made": 4, "dropped": {}}
    assert report["calls"] == calls(16)
    assert report["tokens"]["prompt"] == sum(
        len(m["content"].split()) for body in bodies for m in body["messages"]
    )  # the stub counts words
    assert len(bodies) == 16  # two turns of instruction + answer per sample
    for sample in samples:
        assert [m["role"] for m in sample["messages"]] == ["user", "assistant"] * 2
        meta = sample["meta"]
        assert meta["model"] == "stub-model" and meta["task"] == meta["turn_tasks"][0]
        document = (docs / Path(meta["document"]).name).read_text()
        first = sample["messages"][0]["content"]
        kept, instruction = first.rsplit("\n\n", 1)
        assert document.startswith(kept) and instruction.startswith("Which two sections")
        assert count(sample_tokenizer, kept) == meta["document_tokens"] <= 900
        assert meta["document_cut"] == (kept != document)
        assert sample["messages"][2]["content"].startswith("And how does that")
    assert [s["meta"]["sample"] for s in samples] == [0, 1, 0, 1]  # in document order
    assert sum(report["samples_by_task"].values()) == 4
    assert not work_path(out).exists()
    assert len(lines(out / "calls.jsonl")) == 16  # every answer, kept with the output
    # The answer call of turn 2 sends the whole conversation the sample keeps
    assert samples[0]["messages"][:3] in [body["messages"] for body in bodies]


def test_the_same_file_whatever_the_concurrency(tmp_path, docs, sample_tokenizer):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "one", server, sample_tokenizer, concurrency=1)
        run_self_instruct(docs, tmp_path / "four", server, sample_tokenizer, concurrency=4)
    assert (tmp_path / "one" / "data.jsonl").read_bytes() == (tmp_path / "four" / "data.jsonl").read_bytes()


def test_500_every_third_call_ends_with_every_sample_and_the_counts(tmp_path, docs, sample_tokenizer):
    sleeps: list[float] = []
    with OpenAIStub(scripted, key=KEY, fail_every=3) as server:
        report = run_self_instruct(docs, tmp_path / "gen", server, sample_tokenizer, sleeps)
        received = server.calls
    # 8 requests + r retries = T calls, of which calls 3, 6, 9 failed: T = 11, r = 3, in any order
    assert received == 11
    assert report["samples"]["made"] == 4
    assert report["calls"] == calls(8, retried=3)
    assert len(sleeps) == 3


def test_every_sample_made_under_a_server_that_rate_limits_every_other_request(
    tmp_path, docs, sample_tokenizer, capsys
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "whole", server, sample_tokenizer)
    out = tmp_path / "gen"
    argv = cli_args(docs, out, "URL", "--per-doc", "2", "--max-retries", "0")
    with OpenAIStub(scripted, key=KEY, rate_limit_every=2) as server:
        argv[argv.index("URL")] = server.base_url
        assert main(argv) == 0
        received = server.calls
    report = json.loads((out / "report.json").read_text())
    assert report["samples"] == {"planned": 4, "made": 4, "dropped": {}}
    # arrivals 2, 4, ... were refused and the last answered: 8 answers + 7 refusals, none a retry
    assert received == 15
    assert report["calls"] | {"lowest_concurrency": None} == calls(8, rate_limited=7, lowest_concurrency=None)
    assert report["calls"]["lowest_concurrency"] <= 2  # halved at the first 429
    assert "7 rate-limited (0.0 s waited, concurrency down to " in capsys.readouterr().out
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "whole" / "data.jsonl").read_bytes()


def test_a_request_rate_limited_past_max_wait_drops_its_sample(tmp_path, docs, sample_tokenizer, capsys):
    with OpenAIStub(scripted, key=KEY, rate_limit_every=1, retry_after=1) as server:
        argv = cli_args(docs, tmp_path / "gen", server.base_url, "--max-wait", "0.5")
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "no sample made (2 planned, dropped: 2 call_failed; the first: turn 1 instruction: 429 from the server: "
        in err
    )
    assert "longer than the 0.5 s max wait" in err


def test_a_run_that_makes_no_sample_is_exit_2_and_keeps_the_earlier_output(tmp_path, docs, capsys):
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY) as server:
        assert main(cli_args(docs, out, server.base_url)) == 0
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        # every reply is longer than --max-new-tokens 5: cut, and no sample can be made of it
        assert main(cli_args(docs, out, server.base_url, "--max-new-tokens", "5")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"longalign data: error: {out}: no sample made (2 planned, dropped: 2 reply_cut; the first: turn 1 "
        "instruction: the reply reached --max-new-tokens); left as it was, the 6 answers paid for kept"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(AnswerStore(out)) == 6  # the output's four answers and the two cut replies


def test_a_stopped_run_restarted_asks_nothing_twice_and_writes_the_same_file(
    tmp_path, docs, sample_tokenizer
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "whole", server, sample_tokenizer, turns=2)
        total = server.calls
    out = tmp_path / "gen"
    answered = []

    def revoke_after_five(body):  # the key is revoked with the fifth answer: the sixth call is a 401
        answered.append(body)
        if len(answered) == 5:
            server.key = "sk-revoked"
        return scripted(body)

    with OpenAIStub(revoke_after_five, key=KEY) as server:
        with pytest.raises(ServerError, match="401 from the server"):
            run_self_instruct(docs, out, server, sample_tokenizer, turns=2, concurrency=1)
    assert not out.exists()
    assert len(AnswerStore(out)) == 5
    with OpenAIStub(scripted, key=KEY) as server:
        report = run_self_instruct(docs, out, server, sample_tokenizer, turns=2)
        again = server.requests
    assert len(again) == total - 5
    assert not {canonical(b) for b in answered} & {canonical(b) for b in again}
    assert report["calls"]["reused"] == 5
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "whole" / "data.jsonl").read_bytes()
    assert not work_path(out).exists()


def test_a_rerun_after_dropped_samples_asks_only_the_failed_calls_and_writes_the_same_file(
    tmp_path, docs, sample_tokenizer
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "whole", server, sample_tokenizer)
        total = server.calls
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY, fail_every=3) as server:
        first = run_self_instruct(docs, out, server, sample_tokenizer, max_retries=0, concurrency=1)
        answered = [body for n, body in enumerate(server.requests, 1) if n % 3]  # arrivals 3, 6, ... failed
    # arrivals 1, 2 make sample 1; 3 fails sample 2; 4, 5 make sample 3; 6 fails sample 4
    assert first["samples"] == {"planned": 4, "made": 2, "dropped": {"call_failed": 2}}
    with OpenAIStub(scripted, key=KEY) as server:
        report = run_self_instruct(docs, out, server, sample_tokenizer)
        again = server.requests
    assert len(again) == total - len(answered)  # every call the first run had no answer for, once
    assert not {canonical(b) for b in answered} & {canonical(b) for b in again}
    assert report["calls"]["reused"] == len(answered)
    assert report["tokens"]["reused_prompt"] == sum(
        len(m["content"].split()) for b in answered for m in b["messages"]
    )
    assert report["samples"] == {"planned": 4, "made": 4, "dropped": {}}
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "whole" / "data.jsonl").read_bytes()


def test_more_per_doc_or_turns_ask_only_the_new_calls_and_fresh_asks_everything(
    tmp_path, docs, sample_tokenizer
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "four", server, sample_tokenizer, per_doc=4, turns=2)
        total = server.requests
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, out, server, sample_tokenizer, per_doc=2, turns=1)
        asked = server.requests
        assert len(asked) == 2 * 2 * 2  # documents x samples x calls
        run_self_instruct(docs, out, server, sample_tokenizer, per_doc=2, turns=2)
        asked = server.requests
        assert len(asked) == 8 + 8  # the second turn of the same four samples
        report = run_self_instruct(docs, out, server, sample_tokenizer, per_doc=4, turns=2)
        asked = server.requests
        assert len(asked) == 16 + 16  # four new samples of two turns
        assert report["calls"] | {"lowest_concurrency": 4} == calls(16, reused=16)
        assert sorted(map(canonical, asked)) == sorted(map(canonical, total))  # each request asked once
        assert (out / "data.jsonl").read_bytes() == (tmp_path / "four" / "data.jsonl").read_bytes()
        report = run_self_instruct(
            docs, out, server, sample_tokenizer, per_doc=4, turns=2, answers=AnswerOptions(fresh=True)
        )
        assert server.calls == 32 + 32 and report["calls"]["reused"] == 0
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "four" / "data.jsonl").read_bytes()
    assert len(lines(out / "calls.jsonl")) == 32


# --- batch APIs ------------------------------------------------------------------------------------------


def run_in_batches(docs, out, server, tokenizer, **options):
    answers = AnswerOptions(mode=BATCH, poll_seconds=0.01)
    return run_self_instruct(docs, out, server, tokenizer, answers=answers, **options)


def test_batch_results_equal_the_online_runs_one_batch_per_round(tmp_path, docs, sample_tokenizer, capsys):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "online", server, sample_tokenizer, turns=2)
        online = server.requests
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY) as server:
        report = run_in_batches(docs, out, server, sample_tokenizer, turns=2)
        assert server.calls == 0  # nothing asked one at a time
        assert server.batches == [f"batch_stub_{n}" for n in (1, 2, 3, 4)]  # instruction, answer, x 2 turns
        assert sorted(map(canonical, server.batch_requests)) == sorted(map(canonical, online))
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "online" / "data.jsonl").read_bytes()
    prompt_words = sum(len(m["content"].split()) for body in online for m in body["messages"])
    assert report["batch"] | {"completion_tokens": None} == {
        "mode": "batch", "submitted": 4, "picked_up": 0, "files_written": 0, "requests": 16, "answered": 16,
        "failed": 0, "prompt_tokens": prompt_words, "completion_tokens": None,
    }  # fmt: skip
    assert report["tokens"]["prompt"] == prompt_words and report["calls"]["made"] == 0
    assert "self-instruct round 1: batch batch_stub_1" in capsys.readouterr().err  # the progress line


def test_failed_batch_lines_go_into_the_next_batch_a_400_fails_at_once(tmp_path, docs, sample_tokenizer):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "online", server, sample_tokenizer)
    run_before: set[str] = set()

    def first_run_fails(body):
        first = canonical(body) not in run_before
        run_before.add(canonical(body))
        return first

    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY, fail_batch_line=first_run_fails) as server:
        report = run_in_batches(docs, out, server, sample_tokenizer)
        sizes = [len(server.batch_requests)]
    # the 4 instructions fail, run again and pass; then the 4 answers fail, run again and pass
    assert (report["batch"]["submitted"], report["batch"]["failed"], report["batch"]["answered"]) == (4, 8, 8)
    assert sizes == [16]
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "online" / "data.jsonl").read_bytes()
    refuse_b = lambda body: "prompt too long" if "Section 2.0" in body["messages"][0]["content"] else None  # noqa: E731
    with OpenAIStub(scripted, key=KEY, reject=refuse_b) as server:
        report = run_in_batches(docs, tmp_path / "refused", server, sample_tokenizer)
        assert len(server.batches) == 2  # the refused lines are not sent again
    assert report["samples"]["dropped"] == {"call_failed": 2}
    assert report["dropped_samples"][0]["detail"] == (
        "turn 1 instruction: 400 from the batch: prompt too long (tried once in batches)"
    )


def without_url(argv: list[str]) -> list[str]:
    at = argv.index("--base-url")
    return argv[:at] + argv[at + 2 :]


def test_batch_file_only_then_batch_results_gives_the_batch_output(tmp_path, docs, sample_tokenizer, capsys):
    with OpenAIStub(scripted, key=KEY) as server:
        run_in_batches(docs, tmp_path / "batch", server, sample_tokenizer, per_doc=1)
    offline = OpenAIStub(scripted, key=KEY)  # never started: its run_batch_file stands in for vllm run-batch
    out = tmp_path / "gen"
    argv = without_url(cli_args(docs, out, "unused", "--batch-file-only"))
    written = []
    while True:
        assert main(argv) == 0
        printed = capsys.readouterr().out
        if out.exists():
            break
        batch_file = Path(re.search(r"^wrote (\S+): the next (\d+) requests to stub-model", printed, re.M)[1])
        command = re.search(r"^run it: (vllm run-batch .*)$", printed, re.M)[1].split()
        assert command[:3] == ["vllm", "run-batch", "-i"] and command[3] == str(batch_file)
        results = Path(command[5])
        results.write_text(offline.run_batch_file(batch_file.read_text()))
        written.append(batch_file.name)
        argv = without_url(cli_args(docs, out, "unused", "--batch-results", str(results)))
    assert written == ["gen.batch-1.jsonl", "gen.batch-2.jsonl"]  # the instructions, then the answers
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "batch" / "data.jsonl").read_bytes()
    assert "batches: 0 submitted, 0 picked up again, 0 files written; 0 requests" in printed
    assert len(offline.batch_requests) == 4
    assert (
        main(without_url(cli_args(docs, tmp_path / "other", "unused", "--batch-results", str(results)))) == 2
    )
    assert "none of its 2 lines answers a request this run waits for" in capsys.readouterr().err


def test_batch_flags_that_contradict_are_one_line(tmp_path, docs, capsys):
    for extra, message in (
        (["--batch", "--batch-file-only"], "--batch with --batch-file-only/--batch-results: choose"),
        (["--fresh", "--batch-results", str(docs / "a.md")], "--fresh with --batch-results"),
        (["--batch-results", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
    ):
        assert main(cli_args(docs, tmp_path / "gen", "http://127.0.0.1:9/v1", *extra)) == 2
        assert message in capsys.readouterr().err
    assert main(without_url(cli_args(docs, tmp_path / "gen", "unused"))) == 2
    assert "--base-url: missing" in capsys.readouterr().err


# --- agentwrite ------------------------------------------------------------------------------------------


def writing_prompts(tmp_path) -> Path:
    rows = [
        {"prompt": "Write a travel story about a night train.", "length": 130},
        {"prompt": "Write an epic about the founding of a city."},
        {"prompt": "Write a haiku sequence about rain.", "length": 50},
        {"prompt": "Write a letter to a future reader."},
    ]
    path = tmp_path / "writing.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_agentwrite_plans_then_writes_each_paragraph_given_the_text_so_far(tmp_path):
    out = tmp_path / "write"
    with OpenAIStub(scripted, key=KEY) as server:
        report = agentwrite.generate(writing_prompts(tmp_path), out, client=client_for(server), max_steps=20)
        bodies = server.requests
    samples = lines(out / "data.jsonl")
    assert [s["meta"]["source"].rsplit(":", 1)[1] for s in samples] == ["1", "4"]
    assert report["samples"] == {
        "planned": 4,
        "made": 2,
        "dropped": {"plan_too_many_steps": 1, "plan_unparsed": 1},
    }
    assert [(d["source"].rsplit(":", 1)[1], d["detail"]) for d in report["dropped_samples"]] == [
        ("2", "30 steps, at most 20 (--max-steps)"),
        ("3", "no numbered '1. [N words] ...' steps in the plan: 'Sure! First I will think about the seasons, then write.'"),
    ]  # fmt: skip
    assert report["calls"]["made"] == len(bodies) == 4 + 2 * 3  # four plans, three paragraphs for two of them
    story = samples[0]
    assert story["messages"][0] == {"role": "user", "content": "Write a travel story about a night train."}
    written = story["messages"][1]["content"].split("\n\n")
    assert [p.split(" ")[1] for p in written] == ["1", "2", "3"]
    assert story["meta"] | {"words": None} == {
        "source": f"{tmp_path / 'writing.jsonl'}:1",
        "task": "agentwrite",
        "requested_length": 130,
        "plan_steps": 3,
        "planned_words": 130,
        "words": None,
        "model": "stub-model",
    }
    asks = [b["messages"][0]["content"] for b in bodies if "night train" in b["messages"][0]["content"]]
    assert "about 130 words long" in asks[0]  # the plan, asked first
    third = next(ask for ask in asks if "Now write paragraph 3" in ask)
    assert f"<written_so_far>\n{written[0]}\n\n{written[1]}\n</written_so_far>" in third


def test_agentwrite_500_every_third_call_ends_with_every_sample_and_the_counts(tmp_path):
    prompts = tmp_path / "writing.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write story {i}."}) + "\n" for i in range(3)))
    with OpenAIStub(scripted, key=KEY, fail_every=3) as server:
        report = agentwrite.generate(prompts, tmp_path / "write", client=client_for(server))
        received = server.calls
    # 3 plans + 9 paragraphs = 12 requests; T = 12 + T // 3 gives T = 17 (calls 3, 6, ..., 15 failed)
    assert received == 17
    assert report["samples"] == {"planned": 3, "made": 3, "dropped": {}}
    assert report["calls"] == calls(12, retried=5)


def test_bad_prompt_rows_are_refused_naming_the_line_before_any_call(tmp_path):
    bad = tmp_path / "bad.jsonl"
    with OpenAIStub(scripted, key=KEY) as server:
        for text, message in (
            ('{"prompt": "ok"}\n{"prompt": ""}\n', "bad.jsonl: line 2: expected an object with a non-empty 'prompt'"),
            ('{"prompt": "ok", "length": "long"}\n', "bad.jsonl: line 1: 'length' must be a positive number of words"),
            ("\n\n", "bad.jsonl: no prompts"),
        ):  # fmt: skip
            bad.write_text(text)
            with pytest.raises(InputError, match=message):
                agentwrite.generate(bad, tmp_path / "out", client=client_for(server))
        with pytest.raises(PathError, match="missing.jsonl: prompts file not found"):
            agentwrite.generate(tmp_path / "missing.jsonl", tmp_path / "out", client=client_for(server))
        assert server.calls == 0


# --- bad input, errors, the key ------------------------------------------------------------------------


def test_bad_input_is_refused_before_any_call(tmp_path, docs, sample_tokenizer):
    empty = tmp_path / "empty"
    empty.mkdir()
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    with OpenAIStub(scripted, key=KEY) as server:
        cases = [
            (dict(docs=empty), InputError, "empty: no documents"),
            (dict(min_tokens=8000, max_tokens=9000), InputError, r"no document within --min-tokens 8000 .. --max-tokens 9000 \(3 read: 3 too_short\)"),
            (dict(min_tokens=900, max_tokens=800), ConfigError, "--min-tokens 900 > --max-tokens 800"),
            (dict(min_tokens=0, max_tokens=20), ConfigError, "--max-tokens 20: cannot hold the prompt"),
            (dict(tasks="summary,poetry"), ConfigError, "--tasks: unknown task type.s. poetry; known: summary, single_hop"),
            (dict(prompts_dir=tmp_path / "nowhere"), PathError, "nowhere: not a directory of prompt files"),
        ]  # fmt: skip
        for options, error, message in cases:
            options = {"docs": docs, **options}
            with pytest.raises(error, match=message):
                run_self_instruct(options.pop("docs"), tmp_path / "out", server, sample_tokenizer, **options)
        (prompts / "instructions.txt").write_text("{document}")
        with pytest.raises(ConfigError, match="instructions.txt: not a prompt of this command"):
            run_self_instruct(docs, tmp_path / "out", server, sample_tokenizer, prompts_dir=prompts)
        (prompts / "instructions.txt").unlink()
        (prompts / "instruction.txt").write_text("Ask about {document}.")
        with pytest.raises(
            ConfigError, match=r"instruction.txt: the prompt lacks \{task\}, \{task_description\}"
        ):
            run_self_instruct(docs, tmp_path / "out", server, sample_tokenizer, prompts_dir=prompts)
        with pytest.raises(ConfigError, match="the output is the input"):
            run_self_instruct(docs, docs, server, sample_tokenizer)
        assert server.calls == 0
    assert not (tmp_path / "out").exists()


def test_prompt_files_replace_the_shipped_ones(tmp_path, docs, sample_tokenizer):
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "tasks.txt").write_text("timeline: the events of the document in order\n")
    (prompts / "user_turn.txt").write_text("Read this:\n{document}\n---\n{instruction}\n")
    with OpenAIStub(scripted, key=KEY) as server:
        report = run_self_instruct(
            docs, tmp_path / "gen", server, sample_tokenizer, prompts_dir=prompts, per_doc=1
        )
        asks = [b["messages"][0]["content"] for b in server.requests]
    assert report["samples_by_task"] == {"timeline": 2}
    assert any("type: timeline (the events of the document in order)" in ask for ask in asks)
    first = lines(tmp_path / "gen" / "data.jsonl")[0]["messages"][0]["content"]
    assert first.startswith("Read this:\nSection 1.0") and "\n---\nWhich two sections" in first


def cli_args(docs: Path, out: Path, base_url: str, *extra: str) -> list[str]:
    return [
        "data", "self-instruct", "--docs", str(docs), "--tokenizer", str(TOKENIZER), "--min-tokens", "200",
        "--max-tokens", "900", "--output", str(out), "--base-url", base_url, "--served-model", "stub-model",
        "--api-key-env", KEY_ENV, *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("task", ["self-instruct", "agentwrite"])
def test_each_task_has_help(task, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["data", task, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: longalign data {task}")
    assert all(
        flag in out for flag in ("--output", "--base-url", "--served-model", "--concurrency", "--seed")
    )


def test_an_unreachable_server_is_one_line(tmp_path, docs, capsys):
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    assert main(cli_args(docs, tmp_path / "gen", url, "--max-retries", "0")) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"longalign data: error: {url}: cannot reach the server (")
    assert err.endswith("; tried 1 times)")
    assert not (tmp_path / "gen").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["docs"]  # no staging left, no cache: nothing answered


def test_the_key_is_in_no_file(tmp_path, docs, capsys):
    with OpenAIStub(scripted, key=KEY) as server:
        answers = 0

        def revoke_after_three(body):
            nonlocal answers
            answers += 1
            if answers == 3:
                server.key = "sk-revoked"
            return scripted(body)

        server.reply = revoke_after_three
        assert main(cli_args(docs, tmp_path / "stopped", server.base_url, "--concurrency", "1")) == 2
        assert work_path(tmp_path / "stopped").exists()  # kept for the restart
        server.key, server.reply = KEY, scripted
        assert main(cli_args(docs, tmp_path / "gen", server.base_url)) == 0
    printed = capsys.readouterr()
    assert "401 from the server: the API key in LONGALIGN_TEST_DATA_KEY was refused" in printed.err
    assert "2 of 2 samples" in printed.out and "calls: 4 made" in printed.out
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"data.jsonl", "report.json", "calls.jsonl", ".stopped.calls.jsonl"}
    for path in files:
        assert KEY.encode() not in path.read_bytes(), path
    assert KEY not in printed.out + printed.err


# --- the slow tier: a real kill, and the output as a train_file ------------------------------------------


@pytest.mark.integration
def test_a_killed_run_restarted_pays_for_nothing_twice_and_writes_the_same_file(
    tmp_path, docs, sample_tokenizer
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "whole", server, sample_tokenizer, per_doc=2)
        total = server.calls
    out = tmp_path / "gen"
    gate = Gate(scripted, open_for=5)
    with OpenAIStub(gate, key=KEY) as server:
        cmd = [sys.executable, "-m", "longalign",
               *cli_args(docs, out, server.base_url, "--per-doc", "2", "--concurrency", "2")]  # fmt: skip
        # every answered call is in the work file before the kill
        returncode = killed_once(
            cmd, ready=lambda: finished_lines(work_path(out)) >= 5, what="kept 5 answers", cwd=ROOT
        )
        gate.release.set()
    assert returncode == -signal.SIGKILL
    assert not out.exists()
    assert len(AnswerStore(out)) == 5
    with OpenAIStub(scripted, key=KEY) as server:
        result = run_process(
            [sys.executable, "-m", "longalign", *cli_args(docs, out, server.base_url, "--per-doc", "2")],
            timeout=300,
            cwd=ROOT,
        )
        again = server.requests
    assert result.returncode == 0, result.stderr[-2000:]
    assert "5 answers reused" in result.stdout
    assert len(again) == total - 5
    assert not {canonical(b) for b in gate.answered} & {canonical(b) for b in again}
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "whole" / "data.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "gen", "whole"]  # no work file, no staging


@pytest.mark.integration
def test_a_run_killed_after_submitting_a_batch_polls_that_batch_again_on_restart(
    tmp_path, docs, sample_tokenizer
):
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, tmp_path / "online", server, sample_tokenizer, per_doc=2)
    out = tmp_path / "gen"
    held = threading.Event()  # the server keeps every batch in progress until it is set
    with OpenAIStub(scripted, key=KEY, hold_batches=held) as server:
        cmd = [sys.executable, "-m", "longalign",
               *cli_args(docs, out, server.base_url, "--per-doc", "2", "--batch", "--batch-poll", "0.05")]  # fmt: skip
        stored = lambda: work_path(out).exists() and b'"batch": "batch_stub_1"' in work_path(out).read_bytes()  # noqa: E731
        assert killed_once(cmd, ready=stored, what="stored its batch id", cwd=ROOT) == -signal.SIGKILL
        assert server.batches == ["batch_stub_1"] and server.batch_requests == []
        held.set()
        result = run_process(cmd, timeout=300, cwd=ROOT)
        batches, lines_run = server.batches, server.batch_requests
    assert result.returncode == 0, result.stderr[-2000:]
    assert batches == ["batch_stub_1", "batch_stub_2"]  # the instructions' batch read, not submitted again
    assert len(lines_run) == len({canonical(b) for b in lines_run}) == 8
    batch = json.loads((out / "report.json").read_text())["batch"]
    assert (batch["picked_up"], batch["submitted"], batch["answered"]) == (1, 1, 8)
    assert (out / "data.jsonl").read_bytes() == (tmp_path / "online" / "data.jsonl").read_bytes()


@pytest.mark.integration
def test_the_output_pre_tokenizes_and_trains_as_a_train_file(tmp_path, docs, sample_tokenizer, capsys):
    out = tmp_path / "gen"
    with OpenAIStub(scripted, key=KEY) as server:
        run_self_instruct(docs, out, server, sample_tokenizer, per_doc=3, turns=2)
    tokenized = tmp_path / "tokenized"
    pre_tokenize = [
        "pre-tokenize",
        "--input",
        str(out),
        "--tokenizer",
        str(TOKENIZER),
        "--output",
        str(tokenized),
    ]
    assert main([*pre_tokenize, "--max-seq-len", "2048"]) == 0
    report = json.loads((tokenized / "report.json").read_text())
    assert (report["lines_read"], report["samples_kept"]) == (6, 6), report
    train_demo(out, tmp_path / "run", "training.max_steps=2", max_seq_len=2048)
    printed = capsys.readouterr()
    assert "train_loss" in printed.out + printed.err


def test_agentwrite_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "write"
    with OpenAIStub(scripted, key=KEY) as server:
        argv = ["data", "agentwrite", "--prompts", str(writing_prompts(tmp_path)), "--output", str(out),
                "--max-steps", "40", "--base-url", server.base_url, "--served-model", "stub-model",
                "--api-key-env", KEY_ENV]  # fmt: skip
        assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}/data.jsonl: 3 of 4 samples (dropped: 1 plan_unparsed)" in printed
    assert len(lines(out / "data.jsonl")) == 3
    assert json.loads((out / "report.json").read_text())["settings"]["max_steps"] == 40
