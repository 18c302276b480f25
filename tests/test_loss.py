import pytest
import torch
from conftest import (
    FLOAT32_BOUND,
    FLOAT64_BOUND,
    TINY,
    assert_relatively_close,
    pack_row,
    relative_error,
    tiny_model,
    tiny_moe,
)
from torch.nn import functional as F
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    HyperCLOVAXConfig,
    HyperCLOVAXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import longalign.patch
from longalign.batching import PackCollator, PaddedCollator
from longalign.loss import (
    MODEL_INPUT_KEYS,
    LossHead,
    RouterLoss,
    lm_head_spec,
    loss_sums,
    router_loss_spec,
    router_loss_sum,
    weighted_loss_sum,
    weighted_token_loss,
)

X = -100
VOCAB, HIDDEN = TINY["vocab_size"], TINY["hidden_size"]


def reference_loss(hidden, weight, labels, loss_weights, bias=None, scale=None, softcap=None):
    """Full [T, V] logits and F.cross_entropy, one row at a time: the definition the chunked loss must meet."""
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the loss computes it
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = F.cross_entropy(
        logits[..., :-1, :].transpose(-1, -2), labels[..., 1:], ignore_index=X, reduction="none"
    )
    return (loss_weights[..., 1:] * ce).sum()


# Two packs of (length, prompt tokens) samples; the prompt is -100, the rest targets; (3, 3) has none.
PACK_SHAPES = ([(5, 2), (9, 4), (4, 0)], [(7, 3), (3, 3)])


