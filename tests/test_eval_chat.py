"""The judge's rating parse and prompt, LongBench-Chat cases, few-shot examples and middle cuts."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TOKENIZER
from transformers import AutoTokenizer

from longalign.errors import InputError
from longalign.eval.chat import middle_cut, middle_cut_prompt, read_chat_cases, read_examples
from longalign.eval.judge import Example, JudgeCase, judge_message, parse_rating
from longalign.eval.models import chat_frame


@pytest.mark.parametrize(
    ("text", "rating"),
    [
        ("Rating: [[7]]", 7.0),
        ("Example got [[2]]; this one [[ 9 ]].", 9.0),  # the last one counts
        ("[[8.5]]", 8.5),
        ("[[10]]", 10.0),
        ("Rating: 7", None),
        ("[[0]]", None),  # out of the 1-10 scale
        ("[[11]]", None),
        ("[[seven]]", None),
        ("", None),
    ],
)
def test_the_last_double_bracketed_rating_in_1_to_10_is_parsed(text, rating):
    assert parse_rating(text) == rating


def test_the_judge_sees_examples_then_question_reference_and_answer():
    example = Example("Q0?", "R0", "A0", 3, "Misses the point.")
    message = judge_message(JudgeCase(question="Q1?", answer="A1", reference="R1"), [example])
    assert message.index("Q0?") < message.index("Rating: [[3]]") < message.index("Q1?")
    assert message.index("Q1?") < message.index("R1") < message.index("A1")
    assert "[Reference answer]" not in judge_message(JudgeCase(question="Q", answer="A"))


def test_cases_and_few_shots_from_json_and_jsonl(tmp_path):
    rows = [
        {"idx": 7, "prompt": "P7", "query": "Q7", "answer": "A7"},
        {"prompt": "P", "query": "Q", "answer": "A"},
    ]
    (tmp_path / "c.json").write_text(json.dumps(rows))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert read_chat_cases(tmp_path / "c.json") == read_chat_cases(tmp_path / "c.jsonl")
    cases = read_chat_cases(tmp_path / "c.json")
    assert [c.idx for c in cases] == [7, 1]
    shots = [{"query": "q", "answer": "a", "output": "o", "rating": 4},
             {"idx": 7, "query": "q7", "answer": "a7", "output": "o7", "rating": 9, "explanation": "Right."}]  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(shots))
    examples = read_examples(tmp_path / "s.json", cases)
    assert [[e.question for e in mine] for mine in examples] == [["q", "q7"], ["q"]]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "P", "query": "Q"}\n', "row 1: missing field 'answer'"),
        ('{"prompt": 3, "query": "Q", "answer": "A"}\n', "row 1: field 'prompt' has the wrong type (int)"),
        ('{"prompt": "P", "query": "Q", "answer": "A"}\n{oops\n', "line 2: not JSON"),
        ("[1]", "row 1: expected an object, got int"),
        ("", "no rows"),
    ],
)
def test_bad_rows_are_one_line_naming_file_and_row(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InputError, match=re.escape(message)):
        read_chat_cases(path)


def test_a_long_prompt_loses_its_middle_in_token_space_to_fit_max_length():
    assert middle_cut(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert middle_cut([1, 2], 5) == [1, 2]
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    text = "Start of the document. " + "Filler words go here. " * 300 + "The question at the end?"
    prompt = middle_cut_prompt(tokenizer, text, max_length=200)
    frame = chat_frame(tokenizer)
    assert len(prompt.input_ids) == 200
    text = frame.before + prompt.messages[0]["content"] + frame.after  # encoded in one pass
    assert prompt.input_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert prompt.messages[0]["content"].startswith("Start of the document.")
    assert prompt.messages[0]["content"].endswith("The question at the end?")
    assert len(middle_cut_prompt(tokenizer, "Short.", max_length=200).input_ids) < 200
