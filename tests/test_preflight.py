"""Preflight: the comparison on hand-made reports, and real 2-rank CPU launches of the script and train.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import DEMO, ROOT, count_packs, demo_overrides, launch, needs_launcher, run_process, save_packs

from longalign.config import load_config
from longalign.preflight import (
    Check,
    adapter_check,
    compare,
    config_check,
    env_checks,
    packs_check,
    preflight_enabled,
    sequence_parallel_checks,
)

# Runs a script as one rank of a launch with that rank's own working directory and environment variables,
# as on a node of its own: {"1": {"cwd": "...", "env": {"NAME": "value"}}} (RANK comes from the launcher).
PER_RANK = """
import json, os, runpy, sys
spec = json.loads(sys.argv[1]).get(os.environ["RANK"], {})
os.chdir(spec.get("cwd", "."))
os.environ.update(spec.get("env", {}))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def write_packs(path: Path, per_pack: list[list[int]]) -> Path:
    return save_packs(path, count_packs(per_pack))


PACKS = [[5, 7], [12], [3, 4, 5]]


# --- the comparison --------------------------------------------------------------------------------------


def table_rows(report) -> dict[str, list[str]]:
    """check name -> its lines in the table (a disagreement has one line per distinct value)."""
    out, name = {}, None
    for line in report.table.splitlines()[2:]:
        if not line.startswith(" "):
            name = line.split("  ")[0]
        out.setdefault(name, []).append(line)
    return out


def test_agreeing_ranks_show_one_value_per_check():
    report = compare(
        [
            [Check("torch", "2.13.0"), Check("device", "cuda:0, 70 GiB free", must_agree=False)],
            [Check("torch", "2.13.0"), Check("device", "cuda:1, 69 GiB free", must_agree=False)],
        ]
    )
    assert report.ok and report.problems == []
    table = table_rows(report)
    assert table["torch"][0].split() == ["torch", "ok", "all", "2.13.0"]
    # May differ: one line per rank, marked info, not a failure.
    assert table["device"][0].split()[:4] == ["device", "info", "0", "cuda:0,"]
    assert table["device"][1].split()[:2] == ["1", "cuda:1,"]


def test_the_odd_rank_is_named_against_the_majority():
    reports = [[Check("torch", "2.13.0", fix="same versions")] for _ in range(4)]
    reports[2] = [Check("torch", "2.12.1", fix="same versions")]
    report = compare(reports)
    assert not report.ok
    assert report.problems == [
        "torch: rank 2 differs from the other 3 ranks (2.12.1 vs 2.13.0). Fix: same versions"
    ]
    lines = table_rows(report)["torch"]
    assert lines[0].split()[:3] == ["torch", "DIFFERS", "0-1,3"] and lines[1].split() == ["2", "2.12.1"]
    # Two ranks: rank 0 is the reference.
    two = compare([[Check("x", "a")], [Check("x", "b")]])
    assert two.problems[0].startswith("x: rank 1 differs from rank 0 (b vs a)")


def test_config_difference_names_the_keys():
    base = load_config(DEMO)
    other = load_config(DEMO, ["loss.chunk_size=512"])
    report = compare([[config_check(base)], [config_check(other)]])
    assert "loss.chunk_size 512 vs 2048" in report.problems[0]
    assert "same config file" in report.problems[0]


def test_a_failed_check_fails_and_a_missing_one_differs():
    report = compare(
        [
            [Check("dataset", "-", error="FileNotFoundError: out/packed", fix="copy it")],
            [Check("dataset", "3 packs")],
        ]
    )
    assert report.problems == ["dataset: failed on rank 0: FileNotFoundError: out/packed. Fix: copy it"]
    assert (
        compare([[Check("a", "1"), Check("b", "1")], [Check("a", "1")]])
        .problems[0]
        .startswith("b: rank 1 differs")
    )


