"""Attention over one packed long-tail batch on CPU, three ways, side by side in one run.

    python benchmarks/attention.py [--tokens 16384] [--repeat 2]

Every row takes the same packed ``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` and returns ``[T, Hq, D]``, forward and
backward:

- sdpa_segments: longalign's CPU backend, one ``scaled_dot_product_attention`` per sample;
- transformers sdpa + mask: what transformers does for a packed row without a cache: it builds a dense
  ``[T, T]`` block-causal mask from ``position_ids`` (``create_causal_mask``) and runs its
  ``sdpa_attention_forward`` (which repeats K/V heads when a mask is present);
- padded: every sample padded to the longest, one batched causal ``scaled_dot_product_attention``
  (padding and unpadding included).

Peak memory is the growth of the process's peak resident set (``VmHWM``) over its resident size just
before the first measured call, in a fresh process per row: it counts everything the call allocates
(masks, padded copies, saved activations, gradients, allocator slack) and not the shared inputs. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask

from longalign.attention import varlen_attention

ROWS = {
    "sdpa_segments": "sdpa_segments (longalign)",
    "transformers": "transformers sdpa + mask",
    "padded": "padded to the longest",
}


def long_tail_lengths(tokens: int, longest: int, seed: int) -> list[int]:
    """Sample lengths summing to ``tokens``: mostly short chats, a few long documents (log-normal, capped)."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        draw = torch.empty(1).log_normal_(mean=5.5, std=1.5, generator=generator).item()
        lengths.append(int(min(max(draw, 8), longest, tokens - sum(lengths))))
    return lengths


def segments(q, k, v, lengths):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return varlen_attention(q, k, v, cu_seqlens, max(lengths), backend="sdpa_segments")


def transformers_dense_mask(q, k, v, lengths):
    total, q_heads, head_dim = q.shape
    config = LlamaConfig(num_attention_heads=q_heads, num_key_value_heads=k.shape[1], head_dim=head_dim)
    config._attn_implementation = "sdpa"
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = create_causal_mask(
        config=config,
        inputs_embeds=q.new_empty(1, total, 1),
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
    )
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=q_heads // k.shape[1])
    out, _ = sdpa_attention_forward(module, *(x.transpose(0, 1)[None] for x in (q, k, v)), mask)
    return out[0]


def padded(q, k, v, lengths):
    longest = max(lengths)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths])
    slot = sample * longest + position

    def pad(x):
        rows = x.new_zeros(len(lengths) * longest, *x.shape[1:]).index_copy(0, slot, x)
        return rows.view(len(lengths), longest, *x.shape[1:]).transpose(1, 2)

    # Right padding: causal masking alone keeps every real query off the padding behind it.
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(len(lengths) * longest, *q.shape[1:])[slot]


VARIANTS = {"sdpa_segments": segments, "transformers": transformers_dense_mask, "padded": padded}


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def measure(args: argparse.Namespace) -> dict:
    """One row, in this (fresh) process: peak memory of the first call, best time over the repeats."""
    lengths = long_tail_lengths(args.tokens, args.longest, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    q, k, v = (
        torch.randn(args.tokens, heads, args.head_dim, generator=generator).requires_grad_()
        for heads in (args.heads, args.kv_heads, args.kv_heads)
    )
    cotangent = torch.randn(args.tokens, args.heads, args.head_dim, generator=generator)
    run = VARIANTS[args.row]

    def step() -> torch.Tensor:
        out = run(q, k, v, lengths)
        out.backward(cotangent)
        return out.detach()

    gc.collect()
    baseline = memory_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            peak = memory_kib("VmHWM") - baseline
    with torch.no_grad():
        error = (out - segments(q, k, v, lengths)).abs().max().item()
    return {"seconds": min(times), "peak_mib": peak / 1024, "max_error": error, "lengths": lengths}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--longest", type=int, default=4096, help="cap on a sample's length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--row", choices=list(ROWS), help=argparse.SUPPRESS
    )  # set for the per-row child process
    args = parser.parse_args()
    if args.row:
        print(json.dumps(measure(args)))
        return

    results = {}
    for row in ROWS:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--row", row],
            check=True,
            capture_output=True,
            text=True,
        )
        results[row] = json.loads(child.stdout.splitlines()[-1])
    lengths = results["sdpa_segments"]["lengths"]
    median = sorted(lengths)[len(lengths) // 2]
    print(
        f"packed batch: {sum(lengths)} tokens, {len(lengths)} samples (lengths {min(lengths)}..{max(lengths)}, "
        f"median {median}); Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} float32, forward+backward; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeat}"
    )
    base = results["sdpa_segments"]
    header = (
        f"{'row':<28}{'time s':>9}{'x time':>9}{'peak MiB':>10}{'x memory':>10}{'max |out - segments|':>22}"
    )
    print(header)
    print("-" * len(header))
    for row, label in ROWS.items():
        result = results[row]
        print(
            f"{label:<28}{result['seconds']:>9.2f}{result['seconds'] / base['seconds']:>8.1f}x"
            f"{result['peak_mib']:>10.0f}{result['peak_mib'] / base['peak_mib']:>9.1f}x{result['max_error']:>22.1e}"
        )
    print("peak MiB: growth of peak resident memory during the first call, one fresh process per row")


if __name__ == "__main__":
    main()
