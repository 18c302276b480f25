"""Batching: the collators (positions, boundary masking, loss weights), the pack sampler and the loader."""

import datasets
import numpy as np
import pytest
import torch
from conftest import FLOAT64_BOUND, assert_relatively_close, count_packs, pack_row
from hypothesis import given, settings
from hypothesis import strategies as st

from longalign.batching import (
    PackBatchSampler,
    PackCollator,
    PaddedCollator,
    mask_and_weigh,
    pack_costs,
    pack_loader,
)
from longalign.loss import weighted_token_loss

X = -100

# Two pack rows, three samples: A = [11 12 13], B = [21 22], C = [31 32 33]; every label a target.
PACKS = [
    {"input_ids": [11, 12, 13, 21, 22], "labels": [X, 12, 13, 21, 22], "cu_seqlens": [0, 3, 5]},
    {"input_ids": [31, 32, 33], "labels": [X, 32, 33], "cu_seqlens": [0, 3]},
]


def test_pack_collator_hand_drawn_pack():
    batch = PackCollator(weighting="token_level")(PACKS)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33]]
    assert batch["labels"].tolist() == [[X, 12, 13, X, 22, X, 32, 33]]  # B's first label masked
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]  # pack 1 offset by pack 0's 5 tokens
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(batch["cu_seq_lens_k"], batch["cu_seq_lens_q"])
    assert batch["max_length_q"] == batch["max_length_k"] == 3
    assert isinstance(batch["max_length_q"], int)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].dtype == torch.long
    assert batch["loss_weights"].dtype == torch.float32
    assert batch["loss_weights"].tolist() == [[0, 1, 1, 0, 1, 0, 1, 1]]
    assert batch["loss_weights"].sum() == 5  # sum_i N_i


def test_pack_collator_sequence_level_weights():
    weights = PackCollator(weighting="sequence_level")(PACKS)["loss_weights"]
    assert weights.tolist() == [[0, 0.5, 0.5, 0, 1, 0, 0.5, 0.5]]
    assert weights.sum() == 3  # M


def test_reference_weightings_on_the_hand_drawn_packs():
    """5 targets in the micro-batch: A has 2, B 1 (pack 0, 2 samples), C 2 (pack 1, 1 sample)."""
    mean = PackCollator(weighting="pack_token_mean")(PACKS)
    torch.testing.assert_close(mean["loss_weights"], torch.tensor([[0, 0.2, 0.2, 0, 0.2, 0, 0.2, 0.2]]))
    assert mean["loss_denominator"] == 1.0  # one micro-batch
    writer = PackCollator(weighting="longwriter", longwriter_divisor=30.0)(PACKS)
    pack0, pack1 = 2 / (30 * 3), 1 / (30 * 2)  # n_p / (divisor * N_p)
    torch.testing.assert_close(
        writer["loss_weights"], torch.tensor([[0, pack0, pack0, 0, pack0, 0, pack1, pack1]])
    )
    assert writer["loss_denominator"] == 2.0  # two packs with targets
    exact = PackCollator(weighting="token_level")(PACKS)
    assert exact["loss_denominator"] == 5.0 == exact["loss_weights"].sum()


def test_a_filler_row_adds_nothing_to_any_denominator():
    rows = [PACKS[0], {**PACKS[1], "active": False}]
    assert PackCollator(weighting="longwriter")(rows)["loss_denominator"] == 1.0
    assert (
        PackCollator(weighting="pack_token_mean")([{**PACKS[1], "active": False}])["loss_denominator"] == 0.0
    )


def test_padding_every_pack_adds_a_filler_segment_that_weighs_nothing():
    batch = PackCollator(weighting="sequence_level", pad_packs_to=8, pad_token_id=0)(PACKS)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0, 0, 31, 32, 33, 0, 0, 0, 0, 0]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 11, 16]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch["loss_weights"].tolist() == [[0, 0.5, 0.5, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0, 0, 0, 0, 0]]
    assert (batch["num_tokens"], batch["num_samples"], batch["loss_denominator"]) == (8, 3, 3.0)
    writer = PackCollator(weighting="longwriter", pad_packs_to=8)(PACKS)  # the filler is no sample
    unpadded = PackCollator(weighting="longwriter")(PACKS)
    assert (
        writer["loss_weights"][writer["loss_weights"] > 0].tolist()
        == unpadded["loss_weights"][unpadded["loss_weights"] > 0].tolist()
    )
    with pytest.raises(ValueError, match="pack row 0: 5 tokens do not fit the padded length 4"):
        PackCollator(pad_packs_to=4)(PACKS)


