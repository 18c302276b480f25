"""``accelerate launch -m longalign eval``: prompts shared out over ranks, rank 0 merges them in order."""

from __future__ import annotations

import json

import pytest
from conftest import launch, needs_launcher, save_tiny_model

from longalign.cli import main
from longalign.eval.ranks import across_ranks


def test_one_process_works_on_everything_in_order():
    assert across_ranks(list("abcde"), lambda mine: [x.upper() for x in mine]) == list("ABCDE")


@pytest.mark.integration
@needs_launcher
def test_two_ranks_give_the_same_results_as_one_process(tmp_path):
    save_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    grid = ["--model", str(tmp_path / "model"), "--lengths", "150,300", "--depths", "0,50,100",
            "--max-new-tokens", "4"]  # fmt: skip
    assert main(["eval", "needle", *grid, "--output", str(tmp_path / "one")]) == 0
    done = launch("-m", "longalign", "eval", "needle", *grid, "--output", str(tmp_path / "two"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("needle: 6 prompts") == 1  # rank 0 alone reports and writes
    assert "| 3/3 [" in done.stderr and "| 6/6 [" not in done.stderr  # each rank's bar: its 3 prompts
    one = (tmp_path / "one" / "results.jsonl").read_text().splitlines()
    two = (tmp_path / "two" / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in two] == [json.loads(line) for line in one]
    assert [(r["length"], r["depth"]) for r in map(json.loads, two)] == [
        (150, 0), (150, 50), (150, 100), (300, 0), (300, 50), (300, 100)]  # fmt: skip


@pytest.mark.integration
@needs_launcher
def test_ruler_on_two_ranks_gives_the_same_results_as_one_process(tmp_path):
    save_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    grid = ["--model", str(tmp_path / "model"), "--lengths", "900", "--samples-per-task", "2",
            "--tasks", "niah_single_1,vt,fwe"]  # fmt: skip
    assert main(["eval", "ruler", *grid, "--output", str(tmp_path / "one")]) == 0
    done = launch("-m", "longalign", "eval", "ruler", *grid, "--output", str(tmp_path / "two"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ruler: 6 prompts") == 1  # rank 0 alone reports and writes
    one = (tmp_path / "one" / "results.jsonl").read_text().splitlines()
    two = (tmp_path / "two" / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in two] == [json.loads(line) for line in one]
    assert [r["task"] for r in map(json.loads, two)] == ["niah_single_1"] * 2 + ["vt"] * 2 + ["fwe"] * 2
