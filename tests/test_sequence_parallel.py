"""Sequence parallelism: a step with every pack split over ranks is the step of the unsplit packs, exactly.

The fast tests cover what a model must have to split its attention, and the guard on the registry. The
launched ones run the real trainer (DDP or DeepSpeed ZeRO-3, activation checkpointing on) with
``sequence_parallel_size`` 2 over 2 ranks (one group) and 4 ranks (two groups), every variant of a launch
in one process (``sequence_parallel_run.py``), and compare each with the same step on one process
without splitting: the parameters after one plain SGD step (the update the engine applied, so a gradient
scaled by the group size would show), the step's loss and the eval loss. Two controls break the split on
purpose and must show a difference. Last, the memory probe as users launch it (``train.py`` split
over two ranks is checked on the launch of tests/test_eval_in_training.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    DEMO,
    FLOAT32_BOUND,
    ROOT,
    launch,
    needs_deepspeed,
    needs_launcher,
    tiny_model,
)
from sequence_parallel_run import model, one_step, outcome
from transformers import DeepseekV3Config, GlmConfig, LlamaConfig, Qwen3NextConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import longalign.patch
from longalign.config import load_config
from longalign.patch import ATTENTION_NAMES, UnsupportedModelError, sequence_parallel_problems
from longalign.patch.sequence_parallel import SUFFIX

HERE = Path(__file__).resolve().parent
WEIGHTINGS = ("sequence_level", "token_level")

# --- what a model needs ----------------------------------------------------------------------------------


def test_heads_must_split_over_the_group():
    config = LlamaConfig(num_attention_heads=32, num_key_value_heads=8)
    assert sequence_parallel_problems(config, 8) == []
    assert sequence_parallel_problems(config, 16) == []  # 16 / 8: each key/value head goes to 2 ranks
    assert sequence_parallel_problems(config, 3) == [
        "its 32 attention heads are not a multiple of 3",
        "its 8 key/value heads neither divide by 3 nor divide 3",
    ]
    assert sequence_parallel_problems(
        LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6), 4
    ) == ["its 6 key/value heads neither divide by 4 nor divide 4"]


def test_attention_that_is_not_split_by_heads_is_refused():
    latent = sequence_parallel_problems(DeepseekV3Config(num_attention_heads=8, num_key_value_heads=8), 2)
    assert len(latent) == 1 and "multi-head latent attention" in latent[0]
    hybrid = sequence_parallel_problems(Qwen3NextConfig(num_hidden_layers=4), 2)
    assert hybrid == [
        "it has linear_attention layers, which mix tokens outside attention and would see only one rank's "
        "slice of the pack"
    ]


@pytest.mark.parametrize(
    "run_file, config",
    [
        (
            "llama3_8b_256k_sp8.toml",
            LlamaConfig(num_attention_heads=32, num_key_value_heads=8),
        ),  # Llama-3.1-8B
        (
            "glm4_9b_128k_sp4.toml",
            GlmConfig(num_attention_heads=32, num_key_value_heads=2),
        ),  # glm-4-9b-chat-hf
    ],
)
def test_the_shipped_split_run_files_fit_their_models(run_file, config):
    size = load_config(ROOT / "configs" / run_file).training.sequence_parallel_size
    assert sequence_parallel_problems(config, size) == []


def test_apply_refuses_a_model_that_cannot_split_before_touching_the_registry():
    with pytest.raises(
        UnsupportedModelError, match="cannot split its attention over 3 ranks: its 4 attention"
    ):
        tiny_model(backend="sdpa_segments", sequence_parallel_size=3)


def test_a_name_wrapped_for_sequence_parallelism_is_not_registered_again(monkeypatch):
    """Registering over DeepSpeed's wrapper would silently change what sequence-parallel models run."""

    def wrapper(*args, **kwargs):
        raise AssertionError("not called")

    wrapper.__qualname__ = "UlyssesSPAttentionHF.register_with_transformers.<locals>.uattn_wrapper"
    name = ATTENTION_NAMES["sdpa_segments"] + SUFFIX
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, name, wrapper)
    with pytest.raises(ValueError, match="is wrapped by DeepSpeed's Ulysses layer"):
        longalign.patch.register("sdpa_segments", name=name)
    assert longalign.patch.register("sdpa_segments") == ATTENTION_NAMES["sdpa_segments"]  # others still can


