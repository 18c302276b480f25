"""Packing: rows, efficiency and wall time of each strategy on the same lengths, side by side, one run.

    python benchmarks/packing.py [--chat-samples 1000000] [--long-samples 100000] [--trl-samples N]

Workloads, lengths drawn with a fixed seed:
(a) chat: short chats, log-normal around 400 tokens, clipped to 16..4096, packed to 4096;
(b) long: LongAlign-like, 90% log-uniform in 1k..8k and a tail of 10% log-uniform in 8k..64k,
    packed to 65536.

Rows: the lower bound ceil(tokens / max_len) on the number of packs; ``pack`` with bfd, ffd and greedy
(one process, best of 3, lengths in and index lists out); padding, one sample per row padded to max_len;
TRL's ``pack_dataset`` (bfd inside each 1000-row ``datasets.map`` batch, its default) when trl is
installed. TRL's time includes moving tokens into the packs (1-byte placeholders here, so it is a lower
bound on its cost); ours is the packing decision only, the gather is ``build_pack_table``'s job.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import numpy as np

from longalign.packing import pack

REPEAT = 3


def chat_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(400), 1.0, n), 16, 4096).astype(np.int64)


def long_tail_lengths(n: int, rng: np.random.Generator) -> np.ndarray:
    body = np.exp(rng.uniform(np.log(1024), np.log(8192), n))
    tail = np.exp(rng.uniform(np.log(8192), np.log(65536), n))
    return np.where(rng.random(n) < 0.9, body, tail).astype(np.int64)


def best_time(run: Callable[[], list]) -> tuple[list, float]:
    times = []
    for _ in range(REPEAT):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return result, min(times)


def trl_pack(lengths: np.ndarray, max_len: int) -> tuple[int, float] | None:
    """Rows and seconds of ``trl.data_utils.pack_dataset`` on ``lengths``; None without trl."""
    try:
        import datasets
        import pyarrow as pa
        from trl.data_utils import pack_dataset
    except ImportError:
        return None
    datasets.disable_progress_bars()
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int64())
    tokens = pa.nulls(int(lengths.sum()), pa.int8())  # placeholders: TRL only looks at list lengths
    dataset = datasets.Dataset(pa.table({"input_ids": pa.LargeListArray.from_arrays(offsets, tokens)}))
    start = time.perf_counter()
    packed = pack_dataset(dataset, max_len, map_kwargs={"keep_in_memory": True})
    return len(packed), time.perf_counter() - start


def measure(lengths: np.ndarray, max_len: int, trl_samples: int) -> dict[str, tuple]:
    """``{method: (rows, tokens, seconds or None)}`` for one workload; None when trl is absent."""
    tokens = int(lengths.sum())
    rows = {"lower bound": (math.ceil(tokens / max_len), tokens, None)}
    for strategy in ("bfd", "ffd", "greedy"):
        packs, seconds = best_time(lambda s=strategy: pack(lengths, max_len, s))
        rows[strategy] = (len(packs), tokens, seconds)
    rows["padding"] = (len(lengths), tokens, None)
    subset = lengths[:trl_samples]
    trl = trl_pack(subset, max_len)
    name = "trl pack_dataset" if len(subset) == len(lengths) else f"trl pack_dataset, first {len(subset):,}"
    if trl is None:
        rows["trl (not installed)"] = None
    else:
        rows[name] = (trl[0], int(subset.sum()), trl[1])
        if len(subset) < len(lengths):
            packs, seconds = best_time(lambda: pack(subset, max_len, "bfd"))
            rows[f"bfd, first {len(subset):,}"] = (len(packs), int(subset.sum()), seconds)
    return rows


def cells(row: tuple | None, max_len: int, bfd_seconds: float) -> list[str]:
    if row is None:
        return ["-"] * 4
    packs, tokens, seconds = row
    lower_bound = math.ceil(tokens / max_len)
    return [
        f"{packs:,}",
        f"{100 * (packs / lower_bound - 1):+.3f}%",
        f"{100 * tokens / (packs * max_len):.3f}%",
        "-" if seconds is None else f"{seconds:.3f} ({seconds / bfd_seconds:.1f}x)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chat-samples", type=int, default=1_000_000)
    parser.add_argument("--long-samples", type=int, default=100_000)
    parser.add_argument("--trl-samples", type=int, default=None, help="give TRL only the first N samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    workloads = [
        ("(a) chat", chat_lengths(args.chat_samples, rng), 4096),
        ("(b) long", long_tail_lengths(args.long_samples, rng), 65536),
    ]
    results = [
        measure(lengths, max_len, args.trl_samples or len(lengths)) for _, lengths, max_len in workloads
    ]

    methods = list(dict.fromkeys(name for rows in results for name in rows))
    table = [["method", *["rows", "over LB", "efficiency", "time s (x bfd)"] * len(workloads)]]
    for method in methods:
        line = [method]
        for (_, _, max_len), rows in zip(workloads, results, strict=True):
            line += cells(rows.get(method), max_len, rows["bfd"][2])
        table.append(line)
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    titles = [f"{name}: {len(lengths):,} samples -> {max_len}" for name, lengths, max_len in workloads]
    spans = [sum(widths[1 + 4 * i : 5 + 4 * i]) + 6 for i in range(len(titles))]
    print(" " * widths[0] + "".join(f"  {t:<{w}}" for t, w in zip(titles, spans, strict=True)).rstrip())
    for line in table:
        print(
            f"{line[0]:<{widths[0]}}"
            + "".join(f"  {c:>{w}}" for c, w in zip(line[1:], widths[1:], strict=True))
        )


if __name__ == "__main__":
    main()