def random_packs(seed: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    packs = []
    for shapes in PACK_SHAPES:
        ids, labels = [], []
        for length, prompt in shapes:
            tokens = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
            ids += tokens
            labels += [X] * prompt + tokens[prompt:]
        cu_seqlens = torch.tensor([0] + [length for length, _ in shapes]).cumsum(0).tolist()
        packs.append({"input_ids": ids, "labels": labels, "cu_seqlens": cu_seqlens})
    return packs


def leaves(seed: int, num_tokens: int, bias: bool, dtype: torch.dtype = torch.float64):
    """Hidden states, head weight and bias; float64 unless asked, so identities hold to rounding."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, num_tokens, HIDDEN, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype).mul_(0.5).requires_grad_()
    bias = torch.randn(VOCAB, generator=generator, dtype=dtype).requires_grad_() if bias else None
    return hidden, weight, bias


@pytest.mark.parametrize("weighting", ["sequence_level", "token_level"])
@pytest.mark.parametrize("chunk_size", [1, 4, 7, 4096])
@pytest.mark.parametrize(("scale", "softcap"), [(None, None), (0.25, None), (None, 3.0), (1.7, 2.5)])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_equals_full_logits(weighting, chunk_size, scale, softcap, bias):
    batch = PackCollator(weighting=weighting)(random_packs(seed=chunk_size))
    hidden, weight, bias = leaves(seed=1, num_tokens=batch["labels"].shape[1], bias=bias)
    labels, weights = batch["labels"], batch["loss_weights"]
    params = [p for p in (hidden, weight, bias) if p is not None]

    expected = reference_loss(hidden, weight, labels, weights, bias, scale, softcap)
    expected_grads = torch.autograd.grad(expected, params)
    loss = weighted_token_loss(
        hidden,
        weight,
        labels,
        weights,
        lm_head_bias=bias,
        logit_scale=scale,
        final_logit_softcap=softcap,
        chunk_size=chunk_size,
    )
    grads = torch.autograd.grad(loss, params)

    assert loss.dtype == torch.float64  # a float64 head keeps float64
    assert_relatively_close(loss, expected, FLOAT64_BOUND)
    assert_relatively_close(grads, expected_grads, FLOAT64_BOUND)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_dtypes_get_a_float32_loss_close_to_the_float64_one(dtype):
    batch = PackCollator(weighting="sequence_level")(random_packs(seed=11))
    hidden, weight, _ = leaves(seed=12, num_tokens=batch["labels"].shape[1], bias=False)
    args = (batch["labels"], batch["loss_weights"])
    exact = weighted_token_loss(hidden.detach(), weight.detach(), *args)
    loss = weighted_token_loss(hidden.detach().to(dtype), weight.detach().to(dtype), *args, chunk_size=5)
    assert loss.dtype == torch.float32
    assert_relatively_close(loss, exact, FLOAT32_BOUND if dtype == torch.float32 else 2e-2)


def test_padded_batch_gives_the_packed_loss():
    """[B, L] rows shift per row: the padded baseline and the packed row agree sample by sample."""
    pack = random_packs(seed=3)[0]
    starts, ends = pack["cu_seqlens"][:-1], pack["cu_seqlens"][1:]
    samples = [
        {key: pack[key][a:b] for key in ("input_ids", "labels")} for a, b in zip(starts, ends, strict=True)
    ]
    packed = PackCollator(weighting="sequence_level")([pack])
    padded = PaddedCollator(weighting="sequence_level")(samples)
    hidden, weight, _ = leaves(seed=4, num_tokens=len(pack["input_ids"]), bias=False)
    padded_hidden = torch.randn(
        *padded["labels"].shape, HIDDEN, dtype=hidden.dtype
    )  # padding rows: any value
    padded_hidden[padded["attention_mask"].bool()] = hidden[0].detach()
    loss_packed = weighted_token_loss(hidden, weight, packed["labels"], packed["loss_weights"], chunk_size=3)
    loss_padded = weighted_token_loss(
        padded_hidden, weight, padded["labels"], padded["loss_weights"], chunk_size=3
    )
    torch.testing.assert_close(loss_padded, loss_packed)


def test_rows_of_a_batch_shift_separately():
    """In [B, T] the last position of row 0 does not predict the first label of row 1."""
    hidden, weight, _ = leaves(seed=10, num_tokens=10, bias=False)
    hidden = hidden.detach().reshape(2, 5, HIDDEN)
    labels = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10))
    weights = torch.ones(2, 5)
    expected = reference_loss(hidden, weight, labels, weights)
    torch.testing.assert_close(weighted_token_loss(hidden, weight, labels, weights, chunk_size=3), expected)


def test_pre_shifted_targets_make_slices_of_a_row_add_up_to_the_row():
    """Cut a row into slices (as the ranks of a sequence-parallel group hold it), targets shifted over the
    whole row first: the slices' sums add up to the row's. Shifting inside each slice loses the target
    that sits across each cut."""
    batch = PackCollator(weighting="sequence_level")(random_packs(seed=2))
    labels, weights = batch["labels"], batch["loss_weights"]
    hidden, weight, _ = leaves(seed=2, num_tokens=labels.shape[1], bias=False)
    whole = weighted_token_loss(hidden, weight, labels, weights, chunk_size=3)
    shift_labels = torch.cat([labels[:, 1:], torch.full((1, 1), X)], dim=1)
    shift_weights = torch.cat([weights[:, 1:], torch.zeros(1, 1)], dim=1)
    cuts = [slice(0, 7), slice(7, 15), slice(15, None)]
    sliced = sum(
        weighted_token_loss(
            hidden[:, cut], weight, shift_labels[:, cut], shift_weights[:, cut], chunk_size=3, shifted=True
        )
        for cut in cuts
    )
    torch.testing.assert_close(sliced, whole)
    naive = sum(weighted_token_loss(hidden[:, cut], weight, labels[:, cut], weights[:, cut]) for cut in cuts)
    assert not torch.allclose(naive, whole)


def test_loss_head_puts_the_head_back_after_an_error(llama):
    batch = PackCollator()(random_packs(seed=4))
    with pytest.raises(RuntimeError, match="boom"), LossHead(llama, batch, chunk_size=4):
        assert "forward" in vars(llama.lm_head)
        raise RuntimeError("boom")
    assert "forward" not in vars(llama.lm_head)


def test_samples_without_targets_contribute_nothing():
    hidden, weight, _ = leaves(seed=5, num_tokens=6, bias=False)
    labels = torch.tensor([[X, 3, 4, X, X, X]])  # second sample (positions 3-5) has no targets
    weights = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0]])
    loss = weighted_token_loss(hidden, weight, labels, weights, chunk_size=2)
    loss.backward()
    torch.testing.assert_close(
        loss, weighted_token_loss(hidden[:, :3], weight, labels[:, :3], weights[:, :3])
    )
    assert torch.all(hidden.grad[0, 2:] == 0)  # h2 predicts the masked boundary label, h3-h5 nothing

    # A target label with weight 0, a weight on a non-target, and NaN hidden states there (as padding rows
    # can have): never computed, so exactly 0 and no NaN gradient.
    labels, weights = torch.tensor([X, 5, X, 7]), torch.tensor([0.0, 0.0, 3.0, 0.0])
    garbage = torch.full((4, HIDDEN), float("nan"), requires_grad=True)
    loss = weighted_token_loss(garbage, weight, labels, weights)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(garbage.grad, torch.zeros_like(garbage)) and torch.isfinite(weight.grad).all()


def test_no_targets_at_all_is_exactly_zero_with_zero_gradient():
    hidden, weight, bias = leaves(seed=6, num_tokens=5, bias=True)
    loss = weighted_token_loss(hidden, weight, torch.full((1, 5), X), torch.zeros(1, 5), lm_head_bias=bias)
    loss.backward()
    assert loss.item() == 0.0
    for param in (hidden, weight, bias):
        assert torch.equal(param.grad, torch.zeros_like(param))


def test_bf16_matches_the_bf16_full_logits_path():
    batch = PackCollator(weighting="token_level")(random_packs(seed=7))
    hidden, weight, _ = leaves(seed=8, num_tokens=batch["labels"].shape[1], bias=False)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    args = (hidden, weight, batch["labels"], batch["loss_weights"])
    expected = reference_loss(*args)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = weighted_token_loss(*args, chunk_size=5)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    assert_relatively_close(loss, expected, FLOAT32_BOUND)  # both sum the same float32 terms
    assert_relatively_close(grads, expected_grads, 2e-2)  # gradients round to bf16


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="loss_weights"):
        weighted_token_loss(torch.zeros(1, 4, 2), torch.zeros(3, 2), torch.zeros(1, 4).long(), torch.zeros(4))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama").double().eval()


def test_weighted_loss_sum_equals_full_logits_and_keeps_samples_apart(llama):
    batch = PackCollator()(random_packs(seed=9))
    with torch.no_grad():
        total = weighted_loss_sum(llama, batch, chunk_size=5)
        logits = llama(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        hidden = llama.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        )
    expected = reference_loss(
        hidden.last_hidden_state, llama.lm_head.weight, batch["labels"], batch["loss_weights"]
    )
    assert_relatively_close(total, expected, FLOAT64_BOUND)
    # Each sample scored alone gives the same sum: the varlen keys reached attention through the swapped head.
    alone = 0.0
    cu_seqlens = batch["cu_seq_lens_q"].tolist()
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        with torch.no_grad():
            logits = llama(input_ids=batch["input_ids"][:, start:end], use_cache=False).logits
        ce = F.cross_entropy(
            logits[0, :-1], batch["labels"][0, start + 1 : end], ignore_index=X, reduction="none"
        )
        alone += float((batch["loss_weights"][0, start + 1 : end] * ce).sum())
    assert_relatively_close(total, alone, FLOAT64_BOUND)
    assert type(llama.lm_head).forward is torch.nn.Linear.forward and "forward" not in vars(llama.lm_head)


def test_padding_packs_to_a_fixed_length_changes_no_loss(llama):
    packs = random_packs(seed=6)
    with torch.no_grad():
        plain = weighted_loss_sum(llama, PackCollator()(packs))
        padded = weighted_loss_sum(llama, PackCollator(pad_packs_to=40)(packs))
    torch.testing.assert_close(padded, plain)


def test_boundary_next_sample_first_token_does_not_change_previous_loss(llama):
    """Changing B's first token changes nothing in A's loss: A's last token has no target after it."""

    def loss_of_a(first_of_b: int, collate: bool) -> torch.Tensor:
        ids = [5, 6, 7, 8, first_of_b, 9, 10]
        pack = {"input_ids": ids, "labels": ids, "cu_seqlens": [0, 4, 7]}
        batch = PackCollator(weighting="token_level")([pack])
        if not collate:
            batch["labels"] = torch.tensor([ids])  # without the boundary masking
        # Weight 1 on A's targets and on the label that follows A, whoever it belongs to.
        batch["loss_weights"] = torch.tensor([[0.0] + [1.0] * 4 + [0.0] * 2])
        with torch.no_grad():
            return weighted_loss_sum(llama, batch)

    assert loss_of_a(11, collate=True) == loss_of_a(12, collate=True)
    assert loss_of_a(11, collate=False) != loss_of_a(12, collate=False)  # the test can fail


# Families that transform their logits after the LM head, each with what makes it differ from Llama set.
TRANSFORMING_FAMILIES = {
    "granite": (
        GraniteForCausalLM,
        GraniteConfig(
            **TINY,
            logits_scaling=16.0,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
        ),
    ),
    "cohere2": (Cohere2ForCausalLM, Cohere2Config(**TINY, logit_scale=0.25, sliding_window=16)),
    # Attention soft-capping is another matter (the patch refuses it): off here.
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config(**TINY, final_logit_softcapping=30.0, attn_logit_softcapping=None),
    ),
}
# (length, prompt tokens) of one pack's samples; all longer than Cohere2's sliding window of 16.
LONG_SAMPLES = [(20, 5), (17, 2), (25, 7)]


