"""One variant of ``long_context_memory.py`` at one length, in this process: one rank's step, counted.

    python benchmarks/long_context_step.py VARIANT LENGTH WORK [--hidden 128] [--layers 4]
    accelerate launch --multi_gpu --num_processes 2 benchmarks/long_context_step.py "+ SP 2, per rank" ...

``WORK`` holds the pack (``WORK/packs``, written by the caller); each rank writes ``WORK/rankN.json``:
its tokens, the step's peak tensor bytes on the device and in host memory, and the step's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

import longalign.patch.offload
from longalign.config import load_config
from longalign.probe_step import probe_overrides
from longalign.run import build_trainer, close
from longalign.tensor_memory import CopiesToHost, LiveTensors

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTING = ["training.activation_checkpointing=true"]
OFFLOAD = ["training.offload_activations=true"]
VARIANTS = {
    "checkpointing": CHECKPOINTING,
    "+ tiled MLP": [*CHECKPOINTING, "training.sequence_tiling=mlp"],
    "+ offloaded inputs": [*CHECKPOINTING, "training.sequence_tiling=mlp", *OFFLOAD],
    "+ tiled layer": [*CHECKPOINTING, "training.sequence_tiling=layer", *OFFLOAD],
    "+ SP 2, per rank": [
        *CHECKPOINTING,
        "training.sequence_tiling=layer",
        *OFFLOAD,
        "training.sequence_parallel_size=2",
    ],
}
RANKS = {"+ SP 2, per rank": 2}


class StepMeter(TrainerCallback):
    """Counts the tensors of the optimizer step (:class:`LiveTensors`) and times it."""

    def __init__(self, live: LiveTensors) -> None:
        self.live = live
        self.start = 0.0
        self.seconds = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.live.__enter__()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start
        self.live.__exit__(None, None, None)


def model_override(hidden: int, layers: int) -> str:
    heads = hidden // 32
    settings = (
        f"model_type='llama', vocab_size={31 * hidden}, hidden_size={hidden}, intermediate_size={hidden * 7 // 2}, "
        f"num_hidden_layers={layers}, num_attention_heads={heads}, num_key_value_heads={heads // 4}, "
        "max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=false, "
        "bos_token_id=0, eos_token_id=1, pad_token_id=2"
    )
    return "model.init_from_config={" + settings + "}"


def run_variant(variant: str, length: int, hidden: int, layers: int, work: Path) -> dict[str, Any]:
    """One optimizer step of ``variant`` at ``length`` tokens in this process (one rank of it): what it held."""
    live = LiveTensors()
    longalign.patch.offload.host_memory_hooks = lambda: CopiesToHost(live)
    overrides = probe_overrides(length, train_file=work / "packs", output_dir=work / "run")
    overrides += [model_override(hidden, layers), "training.max_steps=1", "training.optim='sgd'"]
    overrides += ["loss.chunk_size=1024"]
    overrides += [f"model.tokenizer='{ROOT / 'data' / 'tokenizer'}'", *VARIANTS[variant]]
    trainer = build_trainer(load_config(ROOT / "configs" / "demo.toml", overrides))
    meter = StepMeter(live)
    trainer.add_callback(meter)
    trainer.train()
    close()
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "tokens": length // RANKS.get(variant, 1),
        "peak_bytes": live.peak,
        "host_bytes": live.host_peak,
        "step_seconds": meter.seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("variant", choices=list(VARIANTS))
    parser.add_argument("length", type=int, help="tokens in the pack")
    parser.add_argument("work", type=Path, help="the directory with the pack, where the result goes")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    result = run_variant(args.variant, args.length, args.hidden, args.layers, args.work)
    (args.work / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
