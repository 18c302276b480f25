"""The chat template: the tokenizer, what is learned once per tokenizer, and turns located in a rendering.

A conversation is rendered once with the tokenizer's template; ``Rendering.targets`` are the character
spans the model learns (the assistant turns, or the text a ``{% generation %}`` template marks)::

    <|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\nHello!<|eot_id|>
                                                                                                     |-- target --|

Templates without markers are split by the ``TurnLayout`` learned once from a probe conversation (or,
when a conversation does not fit it, by rendering growing prefixes). ``TemplateError`` blames the
template, not a line: the stage stops on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import decoders, models, pre_tokenizers
from transformers.utils.chat_template_utils import render_jinja_template

from longalign.errors import InputError, ModelError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ModelError):
    """A chat template that cannot be split into prompt and assistant parts."""


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
        control_ids=control_ids(tokenizer),
        # longest first, so that a token whose text starts with another's is named whole
        control_text=re.compile("|".join(map(re.escape, control))) if control else None,
        max_token_bytes=longest_token_bytes(tokenizer),
        strips_whitespace=any(tok.lstrip or tok.rstrip for tok in added.values()),
    )


def control_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special added tokens: the ones a chat template writes to frame turns."""
    return frozenset(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)


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


def learn_turn_layout(tokenizer) -> TurnLayout | None:
    """Split the probe conversation by growing prefixes and read off its assistant-turn layout.

    ``None`` (split every conversation by prefixes) when the probe cannot be split or located, or when its
    two assistant turns are framed differently.
    """
    probe = probe_conversation(tokenizer)
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


def probe_conversation(tokenizer) -> list[dict[str, str]]:
    """The probe conversation, without its system message for a template that refuses one (it raises)."""
    try:
        _render(tokenizer, list(PROBE))
    except Exception:
        return list(PROBE[1:])
    return list(PROBE)


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
