"""Reach by simulation: per model family (Llama-3.1-8B, GLM-4-9B, Qwen3-30B-A3B, GLM-4.5-Air, gpt-oss-20b,
Gemma-3-12B, each from its published ``config.json`` under ``configs/models/``), what each long-context
variant holds per token, and the longest pack that fits one 80 GB GPU, one 141 GB GPU, and 8 x 80 GB with
sequence parallelism 8, next to the figures DeepSpeed ALST publishes for Llama-3.1-8B.

    python benchmarks/simulated_reach.py [--lengths 512k,1m] [--kernel flash_attn_2]
        [--models llama,glm,qwen3moe,glm45air,gptoss,gemma3]

Every figure is simulated (``longalign probe --simulate``: the run's step on fake tensors, counted; nothing
is computed and no GPU has measured it). Each variant adds to the one before, all with bfloat16 weights,
the chunked loss, DeepSpeed ZeRO-3 with parameters and optimizer states in host memory
(``configs/accelerate/zero3_offload.yaml``):

- checkpointing:      ``training.activation_checkpointing = true``
- + tiled MLP:        ``training.sequence_tiling = "mlp"``
- + tiled layer:      ``training.sequence_tiling = "layer"``
- + offloaded inputs: ``training.offload_activations = true``

A step's memory is linear in the tokens on a GPU (per-sample attention keeps O(tokens)) once the part that
grows with them holds the peak, so each variant is simulated at the two ``--lengths`` per GPU and the line
through them gives what each more token adds, per unit of hidden (``B/token/hidden``), and the longest pack
under 80 GiB and 141 GB (131.3 GiB); host memory (2 TiB per node) limits every row. Below about 512k
tokens per GPU the tiled layer's peak (with offloaded inputs) is set by another part of the step than the
one that grows fastest, and a line through two such lengths promises too much. The 8-GPU rows are simulated with ``sequence_parallel_size = 8`` (rank 0 of
the group: its slice, and the all-to-all buffers), one process per line. Takes about 4 minutes per model on
two shared cores.

Every model runs the settings of ``configs/llama3_8b_768k_1gpu.toml``; every one but Llama without its
RoPE overrides (``model.config_overrides``, YaRN for Llama's window), at their checkpoint's own RoPE, which
holds the same memory. A cell where the run refuses the model in that variant, or its step fails, holds the
reason instead of a length. gpt-oss's attention sinks run on a GPU in FlashAttention 4, which has no
stand-in: its rows hold FlashAttention 2's buffers (``longalign.simulate.kernel_stand_in``). Gemma 3's
published config is the multimodal class; the simulation builds its text model (its ``text_config`` as a
``gemma3_text`` model, what a text-only fine-tune trains), without the vision tower's weights.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longalign.arguments import parse_lengths
from longalign.probe import format_length, parse_size

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "llama": ("Llama-3.1-8B", ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct"),
    "glm": ("GLM-4-9B", ROOT / "configs" / "models" / "glm-4-9b-chat-hf"),
    "qwen3moe": ("Qwen3-30B-A3B", ROOT / "configs" / "models" / "Qwen3-30B-A3B"),
    "glm45air": ("GLM-4.5-Air", ROOT / "configs" / "models" / "GLM-4.5-Air"),
    "gptoss": ("gpt-oss-20b", ROOT / "configs" / "models" / "gpt-oss-20b"),
    "gemma3": ("Gemma-3-12B", ROOT / "configs" / "models" / "gemma-3-12b-it"),
}
VARIANTS = {
    "checkpointing": [],
    "+ tiled MLP": ["training.sequence_tiling='mlp'"],
    "+ tiled layer": ["training.sequence_tiling='layer'"],
    "+ offloaded inputs": ["training.sequence_tiling='layer'", "training.offload_activations=true"],
}
ALST = {  # Llama-3.1-8B, ArcticTraining's published recipes and measurements
    "80 GB": "500k",
    "141 GB": "1.2M",
    "8 x 80 GB, SP 8": "3.7M",
}
GPUS = {  # label: (GPUs, memory of each)
    "80 GB": (1, parse_size("80GiB")),
    "141 GB": (1, parse_size("141GB")),
    "8 x 80 GB, SP 8": (8, parse_size("80GiB")),
}
HOST = parse_size("2TiB")
RUN_FILE = ROOT / "configs" / "llama3_8b_768k_1gpu.toml"
LAUNCH = ROOT / "configs" / "accelerate" / "zero3_offload.yaml"


def line(model: Path, variant: list[str], lengths: list[int], gpus: int, kernel: str) -> dict:
    """The simulated peak per GPU and host memory per node at two lengths, each as ``(a, b)``: ``a + b x length``;
    ``{"refused": why}`` where the run refuses the model in this variant (the probe's own message) or its step
    fails (the error).

    One ``longalign probe --simulate`` process per line: DeepSpeed sets sequence parallelism up once per
    process, for one attention shape.
    """
    with tempfile.TemporaryDirectory() as work:
        output = Path(work) / "simulated.json"
        command = [
            sys.executable, "-m", "longalign", "probe", "--simulate", "--config", str(RUN_FILE),
            "--lengths", ",".join(map(str, lengths)), "--gpus", str(gpus), "--kernel", kernel,
            "--accelerate-config", str(LAUNCH), "--output", str(output),
            f"model.model_name_or_path='{model}'", "training.offload_activations=false",
            "training.sequence_tiling=''", f"training.sequence_parallel_size={gpus}",
            f"data.max_seq_len={max(lengths)}", *variant,
            *([] if model == MODELS["llama"][1] else ["model.config_overrides={}"]),  # Llama's own RoPE
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if not output.exists():  # refused before the step (the probe's message), or failed in it (the error)
            rows = [row.removeprefix("[rank0]: ") for row in result.stderr.splitlines() if row.strip()]
            refused = [row for row in rows if row.startswith("longalign probe: error: ")]
            if refused:
                return {"refused": refused[-1].removeprefix("longalign probe: error: ")}
            if rows and "Error: " in rows[-1]:
                return {"refused": f"fails in the step ({rows[-1].strip()})"}
            sys.exit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        low, high = json.loads(output.read_text())["simulated"]
    slope = (high["peak"] - low["peak"]) / (high["length"] - low["length"])
    host_slope = (high["host_per_node"] - low["host_per_node"]) / (high["length"] - low["length"])
    config = json.loads((model / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]  # a multimodal config's text model's
    return {
        "peak": (high["peak"] - slope * high["length"], slope),
        "host": (high["host_per_node"] - host_slope * high["length"], host_slope),
        "per_token_per_hidden": slope * gpus / hidden,  # per token on a GPU
    }


def longest(fit: dict, memory: int) -> int:
    """The longest pack (a multiple of 64k tokens) whose simulated peak and host memory fit."""
    (a, b), (c, d) = fit["peak"], fit["host"]
    tokens = (memory - a) / b
    if d > 0:
        tokens = min(tokens, (HOST - c) / d)
    return max(0, math.floor(tokens / 65536) * 65536)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="512k,1m", help="the two lengths per GPU each line goes through")
    parser.add_argument("--kernel", default="flash_attn_2", help="the attention kernel stood in for")
    parser.add_argument("--models", default="llama,glm", help=f"of {','.join(MODELS)}")
    args = parser.parse_args()
    lengths = parse_lengths(args.lengths)
    start = time.perf_counter()
    print(
        f"simulated (nothing computed, no GPU measured), attention {args.kernel}, ZeRO-3 with parameters and "
        "optimizer states offloaded, bf16; each variant adds to the one before"
    )
    print()
    print("| model | variant | B/token/hidden | 80 GB | 141 GB | 8 x 80 GB, SP 8 |")
    print("|---|---|---|---|---|---|")
    for key in args.models.split(","):
        name, path = MODELS[key]
        for variant, overrides in VARIANTS.items():
            lines = {
                gpus: line(path, overrides, [n * gpus for n in lengths], gpus, args.kernel) for gpus in (1, 8)
            }
            cells = []
            for gpus, memory in GPUS.values():
                if "refused" in lines[gpus]:
                    cells.append(lines[gpus]["refused"])
                    continue
                reach = longest(lines[gpus], memory)
                cells.append(format_length(reach) if reach else "-")
            per_hidden = "-" if "refused" in lines[1] else f"{lines[1]['per_token_per_hidden']:.1f}"
            print(f"| {name} | {variant} | {per_hidden} | " + " | ".join(cells) + " |", flush=True)
    print(f"| Llama-3.1-8B | ALST (published) | - | {' | '.join(ALST.values())} |")
    print(f"\nsimulated in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
