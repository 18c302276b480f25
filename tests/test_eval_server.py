"""``longalign eval`` against an OpenAI-compatible server started on 127.0.0.1 in the test (bearer key checked):
scores, the answer store (reruns, a changed judge, a kill), batches, no tokenizer where none is needed."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TOKENIZER, killed_once, run_process, tiny_model
from openai_stub import Gate, OpenAIStub, finished_lines
from transformers import AutoTokenizer

from longalign.answers import work_path
from longalign.cli import main
from longalign.eval.judge import JUDGE_SYSTEM, QUALITY_SYSTEM

KEY = "sk-eval-test-5d1e"
NEEDLE_VALUE = re.compile(r"special magic number for \S+ is (\d+)")


@pytest.fixture(autouse=True)
def key_in_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)


def served(server: OpenAIStub) -> list[str]:
    return ["--backend", "openai", "--base-url", server.base_url, "--served-model", server.model,
            "--tokenizer", str(TOKENIZER), "--max-retries", "0"]  # fmt: skip


def judge(server: OpenAIStub) -> list[str]:
    return ["--judge-base-url", server.base_url, "--judge-model", server.model, "--judge-max-retries", "0"]


def no_key_in(directory: Path) -> None:
    for path in directory.iterdir():
        assert KEY not in path.read_bytes().decode("utf-8", "replace"), path.name


def read_results(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()]


def test_needle_grid_through_a_server_that_reads_the_needle(tmp_path, capsys):
    def reader(body):
        found = NEEDLE_VALUE.search(body["messages"][-1]["content"])
        return f"The number is {found[1]}." if "3" in found[1] else "I could not find it."

    out = tmp_path / "needle"
    with OpenAIStub(reader, key=KEY) as server:
        status = main(["eval", "needle", *served(server), "--lengths", "200,400", "--depths", "0,50,100",
                       "--samples-per-cell", "2", "--output", str(out)])  # fmt: skip
        requests = server.requests
    assert status == 0
    rows = read_results(out)
    assert len(rows) == len(requests) == 12
    assert [r["prompt_tokens"] for r in rows] == [r["length"] for r in rows]
    assert [r["score"] for r in rows] == [100.0 * ("3" in r["answer"]) for r in rows]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overall"] == pytest.approx(sum(r["score"] for r in rows) / 12)
    assert summary["n"] == 12 and set(summary["by_depth"]) == {"0", "50", "100"}
    assert {p.name for p in out.iterdir()} >= {"results.jsonl", "summary.json", "summary.csv", "heatmap.png",
                                               "run_config.json"}  # fmt: skip
    record = json.loads((out / "run_config.json").read_text())
    assert record["server"]["api_key_env"] == "OPENAI_API_KEY"
    assert record["flags"]["lengths"] == "200,400"
    no_key_in(out)
    assert KEY not in capsys.readouterr().out


def test_chat_ratings_parsed_last_one_counts_unrated_retried_then_counted(tmp_path):
    cases = [
        {"idx": "a", "prompt": "Long text A. Question A?", "query": "Question A?", "answer": "ref A"},
        {"idx": "b", "prompt": "Long text B. Question B?", "query": "Question B?", "answer": "ref B"},
        {"idx": "c", "prompt": "Long text C. Question C?", "query": "Question C?", "answer": "ref C"},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in cases))
    asked: dict[str, int] = {}

    def reply(body):
        if body["messages"][0]["content"] != JUDGE_SYSTEM:
            return "answer to " + body["messages"][-1]["content"].split(".")[0]
        case = re.search(r"\[Question\]\nQuestion (\w)\?", body["messages"][-1]["content"])[1]
        asked[case] = asked.get(case, 0) + 1
        if case == "A":
            return "Compared with [[2]] for a bad answer, this one earns [[8]]"
        if case == "B":
            return "Good answer. Rating: [[6]]" if asked[case] == 2 else "I would rather not say."
        return "No rating from me."

    out = tmp_path / "chat"
    with OpenAIStub(reply, key=KEY) as server:
        status = main(["eval", "chat", *served(server), *judge(server), "--judge-retries", "2",
                       "--data", str(data), "--output", str(out)])  # fmt: skip
    assert status == 0
    rows = {r["idx"]: r for r in read_results(out)}
    assert rows["a"]["output"] == "answer to Long text A"
    assert (rows["a"]["rating"], rows["a"]["judge_tries"]) == (8.0, 1)
    assert (rows["b"]["rating"], rows["b"]["judge_tries"]) == (6.0, 2)
    assert (rows["c"]["rating"], rows["c"]["judge_tries"]) == (None, 3)
    assert rows["c"]["judge_output"] == "No rating from me."
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {"mean": 7.0, "n": 3, "rated": 2, "unrated": 1}
    no_key_in(out)


def test_the_judge_key_comes_from_judge_api_key_first(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-only")
    data = tmp_path / "chat.json"
    data.write_text(json.dumps([{"prompt": "P", "query": "Q", "answer": "A"}]))
    with OpenAIStub(lambda body: "[[5]]", key=KEY) as model_server, OpenAIStub(lambda b: "[[9]]", key="sk-judge-only") as judge_server:  # fmt: skip
        status = main(["eval", "chat", *served(model_server), *judge(judge_server), "--data", str(data),
                       "--output", str(tmp_path / "out")])  # fmt: skip
    assert status == 0
    assert read_results(tmp_path / "out")[0]["rating"] == 9.0
    assert "sk-judge-only" not in (tmp_path / "out" / "run_config.json").read_text()


def expected_length_score(x: int, y: int) -> float:
    return 100 * max(0, 1 - (y / x - 1) / 3) if y > x else 100 * max(0, 1 - (x / y - 1) / 2)


def test_write_length_scores_follow_the_formula_and_the_judge_rates_quality(tmp_path):
    requests = [(100, 100), (100, 150), (100, 400), (100, 50), (300, 120), (10, 9)]  # (required, written)
    data = tmp_path / "write.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Write {y} words.", "length": x}) + "\n" for x, y in requests)
    )

    def reply(body):
        if body["messages"][0]["content"] == QUALITY_SYSTEM:
            return "Decent. [[7]]"
        words = int(re.search(r"Write (\d+) words", body["messages"][-1]["content"])[1])
        return " ".join(["word"] * words)

    out = tmp_path / "write"
    with OpenAIStub(reply, key=KEY) as server:
        status = main(["eval", "write", *served(server), *judge(server), "--max-new-tokens", "1000",
                       "--data", str(data), "--output", str(out)])  # fmt: skip
    assert status == 0
    rows = read_results(out)
    assert [r["response_length"] for r in rows] == [y for _, y in requests]
    for row, (x, y) in zip(rows, requests, strict=True):
        assert row["length_score"] == pytest.approx(expected_length_score(x, y), rel=1e-12)
    summary = json.loads((out / "summary.json").read_text())
    scores = [expected_length_score(x, y) for x, y in requests]
    assert summary["length_score"] == pytest.approx(sum(scores) / len(scores), rel=1e-12)
    assert (summary["n"], summary["quality_score"]) == (6, 7.0)
    assert (out / "scatter.png").stat().st_size > 0
    no_key_in(out)


def test_write_without_a_judge_has_no_quality_score(tmp_path):
    data = tmp_path / "write.json"
    data.write_text(json.dumps([{"prompt": "Write.", "length": 4}]))
    with OpenAIStub(lambda body: "one two three four", key=KEY) as server:
        assert (
            main(["eval", "write", *served(server), "--data", str(data), "--output", str(tmp_path / "o")])
            == 0
        )
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (summary["length_score"], summary["quality_score"]) == (100.0, None)


def test_a_prompt_the_server_refuses_is_a_failed_row_and_the_rest_go_on(tmp_path):
    too_long = lambda body: "context too long" if len(body["messages"][-1]["content"]) > 1500 else None  # noqa: E731
    out = tmp_path / "needle"
    with OpenAIStub(lambda body: "no idea", key=KEY, reject=too_long) as server:
        status = main(["eval", "needle", *served(server), "--lengths", "100,600", "--depths", "50",
                       "--output", str(out)])  # fmt: skip
    assert status == 0
    rows = read_results(out)
    assert [(r["length"], r["score"]) for r in rows] == [(100, 0.0), (600, None)]
    assert rows[1]["error"] == "400 from the server: context too long"
    assert json.loads((out / "summary.json").read_text())["failed"] == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_one_line_naming_the_url_and_writes_nothing(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    args = ["--backend", "openai", "--base-url", url, "--served-model", "m", "--tokenizer", str(TOKENIZER),
            "--max-retries", "0", "--lengths", "200", "--depths", "50", "--output", str(tmp_path / "out")]  # fmt: skip
    assert main(["eval", "needle", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"longalign eval: error: {url}: cannot reach the server")
    assert KEY not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lengths", "30"], "--lengths 30: too short"),
        (["--needle", "x"], "--question, --answer: missing"),
        (["--depths", "0,120"], "expected percentages from 0 to 100"),
        (["--score", "logprob"], "--score logprob: needs the model's weights"),
    ],
)
def test_bad_needle_settings_are_one_line_before_any_request(tmp_path, capsys, extra, message):
    with OpenAIStub(key=KEY) as server:
        status = main(["eval", "needle", *served(server), "--output", str(tmp_path / "o"), *extra])
        calls = server.calls
    assert status == 2 and calls == 0
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_chat_row_without_its_query_is_named(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        json.dumps({"prompt": "P", "query": "Q", "answer": "A"}) + "\n" + json.dumps({"prompt": "P"})
    )
    with OpenAIStub(key=KEY) as server:
        status = main(["eval", "chat", *served(server), *judge(server), "--data", str(data),
                       "--output", str(tmp_path / "o")])  # fmt: skip
    assert status == 2
    assert f"{data} row 2: missing field 'query'" in capsys.readouterr().err


def test_the_output_may_not_be_the_data_directory(tmp_path, capsys):
    data = tmp_path / "write.json"
    data.write_text(json.dumps([{"prompt": "Write.", "length": 4}]))
    with OpenAIStub(key=KEY) as server:
        status = main(["eval", "write", *served(server), "--data", str(data), "--output", str(tmp_path)])
    assert status == 2
    assert "the output contains the input" in capsys.readouterr().err


def test_chat_with_a_local_model_and_a_served_judge(tmp_path):
    model = tiny_model("llama", vocab_size=4096, max_position_embeddings=512)
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Text " * n + "Question?", "query": "Question?", "answer": "R"}) + "\n"
                            for n in (5, 900)))  # fmt: skip
    out = tmp_path / "chat"
    with OpenAIStub(lambda body: "Fine. [[4]]", key=KEY) as server:
        status = main(["eval", "chat", "--model", str(tmp_path / "model"), "--max-new-tokens", "6", "--max-length",
                       "300", *judge(server), "--data", str(data), "--output", str(out)])  # fmt: skip
        judged = [r["messages"][-1]["content"] for r in server.requests]
    assert status == 0
    rows = read_results(out)
    assert [r["prompt_tokens"] <= 300 for r in rows] == [True, True] and rows[1]["prompt_tokens"] == 300
    for row in rows:  # the judge's requests arrive in any order (several in flight)
        assert row["output"] and sum(row["output"] in message for message in judged) >= 1
    assert json.loads((out / "summary.json").read_text()) == {"mean": 4.0, "n": 2, "rated": 2, "unrated": 0}
    record = json.loads((out / "run_config.json").read_text())
    assert record["server"] is None and record["judge"]["api_key_env"] == "OPENAI_API_KEY"
    no_key_in(out)


# --- the answer store, batches, no tokenizer -------------------------------------------------------------


def chat_data(tmp_path: Path, n: int = 3) -> Path:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"idx": i, "prompt": f"Long text {i}. Question {i}?", "query": f"Question {i}?",
                                        "answer": f"ref {i}"}) + "\n" for i in range(n)))  # fmt: skip
    return data


def rate(body: dict) -> str:
    """A model that repeats the question, and a judge whose rating is the case's number + 2."""
    content = body["messages"][-1]["content"]
    if body["messages"][0]["content"] == JUDGE_SYSTEM:
        case = int(re.search(r"Question (\d+)", content)[1])
        return f"Fair. [[{case + 2}]]"
    return "answer to " + content.split(".")[0]


