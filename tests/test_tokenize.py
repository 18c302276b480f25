"""The pre-tokenize stage: every line accounted for, hostile lines, the size guard, errors before work."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from templates import GOOD, QUOTING, write_jsonl
from transformers import AddedToken

import longalign.tokenize as stage
from longalign.artifacts import read_report
from longalign.chat_template import (
    longest_token_bytes,
    profile_tokenizer,
)
from longalign.config import IGNORE_INDEX, Source
from longalign.errors import InputError
from longalign.labels import tokenize_conversation
from longalign.records import DROP_REASONS, RecordError, parse_record
from longalign.tokenize import min_tokens, pre_tokenize, process_line

# --- the whole stage -----------------------------------------------------------------------------------


LONG = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]}


def test_stage_accounts_for_every_line(tmp_path, base_tokenizer):
    lines = [
        GOOD,
        "",
        "{not json",
        {"text": "x"},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "gpt", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "x"}]},
        LONG,
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    report = pre_tokenize(src, base_tokenizer, tmp_path / "out", max_seq_len=64, truncation="drop")
    assert report["lines_read"] == len(lines)
    assert report["lines_read"] == report["samples_kept"] + sum(report["dropped"].values())
    assert report["samples_kept"] == 2
    assert report["dropped"] == {
        "empty_line": 1,
        "malformed_json": 1,
        "unknown_format": 1,
        "bad_message": 1,
        "bad_role": 1,
        "empty_assistant": 1,
        "no_targets": 1,
        "template_error": 0,
        "over_length": 1,
    }
    assert set(report["dropped"]) == set(DROP_REASONS)
    assert [e["line"] for e in report["first_errors"]] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert read_report(tmp_path / "out") == report

    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert ds.column_names == ["input_ids", "labels", "length", "num_targets", "line", "source"]
    assert ds["line"] == [1, 10] and ds["source"] == [0, 0]
    (only,) = report["sources"]  # one input: its own counts are the totals
    assert only["name"] == str(src) and only["lines_read"] == report["lines_read"]
    assert only["dropped"] == report["dropped"] and only["total_tokens"] == report["total_tokens"]
    for row in ds:
        assert row["length"] == len(row["input_ids"]) == len(row["labels"])
        assert row["num_targets"] == sum(t != IGNORE_INDEX for t in row["labels"])
    assert report["total_tokens"] == sum(ds["length"])
    assert report["target_tokens"] == sum(ds["num_targets"])


def test_several_sources_are_accounted_for_separately(tmp_path, base_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = write_jsonl(tmp_path / "chats.jsonl", [GOOD, "{broken", GOOD])
    odd = [{"dialog": [{"speaker": "user", "text": "hey"}, {"speaker": "assistant", "text": "hello"}]}] * 2
    pq.write_table(pa.Table.from_pylist(odd), tmp_path / "odd.parquet")
    columns = {"messages": "dialog", "role": "speaker", "content": "text"}
    sources = [Source(str(chats)), Source(str(tmp_path / "odd.parquet"), columns=columns)]
    report = pre_tokenize(sources, base_tokenizer, tmp_path / "out", max_seq_len=64)
    first, second = report["sources"]
    assert (first["lines_read"], first["samples_kept"], first["dropped"]["malformed_json"]) == (3, 2, 1)
    assert (second["name"], second["lines_read"], second["samples_kept"]) == (
        str(tmp_path / "odd.parquet"),
        2,
        2,
    )
    assert report["lines_read"] == 5 and report["samples_kept"] == 4
    assert report["total_tokens"] == first["total_tokens"] + second["total_tokens"]
    assert report["first_errors"][0]["file"] == str(chats) and report["first_errors"][0]["line"] == 2
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    assert list(zip(ds["source"], ds["line"], strict=True)) == [(0, 1), (0, 3), (1, 1), (1, 2)]


@pytest.mark.parametrize("mode", ["right", "left"])
def test_stage_truncation_keeps_valid_samples(tmp_path, base_tokenizer, mode):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, LONG])
    full = len(tokenize_conversation(base_tokenizer, parse_record(LONG))[0])
    report = pre_tokenize(src, base_tokenizer, tmp_path / "out", max_seq_len=full - 3, truncation=mode)
    ds = datasets.load_from_disk(str(tmp_path / "out"))
    if mode == "right":  # the answer sits at the end, so cutting the end leaves no target
        assert report["dropped"]["over_length"] == 1 and report["samples_kept"] == 1
    else:
        assert report["truncated"] == 1 and report["samples_kept"] == 2
        assert ds[1]["length"] == full - 3 and ds[1]["num_targets"] > 0


def test_strict_stops_at_first_bad_line_and_keeps_old_output(tmp_path, base_tokenizer):
    out = tmp_path / "out"
    pre_tokenize(write_jsonl(tmp_path / "ok.jsonl", [GOOD]), base_tokenizer, out, max_seq_len=64)
    before = sorted(p.name for p in out.iterdir())
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, GOOD, {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(RecordError, match="line 3: message 0 has role 'robot'"):
        pre_tokenize(src, base_tokenizer, out, max_seq_len=64, strict=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert read_report(out)["lines_read"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "ok.jsonl", "out"]  # no staging left


def test_unreadable_inputs_are_clear_errors(tmp_path, base_tokenizer):
    with pytest.raises(InputError, match="not found"):
        pre_tokenize(tmp_path / "missing.jsonl", base_tokenizer, tmp_path / "o", max_seq_len=64)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(InputError, match="empty"):
        pre_tokenize(tmp_path / "empty.jsonl", base_tokenizer, tmp_path / "o", max_seq_len=64)
    (tmp_path / "latin1.jsonl").write_bytes(
        json.dumps(GOOD).encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1")
    )
    with pytest.raises(InputError, match="line 2: not valid UTF-8"):
        pre_tokenize(tmp_path / "latin1.jsonl", base_tokenizer, tmp_path / "o", max_seq_len=64)
    assert not (tmp_path / "o").exists()


def test_parallel_tokenization_matches_serial(tmp_path, base_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, LONG, "{bad", GOOD] * 8)
    one = pre_tokenize(src, base_tokenizer, tmp_path / "one", max_seq_len=128)
    two = pre_tokenize(src, base_tokenizer, tmp_path / "two", max_seq_len=128, num_proc=2)
    assert one == two
    a, b = (datasets.load_from_disk(str(tmp_path / name)) for name in ("one", "two"))
    assert a.to_dict() == b.to_dict()


# --- hostile lines -------------------------------------------------------------------------------------


def line_of(record) -> str:
    return record if isinstance(record, str) else json.dumps(record)


@pytest.mark.parametrize(
    "line, reason, words",
    [
        (
            {"messages": [{"role": ["user"], "content": "x"}, {"role": "assistant", "content": "y"}]},
            "bad_role",
            "message 0 has a role of type list",
        ),
        ({"conversations": [{"from": {"a": 1}, "value": "x"}]}, "bad_role", "of type dict"),
        ('{"messages": [], "id": ' + "7" * 5000 + "}", "malformed_json", "4300 digits"),
        ("[" * 1000 + "]" * 1000, "malformed_json", "recursion"),
        ("[" * 100_000, "malformed_json", "recursion"),
        ('{"\\ud800": 1}', "unknown_format", "keys: \\ud800"),
        (
            '{"messages": [{"role": "user", "content": "a\\udfff"}, {"role": "assistant", "content": "b"}]}',
            "bad_message",
            "message 0 content: lone surrogate \\udfff",
        ),
        (
            {"messages": [{"role": "r" * 10_000, "content": "x"}, {"role": "assistant", "content": "y"}]},
            "bad_role",
            "rrrr...",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": None}]},
                    GOOD["messages"][1],
                ]
            },
            "bad_message",
            "message 0 content part 0: 'text' must be a string, got NoneType",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 42}]}, GOOD["messages"][1]]},
            "bad_message",
            "got int",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}, GOOD["messages"][1]]},
            "bad_message",
            "message 0 content part 0: 'text' must be a string",
        ),
        ({"prompt": "hi", "response": [{"type": "image_url", "url": "x"}]}, "bad_message", "response part 0"),
    ],
)
def test_hostile_lines_are_drops_with_a_reason(base_tokenizer, line, reason, words):
    row = process_line(line_of(line), base_tokenizer, max_seq_len=64, truncation="right")
    assert (row["reason"], row["input_ids"]) == (reason, [])
    assert words in row["error"]
    assert len(row["error"]) <= 500
    row["error"].encode("utf-8")  # Arrow stores the message: it must be valid UTF-8


def test_bom_at_file_start_is_not_a_bad_line(tmp_path, base_tokenizer):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n" + json.dumps(GOOD).encode() + b"\n")
    report = pre_tokenize(src, base_tokenizer, tmp_path / "out", max_seq_len=64)
    assert (report["samples_kept"], report["dropped_total"]) == (2, 0)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_strict_stops_before_tokenizing_the_rest(tmp_path, base_tokenizer, monkeypatch, num_proc):
    """The first bad line ends the run at once, as the same one-line RecordError in every process count."""
    import longalign.tokenize as stage

    lines_seen = []
    real = stage.process_line
    monkeypatch.setattr(
        stage, "process_line", lambda text, *a, **k: lines_seen.append(text) or real(text, *a, **k)
    )
    src = write_jsonl(tmp_path / "in.jsonl", ["{oops"] + [GOOD] * 300)
    with pytest.raises(RecordError) as err:
        pre_tokenize(src, base_tokenizer, tmp_path / "out", max_seq_len=64, strict=True, num_proc=num_proc)
    assert str(err.value).startswith(f"{src}: line 1: not valid JSON")
    assert err.value.reason == "malformed_json" and err.value.__cause__ is None
    if num_proc == 1:
        assert lines_seen == ["{oops"]  # no line after the bad one was tokenized
    assert not (tmp_path / "out").exists()


# --- the size guard: too long to fit, known before tokenizing ------------------------------------------


def without_guard(profile):
    return replace(profile, max_token_bytes=None)


def test_longest_token_is_measured_in_the_bytes_it_stands_for(base_tokenizer, glm_tokenizer):
    # Byte-level entries spell one byte per character: "ĊĠĠĠ..." (a newline and 23 spaces) is 24 bytes, not
    # the 47 its UTF-8 spelling takes; the longest entry is a 37-byte ASCII rule, one token.
    assert longest_token_bytes(base_tokenizer) == 37
    assert (
        len(base_tokenizer("+---------------+-------------------+", add_special_tokens=False)["input_ids"])
        == 1
    )
    longer = copy.deepcopy(base_tokenizer)
    longer.add_special_tokens({"additional_special_tokens": ["<|" + "x" * 60 + "|>"]})
    assert longest_token_bytes(longer) == 64  # added tokens count by their content


@pytest.fixture(scope="module")
def bounded_tokenizers(base_tokenizer, glm_tokenizer):
    """The shipped vocabulary, the GLM-4-style one, and one whose <mask> swallows whitespace on both sides."""
    greedy = copy.deepcopy(base_tokenizer)
    greedy.add_special_tokens({"additional_special_tokens": [AddedToken("<mask>", lstrip=True, rstrip=True)]})
    bounded = []
    for tok in (base_tokenizer, glm_tokenizer, greedy):
        profile = profile_tokenizer(tok)
        bounded.append((tok, profile.max_token_bytes, profile.strips_whitespace))
    assert [strips for *_, strips in bounded] == [False, False, True]
    return bounded


@settings(max_examples=200, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            ["a", "b", " ", "\n", "\u00e9", "\u4e2d", "\U0001f600", "<|eot_id|>", "<|user|>", "<mask>"]
        )
        | st.just("+---------------+-------------------+")
        | st.just(" " * 50),
        max_size=60,
    ).map("".join)
)
def test_min_tokens_never_exceeds_the_tokenization(bounded_tokenizers, text):
    for tok, longest, strips in bounded_tokenizers:
        fewest = min_tokens(text, longest, strips_whitespace=strips)
        assert fewest <= len(tok(text, add_special_tokens=False)["input_ids"])


def test_min_tokens_counts_bytes():
    assert min_tokens("h\u00e9llo", 4) == 2  # 6 bytes
    assert min_tokens("ab" * 10, 5) == 4
    assert min_tokens("a" + " " * 100 + "b", 1, strips_whitespace=True) == 2
    assert min_tokens("", 3) == 0


HUGE = "word " * 2000  # 10,000 bytes: at least 271 tokens of this vocabulary, and ~2,000 really


@pytest.mark.parametrize(
    "truncation, messages, words",
    [
        ("drop", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": HUGE}], "at least"),
        (
            "right",
            [{"role": "user", "content": HUGE}, {"role": "assistant", "content": "ok"}],
            "before the first",
        ),
        (
            "left",
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": HUGE},
            ],
            "after the last",
        ),
    ],
)
def test_size_guard_drops_before_tokenizing(base_tokenizer, monkeypatch, truncation, messages, words):
    profile = profile_tokenizer(base_tokenizer)
    line = json.dumps({"messages": messages})
    unguarded = process_line(
        line, base_tokenizer, max_seq_len=100, truncation=truncation, profile=without_guard(profile)
    )
    assert unguarded["reason"] == "over_length"  # the full tokenization agrees, only slower
    monkeypatch.setattr(stage, "encode_rendering", lambda *a, **k: pytest.fail("tokenized a hopeless sample"))
    row = process_line(line, base_tokenizer, max_seq_len=100, truncation=truncation, profile=profile)
    assert row["reason"] == "over_length" and words in row["error"] and "before tokenizing" in row["error"]


def test_size_guard_keeps_a_long_answer_that_truncation_can_cut(base_tokenizer):
    line = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": HUGE}]}
    )
    row = process_line(
        line, base_tokenizer, max_seq_len=100, truncation="right", profile=profile_tokenizer(base_tokenizer)
    )
    assert (row["reason"], len(row["input_ids"]), row["truncated"]) == ("", 100, True)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=2, max_size=5),
    max_seq_len=st.integers(1, 40),
    truncation=st.sampled_from(["drop", "right", "left"]),
)
def test_size_guard_only_saves_time(base_tokenizer, lengths, max_seq_len, truncation):
    """With or without the guard, every line ends the same way: the guard drops only what would drop."""
    profile = profile_tokenizer(base_tokenizer)
    roles = ["user", "assistant"] * len(lengths)
    messages = [{"role": r, "content": "ab\u00e9 " * n + "x"} for r, n in zip(roles, lengths, strict=False)]
    line = json.dumps({"messages": messages})
    kwargs = {"max_seq_len": max_seq_len, "truncation": truncation}
    guarded = process_line(line, base_tokenizer, profile=profile, **kwargs)
    plain = process_line(line, base_tokenizer, profile=without_guard(profile), **kwargs)
    assert (guarded["reason"], guarded["input_ids"], guarded["labels"]) == (
        plain["reason"],
        plain["input_ids"],
        plain["labels"],
    )


def test_report_counts_samples_that_quote_control_tokens(tmp_path, base_tokenizer):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"messages": QUOTING}, GOOD])
    for mode in ("text", "parse"):
        report = pre_tokenize(
            src, base_tokenizer, tmp_path / mode, max_seq_len=256, special_tokens_in_text=mode
        )
        assert report["samples_with_special_token_text"] == 1 and report["special_tokens_in_text"] == mode
    text, parse = (datasets.load_from_disk(str(tmp_path / m))[1]["input_ids"] for m in ("text", "parse"))
    assert text != parse
    with pytest.raises(ValueError, match="special_tokens_in_text"):
        pre_tokenize(src, base_tokenizer, tmp_path / "x", max_seq_len=256, special_tokens_in_text="keep")


# --- errors before work --------------------------------------------------------------------------------


@pytest.mark.parametrize("max_seq_len", [0, -5])
def test_max_seq_len_below_one_fails_before_reading_input(tmp_path, base_tokenizer, max_seq_len):
    with pytest.raises(ValueError, match=f"max_seq_len must be >= 1, got {max_seq_len}$"):
        pre_tokenize(tmp_path / "not-there.jsonl", base_tokenizer, tmp_path / "out", max_seq_len=max_seq_len)


def test_file_that_gives_no_sample_is_an_error_and_writes_nothing(tmp_path, base_tokenizer):
    out = tmp_path / "out"
    pre_tokenize(write_jsonl(tmp_path / "ok.jsonl", [GOOD]), base_tokenizer, out, max_seq_len=64)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\t\n")
    with pytest.raises(InputError, match=f"{blank}: no line became a sample .*3 lines read.*empty_line 3"):
        pre_tokenize(blank, base_tokenizer, out, max_seq_len=64)
    assert read_report(out)["lines_read"] == 1  # the earlier output stands
    with pytest.raises(InputError, match="over_length 1"):
        pre_tokenize(
            write_jsonl(tmp_path / "long.jsonl", [LONG]), base_tokenizer, tmp_path / "o2", max_seq_len=8
        )
    assert not (tmp_path / "o2").exists()
