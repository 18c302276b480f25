"""Pre-tokenization: chat records -> ``input_ids`` and assistant-only ``labels`` with the tokenizer's template.

One JSONL line becomes one sample row::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

    rendered   <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>
               <|start_header_id|>assistant<|end_header_id|>\\n\\nHello!<|eot_id|>
    labels     -100 ... -100 (system, user turns, headers)          Hello ! <|eot_id|>

Labels are not shifted (the loss shifts) and include the token that ends each assistant turn, so the model
learns to stop. Two ways to find the assistant tokens, both on the exact tokenization of the full rendering:

- templates with ``{% generation %}`` markers: the template says which characters are generated;
- templates without them (most official ones): the assistant turn of message k is the text between
  "history + generation prompt" and "history + message k". Rendering those growing prefixes costs
  O(turns^2), so it is done once, on a probe conversation, to learn how the template frames an answer
  (``TurnLayout``); each conversation is then rendered once, every message's text is located in it, and
  the turns follow from the layout. A conversation that does not fit this is split by growing prefixes.
  A turn that ends without a control token (GLM-4 style) gets the next control token, or EOS at the end.

Message text is text: a message that spells a control token (``"<|eot_id|>"``) gets the characters, not
the token, so it cannot fake a turn boundary. Bad lines never raise: each becomes a drop counted under
one of ``DROP_REASONS`` with its line number and a message; a line too long to ever fit is dropped
before it is tokenized.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from tokenizers import decoders, models, pre_tokenizers
from transformers.utils.chat_template_utils import render_jinja_template

from longalign.artifacts import stage_output, write_report
from longalign.errors import InputError, ModelError
from longalign.sources import Source, files_of, records

TRUNCATIONS = ("right", "left", "drop")
# What message text that spells a control token (e.g. "<|eot_id|>") becomes: text, or the control token.
SPECIAL_TEXT_MODES = ("text", "parse")
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
IGNORE_INDEX = -100
MAX_REPORTED_ERRORS = 20
MAX_MESSAGE_CHARS = 300  # a drop message quotes the record; a 10k-character role name is clipped
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RecordError(InputError):
    """A record that cannot become a sample; ``reason`` is one of ``DROP_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # tokenizer processes send it back to the parent pickled
        return type(self), (self.reason, str(self))


class TemplateError(ModelError):
    """A chat template that cannot be split into prompt and assistant parts."""


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


def open_tokenizer(name: str, *, trust_remote_code: bool = False):
    """The fast tokenizer at ``name`` (a local directory or a Hub name); a one-line error when there is none.

    A fast tokenizer is needed: its token offsets place the assistant turns.
    """
    from transformers import AutoTokenizer

    local = Path(name).expanduser()
    if (name.startswith((".", "/", "~")) or local.exists()) and not local.is_dir():
        raise InputError(f"{name}: no tokenizer there (a directory with tokenizer files, or a Hub name)")
    from longalign import checkpoints

    # A ChatGLM checkpoint's tokenizer is built from its rank file; its remote class never runs.
    tokenizer = checkpoints.open_tokenizer(name, trust_remote_code=trust_remote_code)
    try:
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        message = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise InputError(f"{name}: cannot load a tokenizer ({message})") from None
    if not tokenizer.is_fast:
        raise InputError(f"{name}: a fast tokenizer is needed (token offsets locate the assistant turns)")
    return tokenizer


def has_generation_markers(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    return bool(tokenizer.chat_template and _GENERATION_TAG.search(tokenizer.chat_template))


# --- what the stage learns once per tokenizer ----------------------------------------------------------

# Seen by every template at start-up: the template check reads its targets, and the linear split learns
# from it how an assistant turn is framed. Its answers have no surrounding whitespace, so a template that
# trims message text frames them exactly as it writes them.
PROBE = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Eleven."},
)


@dataclass(frozen=True)
class TurnLayout:
    """How a template frames an assistant message's text inside the assistant turn.

    ``opening``: text between the end of the generation prompt and the message's text; ``closing``: text
    after the message's text that still belongs to the turn. For the Llama-3-style template::

        ...<|start_header_id|>assistant<|end_header_id|>\\n\\n | Seven. | <|eot_id|> | <|start_header_id|>user...
           generation prompt                               | text   | closing
        TurnLayout(opening="", closing="<|eot_id|>")
    """

    opening: str
    closing: str


@dataclass(frozen=True)
class TokenizerProfile:
    """What pre-tokenization learns once per tokenizer and then uses for every line.

    ``layout`` is ``None`` when every conversation must be split by rendering growing prefixes (the
    template is marked, or its probe shows no single layout); ``control_ids`` are the special tokens and
    ``control_text`` finds their text (``None``: there are none); ``max_token_bytes`` (``None``: no size
    guard) bounds the text one token stands for, and ``strips_whitespace`` says that some added token
    swallows the whitespace next to it.
    """

    markers: bool
    layout: TurnLayout | None
    control_ids: frozenset[int]
    control_text: re.Pattern | None
    max_token_bytes: int | None
    strips_whitespace: bool


