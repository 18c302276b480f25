"""Packing: group tokenized samples into rows of at most ``max_seq_len`` tokens, with no padding.

A pack row holds its samples back to back plus the 1D ``cu_seqlens`` that tells varlen attention where
each one starts. Samples of 3, 2 and 4 tokens (source lines 12, 7, 40) in one pack of ``max_seq_len=10``::

    input_ids    a a a b b c c c c      9 tokens, nothing stored for the free slot
    labels       . a a . b . c c c      '.' = -100, copied as pre-tokenize wrote them (not shifted)
    cu_seqlens   [0, 3, 5, 9]           int32; no fake sample for the free slot
    seq_lens     [3, 2, 4]
    num_targets  [2, 1, 3]
    lines        [12, 7, 40]            where each sample came from: its line (or row) in its input
    sources      [0, 0, 1]              which input: an index into the pre-tokenize report's "sources"

``pack`` decides which samples share a row from their lengths alone; ``build_pack_table`` gathers the
tokens with Arrow; ``write_packs`` is the stage: load, pack, write atomically, report.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator, Sequence
from itertools import chain, pairwise
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from longalign.artifacts import check_output, load_stage, stage_output, write_report
from longalign.config import STRATEGIES, Source
from longalign.errors import ConfigError, InputError
from longalign.sources import mix_indices

MAX_REPORTED_LINES = 20  # dropped samples whose line the report names
SAMPLE_COLUMNS = ("input_ids", "labels", "length", "num_targets", "line")
PACK_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("cu_seqlens", pa.list_(pa.int32())),
        ("seq_lens", pa.list_(pa.int32())),
        ("num_targets", pa.list_(pa.int32())),
        ("lines", pa.list_(pa.int64())),
        ("sources", pa.list_(pa.int32())),
    ]
)
# Pack rows are gathered and written this many tokens at a time, so memory stays far below the dataset.
_WRITE_BATCH_TOKENS = 1 << 23
_HISTOGRAM_BINS = 50


def pack(
    lengths: np.ndarray,
    max_len: int,
    strategy: str = "bfd",
    *,
    seed: int = 0,
    batch_size: int = 1,
    sort_by_length: bool = False,
) -> list[list[int]]:
    """Group sample indices into packs of at most ``max_len`` tokens, returned in a seeded random order.

    ``lengths[i]`` is the token count of sample ``i``; every index lands in exactly one pack. Strategies:

    - ``bfd`` best-fit decreasing: longest sample first, each into the open pack with the least room that
      still holds it, else a new pack. Runs over the whole dataset at once.
    - ``ffd`` first-fit decreasing: longest first, each into the oldest open pack with room.
    - ``greedy`` next-fit in the given order: a new pack starts when the next sample does not fit; the
      samples of a pack keep their order and the last pack is kept.
    - ``sorted`` no packing: sort by length and cut runs of ``batch_size`` samples, so the samples of a
      batch have similar lengths. ``max_len`` bounds each sample, not the batch.
    - ``none`` no packing: every sample is a row of its own.

    ``sort_by_length`` orders the samples by length (shortest first) before the strategy runs. For
    ``greedy`` that is LongAlign's sort-and-group: next-fit over the sorted samples, so each pack holds
    neighbouring lengths. ``bfd``, ``ffd`` and ``sorted`` sort by themselves, so it changes nothing there;
    ``none`` refuses it (sorted batching is ``sorted``)::

        lengths [4, 1, 3, 2], max_len 5, greedy                  packs [[0, 1], [2, 3]]
        the same, sort_by_length: next-fit over samples 1 3 2 0  packs [[1, 3], [2], [0]] in some order

    Equal lengths are taken in a seeded random order, so ``seed`` fixes the whole result::

        lengths [6, 5, 4, 3, 2], max_len 10, bfd
        6 -> new pack A (room 4);  5 -> new pack B (room 5);  4 -> A (room 0)
        3 -> B (room 2);  2 -> B (room 0)              packs [[0, 2], [1, 3, 4]] in some order
    """
    lengths = _checked_lengths(lengths, max_len)
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    if batch_size < 1 or (batch_size != 1 and strategy != "sorted"):
        raise ConfigError(f"batch_size {batch_size}: must be >= 1, and only strategy 'sorted' takes one > 1")
    if sort_by_length and strategy == "none":
        raise ConfigError("sort_by_length with strategy 'none': sorted batching is strategy 'sorted'")
    rng = np.random.default_rng(seed)
    if strategy == "none":
        order = pack_of = np.arange(len(lengths))
    elif strategy == "greedy":
        order = _by_length(lengths, rng, descending=False) if sort_by_length else np.arange(len(lengths))
        pack_of = _next_fit(lengths[order], max_len)
    elif strategy == "sorted":
        order = _by_length(lengths, rng, descending=False)
        pack_of = np.arange(len(lengths)) // batch_size
    else:
        order = _by_length(lengths, rng, descending=True)
        fit = _best_fit if strategy == "bfd" else _first_fit
        pack_of = fit(lengths[order], max_len)
    return _shuffled_packs(order, pack_of, rng)


def _checked_lengths(lengths: np.ndarray, max_len: int) -> np.ndarray:
    lengths = np.asarray(lengths)
    if max_len < 1:
        raise ConfigError(f"max_len must be >= 1, got {max_len}")
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1D integer array, got shape {lengths.shape} {lengths.dtype}")
    bad = np.flatnonzero((lengths < 1) | (lengths > max_len))
    if bad.size:
        i = int(bad[0])
        raise InputError(f"sample {i} has {lengths[i]} tokens; samples need 1 to max_len={max_len} tokens")
    return lengths.astype(np.int64)


def _by_length(lengths: np.ndarray, rng: np.random.Generator, *, descending: bool) -> np.ndarray:
    """Sample indices sorted by length, equal lengths in random order."""
    shuffled = rng.permutation(len(lengths))
    key = -lengths[shuffled] if descending else lengths[shuffled]
    return shuffled[np.argsort(key, kind="stable")]


def _runs(sorted_lengths: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """``(length, start, count)`` for each run of equal values: [5, 5, 3] -> (5, 0, 2), (3, 2, 1)."""
    starts = np.flatnonzero(np.diff(sorted_lengths, prepend=-1))
    counts = np.diff(starts, append=len(sorted_lengths))
    return zip(sorted_lengths[starts].tolist(), starts.tolist(), counts.tolist(), strict=True)


def _best_fit(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Best-fit decreasing over ``lengths`` (sorted, longest first); return the pack id of each sample.

    Samples of equal length go in together. A pack with the least fitting room ``r`` stays the best fit
    until it is too full, so it takes ``r // length`` of them in a row; packs with equal room are
    interchangeable, so all of them move at once. The loop therefore runs once per (length, room) step,
    not once per sample. The rooms that have open packs are the set bits of one Python int, where the
    least room >= length is one shift and one lowest-set-bit away.
    """
    pack_of = np.empty(len(lengths), dtype=np.int64)
    packs_by_room: dict[int, list[int]] = {}
    rooms = 0  # bit r is set <=> packs_by_room[r] is non-empty
    num_packs = 0

    def add(room: int, packs: list[int]) -> None:
        nonlocal rooms
        if room:  # a full pack never takes another sample
            packs_by_room.setdefault(room, []).extend(packs)
            rooms |= 1 << room

    for length, pos, left in _runs(lengths):
        while left:
            larger = rooms >> length
            if larger:
                room = (larger & -larger).bit_length() - 1 + length
                packs = packs_by_room[room]
            else:
                room = max_len
                new = -(-left // (max_len // length))
                packs = list(range(num_packs, num_packs + new))
                num_packs += new
            per_pack = room // length
            full = min(len(packs), left // per_pack)
            taken = packs[len(packs) - full :]
            del packs[len(packs) - full :]
            pack_of[pos : pos + full * per_pack] = np.repeat(taken, per_pack)
            add(room - per_pack * length, taken)
            pos += full * per_pack
            left -= full * per_pack
            if left and packs:  # fewer than per_pack samples left: one pack takes them all
                last = packs.pop()
                pack_of[pos : pos + left] = last
                add(room - left * length, [last])
                pos, left = pos + left, 0
            if room < max_len and not packs:  # new packs (room max_len) are not in packs_by_room
                del packs_by_room[room]
                rooms ^= 1 << room
    return pack_of


def _first_fit(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """First-fit decreasing over ``lengths`` (sorted, longest first); return the pack id of each sample.

    Samples of equal length go in together with array operations: walking the packs oldest first (then
    new ones), each pack with room ``r`` takes ``r // length`` of them until none is left. This is what
    placing them one by one does, since a pack stays the first fit until it is too full.
    """
    pack_of = np.empty(len(lengths), dtype=np.int64)
    room = np.empty(len(lengths), dtype=np.int64)  # at most one pack per sample
    num_packs = 0
    for length, pos, count in _runs(lengths):
        new = -(-count // (max_len // length))  # enough new packs for every sample of this length
        room[num_packs : num_packs + new] = max_len
        candidates = np.concatenate(
            [np.flatnonzero(room[:num_packs] >= length), np.arange(num_packs, num_packs + new)]
        )
        takes = room[candidates] // length
        placed = np.cumsum(takes)
        last = int(np.searchsorted(placed, count))  # the pack that takes the last sample
        candidates, takes = candidates[: last + 1], takes[: last + 1]
        takes[last] -= placed[last] - count
        pack_of[pos : pos + count] = np.repeat(candidates, takes)
        room[candidates] -= takes * length
        num_packs = max(num_packs, int(candidates[-1]) + 1)
    return pack_of


def _next_fit(lengths: np.ndarray, max_len: int) -> np.ndarray:
    """Next-fit in the given order; return the pack id of each sample."""
    starts_pack = []
    room = 0
    for length in lengths.tolist():
        starts_pack.append(length > room)
        room = (max_len if length > room else room) - length
    return np.cumsum(starts_pack, dtype=np.int64) - 1


def _shuffled_packs(order: np.ndarray, pack_of: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
    """Turn ``pack_of[j]`` = pack of sample ``order[j]`` into index lists, packs in random order."""
    members = order[np.argsort(pack_of, kind="stable")].tolist()
    bounds = np.concatenate([[0], np.cumsum(np.bincount(pack_of))]).tolist()
    return [members[bounds[p] : bounds[p + 1]] for p in rng.permutation(len(bounds) - 1).tolist()]


def packing_report(
    lengths: np.ndarray, packs: list[list[int]], max_len: int, *, strategy: str = "bfd"
) -> dict[str, Any]:
    """Count what ``packs`` (from ``pack``) does with ``lengths``: the numbers of the stage's ``report.json``.

    ``efficiency`` = tokens / slots, where slots are the token positions a trainer pays for: ``max_len``
    per pack, or for ``sorted`` batches samples x longest sample (the batch padded). ``fill`` is the same
    ratio per row. ``attention_cost`` is sum(l_i^2) per row, what varlen attention pays: a pack of 4096
    one-token samples costs 4096, a pack of one 4096-token sample 16.8M. Example, ``max_len`` 5::

        lengths [3, 2, 4], packs [[0, 1], [2]] -> tokens 9, packs 2 (lower bound ceil(9/5) = 2),
        efficiency 9/10, fill [1.0, 0.8], attention_cost [9+4, 16]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if not packs:
        raise ValueError("no packs to report on")
    samples_per_pack = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    seq_lens = lengths[np.fromiter(chain.from_iterable(packs), dtype=np.int64, count=samples_per_pack.sum())]
    starts = np.cumsum(samples_per_pack) - samples_per_pack
    pack_tokens = np.add.reduceat(seq_lens, starts)
    if strategy == "sorted":
        slots = samples_per_pack * np.maximum.reduceat(seq_lens, starts)
    else:
        slots = np.full(len(packs), max_len)
    fill = pack_tokens / slots
    attention_cost = np.add.reduceat(seq_lens**2, starts)
    tokens = int(pack_tokens.sum())
    # No row count can beat ceil(tokens / max_len) packs; it does not apply where nothing is packed.
    lower_bound = None if strategy in ("sorted", "none") else math.ceil(tokens / max_len)
    over_lower_bound = None if lower_bound is None else round(100 * (len(packs) / lower_bound - 1), 4)
    return {
        "strategy": strategy,
        "max_seq_len": max_len,
        "samples": len(seq_lens),
        "tokens": tokens,
        "packs": len(packs),
        "lower_bound_packs": lower_bound,
        "packs_over_lower_bound_pct": over_lower_bound,
        "efficiency": round(tokens / int(slots.sum()), 6),
        "samples_per_pack": _summary(samples_per_pack, {"min": 0, "p50": 50, "max": 100}),
        "fill": _summary(fill, {"min": 0, "p1": 1, "p5": 5, "p50": 50, "p95": 95, "max": 100}),
        "sample_length": _summary(seq_lens, {"min": 0, "p50": 50, "p95": 95, "max": 100}),
        "attention_cost": {
            "total": int(attention_cost.sum()),
            "per_pack": _summary(attention_cost, {"min": 0, "p50": 50, "max": 100}),
        },
        "histograms": {
            "sample_length": _histogram(seq_lens, (0, max_len)),
            "fill": _histogram(fill, (0, 1)),
        },
    }


def _summary(values: np.ndarray, percentiles: dict[str, float]) -> dict[str, float]:
    points = np.percentile(values, list(percentiles.values()))
    return {name: round(float(p), 6) for name, p in zip(percentiles, points, strict=True)}


def _histogram(values: np.ndarray, value_range: tuple[float, float]) -> dict[str, list]:
    counts, edges = np.histogram(values, bins=_HISTOGRAM_BINS, range=value_range)
    return {"edges": [round(float(e), 6) for e in edges], "counts": counts.tolist()}


def build_pack_table(samples: pa.Table, rows: np.ndarray, samples_per_pack: np.ndarray) -> pa.Table:
    """Gather sample rows into pack rows (schema ``PACK_SCHEMA``) without per-token Python objects.

    ``rows`` lists source row numbers pack after pack; ``samples_per_pack`` cuts it into packs::

        rows [4, 0, 7], samples_per_pack [2, 1]  ->  pack 0 = rows 4 and 0, pack 1 = row 7

    ``samples`` has the pre-tokenize columns ``input_ids``, ``labels``, ``num_targets``, ``line`` and
    ``source`` (datasets written before sources were recorded lack it: their samples are all input 0).
    """
    if "source" not in samples.column_names:
        samples = samples.append_column("source", pa.array(np.zeros(samples.num_rows, np.int32)))
    columns = ["input_ids", "labels", "num_targets", "line", "source"]
    taken = _take_rows(samples.select(columns), rows).combine_chunks()
    input_ids, labels = taken["input_ids"].chunk(0), taken["labels"].chunk(0)
    seq_lens = pc.list_value_length(input_ids).to_numpy().astype(np.int64)
    mismatch = np.flatnonzero(pc.list_value_length(labels).to_numpy() != seq_lens)
    if mismatch.size:
        i = int(mismatch[0])
        raise InputError(f"line {taken['line'][i]}: {len(labels[i])} labels for {seq_lens[i]} input_ids")
    sample_offsets = np.concatenate([[0], np.cumsum(samples_per_pack)])
    token_offsets = np.concatenate([[0], np.cumsum(seq_lens)])
    # Pack p with first sample s and n samples owns cu_seqlens entries s+p .. s+p+n (one more than samples),
    # and entry s+p+j is token_offsets[s+j] - token_offsets[s].
    cu_offsets = sample_offsets + np.arange(len(sample_offsets))
    pack_of_entry = np.repeat(np.arange(len(samples_per_pack)), samples_per_pack + 1)
    cu_seqlens = (
        token_offsets[np.arange(cu_offsets[-1]) - pack_of_entry]
        - token_offsets[sample_offsets[pack_of_entry]]
    )
    token_offsets = token_offsets[sample_offsets]

    def lists(offsets: np.ndarray, values: pa.Array) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values)

    return pa.Table.from_arrays(
        [
            lists(token_offsets, input_ids.flatten()),
            lists(token_offsets, labels.flatten()),
            lists(cu_offsets, pa.array(cu_seqlens, pa.int32())),
            lists(sample_offsets, pa.array(seq_lens, pa.int32())),
            lists(sample_offsets, taken["num_targets"].chunk(0)),
            lists(sample_offsets, taken["line"].chunk(0)),
            lists(sample_offsets, taken["source"].chunk(0)),
        ],
        schema=PACK_SCHEMA,
    )


def _take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table.take(rows)``, one record batch at a time.

    Arrow's own take on a chunked list column first concatenates every chunk, i.e. reads the whole
    memory-mapped dataset into memory; taking from each batch only copies the rows asked for.
    """
    batches = table.to_batches()
    batch_starts = np.cumsum([0] + [b.num_rows for b in batches])
    batch_of = np.searchsorted(batch_starts, rows, side="right") - 1
    by_batch = np.argsort(batch_of, kind="stable")
    cuts = np.searchsorted(batch_of[by_batch], np.arange(len(batches) + 1)).tolist()
    parts = [
        batches[b].take(pa.array(rows[by_batch[lo:hi]] - batch_starts[b]))
        for b, (lo, hi) in enumerate(pairwise(cuts))
        if hi > lo
    ]
    grouped = pa.Table.from_batches(parts, schema=table.schema)
    return grouped.take(pa.array(np.argsort(by_batch)))


def write_packs(
    tokenized_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    max_seq_len: int,
    strategy: str = "bfd",
    seed: int = 0,
    batch_size: int = 1,
    sort_by_length: bool = False,
    drop_long: bool = False,
    min_sample_len: int = 0,
    max_sample_len: int | None = None,
    mix: Sequence[Source] | None = None,
    replace: bool = True,
) -> dict[str, Any]:
    """Pack the pre-tokenized dataset at ``tokenized_dir`` into ``output_dir``; return the report.

    Packs from the ``length`` column (see :func:`pack` for ``strategy`` and ``sort_by_length``), then gathers tokens ``_WRITE_BATCH_TOKENS`` at a time, so token
    lists never become Python objects. Samples are left out and counted in the report's ``dropped``:
    ``under_min_length`` (fewer than ``min_sample_len`` tokens), ``over_max_length`` (more than
    ``max_sample_len``, a filter at most ``max_seq_len``) and ``too_long`` (more than ``max_seq_len`` with
    ``drop_long``; without it such a sample is an error naming its line). ``mix`` lists the sources of
    the samples' ``source`` column with what to take of each (``longalign.sources.mix_indices``, seeded
    with ``seed``); the report's ``mix`` says how many each had and gave. The output is checked before
    any work and appears complete or not at all (see ``longalign.artifacts.stage_output``, which also
    says what ``replace=False`` does).
    """
    if max_sample_len is not None and not 1 <= max_sample_len <= max_seq_len:
        raise ConfigError(f"max_sample_len {max_sample_len}: must be between 1 and max_seq_len={max_seq_len}")
    check_output(output_dir, inputs=[tokenized_dir])
    samples = load_stage(tokenized_dir, required_columns=SAMPLE_COLUMNS).data.table
    if samples.num_rows == 0:
        raise InputError(f"{tokenized_dir}: no samples to pack")
    lengths = samples["length"].to_numpy().astype(np.int64)
    lines = samples["line"].to_numpy()
    _check_lengths_match(lengths, samples["input_ids"], lines)
    left_out = {
        "under_min_length": lengths < min_sample_len,
        "over_max_length": lengths > (max_sample_len if max_sample_len is not None else np.inf),
    }
    left_out["too_long"] = (lengths > max_seq_len) & ~left_out["over_max_length"]
    too_long = left_out["too_long"]
    if too_long.any() and not drop_long:
        i = int(np.flatnonzero(too_long)[0])
        raise InputError(
            f"line {lines[i]}: sample has {lengths[i]} tokens, more than max_seq_len={max_seq_len} "
            f"({int(too_long.sum())} such samples); leave them out with --drop-long (longalign pack) "
            "or packing.drop_long = true (a run file)"
        )
    kept = np.flatnonzero(~np.logical_or.reduce(list(left_out.values())))
    mix_report = None
    if mix is not None:
        kept, mix_report = _take_mix(kept, samples["source"].to_numpy(), mix, seed)
    if kept.size == 0:
        counts = ", ".join(f"{reason} {int(mask.sum())}" for reason, mask in left_out.items() if mask.any())
        raise InputError(f"{tokenized_dir}: none of the {len(lengths)} samples is left to pack ({counts})")
    packs = pack(
        lengths[kept], max_seq_len, strategy, seed=seed, batch_size=batch_size, sort_by_length=sort_by_length
    )
    report = {
        "input": str(tokenized_dir),
        "seed": seed,
        "batch_size": batch_size,
        "sort_by_length": sort_by_length,
        "samples_in": len(lengths),
        "dropped": {
            reason: {
                "samples": int(mask.sum()),
                "tokens": int(lengths[mask].sum()),
                "first_lines": lines[mask][:MAX_REPORTED_LINES].tolist(),
            }
            for reason, mask in left_out.items()
        },
        **({"mix": mix_report} if mix_report is not None else {}),
        **packing_report(lengths[kept], packs, max_seq_len, strategy=strategy),
    }
    rows = kept[np.fromiter(chain.from_iterable(packs), dtype=np.int64, count=len(kept))]
    samples_per_pack = np.fromiter(map(len, packs), dtype=np.int64, count=len(packs))
    with stage_output(output_dir, stage="pack", inputs=[tokenized_dir], replace=replace) as staging:
        _save_packs(samples, rows, samples_per_pack, lengths[rows], staging)
        write_report(staging, report)
    return report


def _take_mix(
    kept: np.ndarray, source_of: np.ndarray, mix: Sequence[Source], seed: int
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The samples of ``kept`` that the mix takes, and per source how many it had and gave."""
    per_source = [kept[source_of[kept] == index] for index in range(len(mix))]
    chosen = mix_indices([len(rows) for rows in per_source], mix, seed)
    taken = [rows[indices] for rows, indices in zip(per_source, chosen, strict=True)]
    report = [
        {"name": source.name, "available": len(rows), "taken": len(picked), "rule": source.rule or "all"}
        for source, rows, picked in zip(mix, per_source, taken, strict=True)
    ]
    return np.sort(np.concatenate(taken)), report


def _check_lengths_match(lengths: np.ndarray, input_ids: pa.ChunkedArray, lines: np.ndarray) -> None:
    counted = pc.list_value_length(input_ids).to_numpy()
    for wrong, message in (
        (counted != lengths, "length column says {length}, input_ids has {counted} tokens"),
        (lengths < 1, "sample has no tokens"),
    ):
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise InputError(f"line {lines[i]}: " + message.format(length=lengths[i], counted=counted[i]))


def _save_packs(
    samples: pa.Table, rows: np.ndarray, samples_per_pack: np.ndarray, seq_lens: np.ndarray, directory: Path
) -> None:
    """Write pack rows as a ``datasets`` directory, gathering about ``_WRITE_BATCH_TOKENS`` tokens at a time.

    The batches are streamed to one Arrow file first; ``save_to_disk`` then copies it into the layout
    ``load_from_disk`` reads (it refuses to save a dataset over its own file, hence the subdirectory).
    """
    sample_starts = np.concatenate([[0], np.cumsum(samples_per_pack)])
    pack_tokens = np.add.reduceat(seq_lens, sample_starts[:-1])
    first_token = np.cumsum(pack_tokens) - pack_tokens
    batch_starts = np.flatnonzero(np.diff(first_token // _WRITE_BATCH_TOKENS, prepend=-1))
    unsaved = directory / ".unsaved"
    unsaved.mkdir()
    stream = unsaved / "packs.arrow"
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, PACK_SCHEMA) as writer:
        for lo, hi in pairwise([*batch_starts.tolist(), len(samples_per_pack)]):
            sample_rows = rows[sample_starts[lo] : sample_starts[hi]]
            writer.write_table(build_pack_table(samples, sample_rows, samples_per_pack[lo:hi]))
    datasets.Dataset.from_file(str(stream)).save_to_disk(str(directory))
    shutil.rmtree(unsaved)
