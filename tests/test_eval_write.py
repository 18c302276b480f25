"""LongBench-Write: the response length and the length score."""

from __future__ import annotations

import json

import pytest

from longalign.errors import InputError
from longalign.eval.write import length_score, read_write_cases, response_length


@pytest.mark.parametrize(
    ("text", "length"),
    [
        ("Hello world", 2),
        ("It's a well-known fact, isn't it?", 6),
        ("你好世界", 4),
        ("Python 3 是一种语言。", 2 + 5),
        ("", 0),
        ("— … !!", 0),
    ],
)
def test_response_length_counts_cjk_characters_and_english_words(text, length):
    assert response_length(text) == length


@pytest.mark.parametrize(
    ("required", "produced", "score"),
    [
        (1000, 1000, 100.0),
        (1000, 1500, 100 * (1 - 0.5 / 3)),
        (1000, 4000, 0.0),  # three times over and more: 0
        (1000, 500, 50.0),
        (1000, 250, 0.0),
        (1000, 0, 0.0),
        (3, 4, 100 * (1 - (4 / 3 - 1) / 3)),
    ],
)
def test_length_score_is_the_longbench_write_formula(required, produced, score):
    assert length_score(required, produced) == pytest.approx(score, rel=1e-12, abs=1e-12)


def test_rows_need_a_positive_integer_length(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "p", "length": 0}) + "\n")
    with pytest.raises(InputError, match="row 1: field 'length' must be at least 1"):
        read_write_cases(path)
    path.write_text(json.dumps({"prompt": "p", "length": "500"}) + "\n")
    with pytest.raises(InputError, match="row 1: field 'length' has the wrong type"):
        read_write_cases(path)
