"""Record formats: what pre-tokenize reads as messages, and why a record is dropped."""

from __future__ import annotations

import pytest

from longalign.records import RecordError, clean_message, parse_record

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


def test_drop_messages_are_clipped_and_valid_utf8():
    assert clean_message("fine") == "fine"
    assert clean_message("key '\ud800'") == "key '\\ud800'"
    long = clean_message("x" * 5000)
    assert long.startswith("x" * 300) and long.endswith("(4700 more characters)")