def long_samples() -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for length, prompt in LONG_SAMPLES:
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        out.append((ids, [X] * prompt + ids[prompt:]))
    return out


def transforms_of(model) -> tuple:
    """Where each family keeps its transform's value, as its forward reads it."""
    places = [
        (model.config, "logits_scaling"),
        (model, "logit_scale"),
        (model.config, "final_logit_softcapping"),
    ]
    return tuple(getattr(holder, name, None) for holder, name in places)


@pytest.mark.parametrize("family", TRANSFORMING_FAMILIES)
def test_logit_scales_and_softcaps_are_applied_inside_the_head_exactly(family):
    """A packed row through the loss inside the head equals the cross-entropy of the family's own logits,
    each sample alone: the scale or soft-cap is applied once, inside the head, and not again after it."""
    model_class, config = TRANSFORMING_FAMILIES[family]
    torch.manual_seed(0)
    # One model, one attention function for both sides: the families' norms round to float32 inside
    # (their own code), which would turn float64 differences between two kernels into 1e-9.
    model = longalign.patch.apply(model_class(config).double(), backend="sdpa_segments")
    params = dict(model.named_parameters())
    expected = sum(
        F.cross_entropy(
            model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1],
            torch.tensor(labels[1:]),
            ignore_index=X,
            reduction="sum",
        )
        for ids, labels in long_samples()
    )
    expected_grads = torch.autograd.grad(expected, list(params.values()))
    before = transforms_of(model)

    batch = PackCollator(weighting="token_level")([pack_row(long_samples())])
    total = weighted_loss_sum(model, batch, chunk_size=7)
    grads = dict(zip(params, torch.autograd.grad(total, list(params.values())), strict=True))

    assert transforms_of(model) == before  # held neutral only while the head was installed
    assert_relatively_close(total, expected, FLOAT64_BOUND)
    want = dict(zip(params, expected_grads, strict=True))
    # Cohere2 and Gemma 2 multiply their norms' weights in float32 (their code): those weights' gradients
    # are float32 sums over the tokens, whose order packing changes. Every other gradient is float64.
    float32 = [name for name in params if family != "granite" and "norm" in name]
    float64 = [name for name in params if name not in float32]
    assert_relatively_close([grads[n] for n in float64], [want[n] for n in float64], FLOAT64_BOUND)
    if float32:
        assert_relatively_close([grads[n] for n in float32], [want[n] for n in float32], FLOAT32_BOUND)