def judge_of(server: OpenAIStub) -> list[str]:
    return ["--judge-base-url", server.base_url, "--judge-model", server.model, "--judge-max-retries", "0"]


def test_a_served_eval_run_again_asks_nothing_and_writes_the_same_results(tmp_path, capsys):
    out = tmp_path / "needle"
    argv = ["--lengths", "200,400", "--depths", "0,50,100", "--output", str(out)]
    with OpenAIStub(lambda body: "I could not find it.", key=KEY) as server:
        assert main(["eval", "needle", *served(server), *argv]) == 0
        first = (out / "results.jsonl").read_bytes()
        assert main(["eval", "needle", *served(server), *argv]) == 0
        assert server.calls == 6
        assert main(["eval", "needle", *served(server), *argv, "--samples-per-cell", "2"]) == 0
        assert server.calls == 6 + 6  # the new samples only
        longer = ["--lengths", "200,400,800", *argv[2:], "--samples-per-cell", "2"]
        assert main(["eval", "needle", *served(server), *longer]) == 0
        assert server.calls == 6 + 6 + 6  # the new length only: a prompt does not depend on the others
    assert (out / "results.jsonl").read_bytes() != first
    printed = capsys.readouterr().out
    assert "model: 0 calls made (0 failed, 0 retried, 0 rate-limited), 6 answers reused (" in printed
    report = json.loads((out / "report.json").read_text())
    assert (report["model"]["calls"]["made"], report["model"]["calls"]["reused"]) == (6, 12)
    assert len(read_results(out)) == len((out / "calls.jsonl").read_text().splitlines()) == 18
    no_key_in(out)


