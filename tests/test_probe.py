"""The memory probe: its pure pieces, and the real ladder on CPU with the demo model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEMO, ROOT
from docs_commands import Command, argv, commands_in
from hypothesis import given, settings
from hypothesis import strategies as st

from longalign.arguments import parse_length, parse_lengths
from longalign.batching import PackCollator
from longalign.cli import main
from longalign.config import load_config
from longalign.probe import (
    STOPPED,
    Sharding,
    combine_ranks,
    format_plan,
    format_table,
    growth,
    headline,
    model_states,
    parse_size,
    plan,
    sharding,
    suggestions,
    synthetic_pack,
    synthetic_seq_lens,
)
from longalign.probe_step import ERROR, FITS, OUT_OF_MEMORY, step_config
from longalign.tensor_memory import LiveTensors


def test_lengths_and_sizes():
    assert parse_lengths("64k, 4k,8k,4096,3000") == [3000, 4096, 8192, 65536]
    assert parse_length("1M") == 2**20
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("1.5G") == 3 * 2**29
    assert parse_size("500MB") == 500_000_000
    for bad in ("0", "4x", "-1k", ""):
        with pytest.raises(ValueError, match="length"):
            parse_length(bad)
    with pytest.raises(ValueError, match="memory size"):
        parse_size("lots")


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 200_000), seed=st.integers(0, 2**32 - 1))
def test_synthetic_lengths_fill_the_pack_exactly(total, seed):
    lens = synthetic_seq_lens(total, seed=seed)
    assert sum(lens) == total and min(lens) >= 1
    assert lens == synthetic_seq_lens(total, seed=seed)  # seeded


def test_synthetic_lengths_are_a_long_tail_mix():
    lens = synthetic_seq_lens(65536, seed=0)
    assert len(lens) > 3  # a mix, not one sample
    assert sum(length < 8192 for length in lens) > len(lens) / 2  # most samples short
    assert max(lens) > 8192  # but a long one


def test_synthetic_pack_collates_into_one_varlen_row():
    pack = synthetic_pack(5000, vocab_size=97, seed=3)
    assert len(pack["input_ids"]) == len(pack["labels"]) == 5000
    assert max(pack["input_ids"]) < 97
    batch = PackCollator()([pack])
    assert batch["input_ids"].shape == (1, 5000)
    assert batch["cu_seq_lens_q"].tolist() == pack["cu_seqlens"]
    assert batch["max_length_q"] == max(pack["seq_lens"])


def test_the_steps_train_the_run_without_its_eval_tasks(tmp_path):
    packs = tmp_path / "packs"
    overrides = ["eval_tasks.needle={lengths=[256], every_steps=1}", "lora.r=8"]
    assert load_config(DEMO, overrides).eval_tasks is not None  # the run scores the needle grid
    cfg = step_config(DEMO, overrides, 2048, packs)
    assert cfg.eval_tasks is None and cfg.lora.r == 8  # only the training steps are measured
    assert cfg.data.max_seq_len == 2048 and cfg.training.args["max_steps"] == 2
    assert cfg.training.output_dir == str(packs.parent / "run")
    full = step_config(DEMO, overrides, 2048, packs, full=True)
    assert full.eval_tasks is None and full.lora is None


def rank(index, status=FITS, peak=100, error=None):
    return {
        "rank": index,
        "status": status,
        "peak_bytes": peak,
        "step_start_bytes": 50,
        "step_seconds": 1.0,
        "error": error,
    }


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_a_step_started_from_a_large_process_reads_its_own_peak():
    # The parent touches 1.5 GiB, then starts a process as the probe starts its steps (subprocess): that
    # process's peak is its own, not the parent's (which ru_maxrss would report).
    parent = (
        "import subprocess, sys\n"
        "held = bytearray(1536 * 2**20)\n"
        "held[::4096] = b'x' * len(held[::4096])\n"
        "code = 'import torch; from longalign.probe_step import peak_memory; print(peak_memory(torch.device(\"cpu\")))'\n"
        "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout)\n"
    )
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True)
    assert int(done.stdout) < 1536 * 2**20  # torch imported: a few hundred MiB


def test_the_counter_counts_what_an_operation_makes_not_what_it_writes_into():
    """A storage made before counting and never tracked (as DDP's gradient buckets are) that an operation
    writes into was not made by the step; a view or an in-place result of a counted storage counts once."""
    before = torch.zeros(1024)
    with LiveTensors() as live:
        before[:256].copy_(torch.ones(256))  # the ones (1 KiB) are made, then freed; `before` is written into
        made = torch.empty(512)
        made[:10].add_(1)
    assert live.peak == live.device == live.parts["activations"] == made.nbytes == 2048


def test_combine_ranks_takes_the_worst_rank_and_the_real_cause():
    entry = combine_ranks(4096, [rank(0, peak=100), rank(1, peak=120)])
    assert (entry["status"], entry["peak_bytes"]) == (FITS, 120)
    # Rank 0's step broke because rank 1 ran out of memory: the cause is rank 1's.
    entry = combine_ranks(
        4096,
        [
            rank(0, ERROR, error="Connection closed by peer"),
            rank(1, OUT_OF_MEMORY, error="CUDA out of memory"),
        ],
    )
    assert entry["status"] == OUT_OF_MEMORY and entry["error"] == "rank 1: CUDA out of memory"
    entry = combine_ranks(4096, [rank(0, STOPPED), rank(1, OUT_OF_MEMORY, error="oom")])
    assert entry["error"] == "rank 1: oom"
    entry = combine_ranks(4096, [rank(0, peak=100), rank(1, peak=2048)], max_memory=1024)
    assert entry["status"] == OUT_OF_MEMORY
    assert entry["error"] == "rank 1: peak 2.00 KiB is over --max-memory 1.00 KiB"
    assert combine_ranks(8, [rank(0, peak=2048)], max_memory=1024)["error"].startswith("peak 2.00 KiB")


def test_table_marks_the_lengths_after_a_failure_not_run():
    entries = [
        combine_ranks(4096, [rank(0)]),
        combine_ranks(8192, [rank(0, OUT_OF_MEMORY, peak=None, error="x")]),
    ]
    lines = format_table(entries, [4096, 8192, 16384]).splitlines()
    assert lines[0].split() == ["length", "step", "s", "before", "step", "peak", "step", "growth", "per", "token",
                                "status"]  # fmt: skip
    assert lines[1].startswith("4k") and lines[1].endswith("fits")
    assert lines[2].startswith("8k") and lines[2].endswith("out of memory")
    assert lines[3].startswith("16k") and lines[3].endswith("not run")


def test_table_compares_with_full_fine_tuning():
    adapters = combine_ranks(4096, [rank(0, peak=400)])
    adapters["full"] = combine_ranks(4096, [rank(0, peak=1000)])
    longer = combine_ranks(8192, [rank(0, peak=700)])
    longer["full"] = combine_ranks(8192, [rank(0, OUT_OF_MEMORY, peak=None, error="CUDA out of memory")])
    lines = format_table([adapters, longer], [4096, 8192, 16384], compare_full=True).splitlines()
    assert lines[0].split() == [
        "length",
        "step",
        "s",
        "before",
        "step",
        "peak",
        "step",
        "growth",
        "per",
        "token",
        "full",
        "FT",
        "peak",
        "saved",
        "status",
    ]
    assert lines[1].split()[-4:] == ["1000", "B", "60%", "fits"]
    assert lines[2].split()[-5:] == ["out", "of", "memory", "-", "fits"]  # LoRA fits where full does not
    assert lines[3].startswith("16k") and lines[3].endswith("not run")
    text = headline([adapters, longer])
    assert "full fine-tuning at 4k: peak 1000 B; the adapters save 60%" in text
    assert "full fine-tuning failed at 8k (out of memory: CUDA out of memory)" in text


def test_suggestions_follow_the_config(tmp_path):
    plain = load_config(DEMO)
    advice = suggestions(plain, device_type="cuda", vocab_size=4096, environ={})
    assert any("activation_checkpointing=true" in line for line in advice)
    assert any("training.sequence_tiling=layer, now off" in line for line in advice)
    assert any("FSDP" in line and "ZeRO-3" in line for line in advice)
    assert any("loss.chunk_size (now 2048, try 512)" in line and "32 MiB" in line for line in advice)
    assert any("bfloat16" in line for line in advice)

    zero2 = tmp_path / "ds.json"
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    tuned = load_config(
        DEMO,
        [
            "training.activation_checkpointing=true",
            "training.sequence_tiling=layer",
            f"training.deepspeed='{zero2}'",
            "loss.chunk_size=512",
            "training.bf16=true",
        ],
    )
    advice = suggestions(tuned, device_type="cuda", vocab_size=4096, environ={})
    assert advice[0].startswith("split each pack over more ranks (training.sequence_parallel_size=2, now 1")
    assert advice[1] == "DeepSpeed ZeRO stage 3 (now 2) also shards the parameters"
    assert len(advice) == 3 and "train LoRA adapters" in advice[2]
    split = suggestions(
        load_config(DEMO, ["training.sequence_parallel_size=2"]),
        device_type="cuda",
        vocab_size=None,
        environ={},
    )
    assert any("training.sequence_parallel_size=4, now 2" in line for line in split)
    mlp = suggestions(
        load_config(DEMO, ["training.tiled_mlp=true"]), device_type="cuda", vocab_size=None, environ={}
    )
    assert any("training.sequence_tiling=layer, now mlp" in line for line in mlp)
    adapters = load_config(DEMO, ["lora.r=8"])
    advice = suggestions(adapters, device_type="cuda", vocab_size=4096, environ={})
    assert not any("train LoRA" in line for line in advice)
    assert any("QLoRA (lora.load_in_4bit=true)" in line for line in advice)
    fsdp_env = {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "false"}
    advice = suggestions(
        load_config(DEMO, ["training.activation_checkpointing=true"]),
        device_type="cpu",
        vocab_size=None,
        environ=fsdp_env,
    )
    assert not any("shard parameters" in line for line in advice)
    assert any("offload" in line for line in advice)


# --- the plan ---------------------------------------------------------------------------------------------

LLAMA_8B = {"parameters": 8_030_261_248, "parameter_bytes": 16_060_522_496,
            "trainable_parameters": 8_030_261_248, "trainable_bytes": 16_060_522_496}  # fmt: skip


def test_model_states_follow_zero_stage_and_offload():
    def states(gpus, **how):
        how = Sharding(
            **{"zero_stage": None, "fsdp": False, "offloaded": frozenset(), "optimizer": "adamw_torch"} | how
        )
        return {key: round(value / 1e9, 2) for key, value in model_states(LLAMA_8B, how, gpus).items()}

    assert states(1) == {"weights": 16.06, "gradients": 16.06, "optimizer states": 32.12}  # Adam in bf16
    assert states(8, zero_stage=3) == {"weights": 2.01, "gradients": 2.01, "optimizer states": 12.05}
    assert states(8, zero_stage=2) == {"weights": 16.06, "gradients": 2.01, "optimizer states": 12.05}
    assert states(8, zero_stage=3, offloaded=frozenset({"optimizer"})) == {
        "weights": 2.01, "gradients": 0.0, "optimizer states": 0.0}  # fmt: skip
    assert set(states(1, zero_stage=3, offloaded=frozenset({"parameters", "optimizer"})).values()) == {0.0}
    assert states(8, fsdp=True) == {"weights": 2.01, "gradients": 2.01, "optimizer states": 4.02}
    assert states(1, optimizer="adamw_bnb_8bit")["optimizer states"] == 16.06
    float32 = {
        **LLAMA_8B,
        "parameter_bytes": 2 * LLAMA_8B["parameter_bytes"],
        "trainable_bytes": 2 * LLAMA_8B["trainable_bytes"],
    }
    how = Sharding(zero_stage=1, fsdp=False, offloaded=frozenset(), optimizer="adamw_torch")
    assert model_states(float32, how, 1)["optimizer states"] == 8 * LLAMA_8B["parameters"]  # no master copy


def test_sharding_is_read_from_the_run_file_and_the_launch(tmp_path):
    zero3 = tmp_path / "ds.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}))
    how = sharding(load_config(DEMO, [f"training.deepspeed='{zero3}'"]), environ={})
    assert (how.zero_stage, how.offloaded, how.fsdp) == (3, {"optimizer"}, False)
    launched = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu"}  # fmt: skip
    assert sharding(load_config(DEMO), environ=launched).offloaded == {"parameters"}
    # accelerate launch --config_file configs/accelerate/zero3_offload_optimizer.yaml exports the JSON's path alone
    named = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(zero3)}
    assert sharding(load_config(DEMO), environ=named) == Sharding(
        3, False, frozenset({"optimizer"}), "adamw_torch_fused"
    )
    assert sharding(load_config(DEMO), environ={}) == Sharding(None, False, frozenset(), "adamw_torch_fused")


def ladder_entry(length, peak, previous=None):
    entry = combine_ranks(length, [{**rank(0, peak=peak), "model_sizes": LLAMA_8B}])
    entry["growth_per_token"] = growth(previous, entry, 1)
    return entry


def test_the_plan_adds_the_fitted_growth_to_the_states_of_the_planned_gpus():
    mib = 2**20
    small = ladder_entry(8192, 1000 * mib)
    middle = ladder_entry(16384, 1400 * mib, small)
    large = ladder_entry(32768, 2210 * mib, middle)
    assert middle["growth_per_token"] == 400 * mib / 8192
    how = Sharding(zero_stage=3, fsdp=False, offloaded=frozenset({"optimizer"}), optimizer="adamw_torch")
    rows = plan([small, middle, large], [8192, 32768, 65536], how=how, measured_gpus=1, gpus=1,
                sequence_parallel_size=1, gpu_memory=3 * 1024 * mib)  # fmt: skip
    assert rows[0]["error"] == "needs two measured lengths below it that fit"
    at_32k = rows[1]  # from 8k and 16k, next to what was measured
    assert (
        at_32k["from"] == [8192, 16384] and at_32k["peak"] == 2200 * mib and at_32k["measured"] == 2210 * mib
    )
    assert at_32k["activations"] == 32768 * 400 * mib / 8192
    assert at_32k["weights"] + at_32k["other"] + at_32k["activations"] == at_32k["peak"]
    at_64k = rows[2]  # from 16k and 32k
    assert at_64k["from"] == [16384, 32768] and at_64k["measured"] is None
    assert at_64k["peak"] == 2210 * mib + 32768 * 810 * mib / 16384 and not at_64k["fits"]
    on_8 = plan([small, middle], [32768], how=how, measured_gpus=1, gpus=8, sequence_parallel_size=8,
                gpu_memory=None)[0]  # fmt: skip
    assert on_8["tokens_per_gpu"] == 4096 and on_8["measured"] is None and on_8["fits"] is None
    assert on_8["weights"] == LLAMA_8B["parameter_bytes"] / 8  # ZeRO-3 shards them over the planned GPUs
    text = format_plan(rows, gpus=1, gpu_memory=3 * 1024 * mib).splitlines()
    assert text[0] == "plan: peak per GPU on 1 GPU(s) of 3.00 GiB"
    assert text[2].split()[:2] == ["8k", "8,192"] and text[2].endswith(
        "needs two measured lengths below it that fit"
    )
    assert text[3].split()[:3] == ["32k", "32,768", "8k+16k"] and "2.16 GiB (-0.5%)" in text[3]
    assert text[3].endswith("yes, 872.00 MiB left") and text[4].endswith("over")


@pytest.fixture
def probe(tmp_path, capsys, monkeypatch):
    """``longalign probe --config configs/demo.toml --output TMP/NAME/probe.json ARGS`` in this process, as the
    console command runs it (each length's step still in a process of its own): what it returned and
    printed, and the report it wrote."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the steps' processes: a tiny model, threads only contend
    monkeypatch.chdir(ROOT)  # the pages' paths are relative to the repository
    on_sigterm = signal.getsignal(signal.SIGTERM)  # the probe ends its step on SIGTERM; given back after

    def run(name: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
        output = tmp_path / name / "probe.json"
        argv = ["probe", "--config", str(DEMO), "--output", str(output), *args]
        code = main(argv)
        printed = capsys.readouterr()
        assert "Traceback" not in printed.out + printed.err
        return subprocess.CompletedProcess(argv, code, printed.out, printed.err), json.loads(
            output.read_text()
        )

    yield run
    signal.signal(signal.SIGTERM, on_sigterm)


def run_here(page: str) -> list[Command]:
    """The commands of ``page`` (relative to the repository) that it marks run by this file."""
    found = commands_in((ROOT / page).read_text(encoding="utf-8"), page)
    return [command for command in found if command.run_by == "tests/test_probe.py"]


def probe_arguments(command: Command) -> list[str]:
    """The flags of a page's ``longalign probe`` or ``python scripts/probe_memory.py`` (the same flags)."""
    env, words = argv(command.text)
    assert words[:2] in (["longalign", "probe"], ["python", "scripts/probe_memory.py"]), command.text
    assert set(env) <= {"OMP_NUM_THREADS"}, command.text  # probe() sets it
    return words[2:]


# docs/probe.md's two commands: a ladder under a memory cap, and a ladder with a plan.
PROBE_PAGE = "docs/probe.md"


@pytest.mark.integration
def test_the_pages_ladders_find_a_fitting_length_and_stop_at_a_memory_cap(tmp_path, probe):
    capped, planned = run_here(PROBE_PAGE)
    assert "--max-memory" in capped.text and "--plan" in planned.text
    result, report = probe(
        "free",
        *probe_arguments(planned),
        "--lengths",
        "512,4k",
        "training.hub_token='hf_probe_secret'",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "hf_probe_secret" not in (tmp_path / "free" / "probe.json").read_text()  # overrides are redacted
    assert [p.name for p in (tmp_path / "free").iterdir()] == ["probe.json"]  # the steps' files are gone
    assert "largest length that fits: 4k (4,096 tokens per pack)" in result.stdout
    small, large = report["results"]
    assert small["status"] == large["status"] == FITS
    assert large["peak_bytes"] > small["peak_bytes"] > 0  # a fresh process per length: each peak its own
    assert small["step_seconds"] > 0 and small["samples_per_pack"] >= 1
    assert "plan: peak per GPU on 1 GPU(s) of 2.00 GiB" in result.stdout
    assert [row["from"] for row in report["plan"]] == [[512, 4096], [512, 4096]]

    # The page's capped ladder at 512, 4k and 8k (the last --lengths and --max-memory given win).
    cap = (small["peak_bytes"] + large["peak_bytes"]) // 2  # room for 512 tokens, not for 4k
    result, report = probe(
        "capped", *probe_arguments(capped), "--lengths", "512,4k,8k", "--max-memory", str(cap)
    )
    assert result.returncode == 0  # the smallest length fits: the ladder has an answer
    out = result.stdout
    assert "largest length that fits: 512 (512 tokens per pack)" in out
    assert "4k failed: out of memory: peak" in out and "is over --max-memory" in out
    assert any(line.startswith("8k") and line.endswith("not run") for line in out.splitlines())
    assert "activation_checkpointing=true" in out  # advice from the demo config
    assert report["largest_fitting_length"] == 512
    assert [e["status"] for e in report["results"]] == [FITS, OUT_OF_MEMORY]


@pytest.mark.integration
def test_an_error_stops_the_ladder_in_one_line_with_the_trace_kept(probe):
    # torch's varlen kernel needs CUDA: on CPU the first step fails with the backend's own message.
    result, report = probe(
        "error",
        "--lengths",
        "512,1k",
        "model.attn_backend='torch_varlen'",
    )
    assert result.returncode == 1  # no length fits
    assert "512 failed: error: ConfigError: attention backend 'torch_varlen' cannot run here" in result.stdout
    assert "traceback in" in result.stdout
    failed = report["results"][0]
    assert failed["status"] == ERROR and "Traceback" in failed["ranks"][0]["traceback"]
    assert report["largest_fitting_length"] is None and len(report["results"]) == 1


@pytest.mark.integration
def test_compare_full_shows_what_adapters_save(probe, capsys):
    # Big enough that weights, gradients and optimizer states stand out of the process's own memory.
    model = (
        "model.init_from_config={model_type='llama', vocab_size=4096, hidden_size=512, intermediate_size=1536, "
        "num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=false}"
    )
    result, report = probe("lora", "--lengths", "1k", "--compare-full", "lora.r=8", model)
    assert result.returncode == 0, result.stdout + result.stderr
    entry = report["results"][0]
    assert entry["status"] == entry["full"]["status"] == FITS
    assert entry["full"]["peak_bytes"] > entry["peak_bytes"] > 0  # each in a fresh process of its own
    assert "full FT peak" in result.stdout and "the adapters save" in result.stdout
    assert report["compare_full"] and "saved" in report["table"]
    assert main(["probe", "--config", str(DEMO), "--compare-full"]) == 2  # refused before any step
    assert "--compare-full: the run has no [lora] section" in capsys.readouterr().err


# The page's two plan commands (checkpointing alone, and with the tiled MLP), on a model whose MLP is 64 times
# wider than the model: its [tokens, 2048] tensors in the recomputed layer are most of the memory per
# token, which the tiled MLP removes. A 2048-token window: the synthetic samples, capped at it, keep
# attention linear in the tokens and the steps short. The page marks them run here, not by test_docs.py.
LONG_CONTEXT = "docs/training/long-context.md"
PLAN_COMMANDS = run_here(LONG_CONTEXT)


def test_the_page_shows_both_plan_commands():
    assert ["tiled_mlp=true" in command.text for command in PLAN_COMMANDS] == [False, True]


@pytest.mark.integration
@pytest.mark.parametrize(
    "command", PLAN_COMMANDS, ids=lambda command: "tiled" if "tiled_mlp=true" in command.text else "plain"
)
def test_the_pages_plan_from_2k_and_4k_predicts_the_peak_measured_at_8k(probe, command):
    words = probe_arguments(command)
    assert "--gpu-memory" in words and "training.activation_checkpointing=true" in words
    # A quarter of the page's lengths (the last --lengths and --plan given win).
    result, report = probe("plan", *words, "--lengths", "2k,4k,8k", "--plan", "8k,16k")
    assert result.returncode == 0, result.stdout + result.stderr
    at_8k, at_16k = report["plan"]
    assert at_8k["from"] == [2048, 4096] and at_16k["from"] == [4096, 8192]
    assert abs(at_8k["peak"] / at_8k["measured"] - 1) < 0.10, result.stdout
    assert "plan: peak per GPU on 1 GPU(s) of 3.00 GiB" in result.stdout