@pytest.mark.parametrize(
    ("model_class", "config", "expected"),
    [
        (CohereForCausalLM, CohereConfig(**TINY, logit_scale=0.5), (0.5, None)),
        (GraniteForCausalLM, GraniteConfig(**TINY, logits_scaling=4.0), (0.25, None)),
        (HyperCLOVAXForCausalLM, HyperCLOVAXConfig(**TINY, logits_scaling=4.0), (4.0, None)),
        (Gemma2ForCausalLM, Gemma2Config(**TINY, final_logit_softcapping=2.0), (None, 2.0)),
    ],
    ids=["cohere", "granite", "hyperclovax", "gemma2"],
)
def test_each_family_transform_is_read_as_its_forward_applies_it(model_class, config, expected):
    torch.manual_seed(0)
    model = model_class(config).double().eval()
    spec = lm_head_spec(model)
    assert (spec.logit_scale, spec.final_logit_softcap) == expected
    ids = torch.randint(0, VOCAB, (1, 12))
    labels = ids.clone()
    labels[0, :4] = X
    batch = PaddedCollator(weighting="token_level")([{"input_ids": ids[0], "labels": labels[0]}])
    with torch.no_grad():
        total = weighted_loss_sum(model, batch, chunk_size=3)
        stock = model(input_ids=ids, labels=labels, use_cache=False).loss  # float32 logits: a float32 bound
    assert_relatively_close(total / batch["loss_weights"].sum(), stock)


