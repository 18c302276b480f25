"""Length-ladder memory probe: real training steps on a synthetic pack of each length, smallest first.

``longalign probe`` (``scripts/probe_memory.py``) runs :func:`ladder`: every length in a fresh process
per rank that builds the run's own trainer (``longalign.run.build_trainer``: model, attention backend,
precision, gradient checkpointing, sharding and loss chunking, all from the config) on synthetic packs of
exactly that many tokens, and stops at the first length that fails. The pieces::

    lengths "4k,8k,16k"  ->  [4096, 8192, 16384]
    steps per length     ->  {"peak_bytes": ..., "step_start_bytes": ..., "step_seconds": ...}
    first failure        ->  suggestions(cfg, ...)  ("turn on gradient checkpointing", ...)

For a run with ``[lora]``, ``compare_full`` also runs every length that fits as full fine-tuning (the
same run without ``[lora]``, in a fresh process of its own), and the table shows the memory saved.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.distributed as dist
from transformers import TrainingArguments

from longalign.artifacts import staging_dir, write_json
from longalign.checkpoints import layout_note
from longalign.config import Config
from longalign.errors import ConfigError
from longalign.probe_step import ERROR, FITS, OUT_OF_MEMORY
from longalign.redact import redact_override
from longalign.run import load_tokenizer, model_config, overrides_note

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

STOPPED = (
    "stopped"  # a rank's step was ended because another rank failed first (the other statuses: probe_step)
)
# On CPU the peak is the step process's resident set. glibc keeps freed memory of tensors under its (rising)
# mmap threshold for reuse, so that set follows what the allocator kept, not the live tensors: a step
# whose tensors are many and small (a tiled MLP) measured 4.0 and 1.3 KiB per token on the same model at
# 8k-16k and 16k-32k. Tensors of 64 KiB and more taken straight from the OS go back to it when freed: 1.0
# and 1.0 KiB. Set for the step unless the environment sets it.
CPU_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def parse_size(text: str) -> int:
    """Bytes from ``2GiB``, ``512MiB``, ``2G`` (binary, as the CUDA allocator counts) or ``2GB`` (decimal).

    >>> parse_size("2GiB"), parse_size("2G"), parse_size("2GB"), parse_size("1000")
    (2147483648, 2147483648, 2000000000, 1000)
    """
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ConfigError(f"memory size {text!r}: expected e.g. 80GiB, 512MiB, 2G or 2000000000")
    number, power, binary, unit_b = match.groups()
    decimal = bool(power) and bool(unit_b) and not binary
    return int(float(number) * (1000 if decimal else 1024) ** _POWERS[power.lower()])


def format_length(tokens: int) -> str:
    """The short name of a length: ``4096 -> "4k"``, ``3000 -> "3000"``."""
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def format_bytes(size: float | None, *, digits: int = 2) -> str:
    """``1610612736 -> "1.50 GiB"``; ``None`` (not measured) -> ``"-"``; a negative size keeps its sign."""
    if size is None:
        return "-"
    sign, size = "-" if size < 0 else "", abs(size)
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while size >= 1024 and power < len(units) - 1:
        size /= 1024
        power += 1
    return f"{sign}{size:.0f} B" if power == 0 else f"{sign}{size:.{digits}f} {units[power]}"


def synthetic_seq_lens(
    total: int, *, seed: int = 0, shortest: int = 128, longest: int | None = None
) -> list[int]:
    """Sample lengths that fill exactly ``total`` tokens: a seeded long-tail mix, as in real SFT data.

    Lengths are drawn log-uniform between ``shortest`` and ``longest`` (default ``total``: as many samples
    of 128-256 tokens as of 8k-16k, so most samples are short and most tokens sit in a few long ones); the
    last one is cut to fill the pack exactly.

    >>> lens = synthetic_seq_lens(16384, seed=0)
    >>> sum(lens), min(lens) > 0, max(lens) <= 16384
    (16384, True, True)
    """
    rng = np.random.default_rng([seed, total])
    longest = min(longest or total, total)
    low, high = np.log(min(shortest, longest)), np.log(longest)
    seq_lens, left = [], total
    while left:
        length = min(int(np.exp(rng.uniform(low, high))), left)
        seq_lens.append(length)
        left -= length
    return seq_lens


def synthetic_pack(
    total: int, *, vocab_size: int, seed: int = 0, longest: int | None = None
) -> dict[str, list[int]]:
    """A pack row of exactly ``total`` random tokens with :func:`synthetic_seq_lens` samples of at most
    ``longest`` tokens (the model's window: the run refuses longer samples).

    Every token is a target, the most the loss can cost::

        synthetic_pack(7, vocab_size=100) with seq_lens [4, 3]
        input_ids   t0 t1 t2 t3 | t4 t5 t6
        labels      t0 t1 t2 t3 | t4 t5 t6     (the collator masks each sample's first label)
        cu_seqlens  [0, 4, 7]
    """
    seq_lens = synthetic_seq_lens(total, seed=seed, longest=longest)
    ids = np.random.default_rng([seed, total, vocab_size]).integers(0, vocab_size, total).tolist()
    return {
        "input_ids": ids,
        "labels": ids,
        "cu_seqlens": np.concatenate([[0], np.cumsum(seq_lens)]).tolist(),
        "seq_lens": seq_lens,
    }


def combine_ranks(
    length: int, ranks: list[dict[str, Any]], *, max_memory: int | None = None
) -> dict[str, Any]:
    """One ladder rung from every rank's step result: worst-rank peak and time, and the failure's cause.

    A rank result holds ``status`` (fits, out of memory, error, stopped), ``peak_bytes``,
    ``step_start_bytes``, ``step_seconds`` and, on failure, ``error`` (one line) and ``traceback``. A
    peak above ``max_memory`` counts as out of memory::

        ranks [{"rank": 0, "status": "fits", "peak_bytes": 9}, {"rank": 1, "status": "fits", "peak_bytes": 12}]
        max_memory 10  ->  {"status": "out of memory", "error": "rank 1: peak 12 B is over --max-memory 10 B", ...}
    """

    def worst(key: str) -> float | None:
        return max((r[key] for r in ranks if r.get(key) is not None), default=None)

    entry = {
        "length": length,
        "status": FITS,
        "error": None,
        "peak_bytes": worst("peak_bytes"),
        "step_start_bytes": worst("step_start_bytes"),
        "step_seconds": worst("step_seconds"),
        "ranks": ranks,
    }

    def where(result: dict[str, Any]) -> str:
        return f"rank {result['rank']}: " if len(ranks) > 1 else ""

    # An out-of-memory rank is the cause; its peers' errors (a collective's peer gone) are its echo.
    failed = sorted(
        (r for r in ranks if r["status"] not in (FITS, STOPPED)), key=lambda r: r["status"] != OUT_OF_MEMORY
    )
    over = [r for r in ranks if max_memory is not None and (r.get("peak_bytes") or 0) > max_memory]
    if failed:
        cause = failed[0]
        entry.update(
            status=cause["status"], error=where(cause) + cause["error"], traceback=cause.get("traceback")
        )
    elif over:
        peak = format_bytes(over[0]["peak_bytes"])
        entry.update(
            status=OUT_OF_MEMORY,
            error=f"{where(over[0])}peak {peak} is over --max-memory {format_bytes(max_memory)}",
        )
    elif any(r["status"] == STOPPED for r in ranks):
        entry.update(status=ERROR, error="stopped without a rank reporting why")
    return entry


def format_table(entries: list[dict[str, Any]], lengths: list[int], *, compare_full: bool = False) -> str:
    """The ladder as a table.

    One row per length; the lengths after the first failure are ``not run``. ``step growth`` is the peak
    over what the process held as the step began (activations, gradients, the step's buffers); ``per
    token`` is how much the peak grew per token on a rank since the length before (see :func:`growth`)::

        length  step s  before step        peak  step growth  per token  status
        4k        0.41   512.00 MiB  640.12 MiB   128.12 MiB          -  fits
        8k        0.83   512.00 MiB  800.12 MiB   288.12 MiB   40.0 KiB  fits
        16k          -            -           -            -          -  out of memory
        32k                                                                not run

    With ``compare_full`` (a ``[lora]`` run), two more columns: the peak of full fine-tuning at that
    length (or why it has none) and the share of it the adapters save::

        length  ...  per token    full FT peak  saved  status
        4k      ...          -        1.60 GiB    61%  fits
        8k      ...   40.0 KiB   out of memory      -  fits
    """
    lines = [format_row(None, compare_full=compare_full)]
    lines += [format_row(entry, compare_full=compare_full) for entry in entries]
    lines += [format_row(length, compare_full=compare_full) for length in lengths[len(entries) :]]
    return "\n".join(lines)


def format_row(entry: dict[str, Any] | int | None, *, compare_full: bool = False) -> str:
    """One line of :func:`format_table`: a rung's entry, a length not run, or ``None`` for the header."""
    if entry is None:
        full = f"{'full FT peak':>16}{'saved':>7}" if compare_full else ""
        return (
            f"{'length':<7}{'step s':>7}{'before step':>14}{'peak':>14}{'step growth':>14}{'per token':>11}"
            f"{full}  status"
        )
    if isinstance(entry, int):
        return f"{format_length(entry):<7}{'':<{62 + 23 * compare_full}}  not run"
    seconds = "-" if entry["step_seconds"] is None else f"{entry['step_seconds']:.2f}"
    before, peak = format_bytes(entry["step_start_bytes"]), format_bytes(entry["peak_bytes"])
    step = None
    if entry["peak_bytes"] is not None and entry["step_start_bytes"] is not None:
        step = entry["peak_bytes"] - entry["step_start_bytes"]
    per_token = entry.get("growth_per_token")
    per_token = "-" if per_token is None else format_bytes(per_token, digits=1)
    full = ""
    if compare_full:
        other = entry.get("full")
        if other is None:
            full_peak, saved = "not run", "-"
        elif other["status"] != FITS:
            full_peak, saved = other["status"], "-"
        else:
            full_peak, saved = format_bytes(other["peak_bytes"]), "-"
            if entry["status"] == FITS and other["peak_bytes"]:
                saved = f"{1 - entry['peak_bytes'] / other['peak_bytes']:.0%}"
        full = f"{full_peak:>16}{saved:>7}"
    return (
        f"{format_length(entry['length']):<7}{seconds:>7}{before:>14}{peak:>14}{format_bytes(step):>14}"
        f"{per_token:>11}{full}  {entry['status']}"
    )


def growth(
    earlier: dict[str, Any] | None, entry: dict[str, Any], sequence_parallel_size: int
) -> float | None:
    """Bytes the peak grew per token on a rank from the ``earlier`` rung to ``entry`` (both fitting).

    Tokens on a rank are the pack's over the sequence-parallel split::

        4k: peak 640 MiB, 8k: peak 800 MiB, no split  ->  160 MiB / 4096 tokens = 40 KiB per token
    """
    if earlier is None or FITS != earlier["status"] or FITS != entry["status"]:
        return None
    tokens = (entry["length"] - earlier["length"]) / sequence_parallel_size
    return (entry["peak_bytes"] - earlier["peak_bytes"]) / tokens


def headline(entries: list[dict[str, Any]]) -> str:
    """The answer of the probe: the longest length that fits, and where the ladder stopped."""
    fits = [entry for entry in entries if entry["status"] == FITS]
    if fits:
        best = fits[-1]
        text = (
            f"largest length that fits: {format_length(best['length'])} ({best['length']:,} tokens per pack), "
            f"peak {format_bytes(best['peak_bytes'])} per rank"
        )
    else:
        text = "no length fits"
    if entries and entries[-1]["status"] != FITS:
        last = entries[-1]
        text += f"\n{format_length(last['length'])} failed: {last['status']}: {last['error']}"
    both = [e for e in fits if e.get("full") is not None and e["full"]["status"] == FITS]
    if both:
        best = both[-1]
        text += (
            f"\nfull fine-tuning at {format_length(best['length'])}: peak {format_bytes(best['full']['peak_bytes'])}; "
            f"the adapters save {1 - best['peak_bytes'] / best['full']['peak_bytes']:.0%}"
        )
    failed = next((e for e in fits if e.get("full") is not None and e["full"]["status"] != FITS), None)
    if failed is not None:
        text += (
            f"\nfull fine-tuning failed at {format_length(failed['length'])} ({failed['full']['status']}: "
            f"{failed['full']['error']})"
        )
    return text


def suggestions(
    cfg: Config, *, device_type: str, vocab_size: int | None, environ: Mapping[str, str]
) -> list[str]:
    """What would raise the longest length that fits, judged from the run's config and launch settings.

    ``environ`` is the launch environment (``accelerate launch`` passes FSDP and DeepSpeed settings
    there). The advice that saves the most memory comes first.
    """
    args = cfg.training.args
    out = []
    if not (args.get("activation_checkpointing") or args.get("gradient_checkpointing")):
        out.append(
            "turn on activation checkpointing (training.activation_checkpointing=true): keeps one layer's "
            "activations at a time instead of all of them, for about a third more compute"
        )
    tiling = cfg.training.sequence_tiling
    if tiling != "layer":
        out.append(
            f"tile every token-wise part of each layer (training.sequence_tiling=layer, now {tiling or 'off'}): "
            "the recomputed layer keeps one tile of its norms, projections and MLP instead of the whole pack's, "
            "exactly, for one more forward of all but attention"
        )
    split = cfg.training.sequence_parallel_size
    out.append(
        f"split each pack over more ranks (training.sequence_parallel_size={2 * split}, now {split}; DeepSpeed "
        "Ulysses): each rank holds 1/N of a pack's tokens and activations; the world size and the attention "
        "heads must split into N"
    )
    batch = args.get("per_device_train_batch_size", _default_batch_size())
    if batch > 1:
        out.append(
            f"training.per_device_batch_size=1 (now {batch}) with {batch}x gradient_accumulation_steps: "
            f"the same global batch with 1/{batch} of the tokens per micro-batch"
        )
    stage = _zero_stage(args, environ)
    fsdp = bool(args.get("fsdp")) or environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not fsdp and stage is None:
        out.append(
            "shard parameters, gradients and optimizer states across the ranks: FSDP2 "
            "(accelerate launch --config_file configs/accelerate/fsdp2.yaml) or DeepSpeed ZeRO-3 "
            "(configs/accelerate/zero3.yaml); probe again under that launch"
        )
    elif stage is not None and stage < 3:
        out.append(f"DeepSpeed ZeRO stage 3 (now {stage}) also shards the parameters")
    if not _offloaded(args, environ):
        out.append(
            "offload parameters (and optimizer states) to CPU memory: fsdp_offload_params: true in the FSDP "
            "config, or offload_optimizer / offload_param in the DeepSpeed one; slower steps, far less GPU memory"
        )
    if cfg.lora is None:
        out.append(
            "train LoRA adapters instead of every weight (a [lora] section, e.g. lora.r=16): no gradients or "
            "optimizer states for the frozen base; probe --compare-full shows what that saves"
        )
    elif device_type == "cuda" and not (cfg.lora.load_in_4bit or cfg.lora.load_in_8bit):
        out.append("QLoRA (lora.load_in_4bit=true): the frozen base in 4 bits, a quarter of its bf16 memory")
    chunk = cfg.loss.chunk_size
    if chunk > 1024:
        buffer = f", {chunk * vocab_size * 4 / 2**20:.0f} MiB here" if vocab_size else ""
        out.append(
            f"a smaller loss.chunk_size (now {chunk}, try {chunk // 4}): the loss holds a float32 "
            f"[chunk_size, vocab] buffer{buffer}"
        )
    fp32 = not (args.get("bf16") or args.get("fp16")) and cfg.model.torch_dtype in ("float32", "auto")
    if device_type == "cuda" and fp32:
        out.append('train in bfloat16 (model.torch_dtype="bfloat16" or training.bf16=true)')
    return out


def _default_batch_size() -> int:
    return TrainingArguments.per_device_train_batch_size


def _deepspeed_config(args: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The run's DeepSpeed JSON: ``[training] deepspeed``, else the file an accelerate config names (which
    ``accelerate launch`` exports as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, without the stage itself)."""
    value = args.get("deepspeed")
    if value is None and environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        value = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if isinstance(value, str) and Path(value).is_file():
        return json.loads(Path(value).read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else None


def _zero_stage(args: Mapping[str, Any], environ: Mapping[str, str]) -> int | None:
    """The DeepSpeed ZeRO stage of the run (config file or launcher setting), or ``None`` without DeepSpeed."""
    settings = _deepspeed_config(args, environ)
    if settings is not None:
        return int(settings.get("zero_optimization", {}).get("stage", 0))
    if args.get("deepspeed") or environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return int(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0") or 0)
    return None


def _offloaded(args: Mapping[str, Any], environ: Mapping[str, str]) -> set[str]:
    """What the run keeps in CPU memory: ``{"parameters", "optimizer"}`` or part of it (FSDP offloads both)."""
    fsdp = args.get("fsdp") or ""
    if "offload" in (fsdp if isinstance(fsdp, str) else " ".join(fsdp)):
        return {"parameters", "optimizer"}
    if environ.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true":
        return {"parameters", "optimizer"}
    zero = (_deepspeed_config(args, environ) or {}).get("zero_optimization", {})
    found = set()
    for key, what in (("offload_param", "parameters"), ("offload_optimizer", "optimizer")):
        device = zero.get(key, {}).get("device", "none")
        if device == "none":
            device = environ.get(f"ACCELERATE_DEEPSPEED_{key.upper()}_DEVICE", "none")
        if device != "none":
            found.add(what)
    return found


# --- the plan: fixed memory, and memory per token -----------------------------------------------------


@dataclass(frozen=True)
class Sharding:
    """How the run places weights, gradients and optimizer states (read by :func:`sharding`)."""

    zero_stage: int | None  # DeepSpeed ZeRO stage; None without DeepSpeed
    fsdp: bool  # FSDP: everything sharded over the ranks
    offloaded: frozenset[str]  # kept in CPU memory: "parameters", "optimizer"
    optimizer: str  # TrainingArguments.optim


def sharding(cfg: Config, environ: Mapping[str, str]) -> Sharding:
    """The run's :class:`Sharding`, from its config and the launcher's settings (as :func:`suggestions`)."""
    args = cfg.training.args
    return Sharding(
        zero_stage=_zero_stage(args, environ),
        fsdp=bool(args.get("fsdp")) or environ.get("ACCELERATE_USE_FSDP", "").lower() == "true",
        offloaded=frozenset(_offloaded(args, environ)),
        optimizer=str(args.get("optim", TrainingArguments.optim)),
    )


def model_states(sizes: Mapping[str, int], how: Sharding, gpus: int) -> dict[str, float]:
    """Bytes per GPU of the weights, gradients and optimizer states, as the run places them on ``gpus``.

    ``sizes`` are the model's parameters in their dtypes (``longalign.run.parameter_sizes``). Without
    DeepSpeed, gradients take the trainable parameters' bytes and Adam two states of the same dtype (an
    8-bit optimizer two bytes per parameter, SGD none); DeepSpeed's optimizer keeps Adam's two states in
    float32 and, for 16-bit weights, a float32 master copy: 12 bytes per trainable parameter. ZeRO stage 1
    shards the optimizer states over the GPUs, stage 2 the gradients too, stage 3 the weights too; FSDP
    shards all three. Offloaded parameters or optimizer states take no GPU memory, and DeepSpeed's
    optimizer offload (ZeRO-Offload) keeps the gradients' partitions in CPU memory with them; FSDP's
    offload moves all three::

        8.0B bf16 parameters, all trainable, on 8 GPUs
        ZeRO-3                          weights 2 B x 8.0B / 8 = 2 GB, gradients 2 GB, optimizer 12 GB
        ZeRO-3, optimizer offloaded     weights 2 GB, gradients 0, optimizer 0
    """
    trainable = sizes["trainable_parameters"]
    weights, gradients = float(sizes["parameter_bytes"]), float(sizes["trainable_bytes"])
    if how.zero_stage is not None:
        sixteen_bit = sizes["trainable_bytes"] < 4 * trainable
        optimizer = trainable * (12.0 if sixteen_bit else 8.0)
    elif "8bit" in how.optimizer:
        optimizer = 2.0 * trainable
    elif how.optimizer.startswith("sgd"):
        optimizer = 0.0
    else:
        optimizer = 2.0 * gradients
    stage = 3 if how.fsdp else how.zero_stage or 0
    if stage >= 1:
        optimizer /= gpus
    if stage >= 2:
        gradients /= gpus
    if stage >= 3:
        weights /= gpus
    if "parameters" in how.offloaded:
        weights = 0.0
    if "optimizer" in how.offloaded or ("parameters" in how.offloaded and how.fsdp):
        gradients = optimizer = 0.0
    return {"weights": weights, "gradients": gradients, "optimizer states": optimizer}


def plan(
    entries: list[dict[str, Any]],
    lengths: list[int],
    *,
    how: Sharding,
    measured_gpus: int,
    gpus: int,
    sequence_parallel_size: int,
    gpu_memory: int | None,
) -> list[dict[str, Any]]:
    """The predicted peak per GPU at each of ``lengths``, from the measured ladder ``entries``.

    The model: a step's peak on a GPU is a fixed part plus a part that grows with its tokens,
    ``t = length / sequence_parallel_size``::

        peak(t) = weights + gradients + optimizer states   computed (model_states) for the planned GPUs
                + other                                     fitted: what the step holds at any length
                + activations = g x t                       fitted: what grows with the tokens, g per token

    ``g`` is the growth of the measured peak between the two longest fitting lengths below the planned
    one (a, b): ``g = (peak_b - peak_a) / (t_b - t_a)``, and ``other = peak_b - g t_b - model_states(measured
    GPUs)``: the runtime (the interpreter on CPU), buffers, gathered ZeRO-3 layers, the loss chunk. A
    planned length that was measured on as many GPUs also shows its measured peak, and the error::

        measured 8k 967 MiB, 16k 1.38 GiB  ->  g = 55.1 KiB, 32k predicted 2.24 GiB (measured 2.25 GiB)
    """
    fits = [entry for entry in entries if entry["status"] == FITS and entry["peak_bytes"] is not None]
    rows = []
    for length in lengths:
        row: dict[str, Any] = {"length": length, "tokens_per_gpu": length // sequence_parallel_size}
        below = [entry for entry in fits if entry["length"] < length]
        if len(below) < 2:
            rows.append({**row, "error": "needs two measured lengths below it that fit"})
            continue
        a, b = below[-2:]
        t_a, t_b = (a["length"] / sequence_parallel_size, b["length"] / sequence_parallel_size)
        per_token = (b["peak_bytes"] - a["peak_bytes"]) / (t_b - t_a)
        sizes = b["ranks"][0]["model_sizes"]
        states = model_states(sizes, how, gpus)
        other = b["peak_bytes"] - per_token * t_b - sum(model_states(sizes, how, measured_gpus).values())
        activations = per_token * row["tokens_per_gpu"]
        peak = sum(states.values()) + other + activations
        measured = next((e for e in fits if e["length"] == length and gpus == measured_gpus), None)
        rows.append(
            {
                **row,
                "from": [a["length"], b["length"]],
                "bytes_per_token": per_token,
                **states,
                "other": other,
                "activations": activations,
                "peak": peak,
                "measured": measured["peak_bytes"] if measured else None,
                "fits": None if gpu_memory is None else peak <= gpu_memory,
            }
        )
    return rows


def format_plan(rows: list[dict[str, Any]], *, gpus: int, gpu_memory: int | None) -> str:
    """The plan as a table: the parts of each planned length's peak per GPU, and whether it fits::

    plan: peak per GPU on 1 GPU(s) of 3.00 GiB
    length  tokens/GPU  from  per token  weights  gradients  optimizer   other  activations    peak  ...
    32k         32,768  8k+16k  51.6 KiB  2.52 MiB  2.52 MiB   5.05 MiB  512 MiB   1.61 GiB  2.12 GiB  ...
    ...  measured 2.11 GiB (+0.4%)  fits: yes, 899.67 MiB left
    """
    memory = f" of {format_bytes(gpu_memory)}" if gpu_memory else ""
    lines = [
        f"plan: peak per GPU on {gpus} GPU(s){memory}",
        f"{'length':<7}{'tokens/GPU':>11}{'from':>11}{'per token':>11}{'weights':>12}{'gradients':>12}"
        f"{'optimizer':>12}{'other':>12}{'activations':>13}{'peak':>12}{'measured':>20}  fits",
    ]
    for row in rows:
        start = f"{format_length(row['length']):<7}{row['tokens_per_gpu']:>11,}"
        if "error" in row:
            lines.append(f"{start}  {row['error']}")
            continue
        parts = [
            row[key] for key in ("weights", "gradients", "optimizer states", "other", "activations", "peak")
        ]
        measured = "-"
        if row["measured"] is not None:
            measured = f"{format_bytes(row['measured'])} ({row['peak'] / row['measured'] - 1:+.1%})"
        fits = "-" if row["fits"] is None else "yes" if row["fits"] else "no"
        if row["fits"] is not None:
            fits += f", {format_bytes(abs(gpu_memory - row['peak']))} {'left' if row['fits'] else 'over'}"
        lines.append(
            f"{start}{'+'.join(map(format_length, row['from'])):>11}"
            f"{format_bytes(row['bytes_per_token'], digits=1):>11}"
            + "".join(f"{format_bytes(part):>{13 if i == 4 else 12}}" for i, part in enumerate(parts))
            + f"{measured:>20}  {fits}"
        )
    return "\n".join(lines)


# --- the ladder: one fresh process per length and rank --------------------------------------------------


@dataclass(frozen=True)
class ProbeRequest:
    """What ``longalign probe`` was asked; a step process gets the same config path and overrides."""

    config: Path
    overrides: tuple[str, ...]
    lengths: list[int]
    max_memory: int | None
    seed: int
    output: Path
    trace: bool
    compare_full: bool = False  # also run each length that fits without [lora]
    plan: tuple[int, ...] = ()  # lengths to predict the peak of from the ladder (see plan())
    gpus: int | None = None  # GPUs of the plan; default: the ranks measured
    gpu_memory: int | None = None  # memory of each of them; default: max_memory, or the CUDA device's


def ladder(request: ProbeRequest, cfg: Config, say: Callable[[str], None]) -> int:
    """Run the length ladder; rank 0 says the table and writes ``request.output``. The exit status.

    0 when at least the smallest length fits (the table is the answer), 1 when none does.
    """
    if request.compare_full and cfg.lora is None:
        raise ConfigError("--compare-full: the run has no [lora] section, it is full fine-tuning already")
    split = cfg.training.sequence_parallel_size
    if request.gpus is not None and request.gpus % split:
        raise ConfigError(
            f"--gpus {request.gpus}: not a multiple of training.sequence_parallel_size = {split} (each pack is "
            "split over a group of that many GPUs)"
        )
    datasets.disable_progress_bars()
    ranks = Ranks(say)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a launcher stopping us: end the step too
    vocab_size = len(load_tokenizer(cfg))
    per_rank = cfg.training.args.get("per_device_train_batch_size", _default_batch_size())
    groups = max(ranks.world // split, 1)  # a world that does not split is refused by the steps themselves
    entries: list[dict[str, Any]] = []
    holder = f"group of {split} ranks (each pack split over the group)" if split > 1 else "rank"
    ranks.say(
        f"probe of {request.config}: {ranks.world} rank(s), {per_rank} pack(s) of each length per {holder} and step"
    )
    mc = cfg.model
    note = mc.model_name_or_path and layout_note(
        mc.model_name_or_path, trust_remote_code=mc.trust_remote_code, save_format=mc.save_format
    )
    if note:
        ranks.say(f"model: {note}")
    if mc.config_overrides:
        ranks.say(f"model config_overrides: {overrides_note(cfg)}")
    # No synthetic sample longer than the model's window, which the run would refuse.
    window = getattr(model_config(cfg).get_text_config(), "max_position_embeddings", None)
    compare = request.compare_full
    cpu = cfg.training.args.get("use_cpu") or not torch.cuda.is_available()
    ranks.say(format_row(None, compare_full=compare))
    full_fits = compare  # full fine-tuning is run until its first failure
    # The steps' files live next to the report: a killed probe's are removed by the next one there.
    with staging_dir(request.output.resolve().parent, request.output.name) as tmp:
        for length in request.lengths:
            pack = synthetic_pack(length, vocab_size=vocab_size, seed=request.seed, longest=window)
            work = Path(tmp) / format_length(length)
            datasets.Dataset.from_list([pack] * (per_rank * groups)).save_to_disk(str(work / "packs"))
            result = _run_length(request, length, work, ranks, cpu=cpu)
            entry = combine_ranks(length, ranks.gather(result), max_memory=request.max_memory)
            entry.update(samples_per_pack=len(pack["seq_lens"]), packs_per_rank=per_rank)
            if full_fits and entry["status"] == FITS:
                result = _run_length(request, length, work, ranks, full=True, cpu=cpu)
                entry["full"] = combine_ranks(length, ranks.gather(result), max_memory=request.max_memory)
                full_fits = entry["full"]["status"] == FITS
            entry["growth_per_token"] = growth(entries[-1] if entries else None, entry, split)
            entries.append(entry)
            ranks.say(format_row(entry, compare_full=compare))
            if entry["status"] != FITS:
                break
    for length in request.lengths[len(entries) :]:
        ranks.say(format_row(length, compare_full=compare))
    if ranks.rank == 0:
        _report(request, cfg, entries, ranks.world, vocab_size=vocab_size, say=say)
    return 0 if entries[0]["status"] == FITS else 1


def _report(
    request: ProbeRequest,
    cfg: Config,
    entries: list[dict[str, Any]],
    world: int,
    *,
    vocab_size: int,
    say: Callable[[str], None],
) -> None:
    """Rank 0: the headline, the failure with its advice, and the JSON report."""
    say("")
    say(headline(entries))
    last = entries[-1]
    advice = []
    if last["status"] == OUT_OF_MEMORY:
        on_gpu = torch.cuda.is_available() and not cfg.training.args.get("use_cpu")
        advice = suggestions(
            cfg, device_type="cuda" if on_gpu else "cpu", vocab_size=vocab_size, environ=os.environ
        )
        say("what would raise the limit:")
        say("\n".join(f"  {i}. {line}" for i, line in enumerate(advice, 1)))
    if last.get("traceback") and request.trace:
        say(last["traceback"].rstrip("\n"))
    elif last.get("traceback"):
        say(f"(traceback in {request.output}; --trace prints it)")
    planned = []
    if request.plan:
        gpus = request.gpus or world
        memory = request.gpu_memory or request.max_memory
        if memory is None and torch.cuda.is_available() and not cfg.training.args.get("use_cpu"):
            memory = torch.cuda.get_device_properties(0).total_memory
        planned = plan(
            entries,
            list(request.plan),
            how=sharding(cfg, os.environ),
            measured_gpus=world,
            gpus=gpus,
            sequence_parallel_size=cfg.training.sequence_parallel_size,
            gpu_memory=memory,
        )
        say("")
        say(format_plan(planned, gpus=gpus, gpu_memory=memory))
    summary = {
        "config": str(request.config),
        "overrides": [redact_override(item) for item in request.overrides],
        "lengths": request.lengths,
        "packs_per_rank": entries[0]["packs_per_rank"],
        "world_size": world,
        "sequence_parallel_size": cfg.training.sequence_parallel_size,
        "max_memory": request.max_memory,
        "largest_fitting_length": max((e["length"] for e in entries if e["status"] == FITS), default=None),
        "suggestions": advice,
        "compare_full": request.compare_full,
        "table": format_table(entries, request.lengths, compare_full=request.compare_full),
        "results": entries,
        "plan": planned,
    }
    request.output.parent.mkdir(parents=True, exist_ok=True)
    write_json(request.output, summary)
    say(f"wrote {request.output}")


def _run_length(
    request: ProbeRequest, length: int, work: Path, ranks: Ranks, *, full: bool = False, cpu: bool = False
) -> dict[str, Any]:
    """This rank's step at ``length`` in a fresh process (``full``: without ``[lora]``; ``cpu``: the run
    trains on the CPU, see :data:`CPU_ALLOCATOR`); its result, or why it has none."""
    variant = "-full" if full else ""
    result_path, log_path = work / f"result{variant}.json", work / f"step{variant}.log"
    command = [
        sys.executable, "-m", "longalign.probe_step", "--config", str(request.config),
        "--length", str(length), "--packs", str(work / "packs"), "--result", str(result_path),
        *(["--max-memory", str(request.max_memory)] if request.max_memory else []),
        *(["--full-finetune"] if full else []), *request.overrides,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        env = ranks.step_env()
        if cpu:
            env = {**CPU_ALLOCATOR, **env}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            stopped = ranks.wait(process, f"{length}{variant}")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif stopped:
        result = {"status": STOPPED, "error": "ended because another rank failed"}
    else:
        code = process.returncode
        why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        oom = code == -signal.SIGKILL  # what the kernel's out-of-memory killer sends
        result = {
            "status": OUT_OF_MEMORY if oom else ERROR,
            "error": f"the step's process was {why}"
            + (" (the kernel's out-of-memory killer?)" if oom else ""),
            "traceback": log_path.read_text(errors="replace")[-4000:],
        }
    if result["status"] not in (FITS, STOPPED):
        ranks.flag_failure(f"{length}{variant}")
    return {"rank": ranks.rank, **result}


class Ranks:
    """The probe's own processes, one per rank under ``accelerate launch`` (just this one otherwise).

    Each is the parent of its rank's step processes. Per length, the step processes form a process
    group of their own on a fresh port; when one rank's step fails, the others' steps (possibly waiting
    in a collective for it) are ended, through a key-value store the parents share.
    """

    def __init__(self, say: Callable[[str], None]) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self._say = say
        self.store: dist.TCPStore | None = None
        if self.world > 1:
            dist.init_process_group("gloo")
            host = os.environ["MASTER_ADDR"]
            if self.rank == 0:
                self.store = dist.TCPStore(host, 0, self.world, True, wait_for_workers=False)
            port = [self.store.port if self.store else None]
            dist.broadcast_object_list(port, src=0)
            if self.rank != 0:
                self.store = dist.TCPStore(host, port[0], self.world, False)

    def say(self, line: str) -> None:
        if self.rank == 0:
            self._say(line)

    def step_env(self) -> dict[str, str]:
        """The step's environment: under a launcher, a fresh rendezvous that rank 0's step hosts."""
        env = dict(os.environ)
        if "MASTER_ADDR" in env:
            port = [_free_port() if self.rank == 0 else None]
            if self.world > 1:
                dist.broadcast_object_list(port, src=0)
            # Not the launcher's store: each length's steps form a process group of their own.
            env.update(MASTER_PORT=str(port[0]), TORCHELASTIC_USE_AGENT_STORE="False")
        return env

    def wait(self, process: subprocess.Popen, step: str) -> bool:
        """Wait for the step to end; ``True`` when it was ended because another rank failed it."""
        while process.poll() is None:
            if self.store is not None and self.store.check([f"failed/{step}"]):
                return True
            time.sleep(0.2)
        return False

    def flag_failure(self, step: str) -> None:
        if self.store is not None:
            self.store.set(f"failed/{step}", str(self.rank))

    def gather(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        if self.world == 1:
            return [result]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, result)
        return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
