"""Batching: pack rows in, model batches out (the pack sampler, the pack-row dataset and the collators).

A pack row (``scripts/sort_and_group.py``) holds samples back to back with their ``cu_seqlens``. Each
micro-batch concatenates ``per_device_batch_size`` pack rows into one varlen row with per-sample
positions and the loss weights. The collator is where the loss weighting is decided: every target token
gets a weight, and the weights of one optimizer step sum to the step's loss denominator D (sum_i N_i
target tokens for ``token_level``, the number M of samples with targets for ``sequence_level``), so the
trainer can normalise exactly::

    pack row 0 = samples A (3 tokens), B (2 tokens); pack row 1 = sample C (3 tokens)

    input_ids       a0  a1  a2 | b0  b1 | c0  c1  c2
    labels in       -   a1  a2 | b0  b1 | -   c1  c2        (- = ignore_index)
    labels out      -   a1  a2 | -   b1 | -   c1  c2        first label of every sample masked
    position_ids    0   1   2  | 0   1  | 0   1   2
    cu_seq_lens     [0, 3, 5, 8]                            max_length 3
    loss_weights    token_level:     0  1  1 | 0  1 | 0  1  1      sum 5 = sum_i N_i
                    sequence_level:  0 .5 .5 | 0  1 | 0 .5 .5      sum 3 = M (samples with N_i > 0)
    pack_ids        0   0   0  | 0   0  | 1   1   1                 (-1 for filler; the router loss is per pack)

Labels are not shifted: ``labels[t]`` is predicted from position ``t - 1``. Masking the first label of each
sample means the last token of B never learns to predict c0, whatever the loss does with the shift.

Under sequence parallelism a pack is split over ``sequence_parallel_size`` consecutive ranks (a group):
every rank of a group collates the same pack and keeps its own slice (:func:`shard_batch`).

Which packs a group gets is decided by :class:`PackBatchSampler` (seeded, balanced by attention cost);
:func:`pack_loader` puts sampler, :class:`PackRows` and :class:`PackCollator` together.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset

from longalign.config import EXACT_WEIGHTINGS, WEIGHTINGS
from longalign.errors import ConfigError, InputError


def _check_weighting(weighting: str, allowed: tuple[str, ...] = WEIGHTINGS) -> None:
    if weighting not in allowed:
        raise ConfigError(f"weighting: {weighting!r} is not one of {', '.join(allowed)}")


def mask_and_weigh(
    labels: torch.Tensor, seq_lens: torch.Tensor, weighting: str, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask the first label of every sample and return ``(labels, loss_weights)`` for a flat row.

    ``labels`` is 1D and covers the samples of ``seq_lens`` back to back. N_i counts the targets of
    sample i after the masking; ``token_level`` gives each target weight 1, ``sequence_level`` gives it
    1 / N_i. Non-targets weigh 0, so a sample with no targets adds nothing::

        seq_lens [3, 2, 1], labels [-, 7, 8, 5, 6, 9]
        -> labels [-, 7, 8, -, 6, -], sequence_level weights [0, .5, .5, 0, 1, 0]  (sum 2 = M)
    """
    _check_weighting(weighting, EXACT_WEIGHTINGS)
    labels = labels.clone()
    starts = torch.cumsum(seq_lens, 0) - seq_lens
    labels[starts[seq_lens > 0]] = ignore_index
    is_target = labels != ignore_index
    weights = is_target.float()
    if weighting == "sequence_level":
        sample_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens)
        num_targets = torch.bincount(sample_of_token[is_target], minlength=len(seq_lens))
        weights /= num_targets.clamp(min=1)[sample_of_token]
    return labels, weights


