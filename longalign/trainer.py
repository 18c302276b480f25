"""LongAlignTrainer: a ``transformers.Trainer`` that trains on packs with an exactly normalised weighted loss.

One optimizer step sees G = gradient_accumulation_steps micro-batches on each of W ranks. Before the first
backward of the step, the trainer sums the loss weights of all G x W micro-batches into the step's
denominator D (sum of N_i for ``token_level``, the number of samples M for ``sequence_level``; see
``longalign.data``). Each micro-batch then backpropagates ``S_local / D * W``, where ``S_local`` is its
weighted loss sum: DDP, FSDP and DeepSpeed average gradients over ranks, so the step's gradient is the
gradient of ``sum(S) / D`` however the samples were split into packs, micro-batches and ranks::

    step with G = 2, W = 2                 rank 0            rank 1
      micro-batch 1                        S=3.0 (w 2)       S=1.0 (w 1)
      micro-batch 2                        S=2.0 (w 1)       S=0.5 (w 1)
      D = 2 + 1 + 1 + 1 = 5;  loss = (3 + 2 + 1 + 0.5) / 5, exactly, whatever the split

``build_trainer(cfg)`` makes the whole run from a :class:`longalign.config.Config` (model, packs, trainer);
``train.py``, ``scripts/probe_memory.py`` and ``scripts/preflight.py`` all start from it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
import transformers
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

import longalign.patch
from longalign.artifacts import load_stage
from longalign.config import Config, ConfigError
from longalign.data import PackCollator
from longalign.loss import weighted_loss_sum
from longalign.packing import write_packs


def pack_costs(packs) -> np.ndarray:
    """Attention cost of every pack row, ``sum(l_i ** 2)`` over its samples (what varlen attention pays)."""
    seq_lens = packs.data.column("seq_lens").combine_chunks()
    lengths = pc.list_flatten(seq_lens).to_numpy().astype(np.float64)
    parents = pc.list_parent_indices(seq_lens).to_numpy()
    return np.bincount(parents, weights=lengths**2, minlength=len(packs))


class PackBatchSampler:
    """Micro-batches of pack indices for one rank: seeded reshuffle per epoch, ranks balanced by cost.

    Each global micro-step takes the next ``packs_per_batch * num_replicas`` packs of the epoch's order
    and deals them to ranks largest-cost first, each to the least-loaded rank with room, so ranks wait
    less for the slowest. Every rank gets the same number of micro-batches: where the last step has too
    few packs, a rank gets a copy of a pack with ``active=False``, which the trainer weighs 0 (it keeps
    the collectives in step and adds nothing to the loss)::

        costs [9, 1, 4, 4], 2 ranks x 1 pack:  step 1 -> rank 0 gets 9, rank 1 gets 4 ...
        yields [(pack_index, active), ...] per micro-batch
    """

    def __init__(
        self,
        costs: Sequence[float] | np.ndarray,
        *,
        packs_per_batch: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(costs) == 0:
            raise ValueError("PackBatchSampler: no packs")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"PackBatchSampler: rank {rank} outside 0..{num_replicas - 1}")
        self.costs = np.asarray(costs, dtype=np.float64)
        self.packs_per_batch = packs_per_batch
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.costs) // (self.packs_per_batch * self.num_replicas))

    def __iter__(self) -> Iterator[list[tuple[int, bool]]]:
        n = len(self.costs)
        order = (
            np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        )
        group = self.packs_per_batch * self.num_replicas
        for start in range(0, n, group):
            yield self._deal(order[start : start + group])[self.rank]

    def _deal(self, packs: np.ndarray) -> list[list[tuple[int, bool]]]:
        by_cost = sorted(packs.tolist(), key=lambda i: (-self.costs[i], i))
        ranks: list[list[tuple[int, bool]]] = [[] for _ in range(self.num_replicas)]
        load = [0.0] * self.num_replicas
        for index in by_cost:
            open_ranks = [r for r in range(self.num_replicas) if len(ranks[r]) < self.packs_per_batch]
            target = min(open_ranks, key=lambda r: (load[r], r))
            ranks[target].append((index, True))
            load[target] += self.costs[index]
        for assigned in ranks:
            if not assigned:
                assigned.append((by_cost[-1], False))
        return ranks


class PackRows(Dataset):
    """Pack rows by ``(index, active)``; an inactive row keeps its tokens but has no targets."""

    def __init__(self, packs, ignore_index: int = -100) -> None:
        self.packs = packs.select_columns(["input_ids", "labels", "cu_seqlens"])
        self.ignore_index = ignore_index

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, key: tuple[int, bool]) -> dict[str, Any]:
        index, active = key
        row = self.packs[int(index)]
        if not active:
            row["labels"] = [self.ignore_index] * len(row["labels"])
        row["active"] = active
        return row


class PackDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches the pack sampler (Trainer calls it every epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class LongAlignTrainer(Trainer):
    """Trainer over pack rows with sequence- or token-level weighting normalised over the whole step.

    ``train_dataset`` / ``eval_dataset`` are pack datasets (columns ``input_ids``, ``labels``,
    ``cu_seqlens``, ``seq_lens``). ``per_device_train_batch_size`` packs are concatenated into one varlen
    row. Logs per optimizer step: loss, learning rate, tokens/s, samples and packs per step, and the
    packing efficiency of the step (tokens / (packs x max_seq_len)).
    """

    # compute_loss returns S / D * W with D over the whole step: Trainer must not divide by G again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        weighting: str = "sequence_level",
        max_seq_len: int | None = None,
        loss_chunk_size: int = 4096,
        ignore_index: int = -100,
        pack_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("data_collator", PackCollator(weighting=weighting, ignore_index=ignore_index))
        super().__init__(*args, **kwargs)
        self.max_seq_len = max_seq_len
        self.loss_chunk_size = loss_chunk_size
        self.ignore_index = ignore_index
        self.pack_seed = pack_seed
        self._window = {"tokens": 0.0, "samples": 0.0, "packs": 0.0, "steps": 0, "start": 0.0}

    # --- data ------------------------------------------------------------------------------------------

    def _pack_loader(self, packs, *, batch_size: int, shuffle: bool) -> PackDataLoader:
        sampler = PackBatchSampler(
            pack_costs(packs),
            packs_per_batch=batch_size,
            num_replicas=self.accelerator.num_processes,
            rank=self.accelerator.process_index,
            seed=self.pack_seed,
            shuffle=shuffle,
        )
        rows = PackRows(packs, self.ignore_index)
        collate = self.data_collator

        def collate_with_count(batch: list[dict[str, Any]]) -> dict[str, Any]:
            out = collate(batch)
            out["num_packs"] = sum(row["active"] for row in batch)
            out["num_samples"] = sum(len(row["cu_seqlens"]) - 1 for row in batch if row["active"])
            return out

        # Not passed through accelerator.prepare: the sampler already shards by rank, and
        # Trainer moves each batch to the device itself.
        return PackDataLoader(
            rows,
            batch_sampler=sampler,
            collate_fn=collate_with_count,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("LongAlignTrainer: training needs a train_dataset of packs")
        return self._pack_loader(self.train_dataset, batch_size=self._train_batch_size, shuffle=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        packs = eval_dataset if eval_dataset is not None else self.eval_dataset
        if packs is None:
            raise ValueError("LongAlignTrainer: evaluation needs an eval_dataset of packs")
        return self._pack_loader(packs, batch_size=self.args.per_device_eval_batch_size, shuffle=False)

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
                sum(float(b["loss_weights"].double().sum()) for b in batches),
                sum(b["input_ids"].numel() for b in batches if b["num_packs"]),
                sum(b["num_samples"] for b in batches),
                sum(b["num_packs"] for b in batches),
            ],
            dtype=torch.float64,
            device=device,
        )
        totals = (
            self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local
        )
        denominator, tokens, samples, packs = totals.tolist()
        self._window["tokens"] += tokens
        self._window["samples"] += samples
        self._window["packs"] += packs
        self._window["steps"] += 1
        return batches, torch.tensor(denominator, dtype=torch.float32, device=device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        total = weighted_loss_sum(
            model, inputs, chunk_size=self.loss_chunk_size, ignore_index=self.ignore_index
        )
        if num_items_in_batch is None:  # a lone micro-batch (e.g. a probe): normalise by itself
            num_items_in_batch = inputs["loss_weights"].sum()
        # D == 0 only when no sample of the step has a target: the loss and gradient are then 0.
        loss = total / num_items_in_batch.clamp(min=1e-12) * self.accelerator.num_processes
        return (loss, None) if return_outputs else loss

    # --- evaluation ------------------------------------------------------------------------------------

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Weighted eval loss over the whole eval set: sum(S) / sum(weights), the same whatever the packing."""
        loader = self.get_eval_dataloader(eval_dataset)
        model = self.model
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.args.device)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in loader:
                batch = self._prepare_inputs(batch)
                total = weighted_loss_sum(
                    model, batch, chunk_size=self.loss_chunk_size, ignore_index=self.ignore_index
                )
                sums += torch.stack(
                    [
                        total.double(),
                        batch["loss_weights"].double().sum(),
                        torch.tensor(batch["num_samples"]).double().to(sums.device),
                    ]
                )
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        loss_sum, weight_sum, samples = sums.tolist()
        metrics = {
            f"{metric_key_prefix}_loss": loss_sum / weight_sum if weight_sum else float("nan"),
            f"{metric_key_prefix}_samples": samples,
            f"{metric_key_prefix}_runtime": time.perf_counter() - start,
        }
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # --- logging ---------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        window = self._window
        if "loss" in logs and window["steps"]:
            elapsed = time.perf_counter() - window["start"]
            logs["tokens_per_second"] = round(window["tokens"] / elapsed, 1)
            logs["samples_per_step"] = window["samples"] / window["steps"]
            logs["packs_per_step"] = window["packs"] / window["steps"]
            if self.max_seq_len:
                logs["packing_efficiency"] = round(window["tokens"] / (window["packs"] * self.max_seq_len), 4)
            window.update(tokens=0.0, samples=0.0, packs=0.0, steps=0)
        super().log(logs, start_time)


