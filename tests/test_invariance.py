"""The step's gradient does not depend on how samples are split into packs, micro-batches and ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    FLOAT32_BOUND,
    FLOAT64_BOUND,
    assert_relatively_close,
    launch,
    needs_launcher,
    relative_error,
    tiny_model,
)
from invariance_run import SAMPLES, one_step, samples

HERE = Path(__file__).resolve().parent
N = len(SAMPLES)


# Sequence-level weights 1/N_i reach the loss as float32 (the collator's contract): a formula computed in
# float64 differs from the trainer's float64 step by their rounding, about 6e-8 of each term.
WEIGHT_ROUNDING = 1e-6


def assert_same(got: dict, want: dict, bound: float = FLOAT64_BOUND) -> None:
    """Every parameter's gradient, taken together, within ``bound`` of the other (norm-relative)."""
    assert got.keys() == want.keys()
    assert_relatively_close(got, want, bound)


@pytest.fixture(scope="module", params=["sequence_level", "token_level"])
def weighting(request):
    return request.param


@pytest.fixture(scope="module")
def reference(weighting):
    return one_step(weighting, samples_per_pack=1, accumulation=N)  # one pack per micro-batch


def test_all_samples_in_one_pack(weighting, reference):
    assert_same(one_step(weighting, samples_per_pack=N, accumulation=1), reference)


