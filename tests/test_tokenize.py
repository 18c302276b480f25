"""Pre-tokenization: record formats, label masks per template, truncation, bad input, the report."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AddedToken, AutoTokenizer

import longalign.chat_template as chat_template
import longalign.tokenize as stage
from longalign.artifacts import read_report
from longalign.chat_template import (
    TemplateError,
    TurnLayout,
    has_generation_markers,
    linear_assistant_spans,
    locate_contents,
    longest_token_bytes,
    prefix_assistant_spans,
    profile_tokenizer,
    render_conversation,
)
from longalign.errors import InputError
from longalign.labels import (
    IGNORE_INDEX,
    check_chat_template,
    quoted_control_text,
    tokenize_conversation,
    truncate,
)
from longalign.records import DROP_REASONS, RecordError, clean_message, parse_record
from longalign.sources import Source
from longalign.tokenize import min_tokens, pre_tokenize, process_line

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "data" / "chat_templates"
LLAMA3 = (TEMPLATES / "llama3.jinja").read_text()
CHATML = (TEMPLATES / "chatml.jinja").read_text()
CHATML_PLAIN = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHATML)  # the same turns, without markers
# Llama-3 style with every message's text trimmed, as some official templates do.
LLAMA3_TRIMMED = LLAMA3.replace("message['content']", "message['content'] | trim")

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
    tok = with_template(base_tokenizer, CHATML)
    assert has_generation_markers(tok)
    input_ids, labels = tokenize_conversation(tok, CHAT)
    assert target_runs(tok, input_ids, labels) == [a + "<|im_end|>" for a in ANSWERS]


def test_chatml_without_markers_ends_at_im_end(base_tokenizer):
    tok = with_template(base_tokenizer, CHATML_PLAIN)
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


# --- splitting a conversation into turns: linear vs growing prefixes -----------------------------------

# Text that looks like the templates' own frames, to tempt a search for message text into the wrong place.
FRAME_TEXT = [
    "<|start_header_id|>user<|end_header_id|>\n\n",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|eot_id|>",
    "<|im_start|>assistant\n",
    "<|im_end|>\n",
    "<|assistant|>\n",
    "<|user|>",
    "user",
    "assistant",
    "\n",
]
contents = st.one_of(
    st.text(st.sampled_from("ab \n\t\r\u00e9\u4e2d\U0001f600<|>"), max_size=12),
    st.sampled_from(FRAME_TEXT + ["", " ", "\n\n\n", "  padded  "]),
)


@st.composite
def conversations(draw):
    """Random roles in any order; text that is empty, blank, unicode, frame-like or repeats earlier text."""
    messages = []
    for role in draw(st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=7)):
        if messages and draw(st.booleans()):
            content = draw(st.sampled_from([m["content"] for m in messages]))
        else:
            content = draw(contents)
        if role == "assistant" and not content.strip():
            content += "ok"  # blank answers are dropped before splitting (empty_assistant)
        messages.append({"role": role, "content": content})
    return messages


SPLIT_TEMPLATES = {"llama3": LLAMA3, "llama3_trimmed": LLAMA3_TRIMMED, "chatml_plain": CHATML_PLAIN}


@pytest.fixture(scope="module")
def split_tokenizers(base_tokenizer, glm_tokenizer):
    tokenizers = {name: with_template(base_tokenizer, t) for name, t in SPLIT_TEMPLATES.items()}
    tokenizers["glm4_style"] = glm_tokenizer
    return {name: (tok, profile_tokenizer(tok)) for name, tok in tokenizers.items()}


def test_layouts_learned_from_the_probe(split_tokenizers):
    layouts = {name: profile.layout for name, (_, profile) in split_tokenizers.items()}
    assert layouts == {
        "llama3": TurnLayout("", "<|eot_id|>"),
        "llama3_trimmed": TurnLayout("", "<|eot_id|>"),
        "chatml_plain": TurnLayout("", "<|im_end|>\n"),
        "glm4_style": TurnLayout("", ""),
    }


@settings(max_examples=150, deadline=None)
@given(
    messages=conversations(), name=st.sampled_from(["llama3", "llama3_trimmed", "chatml_plain", "glm4_style"])
)
def test_linear_split_equals_growing_prefixes(split_tokenizers, messages, name):
    tok, profile = split_tokenizers[name]
    text, spans = prefix_assistant_spans(tok, messages)
    contents = locate_contents(tok, messages, text)
    assert contents is not None  # these templates copy message text (trimmed or not) into the rendering
    assert linear_assistant_spans(text, messages, contents, profile.layout) == spans
    rendering = render_conversation(tok, messages, profile)
    assert (rendering.text, rendering.targets) == (text, spans)


def test_locate_contents_is_exact_when_text_repeats_the_frame(base_tokenizer):
    messages = [
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nuser"},
        {"role": "user", "content": "user"},
    ]
    text = base_tokenizer.apply_chat_template(messages, tokenize=False)
    spans = locate_contents(base_tokenizer, messages, text)
    assert [text[a:b] for a, b in spans] == [m["content"] for m in messages]
    assert spans[0][0] == len("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")


def test_template_that_rewrites_text_falls_back_to_prefixes(base_tokenizer):
    tok = with_template(base_tokenizer, LLAMA3.replace("message['content']", "message['content'] | upper"))
    profile = profile_tokenizer(tok)
    assert profile.layout is None  # the probe's text is not in the rendering, so nothing is learned
    rendering = render_conversation(tok, CHAT, profile)
    assert rendering.contents is None
    assert (rendering.text, rendering.targets) == prefix_assistant_spans(tok, CHAT)


def test_linear_split_renders_a_conversation_twice(base_tokenizer, monkeypatch):
    """Two renderings (the conversation, and its skeleton) however many turns: no growing prefixes."""
    profile = profile_tokenizer(base_tokenizer)
    renders = []
    real = chat_template._render
    monkeypatch.setattr(chat_template, "_render", lambda *a, **k: renders.append(1) or real(*a, **k))
    turns = [{"role": r, "content": f"turn {i}"} for i in range(200) for r in ("user", "assistant")]
    rendering = render_conversation(base_tokenizer, turns, profile)
    assert len(renders) == 2 and len(rendering.targets) == 200


def test_sample_labels_equal_the_prefix_method(base_tokenizer):
    """Every conversation of the shipped sample splits linearly, into exactly the prefix method's labels."""
    profile = profile_tokenizer(base_tokenizer)
    old = replace(profile, layout=None)  # forces growing prefixes
    lines = (ROOT / "data" / "sample.jsonl").read_text(encoding="utf-8").splitlines()
    for line in lines:
        messages = parse_record(json.loads(line))
        text = base_tokenizer.apply_chat_template(messages, tokenize=False)
        contents = locate_contents(base_tokenizer, messages, text)
        assert linear_assistant_spans(text, messages, contents, profile.layout) is not None
        new = tokenize_conversation(base_tokenizer, messages, profile)
        assert new == tokenize_conversation(base_tokenizer, messages, old)


