"""Batch input and results lines: the OpenAI batch API's shapes and ``vllm run-batch``'s."""

from __future__ import annotations

import json

import pytest

from longalign.batches import batch_input, read_results
from longalign.errors import InputError
from longalign.serving import CallFailure, Completion


def test_a_batch_input_line_per_request_keyed_by_custom_id_with_server_fields_in_the_body():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.0,
            "extra_body": {"top_k": 20}}  # fmt: skip
    (line,) = batch_input({"k1": body}).splitlines()
    assert json.loads(line) == {
        "custom_id": "k1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.0,
            "top_k": 20,
        },
    }
    (line,) = batch_input({"k2": {"model": "m", "prompt": "raw text", "max_tokens": 4}}).splitlines()
    assert json.loads(line)["url"] == "/v1/completions"  # a raw prompt: the completions endpoint


def completion_body(text: str) -> dict:
    return {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": text}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip


def test_results_lines_answered_and_failed_in_each_shape():
    lines = [
        # answered (OpenAI and vLLM alike)
        {"custom_id": "a", "response": {"status_code": 200, "request_id": "r", "body": completion_body("4")}, "error": None},
        # the OpenAI error file: the server's error body
        {"custom_id": "b", "response": {"status_code": 400, "body": {"error": {"message": "too long"}}}, "error": None},
        # the OpenAI error file: no response (e.g. the batch expired)
        {"custom_id": "c", "response": None, "error": {"code": "batch_expired", "message": "not run in time"}},
        # vllm run-batch: an ErrorResponse, or the message of an exception
        {"custom_id": "d", "response": {"status_code": 404, "request_id": "r", "body": None},
         "error": {"error": {"message": "The model `x` does not exist.", "code": 404}}},
        {"custom_id": "e", "response": {"status_code": 400, "request_id": "r", "body": None}, "error": "bad   input"},
    ]  # fmt: skip
    results = read_results("".join(json.dumps(line) + "\n\n" for line in lines), where="r.jsonl")
    assert results == {
        "a": Completion("4", "stop", 3, 1),
        "b": CallFailure("400 from the batch: too long", 400),
        "c": CallFailure("no answer from the batch: not run in time", None),
        "d": CallFailure("404 from the batch: The model `x` does not exist.", 404),
        "e": CallFailure("400 from the batch: bad input", 400),
    }


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"response": {"status_code": 200}}',
        '{"custom_id": "a", "response": {"status_code": 200}}',
    ],
)
def test_a_line_that_is_no_result_is_named(line):
    with pytest.raises(InputError, match=r"^r.jsonl line 2: not a batch result line \("):
        read_results('{"custom_id": "z", "response": null, "error": "x"}\n' + line, where="r.jsonl")