@needs_deepspeed
def test_splitting_needs_a_process_group():
    with pytest.raises(ValueError, match="needs a process group: start the run with accelerate launch"):
        tiny_model(backend="sdpa_segments", sequence_parallel_size=2)


def test_splitting_without_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(
        ValueError, match=r"runs on DeepSpeed, which does not import .*pip install 'longalign\[sp\]'"
    ):
        tiny_model(backend="sdpa_segments", sequence_parallel_size=2)


# --- through the real trainer, against one process -------------------------------------------------------

# One launch per number of ranks: (ranks, ENGINE/VARIANT computed in that one launch). DDP comes first.
LAUNCHES = {
    "2 ranks": (
        2,
        [
            *(f"ddp/{weighting}" for weighting in WEIGHTINGS),
            "ddp/sequence_level:in_shard_shift",
            "ddp/token_level:whole_pack_weights",
            "ddp/sequence_level:adapters",
            "ddp/token_level:moe",
            "ddp/sequence_level:window",
            "ddp/sequence_level:sinks",
            *(f"zero3/{weighting}" for weighting in WEIGHTINGS),
        ],
    ),
    "4 ranks in 2 groups": (
        4,
        [f"{engine}/{weighting}" for engine in ("ddp", "zero3") for weighting in WEIGHTINGS],
    ),
}
# What each engine's steps are compared on: (launch, engine).
SCENARIOS = {
    "2 ranks, DDP": ("2 ranks", "ddp"),
    "2 ranks, ZeRO-3": ("2 ranks", "zero3"),
    "4 ranks in 2 groups, DDP": ("4 ranks in 2 groups", "ddp"),
    "4 ranks in 2 groups, ZeRO-3": ("4 ranks in 2 groups", "zero3"),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, packs not split: the step every launch must reproduce; and the starting parameters."""
    start = {name: p.detach().clone() for name, p in tiny_model().named_parameters()}
    return {"start": start, **{weighting: one_step(weighting) for weighting in WEIGHTINGS}}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Run a launch of ``LAUNCHES`` once per module; its results by ``ENGINE/VARIANT``."""
    done: dict[str, dict] = {}

    def run(name: str) -> dict:
        if name not in done:
            ranks, variants = LAUNCHES[name]
            out = tmp_path_factory.mktemp("sp") / "results.pt"
            result = launch(
                HERE / "sequence_parallel_run.py", str(out), "2", *variants,
                num_processes=ranks, env={"PYTHONPATH": str(HERE)}, timeout=600,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr[-4000:]
            done[name] = torch.load(out)
        return done[name]

    return run


def update_difference(got: dict, want: dict, start: dict) -> float:
    """Largest relative difference between the updates one step applied to any parameter."""
    return max(
        float(((start[k] - got["params"][k]) - (start[k] - want["params"][k])).norm())
        / float((start[k] - want["params"][k]).norm())
        for k in start
    )


def update_ratio(got: dict, want: dict, start: dict) -> float:
    """Size of the whole update against the reference's: 1 when the engine applied the true gradient."""

    def size(result: dict) -> float:
        return sum(float((start[k] - result["params"][k]).square().sum()) for k in start) ** 0.5

    return size(got) / size(want)


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
@pytest.mark.parametrize("name", SCENARIOS)
def test_split_packs_give_the_step_of_the_whole_packs(name, launched, reference):
    launch_name, engine = SCENARIOS[name]
    results = launched(launch_name)
    for weighting in WEIGHTINGS:
        got, want = outcome(results, f"{engine}/{weighting}"), reference[weighting]
        assert update_difference(got, want, reference["start"]) < 1e-4, weighting
        assert update_ratio(got, want, reference["start"]) == pytest.approx(1, rel=1e-5)
        assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=FLOAT32_BOUND)
        # Every rank of a group sees the pack: the logs count it, its samples and tokens once.
        assert got["logged"] == want["logged"]
    assert "is wrapped by DeepSpeed's Ulysses layer" in results["guard"]


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_adapters_train_the_same_step_on_split_packs(launched):
    """LoRA adapters (and trained norms) on split packs: the update the unsplit step applies, exactly."""
    got = outcome(launched("2 ranks"), "ddp/sequence_level:adapters")
    start = {name: p.detach().clone() for name, p in model(1, "adapters").named_parameters()}
    want = one_step("sequence_level:adapters")
    moved = [name for name in start if not torch.equal(want["params"][name], start[name])]
    assert moved and all("lora_B" in name or "norm" in name for name in moved)  # the base stays frozen
    assert update_difference(got, want, {name: start[name] for name in moved}) < 1e-4
    assert all(torch.equal(got["params"][name], start[name]) for name in start if name not in moved)
    assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=FLOAT32_BOUND)


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_the_router_loss_of_split_packs_is_the_router_loss_of_the_whole_packs(launched):
    """A mixture of experts with its router loss on split packs: each rank's routing counts summed over
    the group, its own tokens' probabilities backpropagated, give the unsplit step's update and router loss."""
    got = outcome(launched("2 ranks"), "ddp/token_level:moe")
    start = {name: p.detach().clone() for name, p in model(1, "moe").named_parameters()}
    want = one_step("token_level:moe")
    assert update_difference(got, want, start) < 1e-4
    assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
    assert got["logged"]["router_loss"] == pytest.approx(want["logged"]["router_loss"], rel=FLOAT32_BOUND)
    assert got["logged"]["packs_per_step"] == want["logged"]["packs_per_step"] == 4


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_attention_sinks_split_over_the_ranks_train_the_same_step(launched):
    """gpt-oss: one sink logit per query head; the exchange leaves each rank half the heads, and each rank
    applies (and trains) its heads' sinks: the step of the unsplit run."""
    got = outcome(launched("2 ranks"), "ddp/sequence_level:sinks")
    start = {name: p.detach().clone() for name, p in model(1, "sinks").named_parameters()}
    want = one_step("sequence_level:sinks")
    assert update_difference(got, want, start) < 1e-4
    assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
    sinks = [name for name in start if name.endswith("sinks")]
    moved = [(start[name] - got["params"][name]).abs().min() for name in sinks]
    assert sinks and all(step > 0 for step in moved)  # every head's sink trained, on both ranks' heads


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_a_sliding_window_family_trains_the_same_step_on_split_packs(launched):
    """Mistral with a window shorter than every sample: each rank's heads see the whole pack inside
    attention, where the window applies within each sample, as the unsplit step has it."""
    got = outcome(launched("2 ranks"), "ddp/sequence_level:window")
    start = {name: p.detach().clone() for name, p in model(1, "window").named_parameters()}
    want = one_step("sequence_level:window")
    assert update_difference(got, want, start) < 1e-4
    assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=FLOAT32_BOUND)
    # The window bites: the same weights attending over whole samples take another step.
    assert update_difference(one_step("sequence_level:no_window"), want, start) > 0.01


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_controls_that_break_the_split_show_it(launched, reference):
    results, start = launched("2 ranks"), reference["start"]
    # Shifting inside each slice loses the targets whose label sits on the next rank.
    in_shard = outcome(results, "ddp/sequence_level:in_shard_shift")
    assert update_difference(in_shard, reference["sequence_level"], start) > 0.05
    assert in_shard["loss"] != pytest.approx(reference["sequence_level"]["loss"], rel=1e-3)
    # Every rank counting the whole pack's weight doubles the denominator: half the true step.
    whole = outcome(results, "ddp/token_level:whole_pack_weights")
    assert update_ratio(whole, reference["token_level"], start) == pytest.approx(0.5, rel=1e-5)
    assert whole["loss"] == pytest.approx(reference["token_level"]["loss"] / 2, rel=FLOAT32_BOUND)


# --- the run as users start it ---------------------------------------------------------------------------


# train.py with each pack split over two ranks after the preflight: tests/test_eval_in_training.py
# (test_train_splits_each_pack_over_two_ranks_after_the_preflight), on the launch its scoring test makes.


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_probe_runs_the_length_ladder_with_each_pack_split(tmp_path):
    output = tmp_path / "probe.json"
    result = launch(
        ROOT / "scripts" / "probe_memory.py", "--config", str(DEMO), "--output", str(output),
        "--lengths", "1k,2k", "training.sequence_parallel_size=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "2 rank(s), 1 pack(s) of each length per group of 2 ranks (each pack split over" in result.stdout
    report = json.loads(output.read_text())
    assert report["sequence_parallel_size"] == 2 and report["largest_fitting_length"] == 2048
    for entry in report["results"]:
        assert entry["status"] == "fits" and [r["rank"] for r in entry["ranks"]] == [0, 1]
        assert all(r["peak_bytes"] > 0 and r["step_seconds"] > 0 for r in entry["ranks"])
