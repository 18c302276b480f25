"""One optimizer step of LongAlignTrainer with each pack split over ranks; writes what the step did.

Imported by tests/test_sequence_parallel.py for the one-process reference (sequence_parallel_size 1), and
run under ``accelerate launch`` for the split runs, every variant of a launch in one process:

    accelerate launch --multi_gpu --num_processes 2 tests/sequence_parallel_run.py OUT.pt SIZE ENGINE/VARIANT...

``ENGINE`` is ``ddp`` or ``zero<STAGE>`` (DeepSpeed ZeRO, e.g. ``zero3``); the DDP variants come first, since
a DeepSpeed trainer leaves its engine set up in the process. A variant is ``WEIGHTING``,
``WEIGHTING:adapters`` (LoRA adapters on the tiny model, ``ADAPTERS``), ``WEIGHTING:moe`` (the tiny
Qwen3-MoE with its router loss), ``WEIGHTING:window`` (a tiny Mistral whose sliding window is shorter than
every sample), or ``WEIGHTING:CONTROL`` with a control that breaks the split on purpose
(``CONTROLS``). For each, rank 0 writes, under ``ENGINE/VARIANT``,
the parameters after one plain SGD step (no clipping, no momentum, learning rate 1: the update is the
gradient the engine applied), the step's loss, the eval loss and the step's logged counts; and, under
``guard``, what registering the wrapped attention name again says.

A new case is a new ``:CASE`` word: give it a branch where :func:`one_step` builds the collator or the model.
The Ulysses layer is set up once per process for one attention name, so a case on another attention
backend needs a launch of its own.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import traceback
from collections.abc import Callable

import datasets
import torch
from conftest import TINY, pack_row, tiny_model, tiny_moe
from invariance_run import samples
from transformers import GptOssConfig, GptOssForCausalLM, TrainingArguments

import longalign.patch
from longalign.batching import PackCollator
from longalign.config import LoraConfig
from longalign.lora import add_adapters
from longalign.patch.sequence_parallel import SUFFIX
from longalign.run import close, release
from longalign.trainer import LongAlignTrainer

SAMPLES_PER_PACK = 2  # 4 packs of 13 to 23 tokens, all odd: the collator pads every one


class InShardShift(PackCollator):
    """Control: each rank shifts labels inside its own slice, so predictions across slices are lost."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        del batch["shift_labels"], batch["shift_loss_weights"]
        return batch


class WholePackWeights(PackCollator):
    """Control: every rank of a group counts the whole pack's weights in the step denominator."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        whole = PackCollator(weighting=self.weighting, pad_to_multiple_of=self.sequence_parallel_size)(rows)
        batch["loss_denominator"] = whole["loss_denominator"]
        return batch


CONTROLS = {"in_shard_shift": InShardShift, "whole_pack_weights": WholePackWeights}
# Adapters on every projection, and the norms trained whole: what trains is the adapters' B and the norms.
ADAPTERS = LoraConfig(r=4, alpha=8.0, trainable=["norms"])
WINDOW = 4  # tokens each query sees in the "window" case: fewer than any sample has


def model(size: int, case: str = "") -> torch.nn.Module:
    """The tiny model for ``case`` ("", "adapters", "moe", "sinks", "window" or "no_window": the same Mistral
    attending over whole samples), patched to split packs over ``size`` ranks. Every case has the tiny model's attention
    shape, so DeepSpeed's groups and wrapper, set up once per process, serve them all."""
    if case == "moe":
        return tiny_moe(dtype=torch.float32, sequence_parallel_size=size)
    if case == "sinks":  # gpt-oss: one sink logit per query head, which the exchange splits over the ranks
        config = GptOssConfig(
            **{
                **TINY,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "layer_types": ["full_attention"] * 2,
            }
        )
        torch.manual_seed(0)
        base = GptOssForCausalLM(config).float()
        with torch.no_grad():
            for layer in base.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, TINY["num_attention_heads"]))
        return longalign.patch.apply(base, backend="sdpa_segments", sequence_parallel_size=size)
    if case in ("window", "no_window"):
        window = WINDOW if case == "window" else None
        return tiny_model(
            "mistral", backend="sdpa_segments", sequence_parallel_size=size, sliding_window=window
        )
    base = tiny_model(backend="sdpa_segments", sequence_parallel_size=size)
    return add_adapters(base, ADAPTERS, base_model="tiny") if case == "adapters" else base


def packs() -> datasets.Dataset:
    items = samples()
    return datasets.Dataset.from_list(
        [pack_row(items[i : i + SAMPLES_PER_PACK]) for i in range(0, len(items), SAMPLES_PER_PACK)]
    )


def deepspeed_config(stage: int) -> dict:
    return {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # plain torch SGD, so the update is lr x the gradient
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }


