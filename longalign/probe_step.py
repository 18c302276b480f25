"""One rung of the probe's length ladder, in a process of its own: two training steps at one length.

The probe (``longalign.probe``) starts it once per length and rank, so that each length's peak memory is
that process's alone and a crash or an out-of-memory kill ends only that step::

    python -m longalign.probe_step --config run.toml --length 16384 --packs WORK/packs \\
        --result WORK/result.json [--max-memory BYTES] [--full-finetune] [section.key=value ...]

It builds the run's own trainer on the synthetic packs, runs the steps (:func:`probe_overrides`), and
writes ``{"status": "fits" | "out of memory" | "error", ...}`` with what the steps cost to ``--result``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import Trainer, TrainerCallback

import longalign.patch.offload as offload
from longalign.artifacts import write_json
from longalign.config import Config, load_config
from longalign.run import build_trainer, parameter_sizes
from longalign.tensor_memory import CopiesToHost, LiveTensors

FITS = "fits"
OUT_OF_MEMORY = "out of memory"
ERROR = "error"


def probe_overrides(length: int, *, train_file: str | Path, output_dir: str | Path) -> list[str]:
    """Config overrides that turn the run into two optimizer steps on the synthetic packs at ``train_file``.

    The first step creates the optimizer states (Adam's two moments); only the second carries them
    through forward and backward, so its peak is the run's steady state, and its time is the one
    reported. Gradient accumulation is set to 1: later micro-batches of a step reuse the gradient
    buffers of the first, so a step's peak is that of one micro-batch plus the optimizer step.
    """
    return [
        f"data.train_file={json.dumps(str(train_file))}",
        "data.eval_file=''",
        f"data.max_seq_len={length}",
        f"training.output_dir={json.dumps(str(output_dir))}",
        "training.max_steps=2",
        "training.gradient_accumulation_steps=1",
        "training.save_strategy='no'",
        "training.eval_strategy='no'",
        "training.load_best_model_at_end=false",
        "training.logging_strategy='no'",
        "training.report_to='none'",
        "training.disable_tqdm=true",
    ]


class StepMeter(TrainerCallback):
    """Times the last optimizer step and notes the memory in use just before it starts.

    With ``count`` (CPU steps) it also counts the step's tensors (``longalign.tensor_memory.LiveTensors``,
    the counter the simulation counts its fake steps with): the weights, buffers and optimizer states held
    as the step begins, the batch as the step takes it, and every tensor the step allocates, with the
    offload's copies counted as host memory, as on a GPU.
    """

    def __init__(self, device: torch.device, *, count: bool = False) -> None:
        self.device = device
        self.count = count
        self.live: LiveTensors | None = None
        self.counting = False
        self.counted_steps: list[dict[str, int]] = []  # each step's tokens and counted peaks
        self.start = 0.0
        self.seconds: float | None = None
        self.start_bytes: int | None = None
        self._hooks = offload.host_memory_hooks

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.start_bytes = current_memory(self.device)
        if self.count:
            live = self.live = LiveTensors()
            live.__enter__()
            live.track(model.parameters(), "weights")
            live.track(model.buffers(), "weights")
            states = getattr(optimizer, "optimizer", optimizer).state.values()
            live.track(
                (t for s in states for t in s.values() if isinstance(t, torch.Tensor)), "optimizer states"
            )
            live.watch_gradients(model.parameters())
            offload.host_memory_hooks = lambda: CopiesToHost(live)
            self.counting = True
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
        if self.counting:
            self.counting = False
            self.live.__exit__(None, None, None)
            self.counted_steps[-1].update(
                peak_bytes=self.live.peak,
                activations_peak_bytes=self.live.part_peaks["activations"],
                host_bytes=self.live.host_peak,
            )
            offload.host_memory_hooks = self._hooks

    def counted(self, inputs: Any) -> None:
        """Count the batch's tensors as the step takes them (the trainer's ``_prepare_inputs``)."""
        if self.counting:
            self.live.track((t for t in inputs.values() if isinstance(t, torch.Tensor)), "activations")
            self.counted_steps.append({"tokens": inputs["input_ids"].shape[-1]})


def current_memory(device: torch.device) -> int | None:
    """Bytes in use now: CUDA tensors on ``device``, or this process's resident set (Linux) on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return None
    return int(statm.read_text().split()[1]) * resource.getpagesize()


