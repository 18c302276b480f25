"""Turns in a rendering (learned layout vs growing prefixes), and message text that spells a control token."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from templates import (
    CHAT,
    CHATML,
    CHATML_PLAIN,
    GOOD,
    LLAMA3,
    LLAMA3_TRIMMED,
    QUOTING,
    target_runs,
    with_template,
    write_jsonl,
)

import longalign.chat_template as chat_template
from longalign.chat_template import (
    TurnLayout,
    linear_assistant_spans,
    locate_contents,
    prefix_assistant_spans,
    profile_tokenizer,
    render_conversation,
)
from longalign.config import IGNORE_INDEX
from longalign.labels import (
    quoted_control_text,
    tokenize_conversation,
)
from longalign.records import parse_record
from longalign.tokenize import pre_tokenize, process_line

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


# --- message text that spells a control token is text --------------------------------------------------


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
