"""Raw chat data in: files, directories, saved datasets and Hub datasets, and the mix of several.

A source is anything a run file's ``[data] train_file`` or ``[[data.sources]] path`` may name::

    chats.jsonl / chats.json / chats.parquet    a raw chat file (JSON Lines, a JSON array, Parquet)
    chats/                                      a directory of such files (sorted by name; in a stage's
                                                output, such as `longalign data`'s, not its report.json)
    saved/                                      a `datasets` directory (save_to_disk), split "train" by default
    org/name                                    a Hub dataset, read with datasets.load_dataset (cache first)

``longalign.config.Source`` describes one (path, split, columns, and the share of a mix it takes), as the
run file's checker knows it; this module reads what it names. Every record becomes ``(file, number,
text)``: the file it came from, its 1-based line (or row) number there, and its JSON text, which the
pre-tokenize stage parses like any JSONL line. ``columns`` renames a source's fields to the ones
pre-tokenize reads (``{messages = "dialog", role = "speaker"}``), at the top level and inside every message.

A mix takes samples from each source, deterministically from a seed (``mix_indices``)::

    sources   long.jsonl (all of it)     short.jsonl (fraction = 0.1)
    kept      8,000 samples              120,000 samples
    taken     8,000                      12,000     (a seeded choice without replacement)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from longalign.answers import CALLS_NAME
from longalign.artifacts import MARKER_NAME, REPORT_NAME
from longalign.config import Source
from longalign.errors import InputError

RAW_SUFFIXES = (".jsonl", ".json", ".parquet")
MESSAGE_LISTS = ("messages", "conversations")


def kind(path: str) -> str:
    """What ``path`` is: ``file``, ``directory``, ``dataset`` (saved or longalign stage) or ``hub``."""
    local = Path(path)
    if local.is_file():
        if local.suffix not in RAW_SUFFIXES:
            raise InputError(f"{path}: not a chat file ({', '.join(RAW_SUFFIXES)})")
        return "file"
    if local.is_dir():
        saved = ("dataset_info.json", "state.json", "dataset_dict.json")
        return "dataset" if any((local / name).exists() for name in saved) else "directory"
    if local.exists():
        raise InputError(f"{path}: neither a file nor a directory")
    looks_like_hub_id = path.count("/") <= 1 and not path.startswith((".", "/", "~")) and not local.suffix
    if not looks_like_hub_id:
        raise InputError(f"{path}: not found")
    return "hub"


def files_of(source: Source) -> list[Path]:
    """The raw files a file or directory source reads, in order; empty for datasets."""
    local = Path(source.path)
    found = kind(source.path)
    if found == "file":
        return [local]
    if found != "directory":
        return []
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.suffix in RAW_SUFFIXES)
    if (
        local / MARKER_NAME
    ).exists():  # a stage's output (longalign data): its report and answers are no chat data
        files = [p for p in files if p not in (local / REPORT_NAME, local / CALLS_NAME)]
    if not files:
        raise InputError(f"{source.path}: a directory without {', '.join(RAW_SUFFIXES)} files")
    return files


def records(source: Source) -> Iterator[tuple[str, int, str]]:
    """``(file, number, JSON text)`` for every record of ``source``; numbers are 1-based per file.

    JSON Lines are passed on as written (a line that is not valid JSON still reaches the line parser,
    which counts it); other formats are read as records and written back as JSON, with ``columns`` applied.
    """
    found = kind(source.path)
    if found in ("dataset", "hub"):
        yield from _dataset_records(source, found)
        return
    for path in files_of(source):
        if path.suffix == ".jsonl":
            for number, text in read_lines(path):
                yield str(path), number, _renamed_text(text, source.columns)
        elif path.suffix == ".json":
            for number, record in enumerate(_json_array(path), start=1):
                yield str(path), number, _as_text(record, source.columns)
        else:
            yield from _parquet_records(path, source.columns)


def read_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for every line of a UTF-8 file; a leading byte order mark is skipped.

    Raises :class:`InputError` naming the line where the file is not UTF-8 (one bad byte means the
    file was written in another encoding, and every line after it is suspect).
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(
                    f"{path}: line {number}: not valid UTF-8 ({err.reason} at byte {err.start})"
                ) from None
            yield number, text.rstrip("\r\n")


def _json_array(path: Path) -> list[Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        raise InputError(f"{path}: not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(value, list):
        raise InputError(f"{path}: a .json source holds a JSON array of records, got {type(value).__name__}")
    return value


def _parquet_records(path: Path, columns: Mapping[str, str]) -> Iterator[tuple[str, int, str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise InputError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    number = 0
    for batch in table.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield str(path), number, _as_text(record, columns)


def _dataset_records(source: Source, found: str) -> Iterator[tuple[str, int, str]]:
    import datasets

    split = source.split or "train"
    try:
        if found == "dataset":
            loaded = datasets.load_from_disk(source.path)
            dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:
            dataset = datasets.load_dataset(source.path, split=split)
    except KeyError:
        raise InputError(f"{source.path}: no split {split!r}") from None
    except Exception as err:  # the Hub, the cache and the loaders raise many types; the message says why
        message = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = "neither in the local datasets cache nor reachable" if found == "hub" else "not readable"
        raise InputError(f"{source.path}: {where} ({message})") from None
    for number, record in enumerate(dataset, start=1):
        yield source.name, number, _as_text(record, source.columns)


def _as_text(record: Any, columns: Mapping[str, str]) -> str:
    return json.dumps(_renamed(record, columns), ensure_ascii=False, default=str)


def _renamed_text(text: str, columns: Mapping[str, str]) -> str:
    """A JSONL line with ``columns`` applied; left as written when there is nothing to rename or it is not JSON."""
    if not columns:
        return text
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return text  # the line parser counts it as malformed
    return _as_text(record, columns)


def _renamed(record: Any, columns: Mapping[str, str]) -> Any:
    """``record`` with the source's field names (``columns`` values) renamed to ours (its keys)."""
    if not columns or not isinstance(record, dict):
        return record
    theirs = {their: ours for ours, their in columns.items()}
    out = {theirs.get(key, key): value for key, value in record.items()}
    for key in MESSAGE_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [
                {theirs.get(k, k): v for k, v in message.items()} if isinstance(message, dict) else message
                for message in out[key]
            ]
    return out