def deepspeed_on_cpu() -> None:
    """The process state for DeepSpeed on CPU ranks: accelerate builds it only for a GPU-like device.

    With ``use_cpu`` (or the launcher's ``ACCELERATE_USE_CPU``) accelerate ignores DeepSpeed; without it,
    it finds no device backend and runs one process. Named here, the gloo backend gives DeepSpeed (its CPU accelerator) all the ranks. Built
    afresh for every trainer, as ``TrainingArguments`` does for DDP: an ``Accelerator`` takes its
    DeepSpeed plugin only on a fresh state.
    """
    from accelerate.state import AcceleratorState, PartialState

    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_USE_CPU="false")
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(cpu=False, backend="gloo")


def sgd_step_arguments(out: str, accumulation: int, zero_stage: int | None, **extra) -> TrainingArguments:
    """One optimizer step of plain SGD, learning rate 1, no clipping: the update is the applied gradient."""
    return TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=1,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        use_cpu=zero_stage is None,
        # DeepSpeed: the process state set up by deepspeed_on_cpu(), which accelerate would not build.
        accelerator_config={"use_configured_state": zero_stage is not None},
        report_to="none",
        save_strategy="no",
        logging_steps=1,  # the logged loss is the mean over ranks; unlogged, only rank 0's part
        remove_unused_columns=False,
        disable_tqdm=True,
        deepspeed=deepspeed_config(zero_stage) if zero_stage is not None else None,
        **extra,
    )


def one_step(variant: str, *, size: int = 1, zero_stage: int | None = None) -> dict:
    """Parameters after one step over all packs, the step's loss and the eval loss, for one variant."""
    weighting, _, control = variant.partition(":")
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    groups = world_size // size
    if zero_stage is not None:
        deepspeed_on_cpu()
    with tempfile.TemporaryDirectory() as out:
        # every pack in the one step
        args = sgd_step_arguments(out, len(packs()) // groups, zero_stage, activation_checkpointing=True)
        assert args.world_size == world_size  # and the process group is up, as the model's patch needs
        collator = None
        if control in CONTROLS:
            collator = CONTROLS[control](
                weighting=weighting, sequence_parallel_size=size, sequence_parallel_rank=rank % size
            )
        trainer = LongAlignTrainer(
            model=model(size, "" if control in CONTROLS else control),
            args=args,
            train_dataset=packs(),
            eval_dataset=packs(),
            weighting=weighting,
            max_seq_len=32,
            loss_chunk_size=7,
            sequence_parallel_size=size,
            data_collator=collator,
        )
        loss = trainer.train().training_loss
        assert trainer.is_deepspeed_enabled == (zero_stage is not None), "the launch picked another engine"
        eval_loss = trainer.evaluate()["eval_loss"]
        step = next(entry for entry in trainer.state.log_history if "loss" in entry)
        logged = {
            key: step[key]
            for key in ("samples_per_step", "packs_per_step", "packing_efficiency", "router_loss")
            if key in step
        }
        params = parameters(trainer.model, zero_stage)
        release(trainer)
    return {"params": params, "loss": loss, "eval_loss": eval_loss, "logged": logged}


def parameters(model: torch.nn.Module, zero_stage: int | None) -> dict[str, torch.Tensor]:
    """Every parameter, whole: ZeRO-3 holds a shard of each on every rank, gathered here."""
    if zero_stage != 3:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def engine_stage(engine: str) -> int | None:
    """``"ddp"`` -> None, ``"zero3"`` -> 3."""
    if engine == "ddp":
        return None
    assert engine.startswith("zero") and engine[4:].isdigit(), f"engine {engine!r}: use ddp or zero<STAGE>"
    return int(engine[4:])


def run_variants(step: Callable[..., dict], names: list[str]) -> dict[str, dict]:
    """``step(VARIANT, zero_stage=...)`` for every ``ENGINE/VARIANT`` in ``names``, in order, by that name.

    The DDP ones must come first: a DeepSpeed trainer leaves its engine set up in the process. A case that
    raises (on every rank alike) is kept as ``{"error": traceback}`` and the next one runs, so that each
    test reads its own cases' failure (:func:`outcome`), not the launch's.
    """
    results, deepspeed_ran = {}, False
    for name in names:
        engine, _, variant = name.partition("/")
        zero_stage = engine_stage(engine)
        assert not (deepspeed_ran and zero_stage is None), f"{name}: put the ddp variants first"
        deepspeed_ran |= zero_stage is not None
        try:
            results[name] = step(variant, zero_stage=zero_stage)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


def outcome(results: dict[str, dict], name: str) -> dict:
    """What case ``name`` of a launch wrote; its traceback as the failure if it raised."""
    assert "error" not in results[name], f"{name} failed in the launch:\n{results[name]['error'][-3000:]}"
    return results[name]


if __name__ == "__main__":
    path, size, *variants = sys.argv[1:]
    results = run_variants(functools.partial(one_step, size=int(size)), variants)
    try:
        longalign.patch.register(
            "sdpa_segments", name=longalign.patch.ATTENTION_NAMES["sdpa_segments"] + SUFFIX
        )
        results["guard"] = "registered again"
    except ValueError as err:
        results["guard"] = str(err)
    if torch.distributed.get_rank() == 0:
        torch.save(results, path)
    close()