def profile_tokenizer(tokenizer) -> TokenizerProfile:
    """Learn what every line needs: the template's kind, its assistant-turn layout, the control tokens."""
    markers = has_generation_markers(tokenizer)
    added = tokenizer.added_tokens_decoder
    control = sorted((tok.content for tok in added.values() if tok.special), key=len, reverse=True)
    return TokenizerProfile(
        markers=markers,
        layout=None if markers else learn_turn_layout(tokenizer),
        control_ids=frozenset(i for i, tok in added.items() if tok.special),
        # longest first, so that a token whose text starts with another's is named whole
        control_text=re.compile("|".join(map(re.escape, control))) if control else None,
        max_token_bytes=longest_token_bytes(tokenizer),
        strips_whitespace=any(tok.lstrip or tok.rstrip for tok in added.values()),
    )


def longest_token_bytes(tokenizer) -> int | None:
    """The most bytes of text that one token can stand for; ``None`` when nothing bounds it.

    A byte-level BPE vocabulary spells each byte as one character of a 256-character alphabet, so an
    entry stands for as many bytes as it has characters (``"ĊĠĠĠ"``: a newline and three spaces, 4 bytes
    though its UTF-8 spelling takes 8). Other BPE vocabularies with byte fallback are measured in UTF-8,
    which can only overstate (``"▁"`` spells a 1-byte space). Added tokens stand for their content.
    Without byte level or byte fallback an unknown token can stand for any amount of text: no bound.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.model, models.BPE):
        return None
    if isinstance(backend.decoder, decoders.ByteLevel):
        alphabet = frozenset(pre_tokenizers.ByteLevel.alphabet())

        def size(entry: str) -> int:
            return sum(1 if c in alphabet else len(c.encode("utf-8")) for c in entry)

    elif backend.model.byte_fallback:

        def size(entry: str) -> int:
            return len(entry.encode("utf-8"))

    else:
        return None
    longest = max(map(size, backend.get_vocab(with_added_tokens=False)), default=1)
    added = [len(tok.content.encode("utf-8")) for tok in tokenizer.added_tokens_decoder.values()]
    return max([longest, *added])


_WHITESPACE = re.compile(r"\s+")  # Python's whitespace includes all that Rust's is_whitespace does


def min_tokens(text: str, max_token_bytes: int, *, strips_whitespace: bool = False) -> int:
    """The fewest tokens ``text`` can become when no token stands for more than ``max_token_bytes`` bytes.

        min_tokens("héllo", 4)  ->  2      (6 UTF-8 bytes, at most 4 per token)

    ``strips_whitespace`` leaves whitespace out, for vocabularies whose added tokens can swallow it.
    """
    if strips_whitespace:
        text = _WHITESPACE.sub("", text)
    size = len(text) if text.isascii() else len(text.encode("utf-8"))
    return -(-size // max_token_bytes)


def size_guard(
    tokenizer, profile: TokenizerProfile, text: str, targets, max_seq_len: int, truncation: str
) -> str | None:
    """Why a rendering cannot become a sample, from its byte count alone; ``None`` when it may.

    With ``drop`` the whole text must fit. With ``right`` the text before the first target, and with
    ``left`` the text after the last one, must leave room for a target in the window; ``targets`` may be
    ``None`` for ``drop``. Costs one pass over the text, and nothing when even 4 bytes per character
    could not show it too long, so ordinary lines pay nothing.
    """
    if profile.max_token_bytes is None:
        return None
    if truncation == "drop":
        part, what = text, "the conversation"
    elif not targets:
        return None
    elif truncation == "right":
        part, what = text[: targets[0][0]], "the text before the first assistant turn"
    else:
        part, what = text[targets[-1][1] :], "the text after the last assistant turn"
    # A window can still hold a target when only the token straddling its edge and a borrowed closing
    # token (GLM-4 style) fall inside it, so its bound must clear max_seq_len by two.
    needed = max_seq_len + (1 if truncation == "drop" else 2)
    if 4 * len(part) < needed * profile.max_token_bytes:
        return None
    normalizer = tokenizer.backend_tokenizer.normalizer
    if normalizer is not None:  # the model sees normalized text, which may be shorter (NFC, lowercasing)
        part = normalizer.normalize_str(part)
    fewest = min_tokens(part, profile.max_token_bytes, strips_whitespace=profile.strips_whitespace)
    if fewest < needed:
        return None
    if truncation == "drop":
        return f"{what} is at least {fewest} tokens > max_seq_len {max_seq_len} (known before tokenizing)"
    return (
        f"{what} is at least {fewest} tokens, so truncating to max_seq_len {max_seq_len} keeps no target "
        "(known before tokenizing)"
    )


def learn_turn_layout(tokenizer) -> TurnLayout | None:
    """Split the probe conversation by growing prefixes and read off its assistant-turn layout.

    ``None`` (split every conversation by prefixes) when the probe cannot be split or located, or when its
    two assistant turns are framed differently.
    """
    probe = _probe(tokenizer)
    try:
        text, spans = prefix_assistant_spans(tokenizer, probe)
    except Exception:  # check_chat_template reports what is wrong with such a template
        return None
    contents = locate_contents(tokenizer, probe, text)
    if contents is None:
        return None
    answers = [span for span, m in zip(contents, probe, strict=True) if m["role"] == "assistant"]
    layouts = set()
    for (start, end), (text_start, text_end) in zip(spans, answers, strict=True):
        if not start <= text_start <= text_end <= end:
            return None
        layouts.add(TurnLayout(text[start:text_start], text[text_end:end]))
    return layouts.pop() if len(layouts) == 1 else None


def _probe(tokenizer) -> list[dict[str, str]]:
    """The probe conversation, without its system message for a template that refuses one (it raises)."""
    try:
        _render(tokenizer, list(PROBE))
    except Exception:
        return list(PROBE[1:])
    return list(PROBE)


# --- splitting a rendered conversation into prompt and assistant turns ---------------------------------


@dataclass(frozen=True)
class Rendering:
    """A conversation as the template writes it, with the character spans that matter.

    ``targets``: what the model learns, in order (assistant turns, or the template's marked text);
    ``contents``: where each message's text sits, or ``None`` when the template does not copy it.
    """

    text: str
    targets: list[tuple[int, int]]
    contents: list[tuple[int, int]] | None


def render_conversation(tokenizer, messages: list[dict[str, str]], profile: TokenizerProfile) -> Rendering:
    """Render a conversation once and find its targets (``render_text``, then ``split_rendering``)."""
    return split_rendering(tokenizer, messages, profile, *render_text(tokenizer, messages, profile))


def render_text(
    tokenizer, messages: list[dict[str, str]], profile: TokenizerProfile
) -> tuple[str, list[tuple[int, int]] | None]:
    """The conversation's rendering, with the spans its ``{% generation %}`` blocks wrote (else ``None``)."""
    if profile.markers:
        return _render_marked(tokenizer, messages)
    return _render(tokenizer, messages), None


def split_rendering(
    tokenizer,
    messages: list[dict[str, str]],
    profile: TokenizerProfile,
    text: str,
    marked: list[tuple[int, int]] | None,
) -> Rendering:
    """Find a rendering's targets and the place of each message's text in it.

    Marked templates say which characters are generated. Otherwise the linear split places every turn
    from its message's text and the learned layout; a conversation it cannot vouch for is split by growing
    prefixes instead (same spans, one rendering per assistant turn).
    """
    contents = locate_contents(tokenizer, messages, text)
    if marked is not None:
        return Rendering(text, marked, contents)
    targets = None
    if profile.layout is not None and contents is not None:
        targets = linear_assistant_spans(text, messages, contents, profile.layout)
    if targets is None:
        text, targets = prefix_assistant_spans(tokenizer, messages)
    return Rendering(text, targets, contents)


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    # transformers' renderer, as apply_chat_template uses it, but without its refusal of an empty
    # conversation: the prompt before an opening assistant turn is the empty history's rendering.
    texts, _ = render_jinja_template(
        conversations=[messages],
        chat_template=tokenizer.get_chat_template(),
        add_generation_prompt=add_generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return texts[0]


def _render_marked(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendering and the character spans its ``{% generation %}`` blocks wrote."""
    texts, marked = render_jinja_template(
        conversations=[messages],
        chat_template=tokenizer.get_chat_template(),
        return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map,
    )
    return texts[0], [(start, end) for start, end in marked[0]]


_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")  # private-use characters: no template writes them


def locate_contents(tokenizer, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]] | None:
    """Where each message's text sits in ``text`` (its rendering), or ``None`` if the template changes it.

    The conversation is rendered again with every message's text replaced by a numbered placeholder. The
    template text between placeholders (the skeleton) and the messages' texts, taken in turn, must then
    spell ``text`` exactly; a text that repeats template text or an earlier message therefore cannot be
    placed anywhere but where the template put it. A template that trims text is matched by the trimmed
    text::

        text      <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>...
        skeleton  <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{0}<|eot_id|>...
        result    [(59, 61), ...]
    """
    held = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    try:
        pieces = _PLACEHOLDER.split(_render(tokenizer, held))
    except Exception:  # a template that inspects the text may refuse a placeholder
        return None
    if pieces[1::2] != [str(i) for i in range(len(messages))]:
        return None  # a message dropped, repeated or reordered by the template
    frames = pieces[0::2]
    spans, pos = [], 0
    for message, frame, next_frame in zip(messages, frames, frames[1:], strict=False):
        if not text.startswith(frame, pos):
            return None
        pos += len(frame)
        for content in (message["content"], message["content"].strip()):
            if text.startswith(content, pos) and text.startswith(next_frame, pos + len(content)):
                break
        else:
            return None
        spans.append((pos, pos + len(content)))
        pos += len(content)
    return spans if pos + len(frames[-1]) == len(text) else None


def linear_assistant_spans(
    text: str, messages: list[dict[str, str]], contents: list[tuple[int, int]], layout: TurnLayout
) -> list[tuple[int, int]] | None:
    """Every assistant turn's span from its message's text and the layout; ``None`` if one does not fit.

    A turn must find the layout's opening and closing text around its message's text, inside the gap
    between its neighbours' texts.
    """
    spans = []
    for i, (message, (start, end)) in enumerate(zip(messages, contents, strict=True)):
        if message["role"] != "assistant":
            continue
        turn_start, turn_end = start - len(layout.opening), end + len(layout.closing)
        lower = contents[i - 1][1] if i else 0
        upper = contents[i + 1][0] if i + 1 < len(contents) else len(text)
        if not (
            lower <= turn_start
            and turn_end <= upper
            and text[turn_start:start] == layout.opening
            and text.startswith(layout.closing, end)
        ):
            return None
        spans.append((turn_start, turn_end))
    return spans


def prefix_assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and every assistant turn's span in it, by rendering growing prefixes.

    The turn of message k runs from the end of "messages before k + generation prompt" to the end of
    "messages up to k". Correct for any template that extends its earlier renderings, and quadratic in
    the number of turns: the linear split's reference and fallback.
    """
    full = _render(tokenizer, messages)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:k], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: k + 1])
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise TemplateError(
                f"chat template cannot be split at message {k}: rendering the conversation up to an assistant "
                "turn does not extend the rendering before it (the template rewrites earlier turns); "
                "use a template with {% generation %} markers (--chat-template)"
            )
        if len(upto) == len(prompt):
            raise TemplateError(f"chat template renders assistant message {k} as nothing")
        spans.append((len(prompt), len(upto)))
    return full, spans


