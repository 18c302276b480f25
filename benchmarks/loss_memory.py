"""Peak memory and time of the chunked loss vs transformers' stock loss, forward + backward, fp32 on CPU.

    python benchmarks/loss_memory.py [--tokens 16384] [--vocab 131072] [--hidden 512] [--chunk-size 4096]

stock   = what ``LlamaForCausalLM`` does: full logits ``lm_head(hidden)`` ``[tokens, vocab]``, then
          transformers' ``ForCausalLMLoss`` (``F.cross_entropy`` over the shifted labels); the logits are
          not kept after the loss, as in ``Trainer``.
chunked = ``longalign.loss.weighted_token_loss`` with ``--chunk-size`` targets per logits chunk.

Every position is a target (the worst case for the chunked loss: nothing is skipped). Each variant runs
in a fresh Python process; its peak memory is the growth of the process's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) from just after the inputs (hidden states, LM head weight, labels)
were allocated to the end of backward: everything forward + backward allocated at once at its worst
moment. The stock variant needs about 3 x tokens x vocab x 4 bytes; when the machine's available memory
cannot hold that, both variants are compared at the largest vocabulary (the requested one halved until
it fits), the chunked variant is also run alone at the requested size, and the stock peak there is
extrapolated from its measured buffers-per-logits ratio (printed as such). Times are one run each; the
default sizes take about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from longalign.loss import weighted_token_loss

GIB = 2**30
STOCK_BUFFERS = 3.3  # [tokens, vocab] fp32 buffers alive at the stock loss's worst moment, with margin


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_variant(variant: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int) -> dict[str, float]:
    """Forward + backward of one loss in this process: peak memory growth over the inputs, seconds, loss."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).mul_(hidden_size**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    baseline = peak_rss_bytes()
    start = time.perf_counter()
    if variant == "stock":
        logits = F.linear(hidden[None], weight)
        loss = ForCausalLMLoss(logits, labels[None], vocab_size=vocab)
        del logits
    else:
        loss = weighted_token_loss(hidden, weight, labels, torch.ones(tokens), chunk_size=chunk_size)
        loss = loss / (tokens - 1)  # the stock loss is the token mean
    loss.backward()
    seconds = time.perf_counter() - start
    return {"peak_bytes": peak_rss_bytes() - baseline, "seconds": seconds, "loss": loss.item()}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def in_fresh_process(
    variant: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int
) -> dict[str, float]:
    command = [sys.executable, __file__, "--variant", variant, "--tokens", str(tokens), "--vocab", str(vocab)]
    command += ["--hidden", str(hidden_size), "--chunk-size", str(chunk_size)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--variant", choices=["stock", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.hidden, args.chunk_size)))
        return

    available = available_bytes()
    vocab = args.vocab
    while STOCK_BUFFERS * args.tokens * vocab * 4 > 0.75 * available:
        vocab //= 2
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, hidden {args.hidden}, "
        f"chunk_size {args.chunk_size}, {available / GIB:.1f} GiB available"
    )
    if vocab != args.vocab:
        print(
            f"stock at {args.tokens} x {args.vocab} needs about "
            f"{STOCK_BUFFERS * args.tokens * args.vocab * 4 / GIB:.0f} GiB: compared at vocab {vocab}, "
            f"chunked also run alone at {args.vocab}"
        )
    runs = [(variant, vocab) for variant in ("stock", "chunked")]
    if vocab != args.vocab:
        runs.append(("chunked", args.vocab))
    results = {
        run: in_fresh_process(run[0], args.tokens, run[1], args.hidden, args.chunk_size) for run in runs
    }

    stock = results["stock", vocab]
    print()
    print(
        "| variant | tokens x vocab | full logits fp32 | peak memory | vs stock | time (s) | vs stock | loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (variant, run_vocab), result in results.items():
        same_size = run_vocab == vocab
        memory_ratio = f"{result['peak_bytes'] / stock['peak_bytes']:.1%}" if same_size else "-"
        time_ratio = f"{result['seconds'] / stock['seconds']:.2f}x" if same_size else "-"
        print(
            f"| {variant} | {args.tokens} x {run_vocab} | {args.tokens * run_vocab * 4 / GIB:.1f} GiB "
            f"| {result['peak_bytes'] / GIB:.2f} GiB | {memory_ratio} | {result['seconds']:.1f} "
            f"| {time_ratio} | {result['loss']:.6f} |"
        )
    if vocab != args.vocab:
        # Extrapolated, not measured: stock's peak is a fixed number of [tokens, vocab] buffers.
        buffers = stock["peak_bytes"] / (args.tokens * vocab * 4)
        stock_full = buffers * args.tokens * args.vocab * 4
        chunked_full = results["chunked", args.vocab]["peak_bytes"]
        print(
            f"\nstock's measured peak is {buffers:.2f} x its full logits; at vocab {args.vocab} that is "
            f"{stock_full / GIB:.1f} GiB (extrapolated), and chunked's measured {chunked_full / GIB:.2f} GiB "
            f"is {chunked_full / stock_full:.1%} of it"
        )


if __name__ == "__main__":
    main()
