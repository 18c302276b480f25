"""FLOPs of one training step under activation checkpointing, with the MLP or the whole layer tiled, side by side.

    python benchmarks/tiled_layer_flops.py [--tokens 2048] [--samples 4]

One forward and backward on CPU of a packed row (``--samples`` samples of equal length) through a 2-layer
model shaped as Llama-3.1-8B scaled down by 16 (hidden 256, 8 query and 2 key/value heads of 32,
intermediate 896: the 8B's 4096, 32/8 heads of 128 and 14336 keep the same ratios), float32, longalign's
``sdpa_segments`` attention, every layer checkpointed. Three rows:

- checkpointing: transformers' activation checkpointing alone;
- + tiled MLP: ``tile_mlp``, the MLP in tiles of ``hidden`` tokens;
- + tiled layer: ``tile_layers``, every token-wise part in tiles, the layer its own checkpoint.

The token-wise FLOPs are what ``torch.utils.flop_counter.FlopCounterMode`` counts, less the LM head's
(``6 x tokens x hidden x vocab``, the same in every row) and less any attention op it counts; attention is
counted from the kernel calls' shapes instead: ``4 x causal pairs x query heads x head_dim`` per call
(scores and output; a call in backward's recompute counts as one more forward), its backward not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

import longalign.patch
from longalign import attention

VARIANTS = ["checkpointing", "+ tiled MLP", "+ tiled layer"]
VOCAB = 512


class GlobalOnly(contextlib.AbstractContextManager):
    """FLOPs counted for the whole step only: torch's per-module tracker hooks every module call, and fails
    on a module called with no gradient inside an autograd function on inputs that need one (the tiles)."""

    parents = frozenset({"Global"})

    def __exit__(self, *exc: object) -> None:
        return None


def step_flops(model: torch.nn.Module, ids: torch.Tensor, batch: dict) -> tuple[int, int, int]:
    """(FLOPs the counter saw outside attention, attention's causal FLOPs from its calls, kernel calls)."""
    kernel = attention._BACKEND_FUNCTIONS["sdpa_segments"]
    attended = [0, 0]

    def counted_kernel(q, k, v, cu_seqlens, *args, **kwargs):
        pairs = sum(n * (n + 1) // 2 for n in (b - a for a, b in pairwise(cu_seqlens.tolist())))
        attended[0] += 4 * pairs * q.shape[1] * q.shape[2]
        attended[1] += 1
        return kernel(q, k, v, cu_seqlens, *args, **kwargs)

    attention._BACKEND_FUNCTIONS["sdpa_segments"] = counted_kernel
    counter = FlopCounterMode(display=False)
    counter.mod_tracker = GlobalOnly()
    try:
        with counter:
            logits = model(**batch, use_cache=False).logits
            F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    finally:
        attention._BACKEND_FUNCTIONS["sdpa_segments"] = kernel
    counts = counter.get_flop_counts()["Global"]
    outside = sum(flops for op, flops in counts.items() if "attention" not in str(op))
    return outside, attended[0], attended[1]


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
        model.gradient_checkpointing_enable()
        model.train()
        outside, attended, calls = step_flops(model, ids, batch)
        rows.append((variant, outside - head, attended, calls))
    print(f"{tokens} tokens in {samples} samples, 2 layers, hidden 256, every layer checkpointed\n")
    print(f"| {'variant':<14} | token-wise GFLOP | x checkpointing | attention GFLOP (calls) |")
    print(f"|{'-' * 16}|{'-' * 18}|{'-' * 17}|{'-' * 25}|")
    for variant, tokenwise, attended, calls in rows:
        ratio = tokenwise / rows[0][1]
        print(
            f"| {variant:<14} | {tokenwise / 1e9:>16.3f} | {ratio:>15.3f} | {attended / 1e9:>14.3f} ({calls:>3}) |"
        )


if __name__ == "__main__":
    main()
