"""Collate pack rows into model batches: one varlen row, per-sample positions and the loss weights.

The collator is where the loss weighting is decided. Every target token gets a weight, and the weights of
one optimizer step sum to the step's loss denominator D (sum_i N_i target tokens for ``token_level``, the
number M of samples with targets for ``sequence_level``), so the trainer can normalise exactly::

    pack row 0 = samples A (3 tokens), B (2 tokens); pack row 1 = sample C (3 tokens)

    input_ids       a0  a1  a2 | b0  b1 | c0  c1  c2
    labels in       -   a1  a2 | b0  b1 | -   c1  c2        (- = ignore_index)
    labels out      -   a1  a2 | -   b1 | -   c1  c2        first label of every sample masked
    position_ids    0   1   2  | 0   1  | 0   1   2
    cu_seq_lens     [0, 3, 5, 8]                            max_length 3
    loss_weights    token_level:     0  1  1 | 0  1 | 0  1  1      sum 5 = sum_i N_i
                    sequence_level:  0 .5 .5 | 0  1 | 0 .5 .5      sum 3 = M (samples with N_i > 0)

Labels are not shifted: ``labels[t]`` is predicted from position ``t - 1``. Masking the first label of each
sample means the last token of B never learns to predict c0, whatever the loss does with the shift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from longalign.config import WEIGHTINGS


def _check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting: {weighting!r} is not one of {', '.join(WEIGHTINGS)}")


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
    _check_weighting(weighting)
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

    Pack rows hold ``input_ids``, ``labels`` and ``cu_seqlens`` (other columns are ignored). Returns
    ``input_ids``, ``labels``, ``position_ids`` and ``loss_weights`` of shape ``[1, T]``,
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, equal) and ``max_length_q`` / ``max_length_k`` (int);
    see the module docstring for a worked example. ``loss_weights.sum()`` over all micro-batches and
    ranks of a step is the step's denominator D: sum_i N_i (``token_level``, exact) or M
    (``sequence_level``, up to float32 rounding of the 1 / N_i, about 1e-7 relative).
    """

    weighting: str = "sequence_level"
    ignore_index: int = -100

    def __post_init__(self) -> None:
        _check_weighting(self.weighting)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("PackCollator: got an empty list of pack rows")
        seq_lens = torch.cat([_seq_lens_of_pack(i, row) for i, row in enumerate(rows)])
        input_ids = torch.cat([torch.as_tensor(row["input_ids"], dtype=torch.long) for row in rows])
        labels = torch.cat([torch.as_tensor(row["labels"], dtype=torch.long) for row in rows])
        labels, weights = mask_and_weigh(labels, seq_lens, self.weighting, self.ignore_index)
        cu_seq_lens = torch.nn.functional.pad(torch.cumsum(seq_lens, 0), (1, 0)).to(torch.int32)
        starts = torch.repeat_interleave(cu_seq_lens[:-1].long(), seq_lens)
        position_ids = torch.arange(len(input_ids)) - starts
        max_length = int(seq_lens.max())
        return {
            "input_ids": input_ids[None],
            "labels": labels[None],
            "position_ids": position_ids[None],
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length,
            "max_length_k": max_length,
            "loss_weights": weights[None],
        }


def _seq_lens_of_pack(index: int, row: Mapping[str, Any]) -> torch.Tensor:
    """Sample lengths from a pack row's ``cu_seqlens``, checked against its token count."""
    cu_seqlens = torch.as_tensor(row["cu_seqlens"], dtype=torch.long)
    num_tokens, num_labels = len(row["input_ids"]), len(row["labels"])
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != num_tokens or num_labels != num_tokens:
        raise ValueError(
            f"pack row {index}: cu_seqlens {cu_seqlens.tolist()} must run from 0 to the {num_tokens} "
            f"input_ids, and labels ({num_labels}) must match them"
        )
    seq_lens = torch.diff(cu_seqlens)
    if (seq_lens < 0).any():
        raise ValueError(f"pack row {index}: cu_seqlens {cu_seqlens.tolist()} is not non-decreasing")
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
        _check_weighting(self.weighting)

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
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
        }
