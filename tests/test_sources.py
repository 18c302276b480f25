"""Raw sources: every format becomes the same records, columns are renamed, mixes are seeded and exact."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longalign.config import Source
from longalign.sources import InputError, fingerprint, kind, mix_indices, read_lines, records

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }
    for i in range(3)
]


def texts(source: Source) -> list[dict]:
    return [json.loads(text) for _, _, text in records(source)]


@pytest.fixture
def formats(tmp_path) -> dict[str, str]:
    """The same three chats as JSONL, a JSON array, Parquet, a directory and a saved dataset."""
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    (tmp_path / "chats.json").write_text(json.dumps(CHATS))
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "chats.parquet")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "b.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS[1:]))
    (tmp_path / "dir" / "a.json").write_text(json.dumps(CHATS[:1]))
    (tmp_path / "dir" / "notes.txt").write_text("not a chat file")
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "saved"))
    return {
        name: str(tmp_path / name) for name in ("chats.jsonl", "chats.json", "chats.parquet", "dir", "saved")
    }


def test_every_format_gives_the_same_records(formats):
    for path in formats.values():
        assert texts(Source(path)) == CHATS, path
    numbered = [(file.rsplit("/", 1)[-1], n) for file, n, _ in records(Source(formats["dir"]))]
    assert numbered == [("a.json", 1), ("b.jsonl", 1), ("b.jsonl", 2)]  # files in order, numbers per file
    assert [kind(p) for p in formats.values()] == ["file", "file", "file", "directory", "dataset"]


def test_jsonl_lines_pass_through_as_written(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\nnot json\n\n')
    assert [(n, text) for _, n, text in records(Source(str(path)))] == [
        (1, '{"a": 1}'),
        (2, "not json"),
        (3, ""),
    ]
    path.write_bytes(b'{"a": 1}\n\xff\n')
    with pytest.raises(InputError, match="line 2: not valid UTF-8"):
        list(read_lines(path))


def test_columns_rename_the_source_fields_at_the_top_and_in_messages(tmp_path):
    odd = [
        {"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "assistant", "text": "hello"}], "id": 7}
    ]
    pq.write_table(pa.Table.from_pylist(odd), tmp_path / "odd.parquet")
    columns = {"messages": "dialog", "role": "speaker", "content": "text"}
    (record,) = texts(Source(str(tmp_path / "odd.parquet"), columns=columns))
    assert record == {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        "id": 7,
    }


def test_unreadable_sources_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # the Hub is out of reach here anyway
    (tmp_path / "table.csv").write_text("a,b\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"messages": []}')
    (tmp_path / "bad.parquet").write_text("PAR1 not really")
    for path, message in [
        (tmp_path / "table.csv", "not a chat file"),
        (tmp_path / "missing.jsonl", "not found"),
        (tmp_path / "empty", "a directory without"),
        (tmp_path / "bad.json", "holds a JSON array of records, got dict"),
        (tmp_path / "bad.parquet", "not a readable Parquet file"),
    ]:
        with pytest.raises(InputError, match=message):
            list(records(Source(str(path))))
    with pytest.raises(
        InputError, match="no-such-org/no-such-set: neither in the local datasets cache nor reachable"
    ):
        list(records(Source("no-such-org/no-such-set")))
    with pytest.raises(InputError, match="no split 'test'"):
        saved = tmp_path / "saved"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS)}).save_to_disk(str(saved))
        list(records(Source(str(saved), split="test")))


def test_a_source_takes_at_most_one_rule():
    with pytest.raises(
        InputError, match="set one of weight, num_samples and fraction, not weight and fraction"
    ):
        Source("x.jsonl", weight=1.0, fraction=0.5)
    with pytest.raises(InputError, match="fraction must be between 0 and 1"):
        Source("x.jsonl", fraction=1.5)


def test_mix_counts_follow_the_rules():
    sources = [
        Source("long"),
        Source("short", weight=3),
        Source("code", weight=1),
        Source("math", fraction=0.1),
    ]
    taken = mix_indices([100, 1000, 50, 999], sources, seed=0)
    assert [len(t) for t in taken] == [100, 150, 50, 100]
    assert taken[0].tolist() == list(range(100))  # taken whole
    assert all(len(set(t.tolist())) == len(t) and list(t) == sorted(t) for t in taken)
    with pytest.raises(InputError, match="short: num_samples 2000, but it has 1000 samples"):
        mix_indices([1000], [Source("short", num_samples=2000)], seed=0)


@settings(max_examples=50, deadline=None)
@given(
    available=st.lists(st.integers(0, 500), min_size=1, max_size=4),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_mixes_are_seeded_and_within_range(available, seed, data):
    sources = [
        Source(f"s{i}", fraction=data.draw(st.floats(0, 1)))
        if data.draw(st.booleans())
        else Source(f"s{i}", num_samples=data.draw(st.integers(0, n)))
        for i, n in enumerate(available)
    ]
    first = mix_indices(available, sources, seed)
    assert all(
        np.array_equal(a, b) for a, b in zip(first, mix_indices(available, sources, seed), strict=True)
    )
    for n, taken in zip(available, first, strict=True):
        assert taken.size == 0 or (taken.min() >= 0 and taken.max() < n)


def test_fingerprint_changes_when_a_file_is_touched(formats, tmp_path):
    source = Source(formats["chats.jsonl"])
    before = fingerprint(source)
    assert fingerprint(source) == before
    path = tmp_path / "chats.jsonl"
    path.write_text(path.read_text() + "\n")
    assert fingerprint(source) != before


def test_the_report_and_the_answers_of_a_stage_output_are_not_read_as_chats(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    (out / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    (out / "report.json").write_text('{"samples": 3}')
    (out / "calls.jsonl").write_text('{"key": "3f2a", "model": "m", "completion": {"text": "hi"}}\n')
    (out / ".longalign-stage").write_text('{"stage": "data self-instruct"}')
    assert texts(Source(str(out))) == CHATS
