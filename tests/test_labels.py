"""Labels, token by token, per template: assistant turns are targets and end on a control token; truncation."""

from __future__ import annotations

import pytest
from templates import (
    ANSWERS,
    CHAT,
    CHATML,
    CHATML_PLAIN,
    GOOD,
    REWRITING,
    target_runs,
    with_template,
    write_jsonl,
)

from longalign.chat_template import (
    TemplateError,
    has_generation_markers,
)
from longalign.config import IGNORE_INDEX
from longalign.labels import (
    check_chat_template,
    tokenize_conversation,
    truncate,
)
from longalign.tokenize import pre_tokenize

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
