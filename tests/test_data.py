import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longalign.data import PackCollator, PaddedCollator, mask_and_weigh

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


def test_samples_without_targets_weigh_nothing():
    # B's only target is its first label, which the boundary rule masks: N_B = 0.
    pack = {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [X, 2, 3, X, X, 6], "cu_seqlens": [0, 3, 4, 6]}
    batch = PackCollator(weighting="sequence_level")([pack])
    assert batch["labels"].tolist() == [[X, 2, 3, X, X, 6]]
    assert batch["loss_weights"].tolist() == [[0, 0.5, 0.5, 0, 0, 1]]
    assert batch["loss_weights"].sum() == 2


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
    packs = [_pack(rows[a:b]) for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    batch_cuts = sorted(data.draw(st.sets(st.integers(1, len(packs) - 1))) if len(packs) > 1 else [])
    collate = PackCollator(weighting=weighting)
    batches = [collate(packs[a:b]) for a, b in zip([0, *batch_cuts], [*batch_cuts, len(packs)], strict=True)]

    weights = torch.cat([batch["loss_weights"][0] for batch in batches]).double()
    assert weights.sum().item() == pytest.approx(denominator, rel=1e-6, abs=0)
    # Each sample's weights are the same whatever pack or micro-batch it landed in.
    seq_lens = torch.tensor([length for length, _ in sample_list])
    labels = torch.tensor([label for _, sample_labels in rows for label in sample_labels])
    assert torch.equal(weights.float(), mask_and_weigh(labels, seq_lens, weighting)[1])


def _pack(rows: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    cu_seqlens = [0]
    for ids, _ in rows:
        cu_seqlens.append(cu_seqlens[-1] + len(ids))
    return {
        "input_ids": [i for ids, _ in rows for i in ids],
        "labels": [label for _, labels in rows for label in labels],
        "cu_seqlens": cu_seqlens,
    }
