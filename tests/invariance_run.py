"""One optimizer step of LongAlignTrainer on a fixed global batch; writes the parameter gradient.

Imported by tests/test_invariance.py, and run under ``accelerate launch`` for the multi-rank cases, every
case in one launch:

    accelerate launch --multi_gpu --num_processes 2 tests/invariance_run.py OUT.pt SAMPLES_PER_PACK GA CASE...

A case is ``WEIGHTING`` (every weight trains), ``WEIGHTING:FAMILY`` (``llama``, ``glm4``: LoRA adapters,
:data:`ADAPTERS`, on that family's tiny model), or ``WEIGHTING:moe`` (the tiny Qwen3-MoE with its router
loss, every weight trained). Rank 0 writes the gradients of every case, by case.
"""

from __future__ import annotations

import sys
import tempfile

import datasets
import torch
from conftest import TINY, pack_row, tiny_model, tiny_moe
from transformers import Trainer, TrainerCallback, TrainingArguments

from longalign.batching import PackCollator
from longalign.config import LoraConfig
from longalign.lora import adapted_head
from longalign.loss import linear_head
from longalign.run import close, release
from longalign.trainer import LongAlignTrainer

VOCAB = TINY["vocab_size"]
# Adapters on every projection and on the head, with trained norms: every kind of trained part.
ADAPTERS = LoraConfig(
    r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"], trainable=["norms"]
)
# (length, prompt tokens): the prompt is not a target; the last sample has no target at all.
SAMPLES = [(9, 3), (4, 1), (17, 5), (6, 2), (12, 11), (3, 1), (14, 4), (5, 5)]


def samples() -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for length, prompt in SAMPLES:
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out


def packs(samples_per_pack: int) -> datasets.Dataset:
    items = samples()
    groups = [items[start : start + samples_per_pack] for start in range(0, len(items), samples_per_pack)]
    return datasets.Dataset.from_list([pack_row(group) for group in groups])


class GradientCapture(TrainerCallback):
    """Keeps a copy of every parameter gradient just before the (single) optimizer step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {
            name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad
        }


class StockCollator:
    """The same varlen batch, minus what the stock Trainer would pass on to the model as unknown keys."""

    def __init__(self) -> None:
        self.collate = PackCollator(weighting="token_level")

    def __call__(self, rows):
        batch = self.collate(rows)
        del batch["loss_weights"]
        return batch


def adapted_model(kind: str) -> torch.nn.Module:
    """The tiny model with :data:`ADAPTERS`, their B matrices random: at peft's zero, A's gradient is zero."""
    from longalign.lora import add_adapters

    model = add_adapters(tiny_model(kind, backend="sdpa_segments").double(), ADAPTERS, base_model="tiny")
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def one_step(
    weighting: str,
    samples_per_pack: int,
    accumulation: int,
    *,
    packs_per_batch: int = 1,
    stock: bool = False,
    lora: str | None = None,
    moe: bool = False,
    router_loss: bool = True,
) -> dict:
    """Gradients of the trained parameters in one optimizer step over all SAMPLES (split as asked across
    ranks); ``lora`` (a model family, e.g. "glm4") trains :data:`ADAPTERS` on that family's tiny model;
    ``moe`` trains the tiny Qwen3-MoE, with its router loss unless ``router_loss`` is False."""
    capture = GradientCapture()
    if moe:
        model = tiny_moe(output_router_logits=router_loss)
    else:
        model = adapted_model(lora) if lora else tiny_model(backend="sdpa_segments").double()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=packs_per_batch,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=1e-3,
            max_grad_norm=0.0,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            remove_unused_columns=False,
            disable_tqdm=True,
        )
        common = {
            # float64: a split that changes the gradient shows against rounding near 1e-16, on any CPU
            "model": model,
            "args": args,
            "train_dataset": packs(samples_per_pack),
            "callbacks": [capture],
        }
        if stock:
            trainer = Trainer(**common, data_collator=StockCollator())
        else:
            read_head = adapted_head if lora else linear_head
            trainer = LongAlignTrainer(**common, weighting=weighting, loss_chunk_size=7, read_head=read_head)
        trainer.train()
        release(trainer)  # the DDP wrapper, before the next case's trainer or the process group goes
    return capture.grads


if __name__ == "__main__":
    path, per_pack, accumulation, *cases = sys.argv[1:]
    grads = {}
    for case in cases:
        weighting, _, family = case.partition(":")
        moe = family == "moe"
        grads[case] = one_step(
            weighting, int(per_pack), int(accumulation), lora=None if moe else family or None, moe=moe
        )
    if int(torch.distributed.get_rank()) == 0:
        torch.save(grads, path)
    close()