def test_a_changed_judge_model_re_asks_only_the_judge(tmp_path):
    data, out = chat_data(tmp_path), tmp_path / "chat"
    with (
        OpenAIStub(rate, key=KEY) as model,
        OpenAIStub(rate, key=KEY, model="judge-a") as judge_a,
        OpenAIStub(rate, key=KEY, model="judge-b") as judge_b,
    ):
        argv = ["eval", "chat", *served(model), "--data", str(data), "--output", str(out)]
        assert main([*argv, *judge_of(judge_a)]) == 0
        assert (model.calls, judge_a.calls) == (3, 3)
        assert main([*argv, *judge_of(judge_b)]) == 0
        assert (model.calls, judge_a.calls, judge_b.calls) == (3, 3, 3)  # only the new judge was asked
        assert main([*argv, *judge_of(judge_a)]) == 0  # both judges' ratings are kept
        assert (model.calls, judge_a.calls, judge_b.calls) == (3, 3, 3)
    assert [r["rating"] for r in read_results(out)] == [2.0, 3.0, 4.0]
    report = json.loads((out / "report.json").read_text())
    assert report["judge"]["server"]["model"] == "judge-a" and report["judge"]["calls"]["reused"] == 3


def test_write_and_chat_run_through_a_server_without_a_tokenizer(tmp_path, capsys):
    write_data = tmp_path / "write.jsonl"
    write_data.write_text(json.dumps({"prompt": "Write 4 words, naïvely.", "length": 4}) + "\n")
    no_tokenizer = lambda server: [a for a in served(server) if a != str(TOKENIZER) and a != "--tokenizer"]  # noqa: E731
    with OpenAIStub(lambda body: "one two three four", key=KEY) as server:
        assert main(["eval", "write", *no_tokenizer(server), "--data", str(write_data),
                     "--output", str(tmp_path / "write")]) == 0  # fmt: skip
        (body,) = server.requests
    assert body["messages"] == [{"role": "user", "content": "Write 4 words, naïvely."}]  # the text as it is
    assert read_results(tmp_path / "write")[0]["length_score"] == 100.0
    with OpenAIStub(rate, key=KEY) as server:
        argv = ["eval", "chat", *no_tokenizer(server), *judge_of(server), "--data", str(chat_data(tmp_path))]
        assert main([*argv, "--output", str(tmp_path / "chat")]) == 0
        assert main([*argv, "--max-length", "100", "--output", str(tmp_path / "cut")]) == 2
        assert (
            "--tokenizer: needed with --backend openai (--max-length cuts the prompts' middle in tokens)"
            in (capsys.readouterr().err)
        )
        assert main(["eval", "needle", *no_tokenizer(server), "--output", str(tmp_path / "needle")]) == 2
        assert "--tokenizer: needed with --backend openai (it builds prompts of exact token lengths)" in (
            capsys.readouterr().err
        )
    rows = read_results(tmp_path / "chat")
    assert [(r["prompt_tokens"], r["rating"]) for r in rows] == [(None, 2.0), (None, 3.0), (None, 4.0)]


