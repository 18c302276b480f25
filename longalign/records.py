"""Chat records -> messages: the formats pre-tokenize reads, and why a record cannot become a sample.

Three shapes of record are read, each normalised to role/content messages::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
    {"prompt": "Hi", "response": "Hello!"}
                         ->  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]

A record that cannot become a sample raises ``RecordError`` with one of ``DROP_REASONS``; the stage
counts it and goes on.
"""

from __future__ import annotations

from typing import Any

from longalign.errors import InputError

# Every reason a line can be dropped for. All but "over_length" are bad input (``strict`` stops at them).
DROP_REASONS = (
    "empty_line",
    "malformed_json",
    "unknown_format",
    "bad_message",
    "bad_role",
    "empty_assistant",
    "no_targets",
    "template_error",
    "over_length",
)
BAD_INPUT = DROP_REASONS[:-1]
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
MAX_MESSAGE_CHARS = 300  # a drop message quotes the record; a 10k-character role name is clipped


class RecordError(InputError):
    """A record that cannot become a sample; ``reason`` is one of ``DROP_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # tokenizer processes send it back to the parent pickled
        return type(self), (self.reason, str(self))


def parse_record(record: Any) -> list[dict[str, str]]:
    """Normalise one record to ``[{"role": ..., "content": ...}, ...]``.

    Accepts ``messages`` (role/content), ShareGPT ``conversations`` (from/value: human/gpt/system) and
    ``prompt`` + ``response``/``completion`` (with an optional ``system``).
    """
    if not isinstance(record, dict):
        raise RecordError("unknown_format", f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = [
            _message(m, i, "role", "content", None) for i, m in enumerate(_as_list(record, "messages"))
        ]
    elif "conversations" in record:
        messages = [
            _message(m, i, "from", "value", SHAREGPT_ROLES)
            for i, m in enumerate(_as_list(record, "conversations"))
        ]
    elif "prompt" in record and ("response" in record or "completion" in record):
        answer_key = "response" if "response" in record else "completion"
        messages = [{"role": "user", "content": _text(record["prompt"], "prompt")}]
        messages.append({"role": "assistant", "content": _text(record[answer_key], answer_key)})
        if record.get("system") is not None:
            messages.insert(0, {"role": "system", "content": _text(record["system"], "system")})
    else:
        keys = ", ".join(sorted(record)) or "none"
        raise RecordError(
            "unknown_format",
            f"no 'messages', 'conversations' or 'prompt'+'response'/'completion' key (keys: {keys})",
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_targets", "no assistant message, so nothing to learn")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RecordError("empty_assistant", f"message {i}: assistant content is empty")
    return messages


def _as_list(record: dict, key: str) -> list:
    value = record[key]
    if not isinstance(value, list) or not value:
        raise RecordError("bad_message", f"'{key}' must be a non-empty list, got {type(value).__name__}")
    return value


def _message(item: Any, index: int, role_key: str, content_key: str, aliases: dict | None) -> dict[str, str]:
    if not isinstance(item, dict) or role_key not in item or content_key not in item:
        raise RecordError(
            "bad_message", f"message {index}: expected an object with '{role_key}' and '{content_key}'"
        )
    role = item[role_key]
    allowed = aliases if aliases is not None else {r: r for r in ROLES}
    if not isinstance(role, str):
        raise RecordError(
            "bad_role", f"message {index} has a role of type {type(role).__name__}, expected a string"
        )
    if role not in allowed:
        expected = "/".join(allowed)
        raise RecordError("bad_role", f"message {index} has role {role!r}, expected one of {expected}")
    return {"role": allowed[role], "content": _text(item[content_key], f"message {index} {content_key}")}


def _text(value: Any, where: str) -> str:
    """A message's text; OpenAI-style lists of ``{"type": "text", "text": ...}`` parts are joined."""
    if isinstance(value, list):
        value = "".join(_text_part(part, f"{where} part {j}") for j, part in enumerate(value))
    if not isinstance(value, str):
        raise RecordError("bad_message", f"{where}: expected text, got {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON can spell a lone surrogate; UTF-8 cannot
            raise RecordError(
                "bad_message",
                f"{where}: lone surrogate \\u{ord(value[err.start]):04x} at character {err.start}",
            ) from None
    return value


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise RecordError("bad_message", f"{where}: only text parts are read, got {kind!r}")
    if not isinstance(part.get("text"), str):
        raise RecordError(
            "bad_message", f"{where}: 'text' must be a string, got {type(part.get('text')).__name__}"
        )
    return part["text"]


def clean_message(message: str) -> str:
    """A drop message fit for Arrow and ``report.json``: valid UTF-8, at most ~``MAX_MESSAGE_CHARS`` long.

    A lone surrogate, which JSON can spell and a message may quote (a key, a role), is written as its
    escape: U+D800 becomes the six characters ``\\ud800``.
    """
    if len(message) > MAX_MESSAGE_CHARS:
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
    return message.encode("utf-8", "backslashreplace").decode("utf-8")
