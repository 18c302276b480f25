"""The pre-tokenize stage: chat records -> ``input_ids`` and assistant-only ``labels``, with a report.

It reads records (``longalign.records``), renders them with the chat template and finds the assistant
turns (``longalign.chat_template``), tokenizes and labels them (``longalign.labels``), and writes the
sample dataset and ``report.json``.

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
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import datasets
import numpy as np

from longalign.artifacts import stage_output, write_report
from longalign.chat_template import (
    TemplateError,
    TokenizerProfile,
    profile_tokenizer,
    render_text,
    split_rendering,
)
from longalign.config import IGNORE_INDEX, TRUNCATIONS, Source
from longalign.errors import ConfigError, InputError
from longalign.labels import (
    check_chat_template,
    encode_rendering,
    quoted_control_text,
    truncate,
)
from longalign.records import BAD_INPUT, DROP_REASONS, RecordError, clean_message, parse_record
from longalign.sources import files_of, records

# What message text that spells a control token (e.g. "<|eot_id|>") becomes: text, or the control token.
SPECIAL_TEXT_MODES = ("text", "parse")
MAX_REPORTED_ERRORS = 20
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
        raise ConfigError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    if max_seq_len < 1:
        raise ConfigError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if special_tokens_in_text not in SPECIAL_TEXT_MODES:
        raise ConfigError(
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
        raise ConfigError("pre_tokenize: no input")
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