def batch_flags() -> list[str]:
    return ["--batch", "--batch-poll", "0.01"]


def test_eval_chat_through_the_batch_api_equals_the_online_run(tmp_path):
    data = chat_data(tmp_path)
    with OpenAIStub(rate, key=KEY) as server:
        argv = ["eval", "chat", *served(server), *judge_of(server), "--data", str(data)]
        assert main([*argv, "--output", str(tmp_path / "online")]) == 0
        online = server.calls
        assert main([*argv, *batch_flags(), "--output", str(tmp_path / "batch")]) == 0
        assert server.calls == online  # nothing more asked one at a time
        assert server.batches == ["batch_stub_1", "batch_stub_2"]  # the model's answers, then the ratings
        assert len(server.batch_requests) == 6
    assert read_results(tmp_path / "batch") == read_results(tmp_path / "online")
    report = json.loads((tmp_path / "batch" / "report.json").read_text())
    assert report["model"]["batch"]["answered"] == report["judge"]["batch"]["answered"] == 3


def test_eval_write_batch_file_only_then_batch_results_equals_the_batch_run(tmp_path, capsys):
    data = tmp_path / "write.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"Write {n} words.", "length": 5}) + "\n" for n in (3, 5, 9))
    )

    def reply(body):
        if body["messages"][0]["content"] == QUALITY_SYSTEM:
            return "Decent. [[7]]"
        return " ".join(["word"] * int(re.search(r"Write (\d+) words", body["messages"][-1]["content"])[1]))

    with OpenAIStub(reply, key=KEY) as server:
        argv = ["eval", "write", *served(server), *judge_of(server), "--data", str(data)]
        assert main([*argv, *batch_flags(), "--output", str(tmp_path / "batch")]) == 0
    offline = OpenAIStub(reply, key=KEY)  # never started: its run_batch_file stands in for vllm run-batch
    out = tmp_path / "write"
    argv = ["eval", "write", "--backend", "openai", "--served-model", "stub-model", "--judge-model", "stub-model",
            "--data", str(data), "--output", str(out)]  # fmt: skip
    rounds, results = 0, ["--batch-file-only"]
    while not out.exists():
        assert main([*argv, *results]) == 0
        printed = capsys.readouterr().out
        if out.exists():
            break
        command = re.search(r"^run it: (vllm run-batch .*)$", printed, re.M)[1].split()
        Path(command[5]).write_text(offline.run_batch_file(Path(command[3]).read_text()))
        results = ["--batch-results", command[5]]
        rounds += 1
    assert rounds == 2
    assert read_results(out) == read_results(tmp_path / "batch")


