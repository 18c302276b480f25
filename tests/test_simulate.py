"""The simulated step (``longalign probe --simulate``) against real CPU steps counted the same way, and its
pieces: the kernels' stand-ins, the layer extrapolation, the engine's parts, the one-line refusals."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, counted_real_steps, needs_deepspeed, run_process

from longalign.simulate import (
    Setup,
    simulate_lengths,
)

LENGTHS = [512, 1024, 2048]
CHECKPOINTING = ["training.activation_checkpointing=true"]
VARIANTS = {
    "checkpointing": CHECKPOINTING,
    "tiled MLP": [*CHECKPOINTING, "training.tiled_mlp=true", "training.mlp_tile_tokens=256"],
    "offloaded inputs": [*CHECKPOINTING, "training.offload_activations=true"],
    "LoRA": [*CHECKPOINTING, "lora.r=8"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_simulated_peak_is_the_counted_peak_of_a_real_step(tmp_path, variant):
    """At three lengths, the fake step's peak within 2% of the real CPU step's counted peak (it is equal)."""
    real, cfg = counted_real_steps(tmp_path, LENGTHS, VARIANTS[variant])
    simulated = {row["length"]: row["peak"] for row in simulate_lengths(cfg, LENGTHS, Setup())}
    for length in LENGTHS:
        assert simulated[length] == pytest.approx(real[length], rel=0.02), (length, simulated, real)


@pytest.mark.integration
@needs_deepspeed
@pytest.mark.xfail(
    strict=True,
    reason="rank 0 of a real group under DDP holds 1.8-2.7 MB more at 512 and 1k tokens (up to 10%; at 2k within "
    "0.3%), not yet traced: DDP's reducer is not run by the simulation",
)
def test_the_simulated_rank_of_a_sequence_parallel_group_is_the_counted_real_rank(tmp_path):
    """Rank 0 of a group of 2 (DeepSpeed's Ulysses all-to-alls, DDP), real and simulated, on a fake group:
    the peak of what the step allocates beyond weights, gradients and optimizer states."""
    overrides = [*VARIANTS["offloaded inputs"], "training.sequence_parallel_size=2"]
    command = [
        sys.executable,
        str(ROOT / "tests" / "simulate_ranks_run.py"),
        str(tmp_path),
        ",".join(map(str, LENGTHS)),
    ]
    result = run_process([*command, *overrides], timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    for length in LENGTHS:
        real, simulated = measured["real"][str(length)], measured["simulated"][str(length)]
        assert simulated == pytest.approx(real, rel=0.02), (length, measured)
