"""Long context on CPU: a step's memory per token and time with checkpointing alone, + the tiled MLP,
+ offloaded checkpointed inputs, + the whole layer tiled, + each pack split over 2 ranks.

    python benchmarks/long_context_memory.py [--lengths 16k,32k,64k] [--hidden 128] [--layers 4]

The model has Llama-3-8B's proportions at a small width: intermediate 3.5 x hidden, 4 query heads per
key/value head (head size 32), a vocabulary of 31 x hidden, float32, the chunked loss (1024 tokens per
chunk). Each variant is the run as a run file sets it (``configs/demo.toml`` with that model,
built by ``longalign.run.build_trainer``), on one pack of each length made of 1,024-token samples (so
that attention, quadratic in a sample's length, does not drown the step time on CPU; what a step holds
per token does not depend on it), each variant and length in a fresh process, every variant adding to
the one before:

- checkpointing:       ``training.activation_checkpointing = true``
- + tiled MLP:         ``training.sequence_tiling = "mlp"`` (tiles of ``hidden`` tokens: the automatic size)
- + offloaded inputs:  ``training.offload_activations = true``
- + tiled layer:       ``training.sequence_tiling = "layer"``: every token-wise part of the layer in tiles,
                       not the MLP alone
- + SP 2, per rank:    ``training.sequence_parallel_size = 2`` on 2 gloo ranks; the worse rank

Every rank runs one thread (``OMP_NUM_THREADS=1``), as every rank of a GPU run has one GPU: the SP row
uses two cores, the others one.

One optimizer step, plain SGD (an optimizer without states: the step allocates nothing that is not
activation or gradient), measured and timed (wall clock). Memory is counted, not sampled: a
``TorchDispatchMode`` (``long_context_step.py``) adds up the storage of every tensor an operation
allocates during the step and subtracts it when the storage is freed, so ``step peak`` is the most
tensor memory the step held at once beyond what existed before it (the weights), like CUDA's
``max_memory_allocated`` and without the allocator's caching that blurs the resident set. The count
costs a Python call per operation in every variant (the tiled MLP and layer run more, smaller ones).
``bytes/token`` is that peak over the tokens a rank holds; ``slope`` is its growth per token from the
shortest to the longest length, the part a longer pack pays again for every token.

On CPU host and accelerator memory are one. So that the table shows what a GPU would hold, the offload's
hooks are replaced here by ones that do what they do on a GPU, copy each checkpointed input out at the
forward and back in at the backward, into tensors counted as ``host``; ``step peak`` stays device memory.

After the table, one MLP of the model alone at the longest length: forward and backward, dense and
tiled, measured the same way, to say how much of the MLP term the tiles remove. The default sizes take
about 7 minutes on 2 otherwise idle cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import datasets
import torch
from cpu_ranks import command, environment
from long_context_step import RANKS, VARIANTS, LiveTensors

from longalign.arguments import parse_lengths
from longalign.patch.tiled_mlp import tiled_forward
from longalign.probe import format_bytes

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "long_context_step.py"
# Samples of 1k tokens: attention's cost grows with the square of a sample's length and would drown the
# step time on CPU, while what a step holds per token does not depend on it (varlen attention).
SAMPLE_TOKENS = 1024


def pack(length: int, vocab_size: int) -> dict[str, list[int]]:
    """One pack of ``length`` random tokens in samples of :data:`SAMPLE_TOKENS` (the last one shorter)."""
    seq_lens = [SAMPLE_TOKENS] * (length // SAMPLE_TOKENS) + [length % SAMPLE_TOKENS] * bool(
        length % SAMPLE_TOKENS
    )
    ids = torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    edges = [sum(seq_lens[:i]) for i in range(len(seq_lens) + 1)]
    return {"input_ids": ids, "labels": ids, "cu_seqlens": edges, "seq_lens": seq_lens}


def in_fresh_processes(variant: str, length: int, args: argparse.Namespace) -> dict[str, Any]:
    """``variant`` at ``length`` in processes of its own (one per rank); the worse rank's result."""
    ranks = RANKS.get(variant, 1)
    env = environment(ranks=ranks, threads=1)  # one core per rank, as one GPU per rank
    with tempfile.TemporaryDirectory() as work:
        datasets.Dataset.from_list([pack(length, 31 * args.hidden)]).save_to_disk(f"{work}/packs")
        worker = [
            str(WORKER),
            variant,
            str(length),
            work,
            f"--hidden={args.hidden}",
            f"--layers={args.layers}",
        ]
        result = subprocess.run(
            command(worker, ranks=ranks), capture_output=True, text=True, env=env, cwd=ROOT
        )
        if result.returncode != 0:
            sys.exit(
                f"{variant} at {length} tokens failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
            )
        results = [json.loads(path.read_text()) for path in sorted(Path(work).glob("rank*.json"))]
    return {
        "tokens": results[0]["tokens"],
        "peak_bytes": max(r["peak_bytes"] for r in results),
        "host_bytes": max(r["host_bytes"] for r in results),
        "step_seconds": max(r["step_seconds"] for r in results),
    }


