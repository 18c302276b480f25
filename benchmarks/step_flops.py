"""FLOPs of a Llama-3.1-8B training step, simulated: what each long-context variant executes, next to the
model's FLOPs, and what it holds per token.

    python benchmarks/step_flops.py [--packs 64k/64k,1m/64k,1m/1m] [--gpu h100] [--efficiency 0.38]

Each pack is ``LENGTH/SAMPLE``: a pack of LENGTH tokens of samples of SAMPLE tokens (64k/64k: one sample;
1m/64k: 16 samples of 64k; 1m/1m: one sample of 1M). Every figure is simulated (``longalign probe
--simulate``: the run's step on fake tensors; nothing is computed and no GPU has measured it): matrix
products by torch's ``FlopCounterMode``, attention from the FlashAttention 2 stand-in's calls (causal
pairs of each sample, backward 2.5 forwards, a recompute counted again), the 32 layers extrapolated from
1 and 2. Model FLOPs: 6 x parameters (less the input embedding) x tokens plus attention's causal pairs,
forward and backward, nothing recomputed. Each variant adds to the one before, all with bfloat16 weights,
the chunked loss and DeepSpeed ZeRO-3 with parameters and optimizer states in host memory:

- checkpointing:  ``training.activation_checkpointing = true``
- + tiled MLP:    ``training.sequence_tiling = "mlp"``
- + tiled layer:  ``training.sequence_tiling = "layer"``
- + kept attention: ``training.keep_attention = true`` (with ``offload_activations = true``, which it needs:
  this row's ``B/token/hidden`` is with the layers' inputs in host memory)

``B/token/hidden``: the activations' peak per token per unit of hidden. ``GPU s``: the step on one
``--gpu`` at ``--efficiency`` of its dense bf16 peak.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from longalign.arguments import parse_lengths
from longalign.config import load_config
from longalign.flops import DEFAULT_EFFICIENCY, GPU_PEAK_FLOPS, Throughput
from longalign.probe import _deepspeed_config, format_length, sharding
from longalign.simulate import Setup, accelerate_environment, simulate_lengths

ROOT = Path(__file__).resolve().parents[1]
RUN_FILE = ROOT / "configs" / "llama3_8b_1m_1gpu.toml"  # RoPE to 1M positions: a 1M-token sample is allowed
MODEL = ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct"
LAUNCH = ROOT / "configs" / "accelerate" / "zero3_offload.yaml"
VARIANTS = {
    "checkpointing": ["training.sequence_tiling=''"],
    "+ tiled MLP": ["training.sequence_tiling='mlp'"],
    "+ tiled layer": ["training.sequence_tiling='layer'"],
    "+ kept attention": [
        "training.sequence_tiling='layer'",
        "training.offload_activations=true",
        "training.keep_attention=true",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--packs", default="64k/64k,1m/64k,1m/1m", help="LENGTH/SAMPLE tokens, comma-separated"
    )
    parser.add_argument("--gpu", default="h100", choices=sorted(GPU_PEAK_FLOPS))
    parser.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY)
    args = parser.parse_args()
    packs = [[parse_lengths(part)[0] for part in pack.split("/")] for pack in args.packs.split(",")]
    environ, _ = accelerate_environment(LAUNCH)
    throughput = Throughput(args.gpu, args.efficiency)
    print(
        f"Llama-3.1-8B, one GPU, simulated (nothing computed, no GPU measured), FlashAttention 2 stood in, "
        f"ZeRO-3 offload, bf16; GPU s: one {args.gpu.upper()} at {args.efficiency:.0%} of its peak"
    )
    head = (
        f"{'variant':<18}{'pack':<18}{'executed PF':>12}{'matmul PF':>11}{'attention PF':>14}{'model PF':>10}"
        f"{'exec/model':>11}{'B/token/hidden':>16}{'GPU s':>9}{'simulated s':>13}"
    )
    print(head)
    start = time.perf_counter()
    for variant, overrides in VARIANTS.items():
        cfg = load_config(
            RUN_FILE,
            [f"model.model_name_or_path='{MODEL}'", "training.offload_activations=false", *overrides],
        )
        setup_env = {**os.environ, **environ}
        for length, sample in packs:
            setup = Setup(
                how=sharding(cfg, setup_env),
                deepspeed=_deepspeed_config(cfg.training.args, setup_env),
                kernel="flash_attn_2",
                sample_tokens=sample,
                throughput=throughput,
            )
            (row,) = simulate_lengths(cfg, [length], setup)
            samples = -(-length // sample)
            pack = f"{format_length(length)} ({samples} x {format_length(sample)})"
            print(
                f"{variant:<18}{pack:<18}{row['executed_flops'] / 1e15:>12.2f}"
                f"{row['executed_matmul_flops'] / 1e15:>11.2f}{row['executed_attention_flops'] / 1e15:>14.2f}"
                f"{row['model_flops'] / 1e15:>10.2f}{row['executed_per_model']:>11.3f}"
                f"{row['activation_bytes_per_token_per_hidden']:>16.1f}{row['step_seconds']:>9.1f}"
                f"{row['seconds']:>13.1f}",
                flush=True,
            )
    print(f"simulated in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