def test_conversation_may_open_with_the_assistant(tmp_path, base_tokenizer):
    opening = {"messages": [{"role": "assistant", "content": "Hello! Ask me."}, GOOD["messages"][0]]}
    for profile in (profile_tokenizer(base_tokenizer), None):
        ids, labels = tokenize_conversation(base_tokenizer, parse_record(opening), profile)
        assert target_runs(base_tokenizer, ids, labels) == ["Hello! Ask me.<|eot_id|>"]
    old = replace(profile_tokenizer(base_tokenizer), layout=None)
    assert tokenize_conversation(base_tokenizer, parse_record(opening), old) == (ids, labels)
    report = pre_tokenize(
        write_jsonl(tmp_path / "in.jsonl", [opening]), base_tokenizer, tmp_path / "o", max_seq_len=64
    )
    assert report["samples_kept"] == 1


def test_marked_template_matches_transformers_assistant_mask(base_tokenizer):
    tok = with_template(base_tokenizer, CHATML)
    for line in (ROOT / "data" / "sample.jsonl").read_text(encoding="utf-8").splitlines()[:50]:
        messages = parse_record(json.loads(line))
        out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        labels = [
            t if m else IGNORE_INDEX for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True)
        ]
        assert tokenize_conversation(tok, messages) == (list(out["input_ids"]), labels)


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


# --- message text that spells a control token is text --------------------------------------------------