def test_samples_without_targets_weigh_nothing():
    # B's only target is its first label, which the boundary rule masks: N_B = 0.
    pack = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [X, 2, 3, X, X, 6], "cu_seqlens": [0, 3, 4, 6]}
    batch = PackCollator(weighting="sequence_level")([pack])
    assert batch["labels"].tolist() == [[X, 2, 3, X, X, 6]]
    assert batch["loss_weights"].tolist() == [[0, 0.5, 0.5, 0, 0, 1]]
    assert batch["loss_weights"].sum() == 2


def test_filler_rows_run_but_weigh_nothing_and_are_not_counted():
    batch = PackCollator(weighting="token_level")([PACKS[0], {**PACKS[1], "active": False}])
    assert batch["input_ids"].shape == (1, 8)  # the filler's tokens still run through the model
    assert batch["labels"][0, 5:].tolist() == [X, X, X]
    assert batch["loss_weights"][0, 5:].tolist() == [0, 0, 0]
    assert (batch["num_packs"], batch["num_samples"]) == (1, 2)
    assert (PackCollator()(PACKS)["num_packs"], PackCollator()(PACKS)["num_samples"]) == (2, 3)


def test_pack_collator_accepts_tensors():
    rows = [{key: torch.tensor(value, dtype=torch.int32) for key, value in row.items()} for row in PACKS]
    expected = PackCollator()(PACKS)
    for key, value in PackCollator()(rows).items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected[key])), key


def test_pack_collator_names_a_bad_row():
    bad = {"input_ids": [1, 2, 3], "labels": [X, 2, 3], "cu_seqlens": [0, 2]}
    with pytest.raises(ValueError, match="pack row 1: cu_seqlens"):
        PackCollator()([PACKS[1], bad])
    with pytest.raises(ValueError, match="weighting: 'sample'"):
        PackCollator(weighting="sample")
    with pytest.raises(ValueError, match="weighting: 'longwriter' is not one of sequence_level, token_level"):
        PaddedCollator(weighting="longwriter")