def test_env_secrets_never_in_clear():
    env = {"HF_TOKEN": "hf_very_secret", "WANDB_API_KEY": "k1", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}
    checks = {c.name: c.value for c in env_checks(["HF_TOKEN", "WANDB_API_KEY", "NCCL_*", "HF_HOME"], env)}
    assert checks["env HF_TOKEN"].startswith("sha256:") and "secret" not in checks["env HF_TOKEN"]
    assert checks["env WANDB_API_KEY"].startswith("sha256:")
    assert checks["env NCCL_*"] == "NCCL_DEBUG=INFO, NCCL_IB_DISABLE=1"
    assert checks["env HF_HOME"] == "(unset)"


def test_dataset_fingerprint_follows_cu_seqlens_not_storage(tmp_path):
    a = datasets.load_from_disk(str(write_packs(tmp_path / "a", PACKS)))
    b = datasets.Dataset.from_list(count_packs(PACKS)).cast_column(
        "cu_seqlens", datasets.Sequence(datasets.Value("int64"))
    )
    c = datasets.Dataset.from_list(count_packs([[5, 7], [12], [3, 9, 1]]))
    assert packs_check("dataset", a, "train_file").value == packs_check("dataset", b, "train_file").value
    assert packs_check("dataset", a, "train_file").value != packs_check("dataset", c, "train_file").value
    assert packs_check("dataset", a, "train_file").value.startswith("3 packs, cu_seqlens ")