@dataclass(frozen=True)
class PackCollator:
    """Concatenate pack rows (``per_device_batch_size`` of them) into one varlen batch row.

    Pack rows hold ``input_ids``, ``labels`` and ``cu_seqlens`` (other columns are ignored), and may say
    ``active: False``: a filler row (see :class:`PackBatchSampler`) whose tokens run but whose labels are
    all masked, so it weighs nothing. Returns ``input_ids``, ``labels``, ``position_ids`` and
    ``loss_weights`` of shape ``[1, T]``, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, equal),
    ``max_length_q`` / ``max_length_k`` (int), ``loss_denominator`` (float: this micro-batch's share of
    the step's denominator D), the counts ``num_packs`` / ``num_samples`` / ``num_tokens`` of the active
    rows (own tokens, no filler), and ``pack_ids [1, T]``: which active row each token belongs to, 0 ..
    ``num_packs`` - 1, and -1 for filler tokens and inactive rows; see the module docstring for a worked
    example. The step's loss is
    sum(w * CE) / sum(loss_denominator) over all micro-batches and ranks of the step. Per weighting, with
    N_i the targets of sample i:

    - ``token_level``: w = 1, denominator = sum of w: the step's mean over target tokens (exact).
    - ``sequence_level``: w = 1 / N_i, denominator = sum of w = M, the samples with targets: the mean over
      samples of each sample's mean (exact, up to float32 rounding of the 1 / N_i, about 1e-7 relative).
    - ``pack_token_mean`` (reference): w = 1 / (targets of the micro-batch), denominator 1 per micro-batch
      with targets: each micro-batch's token mean over its packs, averaged over micro-batches and ranks,
      which is "packing without loss weighting" as released code computes it.
    - ``longwriter`` (reference): in pack p with n_p samples and N_p targets, w = n_p / (divisor * N_p),
      denominator 1 per pack with targets: each pack's token mean times its sample count divided by a
      constant, averaged over packs, as LongWriter's released objective computes it (divisor 30).

    The references depend on how samples are split into packs and micro-batches; the exact two do not.

    Filler segments pad a row where a fixed shape is needed: each has its own entry in ``cu_seq_lens``
    (so it attends only to itself), labels ``ignore_index`` and weight 0. ``pad_packs_to`` pads every
    pack row to that many tokens, so every micro-batch has the same shape, and ``pad_to_multiple_of``
    pads the whole row to a multiple of that many tokens::

        pad_packs_to 8, row [a0 a1 a2 | b0 b1]  ->  [a0 a1 a2 | b0 b1 | f f f],  cu_seq_lens [0, 3, 5, 8]

    With ``sequence_parallel_size = N > 1`` the row is padded to a multiple of N as well and the batch is
    this rank's slice of it (:func:`shard_batch`; exact weightings only).
    """

    weighting: str = "sequence_level"
    ignore_index: int = -100
    longwriter_divisor: float = 30.0
    pad_packs_to: int | None = None  # pad every pack row to this many tokens (static shapes)
    pad_to_multiple_of: int = 1  # pad the whole row with one filler segment to a multiple of this
    pad_token_id: int = 0  # the filler's tokens: any id works, the filler attends only to itself
    sequence_parallel_size: int = 1  # ranks a pack is split over; > 1 returns one slice of the row
    sequence_parallel_rank: int = 0  # which slice: the rank's place in its group, 0 .. size - 1

    def __post_init__(self) -> None:
        _check_weighting(self.weighting)
        if self.pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of: must be >= 1, got {self.pad_to_multiple_of}")
        if not 0 <= self.sequence_parallel_rank < self.sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_rank {self.sequence_parallel_rank} outside 0..{self.sequence_parallel_size - 1}"
            )

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("PackCollator: got an empty list of pack rows")
        per_row = [_seq_lens_of_pack(i, row) for i, row in enumerate(rows)]
        active = [bool(row.get("active", True)) for row in rows]
        ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
        labels = [
            torch.as_tensor(row["labels"], dtype=torch.long)
            if on
            else torch.full_like(row_ids, self.ignore_index)
            for row, row_ids, on in zip(rows, ids, active, strict=True)
        ]
        num_tokens = sum(len(row_ids) for row_ids, on in zip(ids, active, strict=True) if on)
        num_samples = [len(lens) for lens in per_row]
        own_lengths = [len(row_ids) for row_ids in ids]
        if self.pad_packs_to is not None:
            ids, labels, per_row = self._pad(ids, labels, per_row)
        seq_lens = torch.cat(per_row)
        input_ids, labels = torch.cat(ids), torch.cat(labels)
        pack_ids = _pack_ids([len(row_ids) for row_ids in ids], own_lengths, active)
        # One filler at the end: to the multiple asked, and to equal slices for the ranks of a group.
        filler = -len(input_ids) % math.lcm(self.pad_to_multiple_of, self.sequence_parallel_size)
        if filler:
            seq_lens = torch.cat([seq_lens, torch.tensor([filler])])
            input_ids = torch.cat([input_ids, torch.full((filler,), self.pad_token_id)])
            labels = torch.cat([labels, torch.full((filler,), self.ignore_index)])
            pack_ids = torch.cat([pack_ids, torch.full((filler,), -1)])
        exact = self.weighting in EXACT_WEIGHTINGS
        labels, weights = mask_and_weigh(
            labels, seq_lens, self.weighting if exact else "token_level", self.ignore_index
        )
        denominator = float(weights.double().sum())
        if self.weighting == "pack_token_mean" and denominator:
            weights, denominator = weights / denominator, 1.0
        elif self.weighting == "longwriter":
            row_tokens = [len(row_ids) for row_ids in ids] + [len(input_ids) - sum(map(len, ids))]
            weights, denominator = _longwriter_weights(
                weights, row_tokens, [*num_samples, 0], self.longwriter_divisor
            )
        cu_seq_lens = torch.nn.functional.pad(torch.cumsum(seq_lens, 0), (1, 0)).to(torch.int32)
        starts = torch.repeat_interleave(cu_seq_lens[:-1].long(), seq_lens)
        position_ids = torch.arange(len(input_ids)) - starts
        max_length = int(seq_lens.max())
        batch = {
            "input_ids": input_ids[None],
            "labels": labels[None],
            "position_ids": position_ids[None],
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length,
            "max_length_k": max_length,
            "loss_weights": weights[None],
            "pack_ids": pack_ids[None],
            "loss_denominator": denominator,
            "num_tokens": num_tokens,
            "num_packs": sum(active),
            "num_samples": sum(n for n, on in zip(num_samples, active, strict=True) if on),
        }
        if self.sequence_parallel_size == 1:
            return batch
        return shard_batch(
            batch, self.sequence_parallel_size, self.sequence_parallel_rank, ignore_index=self.ignore_index
        )

    def _pad(
        self, ids: list[torch.Tensor], labels: list[torch.Tensor], per_row: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Every row padded to ``pad_packs_to`` tokens by a filler segment of its own (no targets)."""
        length = self.pad_packs_to
        padded: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
        for i, (row_ids, row_labels, lens) in enumerate(zip(ids, labels, per_row, strict=True)):
            missing = length - len(row_ids)
            if missing < 0:
                raise InputError(f"pack row {i}: {len(row_ids)} tokens do not fit the padded length {length}")
            filler = torch.full((missing,), self.pad_token_id)
            padded[0].append(torch.cat([row_ids, filler]))
            padded[1].append(torch.cat([row_labels, filler.fill_(self.ignore_index)]))
            padded[2].append(torch.cat([lens, torch.tensor([missing])]) if missing else lens)
        return padded


def _pack_ids(row_lengths: list[int], own_lengths: list[int], active: list[bool]) -> torch.Tensor:
    """Each token's pack: active rows numbered 0, 1, ... in order; padding and inactive rows -1.

    rows of 4, 3, 3 tokens (the first padded from 2), active [True, False, True] -> [0 0 -1 -1 -1 -1 -1 1 1 1]
    """
    pieces, number = [], 0
    for length, own, on in zip(row_lengths, own_lengths, active, strict=True):
        piece = torch.full((length,), -1)
        if on:
            piece[:own] = number
            number += 1
        pieces.append(piece)
    return torch.cat(pieces)


# Keys of a batch that run along its tokens: a shard keeps its slice of each.
_TOKEN_KEYS = ("input_ids", "labels", "position_ids", "loss_weights", "pack_ids")


def shard_batch(
    batch: Mapping[str, Any], size: int, rank: int, *, ignore_index: int = -100
) -> dict[str, Any]:
    """Slice ``rank`` of ``size`` of a whole-row batch, with the targets shifted over the whole row first.

    Each rank keeps ``T / size`` consecutive tokens (``T`` must be a multiple of ``size``: the collator
    pads). ``shift_labels`` / ``shift_loss_weights`` hold the label and weight each position predicts,
    taken before slicing, so the prediction that crosses a slice boundary is kept; ``labels`` /
    ``loss_weights`` are the slice of the unshifted ones (their sum over the ranks of a group is the
    pack's weight, what the step denominator counts). ``cu_seq_lens_q/k`` and ``max_length_q/k`` stay
    whole (attention sees the whole row); ``position_ids`` are the slice (DeepSpeed's Ulysses layer gathers
    them). Samples A (3 tokens) and B (4 tokens), padded with a 1-token filler F, over 2 ranks::

                        rank 0               rank 1
        input_ids       a0  a1  a2  b0   |   b1  b2  b3  f0
        labels          -   a1  a2  -    |   b1  b2  b3  -
        shift_labels    a1  a2  -   b1   |   b2  b3  -   -      b0 predicts b1, which sits on rank 1
        position_ids    0   1   2   0    |   1   2   3   0
        cu_seq_lens     [0, 3, 7, 8] on both ranks, max_length 4
    """
    length = batch["input_ids"].shape[-1]
    if length % size:
        raise ValueError(f"a row of {length} tokens does not split into {size} equal slices; pad it first")
    ignored = torch.full_like(batch["labels"][..., :1], ignore_index)
    shift_labels = torch.cat([batch["labels"][..., 1:], ignored], dim=-1)
    shift_weights = torch.nn.functional.pad(batch["loss_weights"][..., 1:], (0, 1))
    own = slice(rank * (length // size), (rank + 1) * (length // size))
    out = {**batch, **{key: batch[key][..., own] for key in _TOKEN_KEYS if key in batch}}
    out["shift_labels"] = shift_labels[..., own]
    out["shift_loss_weights"] = shift_weights[..., own]
    out["loss_denominator"] = float(out["loss_weights"].double().sum())  # the group's sum is the pack's
    return out


def _longwriter_weights(
    target_mask: torch.Tensor, row_tokens: list[int], row_samples: list[int], divisor: float
) -> tuple[torch.Tensor, float]:
    """Per-token weights n_p / (divisor * N_p) in each pack row p, and the number of rows with targets."""
    weighted, packs = [], 0
    for mask, samples in zip(target_mask.split(row_tokens), row_samples, strict=True):
        targets = float(mask.sum())
        weighted.append(mask * (samples / (divisor * targets)) if targets else mask)
        packs += targets > 0
    return torch.cat(weighted), float(packs)


def _seq_lens_of_pack(index: int, row: Mapping[str, Any]) -> torch.Tensor:
    """Sample lengths from a pack row's ``cu_seqlens``, checked against its token count."""
    cu_seqlens = torch.as_tensor(row["cu_seqlens"], dtype=torch.long)
    num_tokens, num_labels = len(row["input_ids"]), len(row["labels"])
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens or num_labels != num_tokens:
        raise InputError(
            f"pack row {index}: cu_seqlens {cu_seqlens.tolist()} must run from 0 to the {num_tokens} "
            f"input_ids, and labels ({num_labels}) must match them"
        )
    seq_lens = torch.diff(cu_seqlens)
    if (seq_lens < 0).any():
        raise InputError(f"pack row {index}: cu_seqlens {cu_seqlens.tolist()} is not non-decreasing")
    return seq_lens


@dataclass(frozen=True)
class PaddedCollator:
    """One sample per row, right-padded to the longest: the unpacked baseline, same labels and weights.

    Rows hold ``input_ids`` and ``labels`` of one sample (tokenized sample rows). Returns ``input_ids``,
    ``attention_mask``, ``labels`` and ``loss_weights`` of shape ``[B, Lmax]``; padding has label
    ``ignore_index`` and weight 0::

        samples [a0 a1 a2], [b0 b1]  ->  input_ids [[a0 a1 a2], [b0 b1 pad]]
                                         attention_mask [[1 1 1], [1 1 0]]
    """

    weighting: str = "sequence_level"
    ignore_index: int = -100
    pad_token_id: int = 0  # any id works: padded positions are masked out of attention and loss

    def __post_init__(self) -> None:
        _check_weighting(self.weighting, EXACT_WEIGHTINGS)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("PaddedCollator: got an empty list of sample rows")
        seq_lens = torch.tensor([len(row["input_ids"]) for row in rows])
        labels = torch.cat([torch.as_tensor(row["labels"], dtype=torch.long) for row in rows])
        if len(labels) != int(seq_lens.sum()):
            raise ValueError("PaddedCollator: every row needs as many labels as input_ids")
        labels, weights = mask_and_weigh(labels, seq_lens, self.weighting, self.ignore_index)
        lengths = seq_lens.tolist()
        pad = torch.nn.utils.rnn.pad_sequence
        input_ids = [torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows]
        return {
            "input_ids": pad(input_ids, batch_first=True, padding_value=self.pad_token_id),
            "attention_mask": pad([torch.ones(n, dtype=torch.long) for n in lengths], batch_first=True),
            "labels": pad(labels.split(lengths), batch_first=True, padding_value=self.ignore_index),
            "loss_weights": pad(weights.split(lengths), batch_first=True),
            "loss_denominator": float(weights.double().sum()),
        }


def packs_fingerprint(packs) -> str:
    """Row count and a hash of the ``cu_seqlens`` column of a pack dataset (whatever its int width).

    Two pack datasets with the same fingerprint hold the same samples in the same rows, as far as the
    sampler and the loss weights can tell.
    """
    column = packs.data.column("cu_seqlens").combine_chunks()
    digest = hashlib.sha256()
    for part in (pc.list_value_length(column), pc.list_flatten(column)):
        digest.update(part.to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
    return f"{len(packs):,} packs, cu_seqlens {digest.hexdigest()[:12]}"


def pack_costs(packs) -> np.ndarray:
    """Attention cost of every pack row, ``sum(l_i ** 2)`` over its samples (what varlen attention pays)."""
    seq_lens = packs.data.column("seq_lens").combine_chunks()
    lengths = pc.list_flatten(seq_lens).to_numpy().astype(np.float64)
    parents = pc.list_parent_indices(seq_lens).to_numpy()
    return np.bincount(parents, weights=lengths**2, minlength=len(packs))


class PackBatchSampler:
    """Micro-batches of pack indices for one rank: seeded reshuffle per epoch, ranks balanced by cost.

    Each global micro-step takes the next ``packs_per_batch * groups`` packs of the epoch's order and
    deals them to the groups largest-cost first, each to the least-loaded group with room, so ranks wait
    less for the slowest. A group is one rank, or under sequence parallelism ``sequence_parallel_size``
    consecutive ranks that share every pack (``groups = num_replicas / sequence_parallel_size``). Every
    group gets the same number of micro-batches: where the last step has too few packs, a group gets a
    copy of a pack with ``active=False``, which the collator weighs 0 (it keeps the collectives in step
    and adds nothing to the loss)::

        costs [9, 1, 4, 4], 2 ranks x 1 pack:  step 1 -> rank 0 gets 9, rank 1 gets 4 ...
        4 ranks, sequence_parallel_size 2:     step 1 -> ranks 0, 1 get 9; ranks 2, 3 get 4 ...
        yields [(pack_index, active), ...] per micro-batch
    """

    def __init__(
        self,
        costs: Sequence[float] | np.ndarray,
        *,
        packs_per_batch: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        sequence_parallel_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(costs) == 0:
            raise InputError("PackBatchSampler: no packs")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"PackBatchSampler: rank {rank} outside 0..{num_replicas - 1}")
        if num_replicas % sequence_parallel_size:
            raise ConfigError(
                f"PackBatchSampler: {num_replicas} ranks do not split into groups of {sequence_parallel_size}"
            )
        self.costs = np.asarray(costs, dtype=np.float64)
        self.packs_per_batch = packs_per_batch
        self.groups = num_replicas // sequence_parallel_size
        self.group = rank // sequence_parallel_size  # sequence-parallel groups are consecutive ranks
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.costs) // (self.packs_per_batch * self.groups))

    def __iter__(self) -> Iterator[list[tuple[int, bool]]]:
        n = len(self.costs)
        order = (
            np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        )
        step = self.packs_per_batch * self.groups
        for start in range(0, n, step):
            yield self._deal(order[start : start + step])[self.group]

    def _deal(self, packs: np.ndarray) -> list[list[tuple[int, bool]]]:
        by_cost = sorted(packs.tolist(), key=lambda i: (-self.costs[i], i))
        groups: list[list[tuple[int, bool]]] = [[] for _ in range(self.groups)]
        load = [0.0] * self.groups
        for index in by_cost:
            open_groups = [g for g in range(self.groups) if len(groups[g]) < self.packs_per_batch]
            target = min(open_groups, key=lambda g: (load[g], g))
            groups[target].append((index, True))
            load[target] += self.costs[index]
        for assigned in groups:
            if not assigned:
                assigned.append((by_cost[-1], False))
        return groups


class PackRows(Dataset):
    """Pack rows by ``(index, active)``, as :class:`PackBatchSampler` yields them; ``active`` rides along."""

    def __init__(self, packs) -> None:
        self.packs = packs.select_columns(["input_ids", "labels", "cu_seqlens"])

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, key: tuple[int, bool]) -> dict[str, Any]:
        index, active = key
        return {**self.packs[int(index)], "active": active}


class PackDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches the pack sampler (Trainer calls it every epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def pack_loader(
    packs,
    collator: PackCollator,
    *,
    batch_size: int,
    num_replicas: int = 1,
    rank: int = 0,
    sequence_parallel_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> PackDataLoader:
    """This rank's micro-batches over a pack dataset: ``batch_size`` packs each, balanced across groups.

    Under sequence parallelism the collator must cut this rank's slice (``PackCollator``'s
    ``sequence_parallel_size`` and ``sequence_parallel_rank``): the loader gives every rank of a group the
    same packs.
    """
    sampler = PackBatchSampler(
        pack_costs(packs),
        packs_per_batch=batch_size,
        num_replicas=num_replicas,
        rank=rank,
        sequence_parallel_size=sequence_parallel_size,
        seed=seed,
        shuffle=shuffle,
    )
    return PackDataLoader(
        PackRows(packs),
        batch_sampler=sampler,
        collate_fn=collator,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
