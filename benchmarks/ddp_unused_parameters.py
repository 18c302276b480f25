"""DDP step time with and without the search for unused parameters, full fine-tuning on 2 CPU ranks.

    python benchmarks/ddp_unused_parameters.py [--steps 15] [--repeats 2]

Launches ``train.py`` with the demo config (tiny Llama, ``data/sample.jsonl`` packed to 4096 tokens) on 2
gloo ranks (``accelerate launch --multi_gpu --num_processes 2`` with ``ACCELERATE_USE_CPU=1``), once with
``training.ddp_find_unused_parameters=true`` (transformers' default when activation checkpointing is off,
what full fine-tuning ran with before) and once with longalign's default (false), alternating ``--repeats``
times. A step's time is the run's logged ``train_runtime`` over its steps (model loading and data
preparation excluded); each row shows the median over its repeats, every run (the spread is the noise
of a shared machine) and what the preflight's parallelism row says DDP ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).parent / "accelerate"
VARIANTS = {
    "find_unused_parameters=true (before)": ["training.ddp_find_unused_parameters=true"],
    "longalign default (after)": [],
}


def step_time(out: Path, steps: int, overrides: list[str], cache: Path) -> tuple[float, str]:
    """Seconds per step of one 2-rank run, and the preflight's parallelism row."""
    cmd = [str(LAUNCHER), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "demo.toml"),
           f"data.train_file={json.dumps(str(ROOT / 'data' / 'sample.jsonl'))}",
           f"data.cache_dir={json.dumps(str(cache))}", f"training.output_dir={json.dumps(str(out))}",
           f"model.tokenizer={json.dumps(str(ROOT / 'data' / 'tokenizer'))}", f"training.max_steps={steps}",
           "training.save_strategy='no'", "training.disable_tqdm=true", *overrides]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"the launch failed:\n{result.stderr[-3000:]}")
    row = next(line for line in result.stdout.splitlines() if line.startswith("parallelism "))
    state = json.loads((out / "trainer_state.json").read_text())
    runtime = next(entry["train_runtime"] for entry in state["log_history"] if "train_runtime" in entry)
    return runtime / steps, row.split(None, 3)[3]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    rows: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for i, (name, overrides) in enumerate(VARIANTS.items()):
                out = Path(tmp) / f"run-{repeat}-{i}"
                seconds, rows[name] = step_time(out, args.steps, overrides, Path(tmp) / "cache")
                times[name].append(seconds)
    before, after = (statistics.median(values) for values in times.values())
    width = max(map(len, VARIANTS))
    print(f"DDP on 2 CPU ranks, demo model, {args.steps} steps, median of {args.repeats} runs each")
    print(
        f"{'variant':<{width}}  {'s/step':>7}  {'vs before':>9}  {'each run':<20}  preflight parallelism row"
    )
    for name, seconds in zip(VARIANTS, (before, after), strict=True):
        runs = " ".join(f"{value:.3f}" for value in times[name])
        print(f"{name:<{width}}  {seconds:7.3f}  {seconds / before:8.2f}x  {runs:<20}  {rows[name]}")


if __name__ == "__main__":
    main()