def peak_memory(device: torch.device) -> int:
    """Peak bytes so far: CUDA ``max_memory_allocated`` on ``device``, or this process's peak RSS on CPU.

    On Linux the peak is ``VmHWM`` of ``/proc/self/status``, the high-water mark of this process's own
    memory. ``ru_maxrss`` is not: the kernel carries the parent's mark over the ``exec`` of a process
    started by ``vfork`` (as ``subprocess`` starts it), so a step started from a large process (a test
    session, a notebook) would read that process's size as its own peak.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def measure_steps(trainer: Trainer) -> dict[str, Any]:
    """Run ``trainer.train()`` (see :func:`probe_overrides`) and return what its steps cost on this rank.

    ``peak_bytes`` covers the whole process (model load included), ``step_start_bytes`` is what the
    last step starts with (weights, optimizer states), ``step_seconds`` is that step's time;
    ``tensor_peak_bytes`` (CPU) the counted peak of the last step's tensors, by part in
    ``tensor_peak_parts``, and ``host_tensor_peak_bytes`` the offloaded inputs it held in host memory
    (``counted_steps``: every step's tokens and counted peaks);
    ``model_sizes`` are the model's parameters as the engine left them (dtype, full sizes of ZeRO-3
    shards: ``longalign.run.parameter_sizes``), for the probe's plan.
    """
    device = trainer.args.device
    meter = StepMeter(device, count=device.type == "cpu")
    trainer.add_callback(meter)
    prepare = trainer._prepare_inputs

    def prepare_counted(inputs):
        prepared = prepare(inputs)
        meter.counted(prepared)
        return prepared

    trainer._prepare_inputs = prepare_counted
    trainer.train()
    measured = {
        "device": str(device),
        "peak_bytes": peak_memory(device),
        "step_start_bytes": meter.start_bytes,
        "step_seconds": meter.seconds,
        "model_sizes": parameter_sizes(trainer.model),
    }
    if meter.live is not None:
        measured.update(
            tensor_peak_bytes=meter.live.peak,
            tensor_peak_parts=meter.live.peak_parts,
            host_tensor_peak_bytes=meter.live.host_peak,
            counted_steps=meter.counted_steps,
        )
    if device.type == "cuda":
        measured["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return measured


def classify_failure(error: BaseException) -> str:
    """``"out of memory"`` for allocator failures (CUDA or CPU), else ``"error"``."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return OUT_OF_MEMORY
    text = str(error).lower()
    return OUT_OF_MEMORY if "out of memory" in text or "can't allocate memory" in text else ERROR


def step_config(
    config: Path, overrides: Sequence[str], length: int, packs: Path, *, full: bool = False
) -> Config:
    """The run file as the probe's steps train it: :func:`probe_overrides` applied, no ``[eval_tasks]``.

    Only the training steps are measured, so no task is scored next to them; ``full`` also drops
    ``[lora]`` (full fine-tuning of the same model).
    """
    steps = probe_overrides(length, train_file=packs, output_dir=packs.parent / "run")
    cfg = load_config(config, [*overrides, *steps])
    return dataclasses.replace(cfg, eval_tasks=None, lora=None if full else cfg.lora)


def run_step(
    config: Path,
    overrides: Sequence[str],
    length: int,
    packs: Path,
    result_path: Path,
    *,
    max_memory: int | None = None,
    full: bool = False,
) -> NoReturn:
    """The steps at ``length`` tokens per pack, in the fresh process; writes the result and leaves at once.

    ``full`` runs the config without its ``[lora]`` section: full fine-tuning of the same model.
    """
    result: dict[str, Any] = {}
    try:
        if max_memory is not None and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, max_memory / total), device)
        trainer = build_trainer(step_config(config, overrides, length, packs, full=full))
        result = {"status": FITS, **measure_steps(trainer)}
    except Exception as err:  # any failure is the answer for this length, reported in one line
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        result = {
            "status": classify_failure(err),
            "error": f"{type(err).__name__}: {first_line[:300]}",
            "traceback": traceback.format_exc(),
        }
    write_json(result_path, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: after a failure, peers may hold collectives open forever.
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """``python -m longalign.probe_step ...``: parse the arguments the probe passes and run the step."""
    parser = argparse.ArgumentParser(prog="python -m longalign.probe_step", description=__doc__)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--length", type=int, required=True, help="tokens per pack")
    parser.add_argument("--packs", type=Path, required=True, help="the synthetic packs' dataset directory")
    parser.add_argument("--result", type=Path, required=True, help="where the step's result JSON goes")
    parser.add_argument("--max-memory", type=int, help="bytes the CUDA allocator may hand out")
    parser.add_argument("--full-finetune", action="store_true", help="run the config without [lora]")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    run_step(
        args.config,
        args.overrides,
        args.length,
        args.packs,
        args.result,
        max_memory=args.max_memory,
        full=args.full_finetune,
    )


if __name__ == "__main__":
    main()
