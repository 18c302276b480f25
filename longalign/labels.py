"""Tokens and labels: a rendering tokenized once, its target characters turned into target tokens.

    text      ...<|end_header_id|>\\n\\nHello!<|eot_id|>
    input_ids ...  <|end_header_id|>  "\\n\\n"  "Hello"  "!"  <|eot_id|>
    labels    ...  -100               -100     "Hello"  "!"  <|eot_id|>

Labels are not shifted (the loss shifts) and every assistant turn ends with one target control token,
so the model learns to stop.
"""

from __future__ import annotations

from bisect import bisect_right

from longalign.chat_template import (
    Rendering,
    TemplateError,
    TokenizerProfile,
    probe_conversation,
    profile_tokenizer,
    render_conversation,
)
from longalign.config import IGNORE_INDEX
from longalign.records import RecordError


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
    if quoted is not None and rendering.contents is None:
        index, token = quoted
        raise RecordError(
            "template_error",
            f"message {index} spells the control token {token!r}, and the chat template rewrites message "
            "text, so it cannot be kept as text (--special-tokens-in-text parse reads it as the token)",
        )
    input_ids, offsets = encode_text(
        tokenizer, rendering.text, rendering.contents if quoted else None, profile.control_ids
    )
    if profile.markers:
        is_target = _overlapping(offsets, rendering.targets)
    else:
        is_target = _targets_from_spans(offsets, rendering.targets)
        _close_turns(tokenizer, input_ids, is_target, profile.control_ids)
    labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, is_target, strict=True)]
    return input_ids, labels


def encode_text(
    tokenizer,
    text: str,
    contents: list[tuple[int, int]] | None,
    control: frozenset[int],
) -> tuple[list[int], list[tuple[int, int]]]:
    """A rendered chat's token ids and each token's character span: the whole text encoded in one pass.

    ``contents`` (the character spans of the messages' text, or None) asks for message text that spells a
    control token to be read as text (``_reencode_quoted``). Pre-tokenize and every eval prompt encode a
    chat this way, so a prompt is the token sequence the model was trained on.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if contents is None:
        return input_ids, offsets
    return _reencode_quoted(tokenizer, text, input_ids, offsets, contents, control)


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
    probe = probe_conversation(tokenizer)
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