def test_padded_collator_matches_pack_semantics():
    samples = [
        {"input_ids": [11, 12, 13], "labels": [X, 12, 13]},
        {"input_ids": [21, 22], "labels": [21, 22]},
    ]
    batch = PaddedCollator(weighting="sequence_level", pad_token_id=7)(samples)
    assert batch["input_ids"].tolist() == [[11, 12, 13], [21, 22, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[X, 12, 13], [X, 22, X]]
    assert batch["loss_weights"].tolist() == [[0, 0.5, 0.5], [0, 1, 0]]
    packed = PackCollator(weighting="sequence_level")(PACKS[:1])
    assert (
        batch["loss_weights"][batch["attention_mask"].bool()].tolist() == packed["loss_weights"][0].tolist()
    )


# A sample: (length, which labels are targets before the boundary masking).
samples = st.integers(1, 12).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.booleans(), min_size=n, max_size=n))
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(samples, min_size=1, max_size=12),
    st.sampled_from(["sequence_level", "token_level"]),
    st.data(),
)
def test_weights_sum_to_the_denominator_whatever_the_split(sample_list, weighting, data):
    """Split samples into packs and packs into micro-batches at random: the weights of the step sum to D."""
    rows, token = [], 0
    for length, is_target in sample_list:
        ids = list(range(token, token + length))
        labels = [i if target else X for i, target in zip(ids, is_target, strict=True)]
        rows.append((ids, labels))
        token += length
    # N_i after masking each sample's first label.
    num_targets = [sum(is_target[1:]) for _, is_target in sample_list]
    denominator = sum(num_targets) if weighting == "token_level" else sum(n > 0 for n in num_targets)

    cuts = sorted(data.draw(st.sets(st.integers(1, len(rows) - 1))) if len(rows) > 1 else [])
    packs = [pack_row(rows[a:b]) for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    batch_cuts = sorted(data.draw(st.sets(st.integers(1, len(packs) - 1))) if len(packs) > 1 else [])
    collate = PackCollator(weighting=weighting)
    batches = [collate(packs[a:b]) for a, b in zip([0, *batch_cuts], [*batch_cuts, len(packs)], strict=True)]

    weights = torch.cat([batch["loss_weights"][0] for batch in batches]).double()
    assert weights.sum().item() == pytest.approx(denominator, rel=1e-6, abs=0)
    # Each sample's weights are the same whatever pack or micro-batch it landed in.
    seq_lens = torch.tensor([length for length, _ in sample_list])
    labels = torch.tensor([label for _, sample_labels in rows for label in sample_labels])
    assert torch.equal(weights.float(), mask_and_weigh(labels, seq_lens, weighting)[1])


# --- the pack sampler and the loader ---------------------------------------------------------------------


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
    packs = datasets.Dataset.from_list(count_packs([[9, 4, 17], [6, 12, 3], [14, 5]]))
    assert pack_costs(packs).tolist() == [9**2 + 4**2 + 17**2, 6**2 + 12**2 + 3**2, 14**2 + 5**2]


def test_loader_gives_each_rank_its_packs_and_a_filler_where_short():
    packs = datasets.Dataset.from_list(count_packs([[3], [2, 2], [5]]))
    collate = PackCollator(weighting="token_level")
    per_rank = [
        list(pack_loader(packs, collate, batch_size=1, num_replicas=2, rank=rank, shuffle=False))
        for rank in (0, 1)
    ]
    assert [len(batches) for batches in per_rank] == [2, 2]
    counted = [(b["num_packs"], b["num_samples"]) for batches in per_rank for b in batches]
    assert sorted(counted) == [(0, 0), (1, 1), (1, 1), (1, 2)]  # 3 packs, 4 samples, one filler
    filler = next(b for batches in per_rank for b in batches if b["num_packs"] == 0)
    assert filler["loss_weights"].sum() == 0


# --- filler padding and sequence-parallel slices ---------------------------------------------------------


def test_filler_segment_pads_the_row_to_a_multiple():
    batch = PackCollator(weighting="token_level", pad_to_multiple_of=5, pad_token_id=9)(PACKS)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 9, 9]]
    assert batch["labels"].tolist() == [[X, 12, 13, X, 22, X, 32, 33, X, X]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 0, 1]]  # the filler restarts too
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 10]  # its own segment: it attends to itself
    assert batch["loss_weights"].tolist() == [[0, 1, 1, 0, 1, 0, 1, 1, 0, 0]]
    assert (batch["num_packs"], batch["num_samples"], batch["num_tokens"]) == (2, 3, 8)
    unpadded = PackCollator(weighting="token_level", pad_to_multiple_of=4)(PACKS)  # 8 tokens already
    assert unpadded["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]


# Samples A = [11 12 13] and B = [21 22 23 24], split over 2 ranks: padded to 8 with a 1-token filler.
SPLIT_PACK = {
    "input_ids": [11, 12, 13, 21, 22, 23, 24],
    "labels": [X, 12, 13, 21, 22, 23, 24],
    "cu_seqlens": [0, 3, 7],
}


def test_sequence_parallel_slices_hand_drawn_pack():
    rank0, rank1 = (
        PackCollator(weighting="token_level", sequence_parallel_size=2, sequence_parallel_rank=rank)(
            [SPLIT_PACK]
        )
        for rank in (0, 1)
    )
    assert rank0["input_ids"].tolist() == [[11, 12, 13, 21]] and rank1["input_ids"].tolist() == [
        [22, 23, 24, 0]
    ]
    assert rank0["position_ids"].tolist() == [[0, 1, 2, 0]] and rank1["position_ids"].tolist() == [
        [1, 2, 3, 0]
    ]
    # Shifted over the whole pack, then sliced: b0 on rank 0 predicts b1 on rank 1.
    assert rank0["shift_labels"].tolist() == [[12, 13, X, 22]]
    assert rank1["shift_labels"].tolist() == [[23, 24, X, X]]
    assert rank0["shift_loss_weights"].tolist() == [[1, 1, 0, 1]]
    assert rank1["shift_loss_weights"].tolist() == [[1, 1, 0, 0]]
    assert rank0["labels"].tolist() == [[X, 12, 13, X]] and rank1["loss_weights"].tolist() == [[1, 1, 1, 0]]
    for batch in (rank0, rank1):  # attention sees the whole pack on every rank
        assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 7, 8]
        assert batch["max_length_q"] == 4
        assert (batch["num_packs"], batch["num_samples"], batch["num_tokens"]) == (1, 2, 7)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(samples, min_size=1, max_size=8),
    st.sampled_from(["sequence_level", "token_level"]),
    st.integers(2, 4),
)
def test_slices_hold_every_target_of_the_whole_pack_once(sample_list, weighting, size):
    rows, token = [], 0
    for length, is_target in sample_list:
        ids = list(range(token, token + length))
        rows.append((ids, [i if target else X for i, target in zip(ids, is_target, strict=True)]))
        token += length
    pack = pack_row(rows)
    whole = PackCollator(weighting=weighting, pad_to_multiple_of=size)([pack])
    slices = [
        PackCollator(weighting=weighting, sequence_parallel_size=size, sequence_parallel_rank=rank)([pack])
        for rank in range(size)
    ]

    def joined(key):
        return torch.cat([batch[key][0] for batch in slices])

    assert len(joined("input_ids")) % size == 0 and torch.equal(joined("input_ids"), whole["input_ids"][0])
    assert torch.equal(joined("position_ids"), whole["position_ids"][0])
    # Position t predicts the whole pack's label t + 1, with its weight; the last position predicts nothing.
    assert torch.equal(joined("shift_labels")[:-1], whole["labels"][0, 1:])
    assert torch.equal(joined("shift_loss_weights")[:-1], whole["loss_weights"][0, 1:])
    unsplit = PackCollator(weighting=weighting)([pack])["loss_weights"].double().sum()
    for key in ("loss_weights", "shift_loss_weights"):  # the same weights, summed in another order
        assert joined(key).double().sum().item() == pytest.approx(unsplit.item(), rel=1e-12)


