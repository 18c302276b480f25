"""What the commands print and draw from a stage's report: summaries for the terminal, the packing plot.

``pack_summary(report, "out/packed")`` of a pack report reads::

    strategy       bfd  max_seq_len 4096  seed 42
    samples        329 packed of 329  (left out: none)
    ...
"""

from __future__ import annotations

import json
from pathlib import Path

PLOT_NAME = "packing.png"  # next to a pack stage's report.json


def pre_tokenize_summary(report: dict, output: str) -> str:
    """The pre-tokenize report (``report.json``) as the lines the command prints."""
    dropped = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v) or "none"
    pct = report["length_percentiles"]
    lines = [
        f"lines read     {report['lines_read']}",
        f"samples kept   {report['samples_kept']}  (truncated {report['truncated']})",
        f"dropped        {report['dropped_total']}: {dropped}",
        f"tokens         {report['total_tokens']}  (targets {report['target_tokens']})",
    ]
    if report["samples_with_special_token_text"]:
        lines.append(
            f"control-token text in {report['samples_with_special_token_text']} samples, "
            f"read as {report['special_tokens_in_text']}"
        )
    if pct:
        lines.append(
            "length         "
            + "  ".join(f"{k} {v:.0f}" for k, v in pct.items() if k in ("min", "p50", "p90", "max"))
        )
    if len(report["sources"]) > 1:
        lines += [
            f"  {s['name']}: {s['lines_read']} read, {s['samples_kept']} kept, {s['dropped_total']} dropped"
            for s in report["sources"]
        ]
    lines += [
        f"  {e['file']} line {e['line']}: {e['reason']}: {e['message']}" for e in report["first_errors"][:5]
    ]
    lines.append(f"wrote {output} (report.json inside)")
    return "\n".join(lines)


def plot_packing(report: dict, path: Path) -> None:
    """Draw the sample-length histogram and the pack-fill histogram of a packing report."""
    from matplotlib.figure import Figure  # Figure.savefig renders PNG with Agg; no pyplot, no display

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


def pack_summary(report: dict, output: str) -> str:
    """The pack report as the lines the command prints: counts, fill, attention cost."""
    dropped = ", ".join(
        f"{reason} {d['samples']:,} ({d['tokens']:,} tokens)"
        for reason, d in report["dropped"].items()
        if d["samples"]
    )
    per_pack, fill = report["samples_per_pack"], report["fill"]
    cost = report["attention_cost"]
    bound = ""
    if report["lower_bound_packs"] is not None:
        bound = (
            f"  lower bound {report['lower_bound_packs']:,} ({report['packs_over_lower_bound_pct']:+.4f}%)"
        )
    lines = [
        f"strategy       {report['strategy']}  max_seq_len {report['max_seq_len']}  seed {report['seed']}",
        f"samples        {report['samples']:,} packed of {report['samples_in']:,}  (left out: {dropped or 'none'}"
        + (f"; the mix took {sum(s['taken'] for s in report['mix']):,}" if "mix" in report else "")
        + ")",
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


def dry_run_summary(result: dict) -> str:
    """A dry run's result: every setting with where it came from, then what each data stage reported."""
    width = max(len(key) for key, _, _ in result["settings"])
    lines = ["settings (where each comes from)"]
    lines += [
        f"  {key:<{width}}  {toml_value(value):<24}  {source}" for key, value, source in result["settings"]
    ]
    if result["config_overrides"]:
        lines += ["", f"model config_overrides: {result['config_overrides']}"]
    family = result.get("model_family")
    if family:
        follows = ", ".join(family["packs_exactly_with"]) or "nothing beyond causal attention"
        lines += [
            "",
            f"model: {family['architecture']} ({family['model_type']}) packs exactly; it follows {follows}",
        ]
    for which, entry in result["data"].items():
        lines += ["", f"{which} data: {entry['path']}"]
        if entry["pre_tokenize"]:
            lines += [
                "  " + line for line in pre_tokenize_summary(entry["pre_tokenize"], "").splitlines()[:-1]
            ]
        if entry["pack"]:
            for source in entry["pack"].get("mix", []):
                lines.append(
                    f"  mix: {source['name']}: {source['taken']:,} of {source['available']:,} ({source['rule']})"
                )
            lines += ["  " + line for line in pack_summary(entry["pack"], entry["path"]).splitlines()[:-1]]
    if result["eval_tasks"]:
        lines += ["", "eval_tasks (each evaluation):"] + [f"  {line}" for line in result["eval_tasks"]]
    if result["needs_gpu"]:
        lines += [
            "",
            "needs a GPU, not checked here (none on this machine): " + "; ".join(result["needs_gpu"]),
        ]
    lines += [""] * bool(result["not_checked"]) + [f"not checked: {line}" for line in result["not_checked"]]
    lines += ["", "dry run: no model weights loaded, nothing trained"]
    return "\n".join(lines)


def toml_value(value: object) -> str:
    """A setting as a run file writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, default=str) if value is not None else "(unset)"