def test_accumulation_of_four(weighting, reference):
    assert_same(one_step(weighting, samples_per_pack=N // 4, accumulation=4), reference)


# Every two-rank case in one launch: the weightings with every weight trained, the families with adapters,
# the mixture of experts with its router loss.
TWO_RANK_CASES = [
    "sequence_level",
    "token_level",
    "sequence_level:llama",
    "sequence_level:glm4",
    "token_level:moe",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Gradients of one step on 2 ranks x accumulation 2 (N/4 samples per pack), by case; launched once."""
    out = tmp_path_factory.mktemp("invariance") / "grads.pt"
    result = launch(
        HERE / "invariance_run.py", str(out), str(N // 4), "2", *TWO_RANK_CASES, env={"PYTHONPATH": str(HERE)}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.integration
@needs_launcher
def test_two_ranks_times_accumulation_two(weighting, reference, two_ranks):
    assert_same(two_ranks[weighting], reference)


@pytest.fixture(scope="module", params=["llama", "glm4"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def adapter_reference(family):
    return one_step("sequence_level", samples_per_pack=1, accumulation=N, lora=family)


@pytest.mark.parametrize("per_pack, accumulation", [(N, 1), (N // 4, 4)], ids=["one_pack", "accumulation"])
def test_adapter_gradients_do_not_depend_on_the_split(family, adapter_reference, per_pack, accumulation):
    got = one_step("sequence_level", samples_per_pack=per_pack, accumulation=accumulation, lora=family)
    assert any("lora_A" in name for name in got) and any("lm_head.lora_B" in name for name in got)
    assert all("lora" in name or "norm" in name for name in got)  # the base is frozen
    assert_same(got, adapter_reference)


@pytest.mark.integration
@needs_launcher
def test_adapters_on_two_ranks_times_accumulation_two(family, adapter_reference, two_ranks):
    assert_same(two_ranks[f"sequence_level:{family}"], adapter_reference)


# The router loss is per pack, so its step changes with the packs: these keep N/4 samples in each (4 packs)
# and split them differently into micro-batches, as the two-rank launch does.
MOE_PER_PACK = N // 4


@pytest.fixture(scope="module")
def moe_reference() -> dict:
    return one_step("token_level", samples_per_pack=MOE_PER_PACK, accumulation=4, moe=True)  # a pack each


@pytest.mark.parametrize("packs_per_batch, accumulation", [(4, 1), (2, 2)], ids=["one_batch", "two_batches"])
def test_router_loss_gradient_does_not_depend_on_the_micro_batches(
    moe_reference, packs_per_batch, accumulation
):
    got = one_step(
        "token_level",
        samples_per_pack=MOE_PER_PACK,
        accumulation=accumulation,
        packs_per_batch=packs_per_batch,
        moe=True,
    )
    assert_same(got, moe_reference)


def test_router_loss_changes_the_update(moe_reference):
    """With output_router_logits off the step is the language-model loss alone, and a different one."""
    without = one_step(
        "token_level", samples_per_pack=MOE_PER_PACK, accumulation=4, moe=True, router_loss=False
    )
    assert relative_error(without, moe_reference) > 1e-3
    routers = [name for name in without if name.endswith("mlp.gate.weight")]
    assert relative_error({n: without[n] for n in routers}, {n: moe_reference[n] for n in routers}) > 0.1


@pytest.mark.integration
@needs_launcher
def test_router_loss_on_two_ranks_times_accumulation_two(moe_reference, two_ranks):
    assert_same(two_ranks["token_level:moe"], moe_reference)


def test_stock_trainer_is_token_level_not_sequence_level():
    """HF's own loss (token mean over the accumulated step) matches token_level and misses sequence_level."""
    stock = one_step("token_level", samples_per_pack=1, accumulation=N, stock=True)
    # transformers' own loss computes its logits in float32, so the comparison is a float32 one
    assert_same(stock, one_step("token_level", samples_per_pack=1, accumulation=N), FLOAT32_BOUND)
    assert relative_error(stock, one_step("sequence_level", samples_per_pack=1, accumulation=N)) > 0.05


def test_step_gradient_is_the_gradient_of_the_defined_loss(weighting, reference):
    """Each sample alone with full logits: token_level = sum of all CE / sum N_i, sequence_level = mean over
    samples of each sample's mean CE. The trainer's step gradient is the gradient of that loss."""
    model = tiny_model(backend="sdpa_segments").double()
    per_sample = []
    for ids, labels in samples():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        targets = torch.tensor(labels[1:])
        ce = torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=-100, reduction="none")
        n = int((targets != -100).sum())
        if n:
            per_sample.append((ce.sum(), n))
    if weighting == "token_level":
        loss = sum(s for s, _ in per_sample) / sum(n for _, n in per_sample)
    else:
        loss = sum(s / n for s, n in per_sample) / len(per_sample)
    loss.backward()
    assert_same({name: p.grad for name, p in model.named_parameters()}, reference, WEIGHT_ROUNDING)


@pytest.mark.parametrize("weighting", ["pack_token_mean", "longwriter"])
def test_reference_weightings_are_the_released_formulas(weighting):
    """Two samples per pack, one pack per micro-batch, four micro-batches: the trainer's step gradient is
    the gradient of the formula computed sample by sample with full logits."""
    per_pack = 2
    model = tiny_model(backend="sdpa_segments").double()
    ce_sums, targets = [], []
    for ids, labels in samples():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        next_labels = torch.tensor(labels[1:])
        ce = torch.nn.functional.cross_entropy(logits[:-1], next_labels, ignore_index=-100, reduction="none")
        ce_sums.append(ce.sum())
        targets.append(int((next_labels != -100).sum()))
    packs = [range(start, start + per_pack) for start in range(0, N, per_pack)]
    terms = []
    for pack in packs:  # here a micro-batch is one pack
        pack_targets = sum(targets[i] for i in pack)
        if not pack_targets:
            continue
        pack_mean = sum(ce_sums[i] for i in pack) / pack_targets
        terms.append(pack_mean if weighting == "pack_token_mean" else pack_mean * len(pack) / 30.0)
    loss = sum(terms) / len(terms)
    loss.backward()
    got = one_step(weighting, samples_per_pack=per_pack, accumulation=N // per_pack)
    assert_same({name: p.grad for name, p in model.named_parameters()}, got, WEIGHT_ROUNDING)
