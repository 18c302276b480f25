"""Peak memory and step time of full fine-tuning vs LoRA vs LoRA with trained embeddings and norms, on CPU.

    python benchmarks/lora_memory.py [--length 1024] [--hidden 768] [--layers 4] [--vocab 32000] [--r 16]

Every variant is the same run (configs/demo.toml with a bigger random Llama-shaped model, float32, AdamW,
no activation checkpointing) built by ``longalign.run.build_trainer``, on the same synthetic pack of
``--length`` tokens (``longalign.probe.synthetic_pack``: a seeded long-tail mix of samples):

- full:                 every weight trains;
- LoRA:                 ``[lora] r`` on every attention and MLP projection, the rest frozen;
- LoRA + embeddings, norms: the same, with ``trainable = ["embeddings", "norms"]`` (LongLoRA's recipe).

Each variant runs in a fresh Python process, two optimizer steps, measured as the memory probe does
(``longalign.probe_step.measure_steps``): the peak resident set of the process (``getrusage``), the resident set
just before the second step (weights, gradients and optimizer states, after the first step made them),
and the second step's time, wall-clock and CPU (all threads of the process: what the step costs
whatever else the machine runs). The processes run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then maps
every tensor of 64 KiB or more on its own and unmaps it when freed, so the resident set follows the
live tensors instead of what the allocator keeps from the first step. The variants take turns
``--repeats`` times; the table shows each one's fastest step (other work on the machine only slows a
step down) and its largest peak. The default sizes take about 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import TrainerCallback

from longalign.config import load_config
from longalign.probe import synthetic_pack
from longalign.probe_step import measure_steps, probe_overrides
from longalign.run import build_trainer

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
VARIANTS = {
    "full": [],
    "LoRA": [],  # the family's default targets: every attention and MLP projection
    "LoRA + embeddings, norms": ["lora.trainable=['embeddings', 'norms']"],
}


def model_override(args: argparse.Namespace) -> str:
    settings = (
        f"model_type='llama', vocab_size={args.vocab}, hidden_size={args.hidden}, "
        f"intermediate_size={args.hidden * 8 // 3 // 64 * 64}, num_hidden_layers={args.layers}, "
        f"num_attention_heads={args.hidden // 64}, num_key_value_heads={args.hidden // 128}, "
        "max_position_embeddings=65536, tie_word_embeddings=false"
    )
    return "model.init_from_config={" + settings + "}"


class StepCPUTime(TrainerCallback):
    """CPU seconds of the last optimizer step, summed over the process's threads."""

    def __init__(self) -> None:
        self.start = 0.0
        self.seconds = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.process_time() - self.start


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, float]:
    """Two optimizer steps of ``variant`` in this process: what the probe measures, and what trains."""
    with tempfile.TemporaryDirectory() as work:
        pack = synthetic_pack(args.length, vocab_size=4096, seed=0)  # the shipped tokenizer's vocabulary
        datasets.Dataset.from_list([pack]).save_to_disk(f"{work}/packs")
        overrides = probe_overrides(args.length, train_file=f"{work}/packs", output_dir=f"{work}/run")
        overrides += [model_override(args), f"model.tokenizer='{ROOT / 'data' / 'tokenizer'}'"]
        if variant != "full":
            overrides += [f"lora.r={args.r}", f"lora.alpha={2 * args.r}", *VARIANTS[variant]]
        trainer = build_trainer(load_config(ROOT / "configs" / "demo.toml", overrides))
        trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in trainer.model.parameters())
        cpu = StepCPUTime()
        trainer.add_callback(cpu)
        return {**measure_steps(trainer), "step_cpu_seconds": cpu.seconds, "trained": trained, "total": total}


def in_fresh_process(variant: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--variant", variant, "--length", str(args.length)]
    command += ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    command += ["--r", str(args.r)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024, help="tokens in the pack")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every variant, taking turns")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)))
        return

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, Llama-shaped: hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}; one pack of {args.length} tokens; LoRA r {args.r}; "
        f"best of {args.repeats} runs each"
    )
    runs = [{variant: in_fresh_process(variant, args) for variant in VARIANTS} for _ in range(args.repeats)]
    results = {}
    for variant in VARIANTS:
        mine = [run[variant] for run in runs]
        results[variant] = {
            **mine[0],
            "peak_bytes": max(r["peak_bytes"] for r in mine),
            "step_start_bytes": max(r["step_start_bytes"] for r in mine),
            "step_seconds": min(r["step_seconds"] for r in mine),
            "step_cpu_seconds": min(r["step_cpu_seconds"] for r in mine),
        }
    full = results["full"]
    print()
    print(
        "| variant | trained params | before step | vs full | peak | vs full | step (s) | vs full "
        "| step CPU (s) | vs full |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for variant, result in results.items():
        print(
            f"| {variant} | {result['trained'] / 1e6:.2f} M of {result['total'] / 1e6:.1f} M "
            f"| {result['step_start_bytes'] / GIB:.2f} GiB | {result['step_start_bytes'] / full['step_start_bytes']:.2f}x "
            f"| {result['peak_bytes'] / GIB:.2f} GiB | {result['peak_bytes'] / full['peak_bytes']:.2f}x "
            f"| {result['step_seconds']:.2f} | {result['step_seconds'] / full['step_seconds']:.2f}x "
            f"| {result['step_cpu_seconds']:.2f} | {result['step_cpu_seconds'] / full['step_cpu_seconds']:.2f}x |"
        )


if __name__ == "__main__":
    main()
