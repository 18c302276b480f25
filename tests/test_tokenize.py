"""Pre-tokenization: record formats, label masks per template, truncation, bad input, the report."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from longalign.artifacts import read_report
from longalign.tokenize import (
    DROP_REASONS,
    IGNORE_INDEX,
    InputError,
    RecordError,
    TemplateError,
    check_chat_template,
    clean_message,
    has_generation_markers,
    parse_record,
    pre_tokenize,
    process_line,
    tokenize_conversation,
    truncate,
)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "data" / "chat_templates"

# GLM-4 style: a role token opens every turn and nothing closes one, so the next role token (or EOS) ends it.
GLM4_STYLE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Drops every assistant message but the last: earlier renderings are not prefixes of later ones.
REWRITING = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

CHAT = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What does zip do?"},
    {"role": "assistant", "content": "It pairs items from several iterables."},
    {"role": "user", "content": "And enumerate?"},
    {"role": "assistant", "content": "It counts while you loop."},
]
ANSWERS = [m["content"] for m in CHAT if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def base_tokenizer():
    return AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")


def with_template(tokenizer, template: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def glm_tokenizer(base_tokenizer):
    tok = with_template(base_tokenizer, GLM4_STYLE)
    tok.add_special_tokens(
        {"additional_special_tokens": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]}
    )
    return tok


def target_runs(tokenizer, input_ids, labels) -> list[str]:
    """Decode each run of consecutive target tokens, checking every label token by token on the way."""
    runs, current = [], []
    for token, label in zip(input_ids, labels, strict=True):
        assert label in (token, IGNORE_INDEX)
        if label == IGNORE_INDEX:
            if current:
                runs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(token)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


# --- formats -------------------------------------------------------------------------------------------


def test_parse_formats_normalise_to_messages():
    expected = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert parse_record({"messages": expected}) == expected
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert parse_record(sharegpt) == expected
    assert parse_record({"prompt": "hi", "response": "hello"}) == expected
    assert parse_record({"prompt": "hi", "completion": "hello"}) == expected
    with_system = parse_record({"system": "be brief", "prompt": "hi", "response": "hello"})
    assert with_system[0] == {"role": "system", "content": "be brief"}
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
            {"role": "assistant", "content": "hello"},
        ]
    }
    assert parse_record(parts) == expected


@pytest.mark.parametrize(
    "record, reason, words",
    [
        ([1, 2], "unknown_format", "JSON object"),
        ({"text": "hi"}, "unknown_format", "keys: text"),
        ({"messages": []}, "bad_message", "non-empty list"),
        ({"messages": [{"role": "user"}]}, "bad_message", "message 0"),
        (
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
            "bad_message",
            "text",
        ),
        ({"messages": [{"role": "gpt", "content": "x"}]}, "bad_role", "message 0 has role 'gpt'"),
        ({"conversations": [{"from": "bot", "value": "x"}]}, "bad_role", "'bot'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]},
            "empty_assistant",
            "message 1",
        ),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_targets", "no assistant"),
    ],
)
def test_parse_errors_name_reason_and_message(record, reason, words):
    with pytest.raises(RecordError) as err:
        parse_record(record)
    assert err.value.reason == reason
    assert words in str(err.value)


# --- label masks, token by token -----------------------------------------------------------------------


def test_llama3_template_targets_are_answers_with_eot(base_tokenizer):
    tok = base_tokenizer
    assert not has_generation_markers(tok)
    input_ids, labels = tokenize_conversation(tok, CHAT)
    assert (
        input_ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert target_runs(tok, input_ids, labels) == [a + "<|eot_id|>" for a in ANSWERS]


def test_chatml_with_generation_markers(base_tokenizer):
    tok = with_template(base_tokenizer, (TEMPLATES / "chatml.jinja").read_text())
    assert has_generation_markers(tok)
    input_ids, labels = tokenize_conversation(tok, CHAT)
    assert target_runs(tok, input_ids, labels) == [a + "<|im_end|>" for a in ANSWERS]


def test_chatml_without_markers_ends_at_im_end(base_tokenizer):
    plain = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", (TEMPLATES / "chatml.jinja").read_text())
    tok = with_template(base_tokenizer, plain)
    assert not has_generation_markers(tok)
    input_ids, labels = tokenize_conversation(tok, CHAT)
    # The newline after <|im_end|> belongs to the template, not to the answer.
    assert target_runs(tok, input_ids, labels) == [a + "<|im_end|>" for a in ANSWERS]


def test_glm4_style_turn_ends_with_next_role_token_or_eos(glm_tokenizer):
    tok = glm_tokenizer
    input_ids, labels = tokenize_conversation(tok, CHAT)
    runs = target_runs(tok, input_ids, labels)
    assert runs == [ANSWERS[0] + "<|user|>", ANSWERS[1] + tok.eos_token]
    assert input_ids[-1] == tok.eos_token_id  # appended: the last turn has nothing after it


def test_system_and_user_text_never_targets(base_tokenizer):
    input_ids, labels = tokenize_conversation(base_tokenizer, CHAT)
    targets = base_tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    for message in CHAT:
        assert (message["content"] in targets) == (message["role"] == "assistant")


def test_template_that_rewrites_history_fails_loudly(base_tokenizer):
    tok = with_template(base_tokenizer, REWRITING)
    with pytest.raises(TemplateError, match="cannot be split"):
        check_chat_template(tok)


def test_template_failing_on_one_line_stops_the_stage_naming_it(tmp_path, base_tokenizer, monkeypatch):
    """A conversation the start-up check did not foresee still stops the run, naming its line."""
    monkeypatch.setattr("longalign.tokenize.check_chat_template", lambda tokenizer: None)
    tok = with_template(base_tokenizer, REWRITING)  # splits a one-answer chat, not a two-answer one
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD, {"messages": CHAT[1:]}])
    with pytest.raises(TemplateError, match="line 2: chat template cannot be split"):
        pre_tokenize(src, tok, tmp_path / "out", max_seq_len=256)
    assert not (tmp_path / "out").exists()


def test_template_check_needs_a_template(base_tokenizer):
    tok = with_template(base_tokenizer, None)
    with pytest.raises(TemplateError, match="no chat template"):
        check_chat_template(tok)


# --- truncation ----------------------------------------------------------------------------------------


def test_truncate_modes():
    ids = [1, 2, 3, 4, 5, 6]
    labels = [-100, -100, 3, 4, -100, -100]
    assert truncate(ids, labels, 6, "drop") == (ids, labels)  # exactly max_seq_len is kept
    assert truncate(ids, labels, 5, "drop") is None
    assert truncate(ids, labels, 4, "right") == ([1, 2, 3, 4], [-100, -100, 3, 4])
    assert truncate(ids, labels, 4, "left") == ([3, 4, 5, 6], [3, 4, -100, -100])
    assert truncate(ids, labels, 2, "right") is None  # no target survives
    assert truncate(ids, labels, 2, "left") is None


# --- the whole stage -----------------------------------------------------------------------------------


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
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
    assert ds.column_names == ["input_ids", "labels", "length", "num_targets", "line"]
    assert ds["line"] == [1, 10]
    for row in ds:
        assert row["length"] == len(row["input_ids"]) == len(row["labels"])
        assert row["num_targets"] == sum(t != IGNORE_INDEX for t in row["labels"])
    assert report["total_tokens"] == sum(ds["length"])
    assert report["target_tokens"] == sum(ds["num_targets"])


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


def test_drop_messages_are_clipped_and_valid_utf8():
    assert clean_message("fine") == "fine"
    assert clean_message("key '\ud800'") == "key '\\ud800'"
    long = clean_message("x" * 5000)
    assert long.startswith("x" * 300) and long.endswith("(4700 more characters)")


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
