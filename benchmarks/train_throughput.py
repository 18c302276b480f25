"""Training throughput on CPU: packed + varlen vs padded batches vs sorted batching, same samples, one run.

    python benchmarks/train_throughput.py [--samples 160] [--batch-size 4] [--max-seq-len 4096]

Every row trains the demo model (configs/demo.toml, same initial weights) for one pass over the same
samples with the same sequence-level loss; tokens/s counts real tokens only (padding is waste):
- packed (varlen): best-fit-decreasing packs of max_seq_len, per-sample attention, no padding;
- padded (random): batches of --batch-size samples in random order, padded to the longest, masked sdpa
  (LongAlign's "naive" baseline);
- sorted batching: the same batches cut from the length-sorted order, shuffled (LongAlign's sorted batching).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import longalign.patch
from longalign.batching import PackCollator, PaddedCollator
from longalign.config import load_config
from longalign.loss import weighted_loss_sum
from longalign.packing import pack
from longalign.tokenize import pre_tokenize

ROOT = Path(__file__).resolve().parents[1]


def demo_model(varlen: bool) -> torch.nn.Module:
    settings = dict(load_config(ROOT / "configs" / "demo.toml").model.init_from_config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    return longalign.patch.apply(model, backend="sdpa_segments") if varlen else model


def run(model: torch.nn.Module, batches: list[dict]) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for batch in batches:
        loss = weighted_loss_sum(model, batch) / batch["loss_weights"].sum().clamp(min=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    torch.set_num_threads(torch.get_num_threads())

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
        pre_tokenize(
            ROOT / "data" / "sample.jsonl", tokenizer, Path(tmp) / "tok", max_seq_len=args.max_seq_len
        )
        samples = datasets.load_from_disk(str(Path(tmp) / "tok"))
        rng = np.random.default_rng(args.seed)
        chosen = np.sort(rng.choice(len(samples), size=min(args.samples, len(samples)), replace=False))
        rows = [samples[int(i)] for i in chosen]

    lengths = np.array([r["length"] for r in rows])
    real_tokens = int(lengths.sum())
    as_pack = [
        {"input_ids": r["input_ids"], "labels": r["labels"], "cu_seqlens": [0, r["length"]]} for r in rows
    ]
    packed_collate = PackCollator(weighting="sequence_level")
    padded_collate = PaddedCollator(weighting="sequence_level", pad_token_id=tokenizer.pad_token_id)

    packs = pack(lengths, args.max_seq_len, "bfd", seed=args.seed)
    packed = [packed_collate([as_pack[i] for i in group]) for group in packs]
    order = rng.permutation(len(rows))
    random_batches = [order[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    by_length = np.argsort(lengths, kind="stable")
    sorted_batches = [by_length[i : i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    sorted_batches = [sorted_batches[i] for i in rng.permutation(len(sorted_batches))]
    padded = [padded_collate([rows[i] for i in group]) for group in random_batches]
    sorted_padded = [padded_collate([rows[i] for i in group]) for group in sorted_batches]

    variants = [
        ("packed (varlen)", True, packed),
        ("padded (random)", False, padded),
        ("sorted batching", False, sorted_padded),
    ]
    run(demo_model(True), packed[:1])  # warm-up: first-touch allocations, kernel selection
    results = []
    for name, varlen, batches in variants:
        computed = sum(b["input_ids"].numel() for b in batches)
        seconds = run(demo_model(varlen), batches)
        results.append((name, len(batches), computed, seconds))

    print(
        f"{len(rows)} samples, {real_tokens} real tokens (lengths {lengths.min()}..{lengths.max()}, "
        f"median {int(np.median(lengths))}); demo model, CPU, {torch.get_num_threads()} threads, fwd+bwd+step"
    )
    print(
        f"{'method':<18}{'batches':>8}{'computed tok':>14}{'real/computed':>15}{'seconds':>9}{'tokens/s':>10}{'vs packed':>11}"
    )
    base = real_tokens / results[0][3]
    for name, count, computed, seconds in results:
        rate = real_tokens / seconds
        print(
            f"{name:<18}{count:>8}{computed:>14}{real_tokens / computed:>14.1%}{seconds:>9.1f}{rate:>10.0f}{rate / base:>10.2f}x"
        )


if __name__ == "__main__":
    main()
