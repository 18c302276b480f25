"""Sequence parallelism on CPU: per-rank peak memory and step time of one pack, unsplit vs split over 2 ranks.

    python benchmarks/sequence_parallel.py [--length 32k] [--config configs/demo.toml]

Both rows are the memory probe (``longalign probe``) at one pack length, in one run: the run's own
trainer (model, attention, loss chunking from the config), two optimizer steps on a synthetic pack of
exactly that many tokens, each length in a fresh process per rank. ``N = 1`` is one process holding the
whole pack; ``N = 2`` is two gloo ranks (``accelerate launch``) with ``training.sequence_parallel_size=2``,
each holding half the pack's tokens while DeepSpeed's Ulysses layer gives attention the whole pack for
half the heads. Peak memory is each rank's peak resident set (the worst rank), which includes what a
process holds before training (Python, torch, the model and its Adam states: "before step"); the step's
own memory is the growth over it. Step time is the second step's, on the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_ranks import command, environment

from longalign.arguments import parse_length
from longalign.probe import format_bytes

ROOT = Path(__file__).resolve().parents[1]


def probe(config: Path, length: int, size: int, output: Path) -> dict:
    """The probe's entry for ``length`` with packs split over ``size`` ranks (one process when 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = environment(ranks=size, threads=max(1, cores // size))  # the same cores for both rows
    args = [
        "-m", "longalign", "probe", "--config", str(config), "--lengths", str(length),
        "--output", str(output), f"training.sequence_parallel_size={size}",
    ]  # fmt: skip
    result = subprocess.run(command(args, ranks=size), capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0 or not output.exists():
        sys.exit(f"probe with N = {size} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    entry = json.loads(output.read_text())["results"][0]
    if entry["status"] != "fits":
        sys.exit(f"probe with N = {size}: {entry['status']}: {entry['error']}")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", default="32k", help="tokens per pack, e.g. 16k or 32k")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    args = parser.parse_args()
    length = parse_length(args.length)

    with tempfile.TemporaryDirectory() as tmp:
        rows = {
            size: probe(args.config, length, size, Path(tmp) / f"n{size}" / "probe.json") for size in (1, 2)
        }

    print(f"one pack of {length:,} tokens per step, {args.config.name}, CPU ranks (gloo)")
    print(
        f"{'N':<3}{'ranks':>6}{'tokens/rank':>13}{'step s':>8}{'before step':>14}{'peak/rank':>12}{'step growth':>14}"
    )
    for size, entry in rows.items():
        growth = entry["peak_bytes"] - entry["step_start_bytes"]
        print(
            f"{size:<3}{size:>6}{length // size:>13,}{entry['step_seconds']:>8.2f}"
            f"{format_bytes(entry['step_start_bytes']):>14}{format_bytes(entry['peak_bytes']):>12}"
            f"{format_bytes(growth):>14}"
        )
    one, two = rows[1], rows[2]

    def ratio(key: str) -> float:
        return two[key] / one[key]

    growth_ratio = (two["peak_bytes"] - two["step_start_bytes"]) / (
        one["peak_bytes"] - one["step_start_bytes"]
    )
    print(
        f"{'N=2 / N=1':<22}{ratio('step_seconds'):>7.2f}x{ratio('step_start_bytes'):>13.2f}x"
        f"{ratio('peak_bytes'):>11.2f}x{growth_ratio:>13.2f}x"
    )


if __name__ == "__main__":
    main()
