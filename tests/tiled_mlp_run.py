"""One optimizer step of LongAlignTrainer in float64 (float32 under ZeRO-3), MLPs or layers tiled or not; what it did.

Imported by tests/test_tiled_mlp.py, tests/test_offload.py and tests/test_attention_kernels.py for one
process, and run under ``accelerate launch`` for the multi-rank cases, every case of a launch in one process:

    accelerate launch --multi_gpu --num_processes 2 tests/tiled_mlp_run.py OUT.pt ENGINE/VARIANT...

``ENGINE`` is ``ddp`` or ``zero<STAGE>`` (DeepSpeed ZeRO), the DDP cases first (as in
``sequence_parallel_run.py``). A variant is a model family with switches, ``FAMILY[+tiled|+layer]
[+checkpointing][+offload][+adapters][+uneven][+split][+kv4][+bf16][+flash_attn|+torch_varlen]``: ``tiled`` runs
the MLPs in tiles of :data:`TILE_TOKENS` tokens, ``layer`` every token-wise part of the decoder layers
(``tile_layers``), ``checkpointing`` turns activation checkpointing on, ``offload`` keeps
its inputs in host memory, ``adapters`` trains LoRA adapters on every projection (:data:`ADAPTERS`),
``uneven`` trains on two packs of very different lengths, one per rank; ``split`` splits every pack over all
ranks (sequence parallelism); ``kv4`` gives the model 8 query and 4 key/value heads instead of 4 and 2, so
that each of 2 ranks of a split holds two key/value heads, over which a tiled layer's attention loops; ``bf16`` trains float32 weights in bf16 mixed precision (autocast) instead of
float64, and ``flash_attn`` / ``torch_varlen`` run that attention backend through its kernel's real Python
layer on CPU (``kernel_standins.py``; they need ``bf16``), ``sdpa_segments`` otherwise. For each case rank
0 writes, under ``ENGINE/VARIANT``, the update of one plain SGD step (learning rate 1, no clipping: the
gradient the engine applied) to every trained parameter, the step's loss, and the token count of every
call of the first layer's MLP on every rank.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

import datasets
import torch
from conftest import pack_row, tiny_model
from invariance_run import samples
from kernel_standins import STOOD_IN, kernels_on_cpu
from sequence_parallel_run import deepspeed_on_cpu, parameters, run_variants, sgd_step_arguments

import longalign.patch
from longalign.config import LoraConfig
from longalign.lora import add_adapters
from longalign.run import close, release
from longalign.trainer import LongAlignTrainer

TILE_TOKENS = 8  # 2 to 7 tiles per micro-batch of these packs (and of their halves), ending in a shorter one
# Adapters on every projection, the MLP's included; the norms train whole. No dropout: tiles draw their
# masks tile by tile, so a tiled step with dropout is a different draw, not a different gradient.
ADAPTERS = LoraConfig(r=4, alpha=8.0, trainable=["norms"])
SWITCHES = (
    "tiled",
    "layer",
    "checkpointing",
    "offload",
    "adapters",
    "uneven",
    "split",
    "kv4",
    "bf16",
    *STOOD_IN,
)


def parse(variant: str) -> tuple[str, set[str]]:
    """``"llama+tiled+adapters"`` -> ``("llama", {"tiled", "adapters"})``."""
    family, *switches = variant.split("+")
    unknown = set(switches) - set(SWITCHES)
    assert not unknown, f"unknown switches {sorted(unknown)}; use {', '.join(SWITCHES)}"
    return family, set(switches)


def packs(uneven: bool) -> datasets.Dataset:
    """Two packs of four samples (36 and 34 tokens); ``uneven``: one of six samples (51), one of one (14)."""
    items = samples()
    groups = [items[:6], items[6:7]] if uneven else [items[:4], items[4:]]
    return datasets.Dataset.from_list([pack_row(group) for group in groups])


def model(family: str, switches: set[str], size: int, *, float32: bool = False) -> torch.nn.Module:
    """The family's tiny model in float64 (float32 for ``bf16`` and ``float32``), patched as the variant says."""
    backend = next((STOOD_IN[name] for name in STOOD_IN if name in switches), "sdpa_segments")
    heads = dict(num_attention_heads=8, num_key_value_heads=4) if "kv4" in switches else {}
    base = tiny_model(family, backend=backend, sequence_parallel_size=size, **heads)
    base = base.float() if float32 or "bf16" in switches else base.double()
    if "tiled" in switches:
        longalign.patch.tile_mlp(base, tile_tokens=TILE_TOKENS)
    if "layer" in switches:
        longalign.patch.tile_layers(base, tile_tokens=TILE_TOKENS)
    if "offload" in switches:
        longalign.patch.offload_checkpointed_inputs(base)
    if "adapters" not in switches:
        return base
    adapted = add_adapters(base, ADAPTERS, base_model="tiny")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B random: at peft's zero, A's gradient would be zero
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.copy_(
                    torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype) * 0.1
                )
    return adapted


def one_step(variant: str, *, zero_stage: int | None = None) -> dict:
    """The update of one step over all packs, the step's loss, and the tokens of each MLP call."""
    family, switches = parse(variant)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    size = world_size if "split" in switches else 1
    data = packs("uneven" in switches)
    if zero_stage is not None:
        deepspeed_on_cpu()
    kernels = kernels_on_cpu(*(name for name in STOOD_IN if name in switches))
    with tempfile.TemporaryDirectory() as out, kernels:
        args = sgd_step_arguments(
            out,
            max(1, len(data) * size // world_size),  # every pack in the one step
            zero_stage,
            activation_checkpointing="checkpointing" in switches,
            # As the run sets it: DDP then checks that every parameter's gradient is reduced exactly once.
            ddp_find_unused_parameters=False,
            bf16="bf16" in switches,
        )
        # After the arguments, as the run loads its model: under ZeRO-3 the tiled MLPs become leaf modules.
        # DeepSpeed's ZeRO-3 (0.19.8) partitions float16, bfloat16 and float32 parameters only.
        trained = model(family, switches, size, float32=zero_stage == 3)
        start = {name: p.detach().clone() for name, p in trained.named_parameters() if p.requires_grad}
        tokens: list[int] = []
        hook = first_mlp(trained).register_forward_pre_hook(
            lambda module, args: tokens.append(args[0].shape[-2])
        )
        trainer = LongAlignTrainer(
            model=trained,
            args=args,
            train_dataset=data,
            weighting="sequence_level",
            max_seq_len=128,
            loss_chunk_size=7,
            sequence_parallel_size=size,
        )
        loss = trainer.train().training_loss
        assert trainer.is_deepspeed_enabled == (zero_stage is not None), "the launch picked another engine"
        hook.remove()
        params = parameters(trainer.model, zero_stage)
        release(trainer)
    update = {name: start[name] - params[name] for name in start}
    return {"update": update, "loss": loss, "mlp_tokens": gathered(tokens)}


@functools.cache
def reference_step(variant: str) -> dict:
    """``one_step(variant)``, run once per process: the untiled step that several tests compare with."""
    return one_step(variant)


def first_mlp(model: torch.nn.Module) -> torch.nn.Module:
    return next(module for name, module in model.named_modules() if name.endswith("layers.0.mlp"))


def gathered(values: list[int]) -> list[list[int]]:
    """``values`` of every rank, by rank (one rank: ``[values]``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [values]
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, values)
    return out


if __name__ == "__main__":
    path, *variants = sys.argv[1:]
    results = run_variants(one_step, variants)
    if torch.distributed.get_rank() == 0:
        torch.save(results, path)
    close()
