"""Packing: each strategy against a plain reference, the invariants, the report, the packed dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import make_samples, save_samples
from hypothesis import given, settings
from hypothesis import strategies as st

import longalign.packing as packing
from longalign.artifacts import load_stage, read_report
from longalign.config import STRATEGIES
from longalign.packing import (
    PACK_SCHEMA,
    _take_rows,
    build_pack_table,
    pack,
    packing_report,
    write_packs,
)

ROOT = Path(__file__).resolve().parents[1]

# (max_len, lengths) with every length in 1..max_len; small numbers make equal lengths and ties common.
budgets_and_lengths = st.integers(1, 40).flatmap(
    lambda m: st.tuples(st.just(m), st.lists(st.integers(1, m), max_size=60))
)


def reference_best_fit_loads(lengths: list[int], max_len: int) -> list[int]:
    """Best-fit decreasing one sample at a time; the sorted pack loads (ties between packs cannot change them)."""
    rooms: list[int] = []
    for length in sorted(lengths, reverse=True):
        fitting = [p for p, room in enumerate(rooms) if room >= length]
        if fitting:
            best = min(fitting, key=lambda p: rooms[p])
            rooms[best] -= length
        else:
            rooms.append(max_len - length)
    return sorted(max_len - room for room in rooms)


def reference_first_fit(lengths: list[int], max_len: int) -> list[list[int]]:
    """First-fit decreasing one sample at a time; the lengths in each pack."""
    rooms: list[int] = []
    packs: list[list[int]] = []
    for length in sorted(lengths, reverse=True):
        p = next((p for p, room in enumerate(rooms) if room >= length), len(rooms))
        if p == len(rooms):
            rooms.append(max_len)
            packs.append([])
        rooms[p] -= length
        packs[p].append(length)
    return packs


def pack_lengths(lengths: list[int], packs: list[list[int]]) -> list[list[int]]:
    return [[lengths[i] for i in p] for p in packs]


@settings(max_examples=150, deadline=None)
@given(budgets_and_lengths, st.integers(0, 3))
def test_bfd_is_best_fit_decreasing(case, seed):
    max_len, lengths = case
    packs = pack(np.array(lengths, dtype=np.int64), max_len, "bfd", seed=seed)
    assert sorted(map(sum, pack_lengths(lengths, packs))) == reference_best_fit_loads(lengths, max_len)


@settings(max_examples=150, deadline=None)
@given(budgets_and_lengths, st.integers(0, 3))
def test_ffd_is_first_fit_decreasing(case, seed):
    max_len, lengths = case
    packs = pack(np.array(lengths, dtype=np.int64), max_len, "ffd", seed=seed)
    assert sorted(pack_lengths(lengths, packs)) == sorted(reference_first_fit(lengths, max_len))


@settings(max_examples=150, deadline=None)
@given(budgets_and_lengths, st.sampled_from(STRATEGIES), st.integers(1, 5), st.integers(0, 3))
def test_every_sample_once_and_no_pack_over_budget(case, strategy, batch_size, seed):
    max_len, lengths = case
    batch_size = batch_size if strategy == "sorted" else 1
    packs = pack(np.array(lengths, dtype=np.int64), max_len, strategy, seed=seed, batch_size=batch_size)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(p for p in packs)
    if strategy == "sorted":
        remainder = [len(lengths) % batch_size] if len(lengths) % batch_size else []
        assert sorted(map(len, packs)) == remainder + [batch_size] * (len(lengths) // batch_size)
    else:
        assert all(sum(lengths[i] for i in p) <= max_len for p in packs)


@settings(max_examples=100, deadline=None)
@given(budgets_and_lengths)
def test_greedy_is_next_fit_in_input_order(case):
    max_len, lengths = case
    packs = sorted(pack(np.array(lengths, dtype=np.int64), max_len, "greedy"))
    assert [i for p in packs for i in p] == list(range(len(lengths)))
    for current, following in zip(packs, packs[1:], strict=False):
        assert sum(lengths[i] for i in current) + lengths[following[0]] > max_len


def test_greedy_keeps_the_last_pack():
    assert sorted(pack(np.array([3, 2, 4, 6, 1]), 6, "greedy")) == [[0, 1], [2], [3], [4]]


@settings(max_examples=100, deadline=None)
@given(budgets_and_lengths)
def test_greedy_sorted_by_length_is_next_fit_over_the_sorted_samples(case):
    """LongAlign's sort-and-group: packs hold runs of the length-sorted samples, cut where the next one
    does not fit."""
    max_len, lengths = case
    packs = pack(np.array(lengths, dtype=np.int64), max_len, "greedy", sort_by_length=True)
    # Back in the order packed: of packs holding one length only, the fuller one was filled first.
    packs = sorted(packs, key=lambda p: (lengths[p[0]], lengths[p[-1]], -sum(lengths[i] for i in p)))
    order = [i for p in packs for i in p]
    assert sorted(order) == list(range(len(lengths)))
    assert [lengths[i] for i in order] == sorted(lengths)
    for current, following in zip(packs, packs[1:], strict=False):
        assert sum(lengths[i] for i in current) + lengths[following[0]] > max_len


def test_greedy_sorted_by_length_docstring_example():
    assert sorted(pack(np.array([4, 1, 3, 2]), 5, "greedy")) == [[0, 1], [2, 3]]
    assert sorted(pack(np.array([4, 1, 3, 2]), 5, "greedy", sort_by_length=True)) == [[0], [1, 3], [2]]


@pytest.mark.parametrize("strategy", ["bfd", "ffd", "sorted"])
def test_sort_by_length_changes_nothing_for_strategies_that_sort(strategy):
    lengths = np.random.default_rng(1).integers(1, 512, 500)
    batch_size = 4 if strategy == "sorted" else 1
    plain = pack(lengths, 1024, strategy, seed=5, batch_size=batch_size)
    assert pack(lengths, 1024, strategy, seed=5, batch_size=batch_size, sort_by_length=True) == plain


def test_sort_by_length_without_packing_is_refused():
    with pytest.raises(ValueError, match="sorted batching is strategy 'sorted'"):
        pack(np.array([3, 2]), 8, "none", sort_by_length=True)


def test_bfd_docstring_example():
    assert sorted(pack(np.array([6, 5, 4, 3, 2]), 10, "bfd")) == [[0, 2], [1, 3, 4]]


def test_sorted_batches_hold_neighbouring_lengths():
    lengths = np.random.default_rng(0).integers(1, 1000, 103)
    batches = pack(lengths, 1000, "sorted", batch_size=8)
    assert sorted(map(len, batches)) == [7] + [8] * 12
    by_shortest = sorted(batches, key=lambda b: lengths[b].min())
    assert np.all(np.diff(np.concatenate([np.sort(lengths[b]) for b in by_shortest])) >= 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_fixes_the_result_and_packs_come_shuffled(strategy):
    lengths = np.random.default_rng(0).integers(1, 512, 2000)
    packs = pack(lengths, 1024, strategy, seed=3)
    assert pack(lengths, 1024, strategy, seed=3) == packs
    assert pack(lengths, 1024, strategy, seed=4) != packs
    tokens = [int(lengths[p].sum()) for p in packs]
    firsts = [p[0] for p in packs]
    assert tokens != sorted(tokens) and tokens != sorted(tokens, reverse=True)
    assert firsts != sorted(firsts)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="sample 1 has 9 tokens"):
        pack(np.array([3, 9]), 8)
    with pytest.raises(ValueError, match="sample 0 has 0 tokens"):
        pack(np.array([0, 1]), 8)
    with pytest.raises(ValueError, match="strategy 'spfd'"):
        pack(np.array([1]), 8, "spfd")
    with pytest.raises(ValueError, match="batch_size 4"):
        pack(np.array([1]), 8, "bfd", batch_size=4)
    with pytest.raises(ValueError, match="1D integer"):
        pack(np.array([1.5]), 8)
    assert pack(np.array([], dtype=np.int64), 8) == []


def test_report_counts_tokens_fill_and_attention_cost():
    report = packing_report(np.array([3, 2, 4]), [[0, 1], [2]], 5)
    assert report["samples"] == 3 and report["tokens"] == 9 and report["packs"] == 2
    assert report["lower_bound_packs"] == 2 and report["packs_over_lower_bound_pct"] == 0
    assert report["efficiency"] == 0.9
    assert report["fill"]["min"] == 0.8 and report["fill"]["max"] == 1.0
    assert report["samples_per_pack"] == {"min": 1, "p50": 1.5, "max": 2}
    assert report["attention_cost"]["total"] == 9 + 4 + 16
    assert report["attention_cost"]["per_pack"]["min"] == 13
    assert sum(report["histograms"]["sample_length"]["counts"]) == 3
    assert sum(report["histograms"]["fill"]["counts"]) == 2


def test_report_of_sorted_batches_counts_their_padding():
    report = packing_report(np.array([2, 4, 5]), [[0, 1], [2]], 8, strategy="sorted")
    assert report["efficiency"] == round(11 / (2 * 4 + 1 * 5), 6)
    assert report["lower_bound_packs"] is None


def test_take_rows_gathers_across_record_batches():
    table = pa.Table.from_batches(
        [
            pa.record_batch({"x": pa.array([[i] * (i % 3) for i in range(start, start + 4)])})
            for start in (0, 4, 8)
        ]
    )
    rows = np.array([9, 0, 5, 5, 11, 2])
    assert _take_rows(table, rows).to_pylist() == table.take(rows).to_pylist()


@pytest.fixture
def tokenized(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 41, 90).tolist()
    return save_samples(make_samples(lengths), tmp_path / "tokenized")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_dataset_round_trips_tokens_and_labels(tokenized, tmp_path, monkeypatch, strategy):
    monkeypatch.setattr(packing, "_WRITE_BATCH_TOKENS", 100)  # many write batches
    batch_size = 4 if strategy == "sorted" else 1
    out = tmp_path / "packed"
    report = write_packs(tokenized, out, max_seq_len=64, strategy=strategy, batch_size=batch_size)
    source = {row["line"]: row for row in load_stage(tokenized).to_list()}
    packed = load_stage(out)
    assert packed.data.table.schema.remove_metadata() == PACK_SCHEMA
    seen = []
    for row in packed:
        cu = np.array(row["cu_seqlens"])
        assert cu[0] == 0 and cu[-1] == len(row["input_ids"]) == len(row["labels"])
        assert np.diff(cu).tolist() == row["seq_lens"]
        if strategy != "sorted":
            assert cu[-1] <= 64
        for i, line in enumerate(row["lines"]):
            sample = source[line]
            assert row["input_ids"][cu[i] : cu[i + 1]] == sample["input_ids"]
            assert row["labels"][cu[i] : cu[i + 1]] == sample["labels"]
            assert row["num_targets"][i] == sample["num_targets"]
        seen += row["lines"]
    assert sorted(seen) == sorted(source)
    assert read_report(out) == report
    assert report["samples_in"] == report["samples"] == len(source)
    assert report["packs"] == len(packed)
    assert report["tokens"] == sum(len(s["input_ids"]) for s in source.values())
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".longalign-stage"]


def test_write_is_deterministic_for_a_seed(tokenized, tmp_path):
    write_packs(tokenized, tmp_path / "a", max_seq_len=64, seed=7)
    write_packs(tokenized, tmp_path / "b", max_seq_len=64, seed=7)
    assert load_stage(tmp_path / "a").to_list() == load_stage(tmp_path / "b").to_list()


def test_long_sample_is_an_error_naming_its_line_or_dropped(tmp_path):
    tokenized = save_samples(make_samples([5, 30, 7, 31, 2]), tmp_path / "tokenized")
    out = tmp_path / "packed"
    with pytest.raises(
        ValueError,
        match=r"line 4: sample has 30 tokens.*\(2 such samples\).*--drop-long .*packing.drop_long = true",
    ):
        write_packs(tokenized, out, max_seq_len=20)
    assert not out.exists()
    report = write_packs(tokenized, out, max_seq_len=20, drop_long=True)
    assert report["dropped"]["too_long"] == {"samples": 2, "tokens": 61, "first_lines": [4, 10]}
    assert report["samples_in"] == 5 and report["samples"] == 3 and report["tokens"] == 14
    assert sorted(line for row in load_stage(out) for line in row["lines"]) == [1, 7, 13]


def test_all_samples_too_long_or_none_at_all_is_an_error(tmp_path):
    tokenized = save_samples(make_samples([30, 31]), tmp_path / "long")
    with pytest.raises(ValueError, match=r"none of the 2 samples is left to pack \(too_long 2\)"):
        write_packs(tokenized, tmp_path / "out", max_seq_len=20, drop_long=True)
    empty = save_samples(make_samples([]), tmp_path / "empty")
    with pytest.raises(ValueError, match="no samples to pack"):
        write_packs(empty, tmp_path / "out", max_seq_len=20)


def test_inconsistent_sample_rows_are_errors_naming_the_line(tmp_path):
    columns = make_samples([4, 5, 6])
    columns["length"][1] = 3
    with pytest.raises(ValueError, match="line 4: length column says 3, input_ids has 5 tokens"):
        write_packs(save_samples(columns, tmp_path / "a"), tmp_path / "out", max_seq_len=20)
    columns = make_samples([4, 5, 6])
    columns["labels"][2] = columns["labels"][2][:-1]
    with pytest.raises(ValueError, match="line 7: 5 labels for 6 input_ids"):
        write_packs(save_samples(columns, tmp_path / "b"), tmp_path / "out", max_seq_len=20)
    assert not (tmp_path / "out").exists()


def test_build_pack_table_draws_cu_seqlens_per_pack():
    columns = make_samples([3, 2, 4])
    samples = pa.table({k: v for k, v in columns.items() if k != "length"})
    table = build_pack_table(samples, np.array([2, 0, 1]), np.array([2, 1]))
    assert table["cu_seqlens"].to_pylist() == [[0, 4, 7], [0, 2]]
    assert table["seq_lens"].to_pylist() == [[4, 3], [2]]
    assert table["lines"].to_pylist() == [[7, 1], [4]]
    assert table["sources"].to_pylist() == [[0, 0], [0]]
    assert table["input_ids"].to_pylist()[1] == columns["input_ids"][1]


def test_length_filters_leave_samples_out_and_count_them(tmp_path):
    tokenized = save_samples(make_samples([5, 30, 7, 31, 2, 12]), tmp_path / "tokenized")
    report = write_packs(tokenized, tmp_path / "out", max_seq_len=40, min_sample_len=6, max_sample_len=20)
    assert report["dropped"]["under_min_length"] == {"samples": 2, "tokens": 7, "first_lines": [1, 13]}
    assert report["dropped"]["over_max_length"] == {"samples": 2, "tokens": 61, "first_lines": [4, 10]}
    assert report["dropped"]["too_long"]["samples"] == 0
    assert report["samples"] == 2 and report["samples_in"] == 6
    assert sorted(line for row in load_stage(tmp_path / "out") for line in row["lines"]) == [7, 16]
    with pytest.raises(ValueError, match="max_sample_len 50: must be between 1 and max_seq_len=40"):
        write_packs(tokenized, tmp_path / "out2", max_seq_len=40, max_sample_len=50)