def mlp_alone(length: int, hidden: int) -> dict[str, int]:
    """Peak tensor bytes of one MLP's forward and backward over ``length`` tokens, dense and tiled."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 7 // 2))
    x = torch.randn(1, length, hidden, requires_grad=True)
    out = {}
    for name, forward in (("dense", mlp), ("tiled", lambda h: tiled_forward(mlp, h))):
        with LiveTensors() as live:
            forward(x).backward(torch.ones_like(x))
        out[name] = live.peak
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="16k,32k,64k", help="tokens per pack, e.g. 16k,32k,64k")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    lengths = parse_lengths(args.lengths)
    print(
        f"torch {torch.__version__}, CPU, float32; Llama-shaped: hidden {args.hidden}, intermediate "
        f"{args.hidden * 7 // 2}, {args.layers} layers, {args.hidden // 32} heads / {args.hidden // 128} KV, vocab "
        f"{31 * args.hidden}; chunked loss 1024; one SGD step on one pack of 1k-token samples, one thread per "
        "rank; step peak = tensor bytes the step held beyond the weights"
    )
    rows = {
        (variant, length): in_fresh_processes(variant, length, args)
        for length in lengths
        for variant in VARIANTS
    }
    print()
    print(
        "| variant | tokens | tokens/rank | step peak | vs ckpt | bytes/token | host (offload) | s/step | vs ckpt |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        base = rows["checkpointing", length]
        for variant in VARIANTS:
            row = rows[variant, length]
            print(
                f"| {variant} | {length // 1024}k | {row['tokens']:,} | {format_bytes(row['peak_bytes'])} "
                f"| {row['peak_bytes'] / base['peak_bytes']:.2f}x | {row['peak_bytes'] / row['tokens']:,.0f} "
                f"| {format_bytes(row['host_bytes']) if row['host_bytes'] else '-'} | {row['step_seconds']:.1f} "
                f"| {row['step_seconds'] / base['step_seconds']:.2f}x |"
            )
    shortest, longest = lengths[0], lengths[-1]
    if longest > shortest:
        print()
        print(
            f"growth per token from {shortest // 1024}k to {longest // 1024}k (bytes per token of the rank):"
        )
        base = None
        for variant in VARIANTS:
            low, high = rows[variant, shortest], rows[variant, longest]
            slope = (high["peak_bytes"] - low["peak_bytes"]) / (high["tokens"] - low["tokens"])
            base = base or slope
            print(f"  {variant:<20} {slope:>10,.0f}   {slope / base:.2f}x")
    print()
    print("the whole layer tiled against the MLP alone, both with offloaded inputs:")
    for length in lengths:
        layer, mlp = rows["+ tiled layer", length], rows["+ offloaded inputs", length]
        print(
            f"  {length // 1024}k: step peak {layer['peak_bytes'] / mlp['peak_bytes']:.2f}x, "
            f"s/step {layer['step_seconds'] / mlp['step_seconds']:.2f}x"
        )
    mlp = mlp_alone(longest, args.hidden)
    removed = 1 - mlp["tiled"] / mlp["dense"]
    print()
    print(
        f"one MLP alone, forward + backward over {longest:,} tokens: dense {format_bytes(mlp['dense'])}, tiled "
        f"{format_bytes(mlp['tiled'])} ({removed:.0%} of the MLP's memory removed; what stays is its "
        "[tokens, hidden] output, the gradient it receives and its input's gradient, and one tile)"
    )


if __name__ == "__main__":
    main()
