"""Tokenized sample dataset -> packs of at most --max-seq-len tokens with cu_seqlens, plus report.json.

    python scripts/sort_and_group.py --input out/tokenized --output out/packed --max-seq-len 8192

Also writes packing.png (sample-length and pack-fill histograms) next to report.json and prints a summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matplotlib.figure import Figure  # Figure.savefig renders PNG with Agg; no pyplot, no display

from longalign.packing import STRATEGIES, write_packs

PLOT_NAME = "packing.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="dataset directory written by pre_tokenize.py")
    parser.add_argument("--output", required=True, help="output dataset directory (replaced atomically)")
    parser.add_argument("--max-seq-len", type=int, required=True, help="tokens per pack, at most")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="bfd",
        help="bfd/ffd: best/first-fit decreasing; greedy: next-fit in input order; "
        "sorted: no packing, batches of similar length",
    )
    parser.add_argument("--seed", type=int, default=0, help="order of equal lengths and of the packs")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per batch (strategy sorted)")
    parser.add_argument(
        "--drop-long", action="store_true", help="leave out samples over --max-seq-len instead of failing"
    )
    args = parser.parse_args(argv)

    try:
        report = write_packs(
            args.input,
            args.output,
            max_seq_len=args.max_seq_len,
            strategy=args.strategy,
            seed=args.seed,
            batch_size=args.batch_size,
            drop_long=args.drop_long,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"sort_and_group: error: {err}", file=sys.stderr)
        return 2
    plot(report, Path(args.output) / PLOT_NAME)
    print(summary(report, args.output))
    return 0


def plot(report: dict, path: Path) -> None:
    """Draw the sample-length histogram and the pack-fill histogram of a packing report."""
    figure = Figure(figsize=(11, 4), layout="constrained")
    lengths, fills = figure.subplots(1, 2)
    hist = report["histograms"]["sample_length"]
    lengths.stairs(hist["counts"], hist["edges"], fill=True)
    lengths.set(
        title=f"{report['samples']:,} samples, {report['tokens']:,} tokens",
        xlabel="tokens per sample",
        ylabel="samples",
    )
    hist = report["histograms"]["fill"]
    # Log scale: the few part-filled packs are the story, next to thousands of full ones.
    fills.stairs(hist["counts"], [100 * e for e in hist["edges"]], fill=True, baseline=0.5)
    fills.set(
        yscale="log",
        title=f"{report['packs']:,} rows ({report['strategy']}), efficiency {report['efficiency']:.2%}",
        xlabel="fill (% of the row's slots)",
        ylabel="rows",
    )
    figure.savefig(path, dpi=100)


def summary(report: dict, output: str) -> str:
    dropped = report["dropped_long"]
    per_pack, fill = report["samples_per_pack"], report["fill"]
    cost = report["attention_cost"]
    bound = ""
    if report["lower_bound_packs"] is not None:
        bound = (
            f"  lower bound {report['lower_bound_packs']:,} ({report['packs_over_lower_bound_pct']:+.4f}%)"
        )
    lines = [
        f"strategy       {report['strategy']}  max_seq_len {report['max_seq_len']}  seed {report['seed']}",
        f"samples        {report['samples']:,} packed of {report['samples_in']:,}"
        f"  (dropped as too long: {dropped['samples']:,}, {dropped['tokens']:,} tokens)",
        f"tokens         {report['tokens']:,}",
        f"rows           {report['packs']:,}" + bound,
        f"efficiency     {report['efficiency']:.4%}",
        "samples/row    " + "  ".join(f"{k} {v:g}" for k, v in per_pack.items()),
        "fill           " + "  ".join(f"{k} {v:.2%}" for k, v in fill.items()),
        f"attention      sum(l^2) {cost['total']:.3g}; per row "
        + "  ".join(f"{k} {v:.3g}" for k, v in cost["per_pack"].items()),
        f"wrote {output} (report.json, {PLOT_NAME} inside)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
