"""The shipped sample data: data/sample.jsonl, data/tokenizer/ and data/chat_templates/."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys

import pytest
from conftest import ROOT, SAMPLE, TOKENIZER, load_script, run_process
from transformers import AutoTokenizer

DATA = ROOT / "data"
META = DATA / "sample.meta.json"
LLAMA3_TEMPLATE = DATA / "chat_templates" / "llama3.jinja"
CHATML_TEMPLATE = DATA / "chat_templates" / "chatml.jinja"
SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
    "<|im_start|>",
    "<|im_end|>",
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What does `len` do?"},
    {"role": "assistant", "content": "It returns the number of items. Ünïcode: 🙂"},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def conversations() -> list[list[dict]]:
    with SAMPLE.open(encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


def test_sample_is_valid_chat_jsonl(conversations):
    assert 300 <= len(conversations) <= 1000
    for line, messages in enumerate(conversations, start=1):
        roles = [m["role"] for m in messages]
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0::2] == ["user"] * len(body[0::2]), f"line {line}: roles {roles}"
        assert body[1::2] == ["assistant"] * len(body[1::2]), f"line {line}: roles {roles}"
        assert body[-1] == "assistant", f"line {line}: ends with {body[-1]}"
        for m in messages:
            assert set(m) == {"role", "content"}, f"line {line}: keys {sorted(m)}"
            assert isinstance(m["content"], str) and m["content"].strip(), f"line {line}: empty {m['role']}"


def test_sample_mixes_turns_and_system_messages(conversations):
    n = len(conversations)
    with_system = sum(c[0]["role"] == "system" for c in conversations)
    turns = [sum(m["role"] == "assistant" for m in c) for c in conversations]
    assert 0.2 * n <= with_system <= 0.4 * n
    assert 0.5 * n <= turns.count(1) <= 0.9 * n
    assert set(turns) == {1, 2, 3, 4}


def test_sample_has_no_special_token_text(conversations):
    # A special token spelled inside a message would be encoded as the special token itself.
    for line, messages in enumerate(conversations, start=1):
        for m in messages:
            for token in SPECIAL_TOKENS:
                assert token not in m["content"], f"line {line}: contains {token}"


def test_sample_lengths_are_long_tailed(conversations, tokenizer):
    rendered = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    lengths = sorted(len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert statistics.median(lengths) < 400
    assert lengths[-1] > 4000
    assert lengths[-1] <= 8192
    assert sum(n > 2000 for n in lengths) >= 0.05 * len(lengths)
    assert SAMPLE.stat().st_size < 3_000_000


def test_meta_describes_the_shipped_file():
    meta = json.loads(META.read_text(encoding="utf-8"))
    assert meta["sha256"] == hashlib.sha256(SAMPLE.read_bytes()).hexdigest()
    assert meta["conversations"] == len(SAMPLE.read_text(encoding="utf-8").splitlines())


@pytest.mark.integration
def test_generator_reproduces_the_shipped_file(tmp_path):
    out = tmp_path / "sample.jsonl"
    # A different hash seed in the child shows that nothing depends on set or dict-of-str ordering.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = run_process(
        [sys.executable, "scripts/make_sample_data.py", "--output", str(out)], timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr
    shipped = json.loads(META.read_text(encoding="utf-8"))
    regenerated = json.loads((tmp_path / "sample.meta.json").read_text(encoding="utf-8"))
    if regenerated["source_sha256"] != shipped["source_sha256"]:
        pytest.skip(
            f"the standard-library docstrings of Python {regenerated['python']} differ from those of "
            f"Python {shipped['python']}, which generated the shipped file"
        )
    assert out.read_bytes() == SAMPLE.read_bytes()


def test_tokenizer_loads_as_fast_llama3_style(tokenizer):
    assert tokenizer.is_fast
    assert len(tokenizer) == 4096
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|eot_id|>"
    assert tokenizer.pad_token == "<|finetune_right_pad_id|>"
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(4088, 4096))
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    assert tokenizer.encode("hi", add_special_tokens=True)[0] == tokenizer.bos_token_id
    assert tokenizer.chat_template == LLAMA3_TEMPLATE.read_text(encoding="utf-8")


def test_llama3_template_renders_and_round_trips(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat does `len` do?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        "It returns the number of items. Ünïcode: 🙂<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nThanks!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYou're welcome.<|eot_id|>"
    )
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"] == ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|eot_id|>")) == len(CHAT)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|start_header_id|>")) == len(CHAT)
    assert tokenizer.decode(ids) == text
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids


def test_chatml_template_marks_assistant_tokens(tokenizer):
    template = CHATML_TEMPLATE.read_text(encoding="utf-8")
    text = tokenizer.apply_chat_template(CHAT, chat_template=template, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_start|>assistant\nYou're welcome.<|im_end|>\n")

    out = tokenizer.apply_chat_template(
        CHAT, chat_template=template, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = [i for i, m in zip(ids, mask, strict=True) if m]
    assert targets.count(im_end) == 2
    assert (
        tokenizer.decode(targets)
        == "It returns the number of items. Ünïcode: 🙂<|im_end|>You're welcome.<|im_end|>"
    )


def test_tokenizer_training_is_deterministic_and_reproduces_the_shipped_one():
    train_tokenizer = load_script("train_tokenizer")
    first = train_tokenizer.train(SAMPLE)
    assert first.to_str() == train_tokenizer.train(SAMPLE).to_str()
    shipped = json.loads((TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    trained = json.loads(first.to_str())["model"]
    assert trained["vocab"] == shipped["vocab"]
    # Merges are "a b" strings in older tokenizers releases and [a, b] pairs in newer ones.
    as_pairs = [m.split(" ") if isinstance(m, str) else m for m in trained["merges"]]
    assert as_pairs == [m.split(" ") if isinstance(m, str) else m for m in shipped["merges"]]