@pytest.mark.integration
def test_eval_chat_killed_after_some_judged_cases_resumes_asking_nothing_answered(tmp_path):
    data, out = chat_data(tmp_path, n=6), tmp_path / "chat"
    gate = Gate(rate, open_for=6 + 3)  # the six answers and three ratings; the next ratings are held
    command = lambda server: [sys.executable, "-m", "longalign", "eval", "chat", *served(server),  # noqa: E731
                              *judge_of(server), "--data", str(data), "--output", str(out)]  # fmt: skip
    with OpenAIStub(gate, key=KEY) as server:
        # every answer is in the work file before the kill
        ready = lambda: finished_lines(work_path(out)) >= 9  # noqa: E731
        returncode = killed_once(command(server), ready=ready, what="kept nine answers", cwd=ROOT)
        gate.release.set()
        in_flight = list(gate.held)
    assert returncode == -signal.SIGKILL and not out.exists()
    assert in_flight  # ratings were asked and held when the run was killed
    with OpenAIStub(rate, key=KEY) as server:
        result = run_process(command(server), timeout=300, cwd=ROOT)
        again = server.requests
    assert result.returncode == 0, result.stderr[-2000:]
    canonical = lambda body: json.dumps(body, sort_keys=True)  # noqa: E731
    assert len(again) == 3  # the three ratings not answered before the kill
    assert not {canonical(b) for b in gate.answered} & {canonical(b) for b in again}
    assert {canonical(b) for b in in_flight} <= {canonical(b) for b in again}  # asked again: never answered
    assert [r["rating"] for r in read_results(out)] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert not work_path(out).exists()