def test_a_value_the_family_keeps_on_the_module_is_read_there():
    """Cohere multiplies by the module's ``logit_scale`` (copied from the config at init), not the config's."""
    model = CohereForCausalLM(CohereConfig(**TINY, logit_scale=0.5))
    model.logit_scale = 0.125
    assert lm_head_spec(model).logit_scale == 0.125


def test_an_unknown_transform_after_the_head_is_refused(llama):
    class ShiftedLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            outputs = super().forward(*args, **kwargs)
            outputs.logits = outputs.logits + 1
            return outputs

    model = ShiftedLogits(LlamaConfig(**TINY))
    batch = PackCollator()(random_packs(seed=4))
    with pytest.raises(
        ValueError, match="^ShiftedLogits transforms the LM head's output in a way longalign does"
    ):
        weighted_loss_sum(model, batch)
    assert "forward" not in vars(model.lm_head)


def test_the_transform_comes_back_after_an_error():
    model = GraniteForCausalLM(TRANSFORMING_FAMILIES["granite"][1])
    with (
        pytest.raises(RuntimeError, match="boom"),
        LossHead(model, PackCollator()(random_packs(1)), chunk_size=4),
    ):
        assert model.config.logits_scaling == 1.0
        raise RuntimeError("boom")
    assert model.config.logits_scaling == 16.0


def test_lm_head_spec_rejects_what_it_cannot_apply():
    model = CohereForCausalLM(CohereConfig(**TINY))
    model.logit_scale = torch.tensor(0.5)  # a value the forward multiplies by, but not a number to read
    with pytest.raises(
        ValueError, match=r"CohereForCausalLM: 'logit_scale' = tensor\(0.5000\) transforms the"
    ):
        lm_head_spec(model)

    class ScaledHead(torch.nn.Linear):
        pass

    model = LlamaForCausalLM(LlamaConfig(**TINY))
    model.lm_head = ScaledHead(HIDDEN, VOCAB, bias=False)
    with pytest.raises(ValueError, match="output layer is ScaledHead"):
        lm_head_spec(model)


# --- the router (load-balancing) loss --------------------------------------------------------------------

EXPERTS = RouterLoss(coefficient=0.5, num_experts=4, top_k=2)


