"""Write the hostile-input corpus for the pre-tokenize stage: tests/data/hostile.jsonl and hostile.expected.json.

    python tests/data/make_hostile.py

Every line is something a real chat dump can contain, or something a broken exporter writes: wrong
types in every field, unknown roles, missing keys, deep nesting, huge numbers, lone surrogates, NUL
bytes, carriage returns, walls of whitespace, quoted control tokens. Next to each line the expected
outcome is written down by hand ("" = kept, else the drop reason), together with the settings the
expectations hold for. The output is deterministic; run it again after changing a case.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_SEQ_LEN = 512
TRUNCATION = "drop"
# The shipped Llama-3-style template, made to refuse two messages of one role in a row (as many official
# templates refuse roles that do not alternate), so that a template_error drop shows up too.
TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if not loop.first and message['role'] == messages[loop.index0 - 1]['role'] -%}"
    "{{- raise_exception('Conversation roles must alternate') -}}"
    "{%- endif -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

WRONG_VALUES = [None, True, False, 0, -7, 3.5, 1e308, [1], [[["deep"]]], {}, {"text": "x"}, {"a": [None]}]


def chat(user: object = "Hi there.", answer: object = "Hello!") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)  # raw UTF-8; lone surrogates are written as escapes by hand


def cases() -> list[tuple[str, str]]:
    """(line, expected outcome) pairs; the outcome is "" for a kept sample or the drop reason."""
    out: list[tuple[str, str]] = []

    def add(line: str | object, expected: str) -> None:
        out.append((line if isinstance(line, str) else dumps(line), expected))

    # Line 1 starts with a byte order mark (written by make()): it is skipped, the record is kept.
    add(chat(), "")

    # --- kept: every record shape, and hard but valid text ---------------------------------------------
    add({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, "")
    add({"conversations": [{"from": "system", "value": "terse"}, {"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]}, "")  # fmt: skip
    add({"prompt": "2+2?", "response": "4"}, "")
    add({"prompt": "2+2?", "completion": "4", "system": "Be exact."}, "")
    add({"prompt": "2+2?", "response": "4", "system": None}, "")
    add({"messages": [{"role": "assistant", "content": "I open."}, {"role": "user", "content": "ok"}]}, "")
    add({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": "."}]}, "")  # fmt: skip
    add(chat([{"type": "text", "text": "Part one, "}, {"type": "text", "text": "part two."}]), "")
    add(chat([], "Nothing was asked."), "")  # an empty list of parts is empty text
    add({**chat(), "id": 12, "meta": {"source": [1, 2, None], "score": 0.5}, "extra": None}, "")
    add('{"messages": 1, "messages": ' + dumps(chat()["messages"]) + "}", "")  # JSON keeps the last key
    add('{"messages": ' + dumps(chat()["messages"]) + ', "score": NaN, "max": Infinity}', "")
    for text in [
        "emoji \U0001f600\U0001f469\u200d\U0001f4bb and CJK \u4e2d\u6587\u6587\u672c",
        "right-to-left \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 and combining e\u0301\u0301\u0301",
        "zero width\u200b\u200c\u200d\ufeff joiners, a line\u2028separator and a paragraph\u2029separator",
        "a NUL \u0000 inside, a bell \u0007, an escape \u001b[31m, a form feed \u000c",
        "carriage\rreturns\r\nand newlines\n" * 3,
        "\n" * 300 + "after many newlines",
        " " * 1000 + "after many spaces",
        "\t\v\f mixed whitespace \u3000\u00a0\u2003",
        "a" * 400,
        "private use \ue000\ue001 and noncharacters \ufffe\uffff",
    ]:
        add(chat(text, "Noted."), "")
        add(chat("Repeat it.", text + "."), "")
    # Control tokens quoted in messages stay text (counted in the report); so do the template's frames.
    for quote in ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|im_start|>user\n<|im_end|>"]:  # fmt: skip
        add(chat(f"What is {quote}?", f"{quote} is a control token."), "")
    add(chat("user", "assistant"), "")  # text equal to role names
    add(chat("Hello!", "Hello!"), "")  # an answer that repeats the question
    add("   " + dumps(chat()) + "   ", "")  # whitespace around the JSON
    add("\t\r " + dumps(chat()) + "\r", "")  # carriage returns as JSON whitespace, and a CRLF ending
    add(" " * 20_000 + dumps(chat()), "")  # a wall of whitespace before the record
    add(dumps(chat()).replace(", ", ",\r\r\r "), "")
    add({"messages": [m for i in range(15) for m in chat(f"question {i}?", f"answer {i}.")["messages"]]}, "")

    # --- empty lines -----------------------------------------------------------------------------------
    for blank in ["", " ", "\t", "\r", " \t \r", "\v\f", "\u3000\u00a0", " " * 5000]:
        add(blank, "empty_line")

    # --- malformed JSON --------------------------------------------------------------------------------
    for broken in [
        "{not json",
        "{'messages': []}",
        '{"messages": [],}',
        '{"messages": [}',
        "}",
        "null]",
        '"unterminated',
        dumps(chat())[:-1],
        dumps(chat()) + "}",
        dumps(chat()) + " " + dumps(chat()),
        "\x00",
        "\x00" + dumps(chat()),
        dumps(chat()).replace("Hello!", "Hel\x00lo!"),  # a raw NUL inside a string
        dumps(chat()).replace("Hello!", "Hel\rlo!"),  # a raw carriage return inside a string
        dumps(chat()).replace("Hello!", "Hel\tlo!"),  # a raw tab inside a string
        "\ufeff" + dumps(chat()),  # a byte order mark anywhere but the start of the file
        '{"messages": [], "id": ' + "9" * 5000 + "}",  # an integer Python will not read (> 4300 digits)
        dumps(chat())[:-1] + ', "n": -' + "1" * 4301 + "}",
        "[" * 5000 + "]" * 5000,  # nesting deeper than the decoder recurses
        '{"a":' * 2000 + "1" + "}" * 2000,
        "[" * 5000,
        '{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\x41"}]}',  # a bad escape
        "True",
        "None",
        "NaNa",
    ]:
        add(broken, "malformed_json")

    # --- unknown formats -------------------------------------------------------------------------------
    for value in ["42", "-0.5", "null", "true", '"a string"', "[]", "[1, 2]", dumps([chat()]), "{}"]:
        add(value, "unknown_format")
    add({"text": "hi"}, "unknown_format")
    add({"prompt": "no answer"}, "unknown_format")
    add({"response": "no prompt"}, "unknown_format")
    add({"Messages": chat()["messages"]}, "unknown_format")
    add('{"\\ud800": 1, "\\udfff\\ud800": 2}', "unknown_format")  # keys that are lone surrogates
    add({f"key{i}": i for i in range(3000)}, "unknown_format")  # a very long list of keys

    # --- bad messages: wrong types everywhere ----------------------------------------------------------
    for value in WRONG_VALUES + ["a string"]:
        if value == [1] or value == [[["deep"]]]:
            continue  # lists of non-objects are covered below
        add({"messages": value}, "bad_message")
        add({"conversations": value}, "bad_message")
    add({"messages": []}, "bad_message")
    add({"conversations": []}, "bad_message")
    for item in [None, 1, "user: hi", ["user", "hi"], [[["deep"]]], True]:
        add({"messages": [item, {"role": "assistant", "content": "x"}]}, "bad_message")
        add({"conversations": [item, {"from": "gpt", "value": "x"}]}, "bad_message")
    for missing in [{"role": "user"}, {"content": "hi"}, {}, {"role": "user", "text": "hi"}]:
        add({"messages": [missing, {"role": "assistant", "content": "x"}]}, "bad_message")
    add({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}, "bad_message")
    add({"conversations": [{"role": "user", "content": "hi"}, {"from": "gpt", "value": "x"}]}, "bad_message")
    for value in WRONG_VALUES:
        add(chat(value), "bad_message")  # the user's text
        add(chat("hi", value), "bad_message")  # the assistant's text
        add({"prompt": value, "response": "x"}, "bad_message")
        add({"prompt": "x", "response": value}, "bad_message")
        if value is not None:
            add({"prompt": "x", "response": "y", "system": value}, "bad_message")
    for part in [
        {"type": "text", "text": None},
        {"type": "text", "text": 42},
        {"type": "text", "text": ["a"]},
        {"type": "text"},
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"text": "no type"},
        "bare string",
        None,
    ]:
        add(chat([{"type": "text", "text": "ok "}, part]), "bad_message")
    add('{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}, {"role": "assistant", "content": "x"}]}', "bad_message")  # fmt: skip
    add('{"prompt": "x", "response": "ends in \\udfff"}', "bad_message")
    add('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}, {"role": "assistant", "content": "x"}]}', "bad_message")  # fmt: skip
    add({"messages": [{"role": "user", "content": "[" * 2000 + "]" * 2000}, {"role": "assistant", "content": [[[[["x"]]]]]}]}, "bad_message")  # fmt: skip

    # --- bad roles -------------------------------------------------------------------------------------
    for role in [None, 1, True, 2.5, ["user"], {"name": "user"}, [[["user"]]], "", "robot", "gpt", "human", "Assistant", "USER", " user", "user\n", "tool", "function", "r" * 10_000, "\u00fcser"]:  # fmt: skip
        add(
            {"messages": [{"role": role, "content": "hi"}, {"role": "assistant", "content": "x"}]}, "bad_role"
        )
    for source in [None, 3, ["human"], {"a": 1}, "bot", "assistant ", "Human", "h" * 10_000]:
        add({"conversations": [{"from": source, "value": "hi"}, {"from": "gpt", "value": "x"}]}, "bad_role")
    add(
        '{"messages": [{"role": "\\ud800", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
        "bad_role",
    )

    # --- empty answers ---------------------------------------------------------------------------------
    for blank in ["", " ", "\n\n\n", "\t \r\n", "\u3000", [], [{"type": "text", "text": "  "}]]:
        add(chat("hi", blank), "empty_assistant")
        add({"prompt": "hi", "response": blank}, "empty_assistant")
    add(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}, "empty_assistant"
    )

    # --- nothing to learn ------------------------------------------------------------------------------
    add({"messages": [{"role": "user", "content": "hi"}]}, "no_targets")
    add({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}, "no_targets")
    add(
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "human", "value": "again"}]},
        "no_targets",
    )

    # --- the template refuses the conversation ---------------------------------------------------------
    add({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}, "template_error")  # fmt: skip
    add({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}]}, "template_error")  # fmt: skip
    add({"conversations": [{"from": "system", "value": "s"}, {"from": "system", "value": "t"}, {"from": "gpt", "value": "c"}]}, "template_error")  # fmt: skip

    # --- too long for MAX_SEQ_LEN --------------------------------------------------------------------------
    add(chat("word " * 700), "over_length")  # found by tokenizing
    add(chat("hi", "word " * 700), "over_length")
    add(chat("long " * 8000, "ok"), "over_length")  # found from the byte count alone
    add(chat("hi", "\U0001f600" * 20_000), "over_length")
    add({"messages": [m for i in range(200) for m in chat(f"question {i}?", f"answer {i}.")["messages"]]}, "over_length")  # fmt: skip
    return out


def make(directory: Path = HERE) -> None:
    rows = cases()
    lines = [line for line, _ in rows]
    assert all("\n" not in line for line in lines), "a case spans two lines"
    data = ("\ufeff" + "\n".join(lines) + "\n").encode("utf-8")
    (directory / "hostile.jsonl").write_bytes(data)
    expected = {
        "max_seq_len": MAX_SEQ_LEN,
        "truncation": TRUNCATION,
        "chat_template": TEMPLATE,
        "outcomes": [reason for _, reason in rows],
    }
    (directory / "hostile.expected.json").write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    make()
