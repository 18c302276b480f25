"""FLOPs of one CPU training step under activation checkpointing, with the MLP or the whole layer tiled, side by side.

    python benchmarks/step_flops_cpu.py [--tokens 2048] [--samples 4]

One forward and backward on CPU of a packed row (``--samples`` samples of equal length) through a 2-layer
model shaped as Llama-3.1-8B scaled down by 16 (hidden 256, 8 query and 2 key/value heads of 32,
intermediate 896: the 8B's 4096, 32/8 heads of 128 and 14336 keep the same ratios), float32, longalign's
``sdpa_segments`` attention, every layer checkpointed. Four rows:

- checkpointing: transformers' activation checkpointing alone (the kernel on all heads at once);
- + tiled MLP: ``tile_mlp``, the MLP in tiles of ``hidden`` tokens;
- + tiled layer: ``tile_layers``, every token-wise part in tiles, the layer its own checkpoint; its attention
  runs per key/value head, each group's forward keeping its output and log-sum-exp for the kernel's backward;
- + kept attention: the tiled layer keeping those from forward to backward (``keep_attention``), so its
  backward runs no attention forward.

The token-wise FLOPs are what ``torch.utils.flop_counter.FlopCounterMode`` counts, less the LM head's
(``6 x tokens x hidden x vocab``, the same in every row) and less any attention op it counts. Attention is
counted from the kernel calls' shapes instead, causal pairs only: a forward ``4 x pairs x head_dim`` per query
head (``QK^T`` and ``PV``; a call in a recompute counts again), a backward ``10 x`` (``QK^T`` again, ``dV``,
``dP``, ``dQ``, ``dK``), as FlashAttention's kernels do the work. The calls column shows forwards/backwards.
"""

from __future__ import annotations

import argparse
import copy
from itertools import pairwise

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import longalign.patch
from longalign import attention
from longalign.flops import StepFlops

VARIANTS = ["checkpointing", "+ tiled MLP", "+ tiled layer", "+ kept attention"]
VOCAB = 512


class Attention:
    """Attention's FLOPs and calls, counted from the kernel calls' shapes (see the module docstring)."""

    def __init__(self) -> None:
        self.flops, self.forwards, self.backwards = 0, 0, 0

    def unit(self, q: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
        pairs = sum(n * (n + 1) // 2 for n in (b - a for a, b in pairwise(cu_seqlens.tolist())))
        return pairs * q.shape[1] * q.shape[2]

    def forward(self, q: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        self.flops += 4 * self.unit(q, cu_seqlens)
        self.forwards += 1

    def backward(self, q: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        self.flops += 10 * self.unit(q, cu_seqlens)
        self.backwards += 1


class _CountBackward(torch.autograd.Function):
    """Identity on a whole kernel's output that counts the kernel's backward when autograd runs it."""

    @staticmethod
    def forward(ctx, out, q, cu_seqlens, counted):
        ctx.q, ctx.cu_seqlens, ctx.counted = q.detach(), cu_seqlens, counted
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.counted.backward(ctx.q, ctx.cu_seqlens)
        return grad, None, None, None


def step_flops(model: torch.nn.Module, ids: torch.Tensor, batch: dict) -> tuple[int, Attention]:
    """(FLOPs the counter saw outside attention, attention counted from its calls)."""
    whole, kept = attention._BACKEND_FUNCTIONS["sdpa_segments"], attention._KEPT_FUNCTIONS["sdpa_segments"]
    counted = Attention()

    def counted_whole(q, k, v, cu_seqlens, *args, **kwargs):
        counted.forward(q, cu_seqlens)
        out = whole(q, k, v, cu_seqlens, *args, **kwargs)
        return _CountBackward.apply(out, q, cu_seqlens, counted) if torch.is_grad_enabled() else out

    def counted_forward(q, k, v, sinks, call):
        counted.forward(q, call.cu_seqlens)
        return kept.forward(q, k, v, sinks, call)

    def counted_backward(dout, q, k, v, out, lse, sinks, call):
        counted.backward(q, call.cu_seqlens)
        return kept.backward(dout, q, k, v, out, lse, sinks, call)

    attention._BACKEND_FUNCTIONS["sdpa_segments"] = counted_whole
    attention._KEPT_FUNCTIONS["sdpa_segments"] = kept._replace(
        forward=counted_forward, backward=counted_backward
    )
    counter = StepFlops()  # FlopCounterMode counting the whole step (the tiles defeat its module tracker)
    try:
        with counter:
            logits = model(**batch, use_cache=False).logits
            F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    finally:
        attention._BACKEND_FUNCTIONS["sdpa_segments"], attention._KEPT_FUNCTIONS["sdpa_segments"] = (
            whole,
            kept,
        )
    counts = counter.mode.get_flop_counts()["Global"]
    outside = sum(flops for op, flops in counts.items() if "attention" not in str(op))
    return outside, counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=896,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
    )
    torch.manual_seed(0)
    base = longalign.patch.apply(LlamaForCausalLM(config), backend="sdpa_segments")
    tokens, samples = args.tokens, args.samples
    length = tokens // samples
    tokens = length * samples
    ids = torch.randint(0, VOCAB, (1, tokens))
    cu_seqlens = torch.arange(0, tokens + 1, length, dtype=torch.int32)
    batch = {
        "input_ids": ids,
        "position_ids": torch.arange(length).repeat(samples)[None],
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": length,
        "max_length_k": length,
    }
    head = 6 * tokens * config.hidden_size * VOCAB
    rows = []
    for variant in VARIANTS:
        model = copy.deepcopy(base)
        if variant == "+ tiled MLP":
            longalign.patch.tile_mlp(model)
        elif variant == "+ tiled layer":
            longalign.patch.tile_layers(model)
        elif variant == "+ kept attention":
            longalign.patch.tile_layers(model, keep_attention=True)
        model.gradient_checkpointing_enable()
        model.train()
        outside, counted = step_flops(model, ids, batch)
        rows.append((variant, outside - head, counted))
    print(f"{tokens} tokens in {samples} samples, 2 layers, hidden 256, every layer checkpointed\n")
    print(
        "| variant          | token-wise GFLOP | x ckpt | attention GFLOP (fwd/bwd calls) | all GFLOP | x ckpt |"
    )
    print(
        "|------------------|------------------|--------|---------------------------------|-----------|--------|"
    )
    for variant, tokenwise, counted in rows:
        total, first = tokenwise + counted.flops, rows[0][1] + rows[0][2].flops
        calls = f"{counted.forwards}/{counted.backwards}"
        print(
            f"| {variant:<16} | {tokenwise / 1e9:>16.3f} | {tokenwise / rows[0][1]:>6.3f} | "
            f"{counted.flops / 1e9:>20.3f} ({calls:>7}) | {total / 1e9:>9.3f} | {total / first:>6.3f} |"
        )


if __name__ == "__main__":
    main()
