"""``accelerate launch -m longalign eval``: prompts shared out over ranks, rank 0 merges them in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import launch, needs_launcher, save_tiny_model

from longalign.cli import main
from longalign.eval.ranks import _leave_group, across_ranks


def test_one_process_works_on_everything_in_order():
    assert across_ranks(list("abcde"), lambda mine: [x.upper() for x in mine]) == list("ABCDE")


@pytest.mark.integration
@needs_launcher
def test_two_ranks_give_the_same_results_as_one_process(tmp_path):
    """The needle grid, then RULER, on two ranks of one launch: each rank works on its share, rank 0 alone
    reports and writes, and the results are one process's, in its order."""
    save_tiny_model(tmp_path / "model", max_position_embeddings=2048)
    model = ["--model", str(tmp_path / "model")]
    needle = [*model, "--lengths", "150,300", "--depths", "0,100", "--max-new-tokens", "4"]
    ruler = [*model, "--lengths", "1200", "--samples-per-task", "2", "--tasks", "niah_single_1,vt,fwe"]
    assert main(["eval", "needle", *needle, "--output", str(tmp_path / "one" / "needle")]) == 0
    assert main(["eval", "ruler", *ruler, "--output", str(tmp_path / "one" / "ruler")]) == 0
    done = launch(
        Path(__file__).parent / "eval_ranks_run.py",
        "eval", "needle", *needle, "--output", str(tmp_path / "two" / "needle"), "--",
        "eval", "ruler", *ruler, "--output", str(tmp_path / "two" / "ruler"), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0 alone reports and writes; each rank's needle bar counts its 2 of the 4 prompts
    assert done.stdout.count("needle: 4 prompts") == 1 and done.stdout.count("ruler: 6 prompts") == 1
    assert "| 2/2 [" in done.stderr and "| 4/4 [" not in done.stderr
    results = {}
    for task in ("needle", "ruler"):
        one = (tmp_path / "one" / task / "results.jsonl").read_text().splitlines()
        two = (tmp_path / "two" / task / "results.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in two] == [json.loads(line) for line in one]
        results[task] = [json.loads(line) for line in two]
    assert [(r["length"], r["depth"]) for r in results["needle"]] == [
        (150, 0),
        (150, 100),
        (300, 0),
        (300, 100),
    ]
    assert [r["task"] for r in results["ruler"]] == ["niah_single_1"] * 2 + ["vt"] * 2 + ["fwe"] * 2


def test_a_rank_leaves_its_process_group_before_the_interpreter_shuts_down(tmp_path):
    """What ``leave_group_at_exit`` runs as the process ends: the group is destroyed, and again is a no-op."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    assert across_ranks([1, 2, 3], lambda mine: [x * 10 for x in mine]) == [10, 20, 30]
    _leave_group()
    assert not dist.is_initialized()
    _leave_group()  # no group: nothing to do