# --- tokens and labels ---------------------------------------------------------------------------------


def tokenize_conversation(
    tokenizer,
    messages: list[dict[str, str]],
    profile: TokenizerProfile | None = None,
    *,
    special_tokens_in_text: str = "text",
) -> tuple[list[int], list[int]]:
    """Tokenize one conversation with the chat template; return ``(input_ids, labels)``, labels not shifted.

    ``profile`` is learned from the tokenizer when not given. Raises ``TemplateError`` when the template's
    renderings of growing prefixes do not extend each other.
    """
    profile = profile or profile_tokenizer(tokenizer)
    rendering = render_conversation(tokenizer, messages, profile)
    quoted = quoted_control_text(messages, profile) if special_tokens_in_text == "text" else None
    return encode_rendering(tokenizer, rendering, profile, quoted=quoted)


def quoted_control_text(messages: list[dict[str, str]], profile: TokenizerProfile) -> tuple[int, str] | None:
    """The first message whose text spells a control token, and that token's text; ``None`` if none does.

        [{"role": "user", "content": "what is <|eot_id|>?"}, ...]  ->  (0, "<|eot_id|>")

    Control tokens are the tokenizer's special added tokens; their text is found by ``profile.control_text``.
    """
    if profile.control_text is None:
        return None
    for i, message in enumerate(messages):
        if found := profile.control_text.search(message["content"]):
            return i, found.group()
    return None


