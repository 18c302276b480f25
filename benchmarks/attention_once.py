"""FLOPs of one CPU training step with tiled layers, the attention kernel once forward and once backward.

    python benchmarks/attention_once.py [--tokens 1024] [--hidden 256] [--layers 2]

A Llama of the given size (4 query heads per key/value head, head size 32) takes one forward and backward of
a packed row with ``sequence_tiling = "layer"``'s tiled decoder layers, whose attention runs per key/value
head (``varlen_attention(..., per_kv_head=True)``), two ways side by side:

- kept: each group's kernel forward runs once and keeps its output and log-sum-exp; backward calls the
  kernel's backward on them (what longalign does);
- forward again: backward runs each group's kernel forward once more before its backward (what a backward
  that keeps nothing of the kernel must do).

``torch.utils.flop_counter.FlopCounterMode`` counts the step; the attention kernel's own calls are taken out
of its count and counted from their shapes instead, causal pairs only: forward ``4 * pairs * head_dim`` per
query head (``QK^T`` and ``PV``), backward ``10 *`` (``QK^T`` again, ``dV``, ``dP``, ``dQ``, ``dK``), as
FlashAttention's kernels do the work.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

import longalign.patch
from longalign import attention


class GlobalOnly(contextlib.nullcontext):
    """Stands in for ``FlopCounterMode``'s module tracker: no module is ever entered."""

    parents = ("Global",)


def causal_pairs(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def step_flops(args: argparse.Namespace, lengths: list[int], again: bool) -> dict[str, float]:
    """Model and attention FLOPs of one step; ``again``: backward runs each group's forward once more."""
    heads = args.hidden // 32
    config = LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        head_dim=32, max_position_embeddings=args.tokens, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = longalign.patch.apply(LlamaForCausalLM(config), backend="sdpa_segments")
    model = longalign.patch.tile_layers(model, tile_tokens=args.tokens // 4)
    kept = attention._KEPT_FUNCTIONS["sdpa_segments"]
    counts = {
        "attention forward": 0.0,
        "attention backward": 0.0,
        "kernel forwards": 0,
        "kernel backwards": 0,
    }
    counter = FlopCounterMode(display=False)
    # Its per-module tracker hooks every module's backward, which a tiled layer's modules (run without
    # autograd in forward) do not have: every FLOP is counted under "Global" alone instead.
    counter.mod_tracker = GlobalOnly()

    def analytic(q: torch.Tensor, factor: int) -> float:
        return factor * causal_pairs(lengths) * q.shape[-1] * q.shape[1]

    def forward(q, k, v, sinks, call):
        before = counter.get_total_flops()
        result = kept.forward(q, k, v, sinks, call)
        counts["written out"] = counts.get("written out", 0) + counter.get_total_flops() - before
        counts["attention forward"] += analytic(q, 4)
        counts["kernel forwards"] += 1
        return result

    def backward(dout, q, k, v, out, lse, sinks, call):
        if again:
            forward(q, k, v, sinks, call)
        before = counter.get_total_flops()
        result = kept.backward(dout, q, k, v, out, lse, sinks, call)
        counts["written out"] = counts.get("written out", 0) + counter.get_total_flops() - before
        counts["attention backward"] += analytic(q, 10)
        counts["kernel backwards"] += 1
        return result

    ids = torch.randint(3, 512, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    saved = attention._KEPT_FUNCTIONS["sdpa_segments"]
    attention._KEPT_FUNCTIONS["sdpa_segments"] = kept._replace(forward=forward, backward=backward)
    try:
        with counter:
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    finally:
        attention._KEPT_FUNCTIONS["sdpa_segments"] = saved
    attention_flops = counts["attention forward"] + counts["attention backward"]
    rest = counter.get_total_flops() - counts["written out"]
    return {**counts, "rest": rest, "attention": attention_flops, "total": rest + attention_flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    lengths = [args.tokens // 2, args.tokens // 4, args.tokens - args.tokens // 2 - args.tokens // 4]
    rows = {
        "kept (longalign)": step_flops(args, lengths, False),
        "forward again": step_flops(args, lengths, True),
    }
    print(
        f"one step, {args.tokens} tokens packed as {lengths}, hidden {args.hidden}, {args.layers} layers (GFLOP)"
    )
    print(f"{'':18} {'kernel fwd':>10} {'kernel bwd':>10} {'attention':>10} {'rest':>10} {'total':>10}")
    for name, row in rows.items():
        print(
            f"{name:18} {row['kernel forwards']:>10} {row['kernel backwards']:>10} {row['attention'] / 1e9:>10.3f} "
            f"{row['rest'] / 1e9:>10.3f} {row['total'] / 1e9:>10.3f}"
        )
    kept, again = rows["kept (longalign)"], rows["forward again"]
    print(
        f"attention: kept / forward again = {kept['attention'] / again['attention']:.3f} (forward 4 + backward 10 of 4 + 4 + 10)"
    )
    print(f"step:      kept / forward again = {kept['total'] / again['total']:.3f}")


if __name__ == "__main__":
    main()