# --- building a run from its config (train.py, the probe and the preflight share these) -------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(cfg: Config) -> torch.nn.Module:
    """The model of ``[model]`` (pretrained, or random from ``init_from_config``), patched for packed input."""
    mc = cfg.model
    if mc.init_from_config is not None:
        settings = dict(mc.init_from_config)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES.get(mc.torch_dtype, torch.float32))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            mc.model_name_or_path,
            dtype=DTYPES.get(mc.torch_dtype, "auto"),
            trust_remote_code=mc.trust_remote_code,
        )
    return longalign.patch.apply(model, backend=mc.backend)


def resolve_packs(path: str, cfg: Config, args: TrainingArguments):
    """Packs at ``path``: a packed directory as is, or a tokenized one packed once and cached."""
    dataset = load_stage(path)
    if "cu_seqlens" in dataset.column_names:
        return dataset
    if "length" not in dataset.column_names:
        raise ConfigError(
            f"{path}: neither a packed nor a pre-tokenized dataset (columns {dataset.column_names})"
        )
    packing = cfg.packing
    # packing = false: one sample per row, in shuffled order (a "sorted" batch of one).
    strategy = packing.strategy if packing.packing else "sorted"
    batch_size = packing.batch_size if packing.packing and strategy == "sorted" else 1
    settings = {
        "max_seq_len": cfg.data.max_seq_len,
        "strategy": strategy,
        "batch_size": batch_size,
        "seed": packing.seed,
        "drop_long": packing.drop_long,
    }
    source = Path(path)
    key = hashlib.sha256(
        json.dumps(
            [settings, (source / "state.json").read_text(), (source / "report.json").read_text()]
        ).encode()
    ).hexdigest()[:12]
    cache_root = Path(cfg.data.packed_cache_dir or Path(args.output_dir) / "packed")
    cache = cache_root / f"{source.resolve().name}-{key}"
    with args.main_process_first(desc=f"packing {path}"):
        if not cache.exists():
            write_packs(source, cache, **settings)
    return load_stage(cache)


def build_trainer(cfg: Config) -> LongAlignTrainer:
    """Everything a run sets up before ``train()``: arguments, tokenizer, model, packs, trainer."""
    args = TrainingArguments(
        output_dir=cfg.training.output_dir, remove_unused_columns=False, **cfg.training.args
    )
    if not cfg.data.train_file:
        raise ConfigError("data.train_file: set it to a packed or pre-tokenized dataset directory")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.model_name_or_path)
    transformers.set_seed(args.seed)
    model = load_model(cfg)
    train_packs = resolve_packs(cfg.data.train_file, cfg, args)
    eval_packs = resolve_packs(cfg.data.eval_file, cfg, args) if cfg.data.eval_file else None
    return LongAlignTrainer(
        model=model,
        args=args,
        train_dataset=train_packs,
        eval_dataset=eval_packs,
        processing_class=tokenizer,
        weighting=cfg.loss.weighting,
        max_seq_len=cfg.data.max_seq_len,
        loss_chunk_size=cfg.loss.chunk_size,
        ignore_index=cfg.loss.ignore_index,
        pack_seed=cfg.packing.seed,
    )
