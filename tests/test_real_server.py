"""``longalign data`` and ``longalign eval`` against a real OpenAI-compatible server that is not ours:
``transformers serve`` (the ``transformers[serving]`` extra) hosting a tiny Llama built here, on 127.0.0.1, CPU.

The model answers every chat with ``REPLY``: its layers add nothing to the residual stream, so the next
token depends on the last one alone, and its embeddings and output rows chain the chat template's last
token through the tokens of ``REPLY`` to the end-of-turn token. Requests are counted in the server's own
access log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER, tiny_model
from transformers import AutoTokenizer

from longalign.cli import main

REPLY = "Yes, seven."
SERVE = Path(sys.executable).parent / "transformers"
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("fastapi") is None or not SERVE.exists(),
        reason="transformers serve needs the transformers[serving] extra (in dev)",
    ),
]


def build_replying_model(folder: Path) -> None:
    """A tiny Llama (and the shipped tokenizer) that answers every chat with ``REPLY``, saved to ``folder``."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    frame = tokenizer(rendered, add_special_tokens=False).input_ids
    chain = [frame[-1], *tokenizer(REPLY, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "each token of the chain leads to one next token"
    model = tiny_model(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.no_grad():
        for layer in model.model.layers:  # nothing added to the residual: the last token decides
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for dim, (token, following) in enumerate(itertools.pairwise(chain)):
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[following, dim] = 20.0  # a logit of ~110 against 0: sampling picks it too
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``transformers serve`` of the replying model: ``(base URL, model name, access log path)``."""
    folder = tmp_path_factory.mktemp("served") / "replying-model"
    build_replying_model(folder)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = folder.parent / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(SERVE), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:  # ready once /health answers
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "transformers serve did not start"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", str(folder), log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def chat_requests(log: Path) -> int:
    """The chat completions the server has answered so far, from its access log."""
    return log.read_text().count('"POST /v1/chat/completions HTTP/1.1" 200')


def server_flags(url: str, model: str) -> list[str]:
    return ["--base-url", url, "--served-model", model, "--api-key-env", "LONGALIGN_NO_KEY"]


def test_data_self_instruct_through_transformers_serve_and_again_from_the_store(served, tmp_path, capsys):
    url, model, log = served
    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(2):
        (docs / f"d{n}.md").write_text(
            "\n\n".join(f"Part {n}.{p}: the river passes the mill." * 4 for p in range(6))
        )
    out = tmp_path / "gen"
    argv = ["data", "self-instruct", "--docs", str(docs), "--tokenizer", str(TOKENIZER), "--min-tokens", "50",
            "--max-tokens", "600", "--per-doc", "2", "--max-new-tokens", "16", "--output", str(out),
            *server_flags(url, model)]  # fmt: skip
    before = chat_requests(log)
    assert main(argv) == 0
    assert chat_requests(log) - before == 8  # an instruction and an answer for each of 4 samples
    samples = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    assert all(s["messages"][-1] == {"role": "assistant", "content": REPLY} for s in samples)
    assert all(s["messages"][0]["content"].endswith(REPLY) for s in samples)  # the instruction asked
    first = (out / "data.jsonl").read_bytes()
    assert main(argv) == 0
    assert chat_requests(log) - before == 8  # the rerun asked nothing
    assert (out / "data.jsonl").read_bytes() == first
    assert "8 answers reused" in capsys.readouterr().out


def test_eval_needle_write_and_chat_through_transformers_serve(served, tmp_path):
    url, model, log = served
    before = chat_requests(log)
    flags = ["--backend", "openai", *server_flags(url, model), "--max-new-tokens", "16"]
    needle = tmp_path / "needle"
    assert main(["eval", "needle", *flags, "--tokenizer", model, "--lengths", "200,300", "--depths", "0,100",
                 "--output", str(needle)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (needle / "results.jsonl").read_text().splitlines()]
    assert [(r["length"], r["output"], r["score"]) for r in rows] == [
        (n, REPLY, 0.0) for n in (200, 200, 300, 300)
    ]
    write_data = tmp_path / "write.jsonl"
    write_data.write_text(json.dumps({"prompt": "Write two words.", "length": 2}) + "\n")
    write = tmp_path / "write"
    assert main(["eval", "write", *flags, "--data", str(write_data), "--output", str(write)]) == 0
    (row,) = [json.loads(line) for line in (write / "results.jsonl").read_text().splitlines()]
    assert (row["output"], row["response_length"], row["length_score"]) == (REPLY, 2, 100.0)
    chat_data = tmp_path / "chat.jsonl"
    chat_data.write_text(
        json.dumps({"prompt": "A long text. Question?", "query": "Question?", "answer": "R"}) + "\n"
    )
    chat = tmp_path / "chat"
    judge = ["--judge-base-url", url, "--judge-model", model, "--judge-api-key-env", "LONGALIGN_NO_KEY"]
    assert main(["eval", "chat", *flags, *judge, "--judge-retries", "1", "--data", str(chat_data),
                 "--output", str(chat)]) == 0  # fmt: skip
    (row,) = [json.loads(line) for line in (chat / "results.jsonl").read_text().splitlines()]
    assert (row["output"], row["judge_output"], row["rating"], row["judge_tries"]) == (REPLY, REPLY, None, 2)
    asked = chat_requests(log) - before
    assert asked == 4 + 1 + 1 + 2  # needle prompts, the writing prompt, the chat answer, two ratings
    assert main(["eval", "chat", *flags, *judge, "--judge-retries", "1", "--data", str(chat_data),
                 "--output", str(chat)]) == 0  # fmt: skip
    assert chat_requests(log) - before == asked  # all from the store