QUOTING = [
    {"role": "user", "content": "What ends a Llama 3 turn?"},
    {"role": "assistant", "content": "The token <|eot_id|> does; after it comes <|user|> or <|im_start|>."},
    {"role": "user", "content": "And <|im_end|>\n<|im_start|>assistant\n?"},
    {"role": "assistant", "content": "ChatML's."},
]


def control_tokens(tokenizer, ids) -> list[int]:
    control = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return [t for t in ids if t in control]


def template_control_tokens(tokenizer, messages) -> list[int]:
    """The control tokens the template itself writes: those of the rendering with neutral text."""
    neutral = [{**m, "content": "x"} for m in messages]
    text = chat_template._render(tokenizer, neutral)
    return control_tokens(tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"])


def test_quoted_control_token_is_text_in_llama3(base_tokenizer):
    tok = base_tokenizer
    assert quoted_control_text(QUOTING, profile_tokenizer(tok)) == (1, "<|eot_id|>")
    ids, labels = tokenize_conversation(tok, QUOTING)
    assert control_tokens(tok, ids) == template_control_tokens(tok, QUOTING)
    assert target_runs(tok, ids, labels) == [QUOTING[1]["content"] + "<|eot_id|>", "ChatML's.<|eot_id|>"]
    assert tok.decode(ids) == tok.apply_chat_template(QUOTING, tokenize=False)
    old_ids, _ = tokenize_conversation(tok, QUOTING, special_tokens_in_text="parse")  # the old reading
    assert (
        old_ids
        == tok(tok.apply_chat_template(QUOTING, tokenize=False), add_special_tokens=False)["input_ids"]
    )
    assert len(control_tokens(tok, old_ids)) > len(control_tokens(tok, ids))


def test_quoted_role_token_no_longer_cuts_a_glm4_answer_short(glm_tokenizer):
    tok = glm_tokenizer
    ids, labels = tokenize_conversation(tok, QUOTING)
    assert target_runs(tok, ids, labels) == [QUOTING[1]["content"] + "<|user|>", "ChatML's." + tok.eos_token]
    old_ids, old_labels = tokenize_conversation(tok, QUOTING, special_tokens_in_text="parse")
    # read as control tokens, the quoted ones end the answer early: its last words are never learned
    cut = "The token <|eot_id|> does; after it comes <|user|> or <|im_start|>"
    assert target_runs(tok, old_ids, old_labels)[0] == cut


def test_quoted_control_token_is_text_with_generation_markers(base_tokenizer):
    tok = with_template(base_tokenizer, CHATML)
    ids, labels = tokenize_conversation(tok, QUOTING)
    assert control_tokens(tok, ids) == template_control_tokens(tok, QUOTING)
    assert target_runs(tok, ids, labels) == [QUOTING[1]["content"] + "<|im_end|>", "ChatML's.<|im_end|>"]


@settings(max_examples=100, deadline=None)
@given(messages=conversations(), name=st.sampled_from(["llama3", "chatml_plain", "glm4_style", "chatml"]))
def test_message_text_never_adds_a_control_token(quoting_tokenizers, messages, name):
    """Only the template writes control tokens, and the text still reads back whole."""
    tok, profile = quoting_tokenizers[name]
    ids, labels = tokenize_conversation(tok, messages, profile)
    text = chat_template._render(tok, messages)
    if name == "glm4_style" and messages[-1]["role"] == "assistant":
        ids = ids[:-1]  # the EOS a GLM-4-style final turn borrows
    assert control_tokens(tok, ids) == template_control_tokens(tok, messages)
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def quoting_tokenizers(split_tokenizers, base_tokenizer):
    tok = with_template(base_tokenizer, CHATML)
    return {**split_tokenizers, "chatml": (tok, profile_tokenizer(tok))}


def test_quoting_under_a_template_that_rewrites_text_is_a_drop(base_tokenizer):
    tok = with_template(base_tokenizer, LLAMA3.replace("message['content']", "message['content'] | upper"))
    line = json.dumps({"messages": QUOTING})
    row = process_line(line, tok, max_seq_len=256, truncation="right")
    assert row["reason"] == "template_error" and "--special-tokens-in-text parse" in row["error"]
    row = process_line(line, tok, max_seq_len=256, truncation="right", special_tokens_in_text="parse")
    assert row["reason"] == "" and row["special_text"]


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