def test_router_loss_is_each_packs_own_load_balancing_loss():
    """Two packs (one padded to a fixed length) and an inactive row in one micro-batch: the sum of
    transformers' load-balancing loss of each pack run alone. Filler and inactive rows count nowhere."""
    model = tiny_moe()
    rows = [pack_row(long_samples()[:2]), pack_row(long_samples()[2:])]
    batch = PackCollator(weighting="token_level", pad_packs_to=40)([*rows, {**rows[0], "active": False}])
    assert batch["num_packs"] == 2 and set(batch["pack_ids"].unique().tolist()) == {-1, 0, 1}
    with torch.no_grad():
        sums = loss_sums(model, batch, chunk_size=7)
        alone = 0.0
        for row in rows:
            one = PackCollator(weighting="token_level")([row])
            router_logits = model(
                **{key: one[key] for key in MODEL_INPUT_KEYS if key in one}, use_cache=False
            ).router_logits
            alone += float(load_balancing_loss_func(router_logits, EXPERTS.num_experts, EXPERTS.top_k))
    assert router_loss_spec(model) == EXPERTS and sums.router_coefficient == 0.5
    # transformers sums the routing statistics in float32
    assert_relatively_close(sums.router, alone, FLOAT32_BOUND)


def test_router_loss_of_a_packs_slices_adds_up_to_the_packs():
    """Slices of the tokens (the ranks of a sequence-parallel group), their counts summed over the slices:
    the slices' router losses and their gradients add up to the whole batch's, in float64."""
    generator = torch.Generator().manual_seed(3)
    router_logits = [torch.randn(24, 4, generator=generator, dtype=torch.float64) * 3 for _ in range(3)]
    leaves = [logits.requires_grad_() for logits in router_logits]
    pack_ids = torch.tensor([0] * 10 + [1] * 9 + [-1] * 5)
    whole = router_loss_sum(leaves, pack_ids, 2, EXPERTS)
    want = torch.autograd.grad(whole, leaves)

    cuts = [slice(0, 8), slice(8, 16), slice(16, 24)]  # the second cut holds the end of pack 0 and pack 1
    recorded = []
    for cut in cuts:  # what each slice would put into the group's all-reduce
        router_loss_sum([x[cut] for x in leaves], pack_ids[cut], 2, EXPERTS, all_reduce=recorded.append)
    summed = sum(recorded)
    parts = [
        router_loss_sum(
            [x[cut] for x in leaves], pack_ids[cut], 2, EXPERTS, all_reduce=lambda t: t.copy_(summed)
        )
        for cut in cuts
    ]
    assert_relatively_close(sum(parts), whole, FLOAT64_BOUND)
    assert_relatively_close(torch.autograd.grad(sum(parts), leaves), want, FLOAT64_BOUND)
    alone = [router_loss_sum([x[cut] for x in leaves], pack_ids[cut], 2, EXPERTS) for cut in cuts]
    assert (
        relative_error(sum(alone), whole) > 1e-3
    )  # the test can fail: a slice's own counts are not the pack's


def test_router_loss_runs_only_when_the_family_adds_one():
    assert router_loss_spec(tiny_moe(output_router_logits=False)) is None
    assert router_loss_spec(tiny_model("llama")) is None
    no_coefficient = tiny_moe()
    del no_coefficient.router_aux_loss_coef  # a family whose forward adds no router term (DeepSeek-V3, ...)
    assert router_loss_spec(no_coefficient) is None


def test_router_logits_of_another_shape_are_refused():
    """A family that routes otherwise (Doge's product keys give [2, tokens, keys]) is named, not guessed."""
    odd = [torch.zeros(2, 6, 2)]
    with pytest.raises(
        ValueError, match=r"router logits of shape \(2, 6, 2\) are not \[6 tokens, 4 experts\]"
    ):
        router_loss_sum(odd, torch.zeros(6, dtype=torch.long), 1, EXPERTS)


def test_a_micro_batch_without_packs_adds_no_router_loss():
    """Only filler (a group's inactive copy of a pack at the end of an epoch): exactly 0, no collective."""
    router_logits = [torch.randn(6, 4, dtype=torch.float64, requires_grad=True)]

    def no_collective(totals):
        raise AssertionError("called")

    total = router_loss_sum(router_logits, torch.full((6,), -1), 0, EXPERTS, all_reduce=no_collective)
    total.backward()
    assert total.item() == 0.0 and torch.equal(router_logits[0].grad, torch.zeros(6, 4, dtype=torch.float64))