def mix_indices(available: Sequence[int], sources: Sequence[Source], seed: int) -> list[np.ndarray]:
    """Which of each source's samples a mix takes, as sorted indices into that source's kept samples.

    A source without a rule is taken whole; ``fraction`` takes round(fraction x available);
    ``num_samples`` takes exactly that many (more than the source has is an error). The ``weight``
    sources together take as many samples as the scarcest of them allows with their counts in the
    proportion of their weights::

        available [100, 1000, 50], weights [-, 3, 1]  ->  taken [100, 150, 50]

    Each choice is a seeded draw without replacement: the same seed and counts give the same samples.
    """
    weights = {
        i: s.weight / sum(x.weight for x in sources if x.weight) for i, s in enumerate(sources) if s.weight
    }
    weighted_total = min((available[i] / share for i, share in weights.items()), default=0.0)
    out = []
    for i, (n, source) in enumerate(zip(available, sources, strict=True)):
        if source.num_samples is not None and source.num_samples > n:
            raise InputError(f"{source.name}: num_samples {source.num_samples}, but it has {n} samples")
        if source.num_samples is not None:
            count = source.num_samples
        elif source.fraction is not None:
            count = round(source.fraction * n)
        elif i in weights:
            count = min(n, int(weighted_total * weights[i] + 1e-9))
        else:
            count = n
        rng = np.random.default_rng([seed, i])
        out.append(np.arange(n) if count == n else np.sort(rng.choice(n, size=count, replace=False)))
    return out


def fingerprint(source: Source) -> list[Any]:
    """What decides a source's content: each file's path, size and modification time; a dataset's own
    fingerprint; a Hub id with its split (the local cache decides what it holds)."""
    found = kind(source.path)
    if found == "dataset":
        state = Path(source.path) / "state.json"
        info = [p.stat().st_mtime_ns for p in Path(source.path).rglob("*") if p.is_file()]
        return [source.path, source.split, state.read_text() if state.exists() else max(info, default=0)]
    if found == "hub":
        return [source.path, source.split]
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files_of(source)] + [
        dict(source.columns)
    ]