def test_group_checks_are_compared_within_each_group():
    def first(rank: int, value: str) -> list[Check]:
        return [Check("first packs", value, fix="same packs", group=rank // 2)]

    agree = compare(
        [first(0, "group 0: a"), first(1, "group 0: a"), first(2, "group 1: b"), first(3, "group 1: b")]
    )
    assert agree.ok  # groups differ from each other, as they should
    lines = table_rows(agree)["first packs"]
    assert lines[0].split()[2:] == ["ok", "0-1", "group", "0:", "a"] and lines[1].split() == [
        "2-3",
        "group",
        "1:",
        "b",
    ]
    split = compare(
        [first(0, "group 0: a"), first(1, "group 0: a"), first(2, "group 1: b"), first(3, "group 1: c")]
    )
    assert split.problems == [
        "first packs: rank 3 differs from rank 2 (group 1: c vs group 1: b). Fix: same packs"
    ]


def test_sequence_parallel_rows_deal_packs_as_the_trainer_does(tmp_path):
    cfg = load_config(DEMO, ["training.sequence_parallel_size=2"])
    packs = datasets.Dataset.from_list(count_packs([[5, 7], [12], [3, 4, 5], [9]]))
    per_rank = [
        sequence_parallel_checks(cfg, packs, rank=rank, world_size=4, batch_size=1) for rank in range(4)
    ]
    assert {checks[0].value for checks in per_rank} == {"2 ranks per pack, 2 groups"}
    first = [checks[1] for checks in per_rank]
    assert first[0].value == first[1].value != first[2].value == first[3].value
    assert first[0].value.startswith("group 0: packs [") and first[2].group == 1
    assert compare([checks for checks in per_rank]).ok


def test_preflight_setting():
    assert preflight_enabled(None, 2) and not preflight_enabled(None, 1)
    assert preflight_enabled(True, 1) and not preflight_enabled(False, 8)


def test_adapter_row_says_what_trains_and_refuses_qlora_off_cuda():
    cpu = torch.device("cpu")
    assert adapter_check(load_config(DEMO), cpu).value == "none (full fine-tuning)"
    lora = adapter_check(load_config(DEMO, ["lora.r=8"]), cpu)
    assert lora.error is None and lora.value.startswith("LoRA r=8, peft ")
    qlora = adapter_check(load_config(DEMO, ["lora.load_in_4bit=true"]), cpu)
    assert qlora.error == "RuntimeError: 4-bit QLoRA needs a CUDA GPU (bitsandbytes), this rank runs on cpu"
    assert "longalign[qlora]" in qlora.fix


# --- real launches ---------------------------------------------------------------------------------------


def launch_per_rank(tmp_path: Path, per_rank: dict, script: Path, *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(PER_RANK)
    return launch(
        wrapper, json.dumps(per_rank), str(script), "--config", str(DEMO),
        *demo_overrides(tmp_path / "run", "packs"), *args,
        env={"WANDB_PROJECT": "longalign", "HF_TOKEN": "hf_very_secret"}, cwd=tmp_path,
    )  # fmt: skip


@pytest.fixture
def nodes(tmp_path) -> dict:
    """Two "nodes" (working directories), each with its own copy of the packed dataset at ``packs``."""
    for rank in (0, 1):
        write_packs(tmp_path / f"node{rank}" / "packs", PACKS)
    return {str(rank): {"cwd": str(tmp_path / f"node{rank}")} for rank in (0, 1)}


@pytest.mark.integration
@needs_launcher
def test_two_ranks_that_agree_pass(tmp_path, nodes):
    result = launch_per_rank(tmp_path, nodes, ROOT / "scripts" / "preflight.py", "--env", "WANDB_PROJECT")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert out.startswith("preflight: 2 ranks") and out.rstrip().endswith("preflight: ok")
    for check in (
        "torch",
        "config",
        "tokenizer",
        "dataset",
        "attention backend",
        "env WANDB_PROJECT",
        "all-reduce",
    ):
        line = next(line for line in out.splitlines() if line.startswith(check + "  "))
        assert line.split()[len(check.split()) : len(check.split()) + 2] == ["ok", "all"], line
    assert "ok, 2 ranks" in out and "sdpa_segments (float32 on cpu)" in out
    assert "hf_very_secret" not in out + result.stderr


@pytest.mark.integration
@needs_launcher
def test_rank_with_another_dataset_and_env_value_fails_by_name(tmp_path, nodes):
    write_packs(tmp_path / "node1" / "stale", PACKS[:2])  # node 1's copy is an older one
    (tmp_path / "node1" / "packs").rename(tmp_path / "node1" / "fresh")
    (tmp_path / "node1" / "stale").rename(tmp_path / "node1" / "packs")
    nodes["1"]["env"] = {"WANDB_PROJECT": "elsewhere", "HF_TOKEN": "hf_other_secret"}
    result = launch_per_rank(tmp_path, nodes, ROOT / "scripts" / "preflight.py", "--env", "WANDB_PROJECT")
    assert result.returncode != 0
    out = result.stdout
    assert "dataset: rank 1 differs from rank 0 (2 packs, cu_seqlens" in out
    assert "Fix: copy the same packed dataset to every node" in out
    assert "env WANDB_PROJECT: rank 1 differs from rank 0 (elsewhere vs longalign)" in out
    assert "env HF_TOKEN: rank 1 differs from rank 0 (sha256:" in out
    assert "secret" not in out + result.stderr
    config = next(line for line in out.splitlines() if line.startswith("config "))
    assert config.split()[1:3] == ["ok", "all"]  # the same config file and overrides on both ranks
    assert out.rstrip().endswith("preflight: FAILED")


@pytest.mark.integration
@needs_launcher
def test_train_stops_before_the_first_step_when_ranks_disagree(tmp_path, nodes):
    write_packs(tmp_path / "node1" / "packs", [[12], [5, 7], [3, 4, 5]])  # same packs, another order
    result = launch_per_rank(tmp_path, nodes, ROOT / "train.py", "training.max_steps=1")
    assert result.returncode != 0
    assert "dataset: rank 1 differs from rank 0" in result.stdout  # on by default with two ranks
    assert "train_runtime" not in result.stdout + result.stderr
    assert not (tmp_path / "run" / "checkpoint-1").exists()


@pytest.mark.integration
def test_train_runs_the_preflight_when_asked_on_one_rank(tmp_path):
    packs = write_packs(tmp_path / "packs", PACKS)
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(DEMO), *demo_overrides(tmp_path / "run", packs),
           "training.max_steps=1", "training.save_strategy='no'", "training.preflight=true"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_process(cmd, timeout=300, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "preflight: 1 rank" in result.stdout and "preflight: ok" in result.stdout
    assert "train_runtime" in result.stdout + result.stderr
