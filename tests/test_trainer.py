"""LongAlignTrainer pieces: the rank-aware pack sampler and packing-independent evaluation."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from invariance_run import packs, tiny_model
from transformers import TrainingArguments

from longalign.trainer import LongAlignTrainer, PackBatchSampler, pack_costs


def epoch(costs, ranks: int, per_batch: int, seed: int = 0, epoch_index: int = 0) -> list[list]:
    out = []
    for rank in range(ranks):
        sampler = PackBatchSampler(costs, packs_per_batch=per_batch, num_replicas=ranks, rank=rank, seed=seed)
        sampler.set_epoch(epoch_index)
        out.append(list(sampler))
    return out


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 10_000), min_size=1, max_size=60),
    ranks=st.integers(1, 4),
    per_batch=st.integers(1, 3),
)
def test_every_pack_once_and_ranks_in_step(costs, ranks, per_batch):
    batches = epoch(costs, ranks, per_batch)
    assert len({len(b) for b in batches}) == 1  # same number of micro-batches on every rank
    assert len(batches[0]) == len(PackBatchSampler(costs, packs_per_batch=per_batch, num_replicas=ranks))
    active = sorted(i for rank in batches for batch in rank for i, on in batch if on)
    assert active == list(range(len(costs)))
    for rank in batches:
        for batch in rank:
            assert 1 <= len(batch) <= per_batch
            assert all(on for _, on in batch) or len(batch) == 1  # a filler is alone in its micro-batch


def test_ranks_get_similar_attention_cost():
    rng = np.random.default_rng(0)
    costs = rng.pareto(1.2, size=400) * 1e6  # long tail: a few packs cost far more than the rest
    batches = epoch(costs, ranks=4, per_batch=2)
    spread = []
    for step in zip(*batches, strict=True):
        loads = [sum(costs[i] for i, _ in batch) for batch in step]
        spread.append(max(loads) / (sum(loads) / len(loads)))
    # Dealing largest first keeps the slowest rank close to the mean; dealing in order would not.
    naive = []
    for start in range(0, 400, 8):
        chunk = costs[start : start + 8]
        loads = [chunk[r * 2 : r * 2 + 2].sum() for r in range(4)]
        naive.append(max(loads) / np.mean(loads))
    assert np.mean(spread) < np.mean(naive)


def test_order_is_seeded_and_changes_per_epoch():
    costs = list(range(1, 41))
    assert epoch(costs, 2, 1, seed=3) == epoch(costs, 2, 1, seed=3)
    assert epoch(costs, 2, 1, seed=3, epoch_index=0) != epoch(costs, 2, 1, seed=3, epoch_index=1)
    unshuffled = PackBatchSampler(costs, shuffle=False)
    assert [b[0][0] for b in unshuffled] == list(range(40))


def test_bad_sampler_arguments():
    with pytest.raises(ValueError, match="no packs"):
        PackBatchSampler([])
    with pytest.raises(ValueError, match="rank 2"):
        PackBatchSampler([1], num_replicas=2, rank=2)


def test_pack_costs_are_sums_of_squares():
    assert pack_costs(packs(3)).tolist() == [9**2 + 4**2 + 17**2, 6**2 + 12**2 + 3**2, 14**2 + 5**2]


@pytest.mark.parametrize("weighting", ["sequence_level", "token_level"])
def test_eval_loss_does_not_depend_on_packing(weighting):
    losses = []
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to="none", per_device_eval_batch_size=2)
        for per_pack in (1, 3, 8):
            trainer = LongAlignTrainer(
                model=tiny_model(), args=args, weighting=weighting, eval_dataset=packs(per_pack)
            )
            metrics = trainer.evaluate()
            assert metrics["eval_samples"] == 8
            losses.append(metrics["eval_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) == pytest.approx(losses[2], rel=1e-6)
    assert np.isfinite(losses[0]) and losses[0] > 0
