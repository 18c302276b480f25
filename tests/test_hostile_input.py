"""Hostile input for the pre-tokenize stage: a committed corpus with expected outcomes, and a fuzzer.

Every line, however broken, must become a kept sample or a drop counted under one of ``DROP_REASONS``,
with a message that Arrow can store. tests/data/make_hostile.py writes the corpus and its expectations.
"""

from __future__ import annotations

import json
import runpy
from collections import Counter
from pathlib import Path

import datasets
import pytest
from conftest import TOKENIZER
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from longalign.artifacts import read_report
from longalign.chat_template import profile_tokenizer
from longalign.config import IGNORE_INDEX
from longalign.errors import InputError
from longalign.records import DROP_REASONS
from longalign.tokenize import pre_tokenize, process_line

DATA = Path(__file__).resolve().parent / "data"
CORPUS = DATA / "hostile.jsonl"
EXPECTED = json.loads((DATA / "hostile.expected.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def corpus_tokenizer():
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = EXPECTED["chat_template"]
    return tok


def test_corpus_is_what_its_generator_writes(tmp_path):
    runpy.run_path(str(DATA / "make_hostile.py"))["make"](tmp_path)
    assert (tmp_path / "hostile.jsonl").read_bytes() == CORPUS.read_bytes()
    assert json.loads((tmp_path / "hostile.expected.json").read_text()) == EXPECTED
    assert CORPUS.stat().st_size < 1_000_000
    assert set(EXPECTED["outcomes"]) == {"", *DROP_REASONS}  # every drop reason, and kept samples


def test_corpus_every_line_kept_or_dropped_as_expected(tmp_path, corpus_tokenizer):
    outcomes = EXPECTED["outcomes"]
    settings_ = {"max_seq_len": EXPECTED["max_seq_len"], "truncation": EXPECTED["truncation"]}
    report = pre_tokenize(CORPUS, corpus_tokenizer, tmp_path / "out", **settings_)
    assert report["lines_read"] == report["samples_kept"] + report["dropped_total"] == len(outcomes)
    expected = Counter(outcomes)
    assert report["samples_kept"] == expected[""]
    assert report["dropped"] == {reason: expected[reason] for reason in DROP_REASONS}
    for error in report["first_errors"]:
        assert error["reason"] == outcomes[error["line"] - 1]
    assert report["samples_with_special_token_text"] == 4
    (tmp_path / "out" / "report.json").read_bytes().decode("utf-8")  # strict UTF-8 throughout
    assert read_report(tmp_path / "out") == report

    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert ds["line"] == [n for n, outcome in enumerate(outcomes, start=1) if outcome == ""]
    assert all(0 < n <= EXPECTED["max_seq_len"] for n in ds["length"]) and all(ds["num_targets"])

    # Line by line, each reason exactly, and every message storable.
    profile = profile_tokenizer(corpus_tokenizer)
    lines = CORPUS.read_bytes().decode("utf-8").removeprefix("\ufeff").split("\n")[:-1]
    for number, (line, outcome) in enumerate(zip(lines, outcomes, strict=True), start=1):
        row = process_line(line.rstrip("\r"), corpus_tokenizer, profile=profile, **settings_)
        assert row["reason"] == outcome, (number, row["error"])
        row["error"].encode("utf-8")
        assert len(row["error"]) < 400


@pytest.mark.parametrize(
    "bad_bytes",
    [b"caf\xe9", b"\x80", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xc0\xaf", b"\xff\xfe"],
)
def test_invalid_utf8_is_a_file_error_naming_its_line(tmp_path, corpus_tokenizer, bad_bytes):
    """Not a line to drop: the file is not UTF-8 (wrong encoding, a lone continuation byte, an encoded
    surrogate, an overlong form), so the whole run stops, naming the line, and writes nothing."""
    src = tmp_path / "in.jsonl"
    good = CORPUS.read_bytes().split(b"\n")[1]
    src.write_bytes(good + b"\n" + good + b"\n" + b'{"prompt": "' + bad_bytes + b'", "response": "x"}\n')
    with pytest.raises(InputError, match="line 3: not valid UTF-8"):
        pre_tokenize(src, corpus_tokenizer, tmp_path / "out", max_seq_len=64)
    assert not (tmp_path / "out").exists()


# --- fuzzing the line parser ---------------------------------------------------------------------------

# Text with the characters that break things: lone surrogates, NUL, quotes, backslashes, control tokens.
nasty_text = st.lists(
    st.text(max_size=6)
    | st.sampled_from(
        ["\ud800", "\udfff", "\x00", '"', "\\", "\r", "\n", "\u2028", "<|eot_id|>", "<|im_end|>"]
    ),
    max_size=6,
).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats() | nasty_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(nasty_text, inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "human", "gpt", "robot", ""]) | json_values
parts = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image"]) | json_values, "text": json_values | nasty_text}
    ),
    max_size=3,
)
contents = nasty_text | parts | json_values
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": contents}) | json_values,
    max_size=5,
)
records = st.one_of(
    json_values,
    st.fixed_dictionaries({"messages": messages}),
    st.fixed_dictionaries(
        {"conversations": st.lists(st.fixed_dictionaries({"from": roles, "value": contents}), max_size=4)}
    ),
    st.fixed_dictionaries({"prompt": contents, "response": contents}, optional={"system": contents}),
)


def as_line(record, cut: int | None) -> str:
    line = json.dumps(record)  # ensure_ascii: lone surrogates become escapes, as in real files
    return line if cut is None else line[:cut]


lines = st.one_of(
    st.builds(as_line, records, st.none() | st.integers(0, 40)),
    st.text(max_size=40),
    st.sampled_from(["[" * 3000, '{"a": ' + "1" * 5000 + "}", '{"\\ud800": 0}', "\ufeff{}"]),
)


@pytest.fixture(scope="module")
def fuzz_tokenizer():
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    return tok, profile_tokenizer(tok)


@settings(max_examples=300, deadline=None)
@given(line=lines, max_seq_len=st.integers(1, 64), truncation=st.sampled_from(["right", "left", "drop"]))
def test_process_line_never_raises(fuzz_tokenizer, line, max_seq_len, truncation):
    tok, profile = fuzz_tokenizer
    row = process_line(line, tok, max_seq_len=max_seq_len, truncation=truncation, profile=profile)
    assert row["reason"] in ("", *DROP_REASONS)
    row["error"].encode("utf-8")
    if row["reason"] == "":
        assert row["error"] == "" and 0 < len(row["input_ids"]) == len(row["labels"]) <= max_seq_len
        assert any(t != IGNORE_INDEX for t in row["labels"])
    else:
        assert row["error"] and row["input_ids"] == row["labels"] == []
