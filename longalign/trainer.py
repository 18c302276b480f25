"""LongAlignTrainer: a ``transformers.Trainer`` that trains on packs with an exactly normalised weighted loss.

One optimizer step sees G = gradient_accumulation_steps micro-batches on each of W ranks. Before the first
backward of the step, the trainer sums the loss denominators of all G x W micro-batches into the step's
denominator D (sum of N_i for ``token_level``, the number of samples M for ``sequence_level``; see
``longalign.batching``, which also defines two reference weightings). Each micro-batch then backpropagates
``S_local / D * W``, where ``S_local`` is its weighted loss sum: DDP, FSDP and DeepSpeed average gradients over ranks, so the step's gradient is the
gradient of ``sum(S) / D`` however the samples were split into packs, micro-batches and ranks::

    step with G = 2, W = 2                 rank 0            rank 1
      micro-batch 1                        S=3.0 (w 2)       S=1.0 (w 1)
      micro-batch 2                        S=2.0 (w 1)       S=0.5 (w 1)
      D = 2 + 1 + 1 + 1 = 5;  loss = (3 + 2 + 1 + 0.5) / 5, exactly, whatever the split

A mixture-of-experts model whose own loss adds a router (load-balancing) loss (``output_router_logits``
on) gets it per pack: the step's objective is ``sum(S) / D + coef * sum_p aux_p / P`` with P the packs of
the whole step, counted before it as D is (``longalign.loss.router_loss_sum``); each micro-batch adds
``coef * sum(aux_p of its packs) / P * W`` to its loss, and the logs carry the step's ``router_loss``
(``sum_p aux_p / P``) next to the loss, which includes it.

Under sequence parallelism (``sequence_parallel_size`` N > 1) every rank of a group of N holds a slice of
the same pack, and its ``S_local`` covers the targets its slice predicts. The slices' weights sum to the
pack's weight, so D, summed over all ranks, still counts every sample once, and the backward of
``S_local / D * W`` is unchanged: the all-reduce over all W ranks adds the slices' gradients up. Logged
samples, packs and tokens count each pack once (the sums over ranks divided by N). A router loss sums its
routing counts over the group, so each rank's part of a pack's ``aux_p`` adds up to the whole pack's.

Batches come from ``longalign.batching``; the loss from ``longalign.loss``. ``longalign.run`` builds the
trainer from a run file.

A checkpoint counts only once it is complete: after every rank has saved its part, the main process writes
``checkpoint-N/longalign_checkpoint.json`` (the run record: what decides the pack order and the loss), and
only then are old checkpoints rotated out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from longalign.artifacts import write_json
from longalign.batching import PackCollator, PackDataLoader, pack_loader
from longalign.errors import ConfigError
from longalign.loss import HeadReader, linear_head, loss_sums, weighted_loss_sum

CHECKPOINT_RECORD = "longalign_checkpoint.json"


class LongAlignTrainer(Trainer):
    """Trainer over pack rows with sequence- or token-level weighting normalised over the whole step.

    ``train_dataset`` / ``eval_dataset`` are pack datasets (columns ``input_ids``, ``labels``,
    ``cu_seqlens``, ``seq_lens``). ``per_device_train_batch_size`` packs are concatenated into one varlen
    row; with ``sequence_parallel_size`` N > 1 a group of N consecutive ranks shares that row, each rank
    holding one slice (the model must be patched for it: ``longalign.patch.apply``). Logs per optimizer
    step: loss, learning rate, tokens/s, samples and packs per step, and the packing efficiency of the
    step (tokens / (packs x max_seq_len)).
    """

    # compute_loss returns S / D * W with D over the whole step: Trainer must not divide by G again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        weighting: str = "sequence_level",
        longwriter_divisor: float = 30.0,
        max_seq_len: int | None = None,
        loss_chunk_size: int = 4096,
        read_head: HeadReader = linear_head,
        pack_seed: int = 0,
        pad_packs_to: int | None = None,
        sequence_parallel_size: int = 1,
        run_record: dict[str, Any] | None = None,
        save_layout: Callable[[torch.nn.Module, Path, Mapping[str, torch.Tensor] | None], None] | None = None,
        save_with_model: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        data_collator = kwargs.pop("data_collator", None)
        super().__init__(*args, **kwargs)
        # Built here, once the rank is known: it decides which slice of a shared pack this rank keeps.
        self.data_collator = data_collator or PackCollator(
            weighting=weighting,
            longwriter_divisor=longwriter_divisor,
            pad_packs_to=pad_packs_to,
            sequence_parallel_size=sequence_parallel_size,
            sequence_parallel_rank=self.args.process_index % sequence_parallel_size,
        )
        self.sequence_parallel_size = sequence_parallel_size
        self.max_seq_len = max_seq_len
        self.loss_chunk_size = loss_chunk_size
        self.read_head = read_head
        self.pack_seed = pack_seed
        self.run_record = run_record or {}
        self.save_layout = save_layout  # writes the final model in another layout (longalign.checkpoints)
        self.save_with_model = dict(save_with_model or {})  # JSON files next to every saved model or adapter
        self._checkpointing = False
        self._window = {"tokens": 0.0, "samples": 0.0, "packs": 0.0, "steps": 0, "start": 0.0}
        # P: the packs of the current optimizer step, over all its micro-batches and ranks (the router loss's)
        self._step_packs = 0.0
        self._router_window: torch.Tensor | None = None  # this rank's part of the window's sum_p aux_p / P

    # --- data ------------------------------------------------------------------------------------------

    def _pack_loader(self, packs, *, batch_size: int, shuffle: bool) -> PackDataLoader:
        # Not passed through accelerator.prepare: the sampler already shards by rank, and
        # Trainer moves each batch to the device itself.
        return pack_loader(
            packs,
            self.data_collator,
            batch_size=batch_size,
            num_replicas=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
            sequence_parallel_size=self.sequence_parallel_size,
            seed=self.pack_seed,
            shuffle=shuffle,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ConfigError("LongAlignTrainer: training needs a train_dataset of packs")
        return self._pack_loader(self.train_dataset, batch_size=self._train_batch_size, shuffle=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        packs = eval_dataset if eval_dataset is not None else self.eval_dataset
        if packs is None:
            raise ConfigError("LongAlignTrainer: evaluation needs an eval_dataset of packs")
        return self._pack_loader(packs, batch_size=self.args.per_device_eval_batch_size, shuffle=False)

    # --- checkpoints -----------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Save as transformers does; then mark the checkpoint complete; then rotate old ones out."""
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # rotating first could leave no complete checkpoint after a kill
        self._checkpointing = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
            self._checkpointing = False
        self.accelerator.wait_for_everyone()  # every rank's part (optimizer shards, RNG states) is written
        if not self.args.should_save:
            return
        run_dir = self._get_output_dir(trial=trial)
        record = {"complete": True, "step": self.state.global_step, **self.run_record}
        write_json(
            Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}" / CHECKPOINT_RECORD, record
        )
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save as transformers does, but the final model through ``save_layout`` when one is given.

        Checkpoints stay in transformers' layout: a resume loads them into the model as it is. Either way
        the ``save_with_model`` files are written next to it.
        """
        output = Path(output_dir or self.args.output_dir)
        if self.save_layout is None or self._checkpointing:
            super()._save(output_dir, state_dict)
        elif self.args.should_save:
            self.save_layout(
                self.accelerator.unwrap_model(self.model, keep_torch_compile=False), output, state_dict
            )
            torch.save(self.args, output / TRAINING_ARGS_NAME)
        if self.args.should_save:
            for name, content in self.save_with_model.items():
                write_json(output / name, content)

    # --- loss ------------------------------------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Fetch the step's micro-batches and return the step's global denominator D with them."""
        if self._window["steps"] == 0:  # a logging window starts with its first step, not at set-up
            self._window["start"] = time.perf_counter()
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        local = torch.tensor(
            [
                sum(b["loss_denominator"] for b in batches),
                sum(b["num_tokens"] for b in batches),
                sum(b["num_samples"] for b in batches),
                sum(b["num_packs"] for b in batches),
            ],
            dtype=torch.float64,
            device=device,
        )
        totals = (
            self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local
        )
        # Every rank of a group counts its pack's tokens, samples and packs: count each group once.
        totals[1:] /= self.sequence_parallel_size
        denominator, tokens, samples, packs = totals.tolist()
        self._window["tokens"] += tokens
        self._window["samples"] += samples
        self._window["packs"] += packs
        self._window["steps"] += 1
        self._step_packs = packs
        return batches, torch.tensor(denominator, dtype=torch.float32, device=device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        sums = loss_sums(
            model,
            inputs,
            chunk_size=self.loss_chunk_size,
            read_head=self.read_head,
            sequence_parallel_group=self._sequence_parallel_group(),
        )
        packs = self._step_packs
        if num_items_in_batch is None:  # a lone micro-batch (e.g. a probe): normalise by itself
            num_items_in_batch = torch.tensor(inputs["loss_denominator"], device=sums.tokens.device)
            packs = inputs.get("num_packs", 1)
        # D == 0 only when no sample of the step has a target: the loss and gradient are then 0.
        loss = sums.tokens / num_items_in_batch.clamp(min=1e-12) * self.accelerator.num_processes
        if sums.router is not None:
            router = sums.router / max(packs, 1)
            loss = loss + sums.router_coefficient * router * self.accelerator.num_processes
            if model.training:
                done = self._router_window if self._router_window is not None else 0.0
                self._router_window = done + router.detach().double()
        return (loss, None) if return_outputs else loss

    def _sequence_parallel_group(self) -> Any:
        """The ranks that share this rank's packs (DeepSpeed's group), or None without sequence parallelism."""
        if self.sequence_parallel_size == 1:
            return None
        from longalign.patch.sequence_parallel import group_of_this_rank

        return group_of_this_rank()

    # --- evaluation ------------------------------------------------------------------------------------

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Weighted eval loss over the whole eval set: sum(S) / sum(denominators); for the exact weightings
        the same whatever the packing."""
        loader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.args.device)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in loader:
                batch = self._prepare_inputs(batch)
                total = weighted_loss_sum(
                    model, batch, chunk_size=self.loss_chunk_size, read_head=self.read_head
                )
                sums += torch.stack(
                    [
                        total.double(),
                        torch.tensor(batch["loss_denominator"], dtype=torch.float64, device=sums.device),
                        torch.tensor(batch["num_samples"]).double().to(sums.device),
                    ]
                )
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        loss_sum, weight_sum, samples = sums.tolist()
        metrics = {
            f"{metric_key_prefix}_loss": loss_sum / weight_sum if weight_sum else float("nan"),
            f"{metric_key_prefix}_samples": samples / self.sequence_parallel_size,  # each group's once
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # --- logging ---------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        window = self._window
        if "loss" in logs and self._router_window is not None:  # every rank logs the loss: reduce here
            router = self._router_window
            if self.accelerator.num_processes > 1:
                router = self.accelerator.reduce(router, reduction="sum")
            logs["router_loss"] = float(router) / max(window["steps"], 1)
            self._router_window = None
        if "loss" in logs and window["steps"]:
            elapsed = time.perf_counter() - window["start"]
            logs["tokens_per_second"] = round(window["tokens"] / elapsed, 1)
            logs["samples_per_step"] = window["samples"] / window["steps"]
            logs["packs_per_step"] = window["packs"] / window["steps"]
            if self.max_seq_len:
                logs["packing_efficiency"] = round(window["tokens"] / (window["packs"] * self.max_seq_len), 4)
            window.update(tokens=0.0, samples=0.0, packs=0.0, steps=0)
        super().log(logs, start_time)