def encode_rendering(
    tokenizer, rendering: Rendering, profile: TokenizerProfile, *, quoted: tuple[int, str] | None = None
) -> tuple[list[int], list[int]]:
    """Tokenize a rendering and label its target tokens.

    One pass over the whole text, as the tokenizer reads it. ``quoted`` (from ``quoted_control_text``)
    asks for message text that spells a control token to be read as text, not as the token.
    """
    enc = tokenizer(rendering.text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    if quoted is not None:
        if rendering.contents is None:
            index, token = quoted
            raise RecordError(
                "template_error",
                f"message {index} spells the control token {token!r}, and the chat template rewrites message "
                "text, so it cannot be kept as text (--special-tokens-in-text parse reads it as the token)",
            )
        input_ids, offsets = _reencode_quoted(
            tokenizer, rendering.text, input_ids, offsets, rendering.contents, profile.control_ids
        )
    if profile.markers:
        is_target = _overlapping(offsets, rendering.targets)
    else:
        is_target = _targets_from_spans(offsets, rendering.targets)
        _close_turns(tokenizer, input_ids, is_target, profile.control_ids)
    labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, is_target, strict=True)]
    return input_ids, labels


def _reencode_quoted(
    tokenizer,
    text: str,
    input_ids: list[int],
    offsets: list[tuple[int, int]],
    contents: list[tuple[int, int]],
    control: frozenset[int],
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokenize again, as text, each stretch where message text turned into a control token.

    The template's own control tokens stay. A stretch between two of them that holds a control token
    lying inside a message's text is tokenized again with special tokens read as text; every other token
    is kept as it was, so a conversation tokenizes as before except where its messages quote control
    tokens::

        text    ...<|end_header_id|>\\n\\nsay <|eot_id|> now<|eot_id|>
        before  ... <|end_header_id|> "\\n\\n" "s" "ay" " " <|eot_id|> " now" <|eot_id|>
        after   ... <|end_header_id|> "\\n\\n" "s" "ay" " <" "|" "e" "ot" "_" "id" "|" ">" " now" <|eot_id|>
    """
    starts = [start for start, _ in contents]

    def in_message(span: tuple[int, int]) -> bool:
        k = bisect_right(starts, span[0]) - 1
        return k >= 0 and span[1] <= contents[k][1]

    is_control = [t in control for t in input_ids]
    quoted = [i for i, c in enumerate(is_control) if c and in_message(offsets[i])]
    if not quoted:
        return input_ids, offsets
    template = [i for i, c in enumerate(is_control) if c and not in_message(offsets[i])]
    ids_out: list[int] = []
    offsets_out: list[tuple[int, int]] = []
    bounds = [-1, *template, len(input_ids)]
    for left, right in zip(bounds, bounds[1:], strict=False):
        if left >= 0:
            ids_out.append(input_ids[left])
            offsets_out.append(offsets[left])
        q = bisect_right(quoted, left)
        if q == len(quoted) or quoted[q] > right:
            ids_out += input_ids[left + 1 : right]
            offsets_out += offsets[left + 1 : right]
            continue
        lo = offsets[left][1] if left >= 0 else 0
        hi = offsets[right][0] if right < len(input_ids) else len(text)
        enc = tokenizer(
            text[lo:hi], add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True
        )
        ids_out += enc["input_ids"]
        offsets_out += [(start + lo, end + lo) for start, end in enc["offset_mapping"]]
    return ids_out, offsets_out


def _targets_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Mark tokens whose first character lies in a span (a token merged across a boundary stays prompt)."""
    is_target = [False] * len(offsets)
    span = 0
    for i, (start, _end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        is_target[i] = start >= spans[span][0]
    return is_target


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Mark tokens that share a character with a span (how transformers reads ``{% generation %}``)."""
    is_target = [False] * len(offsets)
    span = 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        is_target[i] = end > spans[span][0]
    return is_target


def _close_turns(tokenizer, input_ids: list[int], is_target: list[bool], control: frozenset[int]) -> None:
    """Make every assistant turn end with exactly one target control token.

    ``...answer<|eot_id|>`` keeps its end token; ``...answer<|im_end|>\\n`` drops the text after the end
    token from the targets; ``...answer`` followed by ``<|user|>`` (GLM-4) takes that token as its end, or
    EOS (appended) when the conversation ends there.
    """
    n = len(input_ids)
    i = 0
    while i < n:
        if not is_target[i]:
            i += 1
            continue
        end = i
        while end < n and is_target[end]:
            end += 1
        last_control = max((j for j in range(i, end) if input_ids[j] in control), default=None)
        if last_control is not None:
            for j in range(last_control + 1, end):
                is_target[j] = False
        elif end < n and input_ids[end] in control:
            is_target[end] = True
            end += 1
        elif end == n and tokenizer.eos_token_id is not None:
            input_ids.append(tokenizer.eos_token_id)
            is_target.append(True)
            n += 1
            end = n
        else:
            raise TemplateError(
                "an assistant turn ends without a control token and no control token or EOS follows it, "
                "so the model could never learn to stop"
            )
        i = end


def check_chat_template(tokenizer) -> None:
    """Check once per tokenizer that its template splits into prompt and assistant parts; raise if not."""
    if not tokenizer.chat_template:
        raise TemplateError("the tokenizer has no chat template; pass one with --chat-template FILE")
    probe = _probe(tokenizer)
    profile = profile_tokenizer(tokenizer)
    try:
        input_ids, labels = tokenize_conversation(tokenizer, probe, profile)
    except TemplateError:
        raise
    except Exception as err:
        raise TemplateError(f"chat template failed on a plain two-turn conversation: {err}") from err
    targets = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    for answer in ("Seven.", "Eleven."):
        if answer not in targets:
            raise TemplateError(
                f"chat template check: assistant text {answer!r} is not among the targets {targets!r}"
            )
    for question in ("Name a prime.", "Another?"):
        if question in targets:
            raise TemplateError(f"chat template check: user text {question!r} ended up among the targets")
    ends = [
        t
        for t, nxt in zip(labels, labels[1:] + [IGNORE_INDEX], strict=True)
        if t != IGNORE_INDEX and nxt == IGNORE_INDEX
    ]
    if any(t not in profile.control_ids and t != tokenizer.eos_token_id for t in ends):
        raise TemplateError(
            "chat template check: an assistant turn's targets do not end with a control token"
        )


def truncate(
    input_ids: list[int], labels: list[int], max_seq_len: int, mode: str
) -> tuple[list[int], list[int]] | None:
    """Cut a sample to ``max_seq_len`` tokens (``right`` keeps the start, ``left`` the end); ``None`` if dropped.

    A sample that would keep no target token is dropped as well.
    """
    if len(input_ids) <= max_seq_len:
        return input_ids, labels
    if mode == "drop":
        return None
    window = slice(0, max_seq_len) if mode == "right" else slice(len(input_ids) - max_seq_len, None)
    input_ids, labels = input_ids[window], labels[window]
    if all(t == IGNORE_INDEX for t in labels):
        return None
    return input_ids, labels


def clean_message(message: str) -> str:
    """A drop message fit for Arrow and ``report.json``: valid UTF-8, at most ~``MAX_MESSAGE_CHARS`` long.

    A lone surrogate, which JSON can spell and a message may quote (a key, a role), is written as its
    escape: U+D800 becomes the six characters ``\\ud800``.
    """
    if len(message) > MAX_MESSAGE_CHARS:
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


@contextmanager
def _faults(reason: str, what: str) -> Iterator[None]:
    """Turn any exception that the record causes inside the block into a drop for ``reason``.

    A ``TemplateError`` blames the template (the run stops) and a ``MemoryError`` the machine, so both
    pass through; a ``RecordError`` already carries its reason.
    """
    try:
        yield
    except (RecordError, TemplateError, MemoryError):
        raise
    except Exception as err:
        raise RecordError(reason, f"{what}: {type(err).__name__}: {err}") from None


def process_line(
    text: str,
    tokenizer,
    *,
    max_seq_len: int,
    truncation: str,
    profile: TokenizerProfile | None = None,
    special_tokens_in_text: str = "text",
) -> dict[str, Any]:
    """One JSONL line -> a sample, or a drop with its reason and message; never raises for bad input.

    Only a ``TemplateError`` (the template, not the line, is at fault) escapes. ``profile`` is learned
    from the tokenizer when not given (pass it when processing many lines). The row's ``special_text``
    says whether a kept sample's messages spell a control token (``special_tokens_in_text`` says how such
    text is read: as ``text``, or ``parse``d into the control token).

    A sample that cannot fit is dropped from byte counts before it is tokenized (``size_guard``).
    """
    row: dict[str, Any] = {
        "input_ids": [],
        "labels": [],
        "reason": "",
        "error": "",
        "truncated": False,
        "special_text": False,
    }
    profile = profile or profile_tokenizer(tokenizer)
    try:
        if not text.strip():
            raise RecordError("empty_line", "empty line")
        # json raises ValueError for bad syntax or a >4300-digit integer, RecursionError for deep nesting
        with _faults("malformed_json", "not valid JSON"):
            record = json.loads(text)
        with _faults("unknown_format", "record not understood"):
            messages = parse_record(record)
        # the template itself may refuse the conversation (e.g. roles must alternate)
        with _faults("template_error", "chat template failed"):
            rendered, marked = render_text(tokenizer, messages, profile)
        if truncation == "drop":  # the text alone may show it too long: no need to locate the turns
            _check_size(tokenizer, profile, rendered, None, max_seq_len, truncation)
        with _faults("template_error", "chat template failed"):
            rendering = split_rendering(tokenizer, messages, profile, rendered, marked)
        if truncation != "drop":
            _check_size(tokenizer, profile, rendered, rendering.targets, max_seq_len, truncation)
        quoted = quoted_control_text(messages, profile)
        row["special_text"] = quoted is not None
        with _faults("template_error", "chat template failed"):
            as_text = quoted if special_tokens_in_text == "text" else None
            input_ids, labels = encode_rendering(tokenizer, rendering, profile, quoted=as_text)
        if all(t == IGNORE_INDEX for t in labels):
            raise RecordError("no_targets", "no assistant token survives tokenization")
        cut = truncate(input_ids, labels, max_seq_len, truncation)
        if cut is None:
            raise RecordError(
                "over_length",
                f"{len(input_ids)} tokens > max_seq_len {max_seq_len}"
                + (" (truncation leaves no target)" if truncation != "drop" else ""),
            )
        row.update(input_ids=cut[0], labels=cut[1], truncated=len(cut[0]) < len(input_ids))
    except RecordError as err:
        row.update(reason=err.reason, error=clean_message(str(err)))
    return row


def _check_size(tokenizer, profile, text, targets, max_seq_len: int, truncation: str) -> None:
    reason = size_guard(tokenizer, profile, text, targets, max_seq_len, truncation)
    if reason is not None:
        raise RecordError("over_length", reason)


def _tokenize_batch(batch: dict[str, list], *, tokenizer, strict: bool, **settings) -> dict[str, list]:
    rows = []
    for text, file, line in zip(batch["text"], batch["file"], batch["line"], strict=True):
        try:
            row = process_line(text, tokenizer, **settings)
        except TemplateError as err:  # the template, not the line, is at fault: stop, naming where it showed
            raise TemplateError(f"{file}: line {line}: {err}") from None
        if strict and row["reason"] in BAD_INPUT:  # stop here rather than tokenize the rest of the input
            raise RecordError(row["reason"], f"{file}: line {line}: {row['error']}")
        rows.append(row)
    keys = ("input_ids", "labels", "reason", "error", "truncated", "special_text")
    out = {key: [r[key] for r in rows] for key in keys}
    out["length"] = [len(r["input_ids"]) for r in rows]
    out["num_targets"] = [sum(t != IGNORE_INDEX for t in r["labels"]) for r in rows]
    return out


def _records(sources: Sequence[Source]) -> Iterator[dict[str, Any]]:
    """Every record of every source as a row: ``source`` (its index), ``file``, ``line``, ``text``."""
    for index, source in enumerate(sources):
        for file, line, text in records(source):
            yield {"source": index, "file": file, "line": line, "text": text}


SAMPLE_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int32"),
        "num_targets": datasets.Value("int32"),
        "line": datasets.Value("int64"),
        "source": datasets.Value("int32"),  # which input (report.json's "sources") the sample came from
    }
)
_RECORD_FEATURES = datasets.Features(
    {
        "source": datasets.Value("int32"),
        "file": datasets.Value("string"),
        "line": datasets.Value("int64"),
        "text": datasets.Value("string"),
    }
)

# While mapping, every line keeps a row; dropped ones carry their reason and message.
_MAPPED_FEATURES = datasets.Features(
    {
        **SAMPLE_FEATURES,
        "file": datasets.Value("string"),
        "reason": datasets.Value("string"),
        "error": datasets.Value("string"),
        "truncated": datasets.Value("bool"),
        "special_text": datasets.Value("bool"),
    }
)


def pre_tokenize(
    inputs: str | os.PathLike | Source | Sequence[str | os.PathLike | Source],
    tokenizer,
    output_dir: str | os.PathLike,
    *,
    max_seq_len: int,
    truncation: str = "right",
    num_proc: int = 1,
    strict: bool = False,
    special_tokens_in_text: str = "text",
    replace: bool = True,
) -> dict[str, Any]:
    """Tokenize chat records into a sample dataset at ``output_dir``; return the report.

    ``inputs`` is one source or several (``longalign.sources``: JSONL, JSON, Parquet, directories of
    them, saved or Hub datasets); each sample row keeps its ``source`` index and ``line``, and the report
    accounts for every source separately as well as in total. Bad lines are skipped and counted by reason
    (``strict`` raises at the first one instead, before tokenizing the lines after it).
    ``special_tokens_in_text`` says how message text that spells a control token is read: as ``text`` or
    ``parse``d into the token. Inputs in which no line becomes a sample are an ``InputError``. The output
    is checked before any work (see ``longalign.artifacts.stage_output``, also for ``replace``) and
    replaced only when everything succeeded; the work files live in its staging directory, never in
    ``$TMPDIR``.
    """
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if special_tokens_in_text not in SPECIAL_TEXT_MODES:
        raise ValueError(
            f"special_tokens_in_text must be one of {', '.join(SPECIAL_TEXT_MODES)}, got {special_tokens_in_text!r}"
        )
    sources = _as_sources(inputs)
    files = [file for source in sources for file in files_of(source)]  # also checks that each exists
    for file in files:
        if file.stat().st_size == 0:
            raise InputError(f"{file}: input file is empty")
    with stage_output(output_dir, stage="pre-tokenize", inputs=files, replace=replace) as staging:
        check_chat_template(tokenizer)
        profile = profile_tokenizer(tokenizer)
        cache_dir = str(staging / ".cache")
        try:
            raw = datasets.Dataset.from_generator(
                _records,
                gen_kwargs={"sources": tuple(sources)},  # a list would be split into shards, one index each
                cache_dir=cache_dir,
                features=_RECORD_FEATURES,
            )
        except datasets.exceptions.DatasetGenerationError as err:
            if isinstance(err.__cause__, InputError):  # raised while reading, wrapped by datasets
                raise err.__cause__ from None
            raise
        fn_kwargs = {
            "tokenizer": tokenizer,
            "profile": profile,
            "max_seq_len": max_seq_len,
            "truncation": truncation,
            "special_tokens_in_text": special_tokens_in_text,
            "strict": strict,
        }
        try:
            mapped = raw.map(
                _tokenize_batch,
                fn_kwargs=fn_kwargs,
                batched=True,
                batch_size=64,
                num_proc=num_proc if num_proc > 1 else None,
                remove_columns=["text"],
                features=_MAPPED_FEATURES,
                desc="pre-tokenize",
            )
        except (RecordError, TemplateError) as err:
            # From a tokenizer process it arrives chained to the worker's traceback: the message says it all.
            raise err from None
        report = _report(mapped, sources, max_seq_len, truncation, special_tokens_in_text)
        if report["samples_kept"] == 0:  # an empty dataset would only fail later, in packing or training
            dropped = ", ".join(f"{reason} {n}" for reason, n in report["dropped"].items() if n)
            raise InputError(
                f"{report['input']}: no line became a sample ({report['lines_read']} lines read; dropped: {dropped})"
            )
        reasons = np.asarray(mapped["reason"])
        kept = mapped.select(np.flatnonzero(reasons == "")).remove_columns(
            ["file", "reason", "error", "truncated", "special_text"]
        )
        kept.save_to_disk(str(staging))
        write_report(staging, report)
        shutil.rmtree(cache_dir)
    return report


def _as_sources(inputs: str | os.PathLike | Source | Sequence[str | os.PathLike | Source]) -> list[Source]:
    if isinstance(inputs, (str, os.PathLike, Source)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("pre_tokenize: no input")
    return [item if isinstance(item, Source) else Source(str(item)) for item in inputs]


def _report(
    mapped: datasets.Dataset,
    sources: list[Source],
    max_seq_len: int,
    truncation: str,
    special_tokens_in_text: str,
) -> dict[str, Any]:
    """The stage's report: the counts in total, and the same counts for every source (``sources``)."""
    columns = [
        "source",
        "file",
        "reason",
        "truncated",
        "special_text",
        "length",
        "num_targets",
        "line",
        "error",
    ]
    table = {name: np.asarray(mapped.select_columns([name])[name]) for name in columns}
    kept = table["reason"] == ""
    bad = np.flatnonzero(~kept)[:MAX_REPORTED_ERRORS]
    return {
        "input": ", ".join(source.name for source in sources),
        "max_seq_len": max_seq_len,
        "truncation": truncation,
        **_counts(table, np.ones(len(kept), dtype=bool)),
        "special_tokens_in_text": special_tokens_in_text,
        "length_percentiles": _percentiles(table["length"][kept]),
        "first_errors": [
            {
                "file": str(table["file"][i]),
                "line": int(table["line"][i]),
                "reason": str(table["reason"][i]),
                "message": str(table["error"][i]),
            }
            for i in bad.tolist()
        ],  # fmt: skip
        "sources": [
            {"name": source.name, **_counts(table, table["source"] == index)}
            for index, source in enumerate(sources)
        ],
    }


def _counts(table: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, Any]:
    """Lines read, kept and dropped by reason, truncations and tokens over ``rows`` of the mapped table."""
    reasons = table["reason"][rows]
    kept = reasons == ""
    dropped = Counter(reasons[~kept].tolist())
    return {
        "lines_read": int(rows.sum()),
        "samples_kept": int(kept.sum()),
        "dropped": {reason: dropped.get(reason, 0) for reason in DROP_REASONS},
        "dropped_total": int((~kept).sum()),
        "truncated": int(table["truncated"][rows][kept].sum()),
        "samples_with_special_token_text": int(table["special_text"][rows][kept].sum()),
        "total_tokens": int(table["length"][rows][kept].sum()),
        "target_tokens": int(table["num_targets"][rows][kept].sum()),
    }


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    points = {"min": 0, "p10": 10, "p50": 50, "p90": 90, "p99": 99, "max": 100}
    out = {name: float(np.percentile(values, q)) for name, q in points.items()}
    out["mean"] = float(values.mean())
    return out