def test_slices_give_the_loss_of_the_whole_pack():
    """The loss contract on slices: shifted targets make the sum of the slices' S the whole pack's S."""
    torch.manual_seed(0)
    whole = PackCollator(pad_to_multiple_of=2)([SPLIT_PACK])
    hidden, head = torch.randn(8, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    expected = weighted_token_loss(hidden[None], head, whole["labels"], whole["loss_weights"])
    slices = [
        PackCollator(sequence_parallel_size=2, sequence_parallel_rank=rank)([SPLIT_PACK]) for rank in (0, 1)
    ]
    parts = [
        weighted_token_loss(
            hidden[None, 4 * r : 4 * r + 4],
            head,
            batch["shift_labels"],
            batch["shift_loss_weights"],
            shifted=True,
        )
        for r, batch in enumerate(slices)
    ]
    assert_relatively_close(parts[0] + parts[1], expected, FLOAT64_BOUND)
    in_slice = [
        weighted_token_loss(hidden[None, 4 * r : 4 * r + 4], head, batch["labels"], batch["loss_weights"])
        for r, batch in enumerate(slices)
    ]
    assert not torch.allclose(in_slice[0] + in_slice[1], expected)  # b0 -> b1 lost at the slice boundary


def test_bad_collator_settings():
    with pytest.raises(ValueError, match="pad_to_multiple_of: must be >= 1"):
        PackCollator(pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="sequence_parallel_rank 2 outside 0..1"):
        PackCollator(sequence_parallel_size=2, sequence_parallel_rank=2)


def test_sampler_deals_each_pack_to_one_group_of_ranks():
    costs = [9, 1, 4, 4, 7, 2, 5]
    per_rank = [
        list(PackBatchSampler(costs, num_replicas=4, rank=rank, sequence_parallel_size=2, seed=1))
        for rank in range(4)
    ]
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]  # a group shares every pack
    assert per_rank == [
        list(PackBatchSampler(costs, num_replicas=2, rank=rank // 2, seed=1)) for rank in range(4)
    ]
    active = sorted(i for rank in (0, 2) for batch in per_rank[rank] for i, on in batch if on)
    assert active == list(range(len(costs)))  # the groups together see every pack once
    with pytest.raises(ValueError, match="4 ranks do not split into groups of 3"):
        PackBatchSampler(costs, num_replicas=4, rank=0, sequence_parallel_size=3)


def test_loader_gives_a_group_one_pack_in_slices():
    packs = datasets.Dataset.from_list(count_packs([[3, 4], [5], [2, 2, 2]]))
    batches = [
        list(
            pack_loader(
                packs,
                PackCollator(sequence_parallel_size=2, sequence_parallel_rank=rank % 2),
                batch_size=1,
                num_replicas=4,
                rank=rank,
                sequence_parallel_size=2,
                shuffle=False,
            )
        )
        for rank in range(4)
    ]
    assert [len(b) for b in batches] == [2, 2, 2, 2]
    for group in (0, 2):
        for first, second in zip(batches[group], batches[group + 1], strict=True):
            assert torch.equal(first["cu_seq_lens_q"], second["cu_seq_lens_q"])
            whole = torch.cat([first["input_ids"], second["input_ids"]], dim=1)
            assert whole.shape[1] == int(first["cu_seq_lens_q"][-1])
