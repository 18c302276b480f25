"""Preflight: the comparison on hand-made reports, and real 2-rank CPU launches of the script and train.py."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    FullyShardedDataParallelPlugin,
)
from conftest import (
    DEMO,
    ROOT,
    count_packs,
    demo_overrides,
    launch,
    launch_with_config,
    needs_deepspeed,
    needs_launcher,
    save_packs,
)
from docs_commands import argv, commands_in

from longalign.cli import main
from longalign.config import load_config
from longalign.preflight import (
    Check,
    Parallelism,
    Request,
    adapter_check,
    compare,
    config_check,
    env_checks,
    packs_check,
    parallelism_check,
    parallelism_in_effect,
    preflight_enabled,
    requested_engines,
    sequence_parallel_checks,
    unmet_request,
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


def test_adapter_row_says_what_trains_and_passes_qlora_where_bitsandbytes_runs():
    cpu = torch.device("cpu")
    assert adapter_check(load_config(DEMO), cpu).value == "none (full fine-tuning)"
    lora = adapter_check(load_config(DEMO, ["lora.r=8"]), cpu)
    assert lora.error is None and lora.value.startswith("LoRA r=8, peft ")
    version = importlib.metadata.version("bitsandbytes")
    for bits in (4, 8):  # bitsandbytes' CPU backend quantizes a small layer and runs it forward and backward
        qlora = adapter_check(load_config(DEMO, [f"lora.load_in_{bits}bit=true"]), cpu)
        assert qlora.error is None, qlora.error
        assert qlora.value.startswith(f"QLoRA {bits}-bit r=16, peft ") and qlora.value.endswith(version)
    elsewhere = adapter_check(load_config(DEMO, ["lora.load_in_4bit=true"]), torch.device("meta"))
    assert elsewhere.error == (
        "RuntimeError: lora.load_in_4bit: bitsandbytes quantizes on CUDA and CPU here; this run is on meta"
    )
    assert "longalign[qlora]" in elsewhere.fix


# --- the parallelism row ---------------------------------------------------------------------------------

# What `accelerate launch --config_file configs/accelerate/X.yaml` exports to each rank (measured).
FSDP2_EXPORTS = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD"}
ZERO3_EXPORTS = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "zero3.json"}


def accelerator(kind: DistributedType, ranks: int, device: str, **state) -> SimpleNamespace:
    """What ``parallelism_in_effect`` reads of an ``Accelerator``: its state and its DDP settings."""
    handler = state.pop("ddp_handler", None)
    return SimpleNamespace(
        state=SimpleNamespace(
            distributed_type=kind, num_processes=ranks, device=torch.device(device), **state
        ),
        ddp_handler=handler,
    )


def test_parallelism_row_reads_the_engine_from_the_accelerator():
    ddp = accelerator(
        DistributedType.MULTI_CPU,
        2,
        "cpu",
        ddp_handler=DistributedDataParallelKwargs(find_unused_parameters=False),
    )
    assert str(parallelism_in_effect(ddp, environ={"LOCAL_WORLD_SIZE": "2"})) == (
        "DDP over 2 CPU ranks on 1 node, find_unused_parameters false"
    )
    fsdp = accelerator(
        DistributedType.FSDP, 16, "cuda:0", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)
    )
    assert str(parallelism_in_effect(fsdp, environ={"LOCAL_WORLD_SIZE": "8"})) == (
        "FSDP2 over 16 GPU ranks on 2 nodes, reshard_after_forward true"
    )
    offload = json.loads((ROOT / "configs" / "deepspeed" / "zero3_offload.json").read_text())
    zero3 = accelerator(
        DistributedType.DEEPSPEED, 8, "cuda:3", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=offload)
    )
    running = parallelism_in_effect(zero3, sequence_parallel_size=4, environ={"LOCAL_WORLD_SIZE": "8"})
    assert str(running) == (
        "DeepSpeed ZeRO-3 over 8 GPU ranks on 1 node, offload params cpu, optimizer cpu; "
        "sequence parallel: 4 ranks per pack, 2 groups"
    )
    alone = parallelism_in_effect(accelerator(DistributedType.NO, 1, "cpu"), environ={})
    assert str(alone) == "single process (1 CPU rank)"


def test_what_the_launch_asked_for_comes_from_its_exports_and_the_run_file():
    assert requested_engines(FSDP2_EXPORTS) == [Request("FSDP", "FSDP2", "accelerate config", fsdp_version=2)]
    assert requested_engines(ZERO3_EXPORTS, zero_stage=3) == [
        Request("DeepSpeed", "DeepSpeed ZeRO-3", "accelerate config", zero_stage=3)
    ]
    assert requested_engines(
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    ) == [Request("DeepSpeed", "DeepSpeed ZeRO-2", "accelerate config", zero_stage=2)]
    assert requested_engines({}, deepspeed="ds.json", zero_stage=1) == [
        Request("DeepSpeed", "DeepSpeed ZeRO-1", "[training] deepspeed", zero_stage=1)
    ]
    assert requested_engines({"ACCELERATE_USE_FSDP": "false", "ACCELERATE_USE_CPU": "1"}) == []


def test_a_launch_that_did_not_get_its_engine_says_so_in_one_line():
    ddp = Parallelism("DDP", world_size=2, find_unused_parameters=False)
    assert unmet_request(ddp, requested_engines(FSDP2_EXPORTS)) == (
        "asked for FSDP2 (accelerate config), running DDP over 2 CPU ranks: FSDP is not in effect"
    )
    assert unmet_request(ddp, requested_engines(ZERO3_EXPORTS, zero_stage=3)) == (
        "asked for DeepSpeed ZeRO-3 (accelerate config), running DDP over 2 CPU ranks: DeepSpeed is not in effect"
    )
    zero3 = Parallelism("DeepSpeed", device="GPU", world_size=8, zero_stage=3)
    assert unmet_request(zero3, requested_engines(ZERO3_EXPORTS, zero_stage=3)) is None
    assert unmet_request(
        zero3, [Request("DeepSpeed", "DeepSpeed ZeRO-2", "[training] deepspeed", zero_stage=2)]
    ) == (
        "asked for DeepSpeed ZeRO-2 ([training] deepspeed), running DeepSpeed ZeRO-3 over 8 GPU ranks: "
        "ZeRO-2 is not in effect"
    )
    fsdp1 = Parallelism("FSDP", device="GPU", world_size=8, fsdp_version=1, sharding="FULL_SHARD")
    assert unmet_request(fsdp1, requested_engines(FSDP2_EXPORTS)).endswith(
        "over 8 GPU ranks: FSDP2 is not in effect"
    )
    assert unmet_request(ddp, []) is None


def test_an_unmet_request_warns_without_failing_and_a_rank_that_runs_otherwise_differs():
    asked = requested_engines(FSDP2_EXPORTS)
    ddp = parallelism_check(Parallelism("DDP", world_size=2), asked)
    report = compare([[ddp], [ddp]])
    assert report.ok and report.warnings == [
        "parallelism: asked for FSDP2 (accelerate config), running DDP over 2 CPU ranks: FSDP is not in effect"
    ]
    assert table_rows(report)["parallelism"][0].split()[:4] == ["parallelism", "warning", "all", "DDP"]
    assert str(report).splitlines()[-2:] == [report.warnings[0], "preflight: ok"]
    # Only rank 1 was launched with the FSDP config: the rows differ, and the warning names the rank.
    plain = parallelism_check(Parallelism("DDP", world_size=2))
    other_node = parallelism_check(Parallelism("DDP", world_size=2, nodes=2), asked)
    mixed = compare([[plain], [other_node]])
    assert mixed.warnings == [report.warnings[0] + " (rank 1)"]
    assert mixed.problems[0].startswith(
        "parallelism: rank 1 differs from rank 0 (DDP over 2 CPU ranks on 2 nodes vs DDP over 2 CPU ranks on 1 node)"
    )


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
def test_train_stops_before_the_first_step_when_ranks_disagree_and_names_what_differs(tmp_path, nodes):
    """Two "nodes": node 1 holds an older copy of the packs and another token. train.py runs the preflight
    by default on two ranks, names each difference with its fix, never shows a secret, and trains nothing."""
    write_packs(tmp_path / "node1" / "stale", PACKS[:2])  # node 1's copy is an older one
    (tmp_path / "node1" / "packs").rename(tmp_path / "node1" / "fresh")
    (tmp_path / "node1" / "stale").rename(tmp_path / "node1" / "packs")
    nodes["1"]["env"] = {"HF_TOKEN": "hf_other_secret"}
    result = launch_per_rank(tmp_path, nodes, ROOT / "train.py", "training.max_steps=1")
    assert result.returncode != 0
    out = result.stdout
    assert "dataset: rank 1 differs from rank 0 (2 packs, cu_seqlens" in out
    assert "Fix: copy the same packed dataset to every node" in out
    assert "env HF_TOKEN: rank 1 differs from rank 0 (sha256:" in out
    assert "secret" not in out + result.stderr
    config = next(line for line in out.splitlines() if line.startswith("config "))
    assert config.split()[1:3] == ["ok", "all"]  # the same config file and overrides on both ranks
    assert "preflight: FAILED" in out
    assert "train_runtime" not in out + result.stderr
    assert not (tmp_path / "run" / "checkpoint-1").exists()


@pytest.mark.integration
def test_train_runs_the_preflight_when_asked_on_one_rank(tmp_path, capsys):
    packs = write_packs(tmp_path / "packs", PACKS)
    args = ["train", "--config", str(DEMO), *demo_overrides(tmp_path / "run", packs), "training.max_steps=1",
            "training.save_strategy='no'", "training.preflight=true"]  # fmt: skip
    assert main(args) == 0  # in this process, as the console command runs it
    printed = capsys.readouterr()
    assert "preflight: 1 rank" in printed.out and "preflight: ok" in printed.out
    assert "train_runtime" in printed.out + printed.err


def parallelism_line(out: str) -> list[str]:
    """The parallelism row as ``[status, ranks, value]``."""
    line = next(line for line in out.splitlines() if line.startswith("parallelism "))
    return line.split(None, 3)[1:]


FSDP_NOT_IN_EFFECT = (
    "asked for FSDP2 (accelerate config), running DDP over 2 CPU ranks: FSDP is not in effect"
)
DEEPSPEED_NOT_IN_EFFECT = (
    "asked for DeepSpeed ZeRO-3 (accelerate config), running DDP over 2 CPU ranks: DeepSpeed is not in effect"
)


PREFLIGHT_PAGE = "docs/preflight.md"


def page_launch(accelerate_config: str) -> list[str]:
    """What follows ``accelerate launch --config_file configs/accelerate/<accelerate_config> --num_processes 2
    --mixed_precision no`` in the launch docs/preflight.md shows and marks run by this file."""
    found = commands_in((ROOT / PREFLIGHT_PAGE).read_text(encoding="utf-8"), PREFLIGHT_PAGE)
    (command,) = [c for c in found if c.run_by == "tests/test_preflight.py"]
    env, words = argv(command.text)
    head = ["accelerate", "launch", "--config_file", f"configs/accelerate/{accelerate_config}",
            "--num_processes", "2", "--mixed_precision", "no"]  # fmt: skip
    assert not env and words[: len(head)] == head, command.text
    return words[len(head) :]


@pytest.mark.integration
@needs_launcher
@pytest.mark.parametrize(
    "accelerate_config, args, env, asked",
    [
        # FSDP needs a GPU-like device: accelerate runs DDP. The page's own launch.
        ("fsdp2.yaml", page_launch("fsdp2.yaml"), {}, FSDP_NOT_IN_EFFECT),
        pytest.param(  # the launcher's --cpu turns DeepSpeed off (run-file use_cpu alone does not)
            "zero3.yaml", ["-m", "longalign", "preflight", "--config", str(DEMO)], {"ACCELERATE_USE_CPU": "1"},
            DEEPSPEED_NOT_IN_EFFECT, marks=needs_deepspeed,
        ),
    ],
    ids=["fsdp2", "zero3-cpu-launch"],
)  # fmt: skip
def test_ranks_that_agree_pass_and_a_sharding_config_not_in_effect_says_so(
    tmp_path, accelerate_config, args, env, asked
):
    packs = write_packs(tmp_path / "packs", PACKS)
    env = {**env, "WANDB_PROJECT": "longalign", "HF_TOKEN": "hf_very_secret"}
    overrides = demo_overrides(tmp_path / "run", packs)
    result = launch_with_config(accelerate_config, *args, *overrides, "--env", "WANDB_PROJECT", env=env)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]  # a warning, not a failure
    out = result.stdout
    assert "preflight: 2 ranks" in out.splitlines()
    for check in ("torch", "config", "tokenizer", "dataset", "attention backend", "env WANDB_PROJECT",
                  "env HF_TOKEN", "all-reduce"):  # fmt: skip
        line = next(line for line in out.splitlines() if line.startswith(check + "  "))
        assert line.split()[len(check.split()) : len(check.split()) + 2] == ["ok", "all"], line
    assert "ok, 2 ranks" in out and "sdpa_segments (float32 on cpu)" in out
    assert "hf_very_secret" not in out + result.stderr
    row = ["warning", "all", "DDP over 2 CPU ranks on 1 node, find_unused_parameters false"]
    assert parallelism_line(out) == row
    assert f"\nparallelism: {asked}\npreflight: ok\n" in out


# ZeRO-3 with sequence parallelism through train.py on CPU ranks: the parallelism row is checked by
# tests/test_eval_in_training.py (test_train_reports_zero3_with_sequence_parallelism_on_cpu_ranks), on the
# launch its scoring test makes with the same accelerate config and run.
