"""Long documents in, each cut to a token range at a paragraph boundary or skipped with its reason.

    read_documents("docs/")            -> [Document(name="docs/a.md", text="..."), ...]   # .txt/.md files, sorted
    read_documents("corpus.jsonl")     -> [Document(name="corpus.jsonl:1", text=...), ...]  # the "text" field
    fit_document(text, count, min_tokens=2000, max_tokens=8000)
        -> Fitted(text=..., tokens=7950, cut=True)     # longer: cut after its last paragraph that fits
        -> Skipped("too_short")                        # under min_tokens, or nothing in range to cut at

A paragraph ends at a blank line. A cut keeps whole paragraphs only, so a sample never ends mid-sentence::

    | para 1 | para 2 | para 3 ......... | para 4 |        max_tokens
    |<------------ kept -------------->|              <--- cut here (the last boundary under the limit)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from longalign.errors import InputError, PathError
from longalign.sources import read_lines

DOCUMENT_SUFFIXES = (".txt", ".md", ".jsonl")
SKIP_REASONS = ("empty", "too_short", "no_boundary_in_range")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


@dataclass(frozen=True)
class Document:
    """One document as read: how the report and the samples' ``meta`` name it, and its text."""

    name: str  # the file path, or "file.jsonl:LINE" for a JSONL record
    text: str


@dataclass(frozen=True)
class Fitted:
    """A document inside the token range: its text (cut or whole) and its token count."""

    text: str
    tokens: int
    cut: bool  # True when paragraphs at the end were left out to fit max_tokens


@dataclass(frozen=True)
class Skipped:
    """A document left out, with one of ``SKIP_REASONS``."""

    reason: str


def read_documents(path: str | os.PathLike) -> list[Document]:
    """The documents at ``path``: a .txt/.md file, a JSONL file of ``{"text": ...}`` rows, or a directory of them.

    A directory is read recursively, files sorted by path. Raises ``InputError`` naming the file and line
    of a row without a ``text`` string, and when there is no document at all.
    """
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in DOCUMENT_SUFFIXES)
    elif root.is_file():
        if root.suffix not in DOCUMENT_SUFFIXES:
            raise InputError(f"{path}: not a document file ({', '.join(DOCUMENT_SUFFIXES)})")
        files = [root]
    else:
        raise PathError(f"{path}: not found")
    documents = [doc for file in files for doc in _documents_in(file)]
    if not documents:
        raise InputError(
            f"{path}: no documents ({', '.join(DOCUMENT_SUFFIXES)} files, JSONL rows with 'text')"
        )
    return documents


def _documents_in(file: Path) -> list[Document]:
    if file.suffix != ".jsonl":
        try:
            return [Document(str(file), file.read_text(encoding="utf-8-sig"))]
        except UnicodeDecodeError as err:
            raise InputError(f"{file}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    documents = []
    for number, line in read_lines(file):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise InputError(f"{file}: line {number}: not valid JSON ({err})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise InputError(f"{file}: line {number}: expected an object with a 'text' string")
        documents.append(Document(f"{file}:{number}", row["text"]))
    return documents


def fit_document(
    text: str, count_tokens: Callable[[str], int], *, min_tokens: int, max_tokens: int
) -> Fitted | Skipped:
    """``text`` within ``[min_tokens, max_tokens]`` tokens, cut at the last paragraph break that fits.

    fit_document("a b\\n\\nc d\\n\\ne f", lambda t: len(t.split()), min_tokens=1, max_tokens=4)
    -> Fitted(text='a b\\n\\nc d', tokens=4, cut=True)
    """
    text = text.strip()
    if not text:
        return Skipped("empty")
    tokens = count_tokens(text)
    if tokens < min_tokens:
        return Skipped("too_short")
    if tokens <= max_tokens:
        return Fitted(text, tokens, cut=False)
    # The longest prefix that fits, by bisection over the paragraph breaks (a prefix's count grows with
    # it); each prefix is counted as it will be tokenized, so the limit holds whatever the tokenizer does
    # at the seam.
    breaks = [m.start() for m in _PARAGRAPH_BREAK.finditer(text)]
    low, high, best = 0, len(breaks) - 1, None
    while low <= high:
        middle = (low + high) // 2
        prefix = text[: breaks[middle]].rstrip()
        tokens = count_tokens(prefix)
        if tokens <= max_tokens:
            best, low = Fitted(prefix, tokens, cut=True), middle + 1
        else:
            high = middle - 1
    if best is None or best.tokens < min_tokens:
        return Skipped("no_boundary_in_range")
    return best
