"""Linear-attention layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi-Linear): a packed row equals each sample alone.

Tiny float64 models of 4 layers, linear-attention and full-attention layers both present. The reference runs
every sample alone through transformers' sdpa: its eager attention takes the softmax in float32 whatever the
model's dtype (1e-7 off). These families compute more in float32 whatever the dtype (the delta rule, the
gated norm, the decay); where that rounding meets a sum over the tokens, packed and alone differ by float32
rounding and nothing else, and the tests say where.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT64_BOUND, assert_relatively_close, relative_error
from transformers import (
    KimiLinearConfig,
    KimiLinearForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.qwen3_next import modeling_qwen3_next

from longalign.patch import (
    UnsupportedModelError,
    apply,
    check_model,
    linear_attention,
    sequence_parallel_problems,
)

VOCAB = 128
LENGTHS = [45, 70, 29]  # the middle sample spans two of the delta rule's 64-token chunks
CU_SEQLENS = [0, 45, 115, 144]
LINEAR = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # linear, linear, linear, full: the families' default pattern
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    experts_implementation="eager",  # the default grouped_mm refuses float64 on CPU
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
KIMI = dict(
    {key: value for key, value in BASE.items() if key != "head_dim"},
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    linear_head_dim=8,
    linear_num_heads=4,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
# Qwen3.5 checkpoints carry multimodal RoPE settings; their text model gives every axis the same positions.
QWEN3_5_ROPE = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25, mrope_section=[1, 1, 0])
FAMILIES = {
    "qwen3_next": (Qwen3NextForCausalLM, Qwen3NextConfig, dict(BASE, **LINEAR, **MOE)),
    "qwen3_5": (
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        dict(BASE, **LINEAR, rope_parameters=dict(QWEN3_5_ROPE, mrope_interleaved=True)),
    ),
    "qwen3_5_moe": (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        dict({k: v for k, v in BASE.items() if k != "intermediate_size"}, **LINEAR, **MOE),
    ),
    # Dense MLPs: Kimi-Linear's router runs its linear layer in float32, whose rounding depends on how many
    # tokens it sees (~1e-9 in the logits, packed or not); the MoE variant below is held to a float32 bound.
    "kimi_linear": (KimiLinearForCausalLM, KimiLinearConfig, dict(KIMI, mlp_layer_types=["dense"] * 4)),
    "kimi_linear_moe": (KimiLinearForCausalLM, KimiLinearConfig, KIMI),
}
EXACT = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear"]
# Norms that transformers applies as (1 + weight.float()) * ...: their weights' gradients are float32 sums over
# the tokens, one sum over the pack against one per sample alone (~1e-7 apart); every other gradient is float64.
FLOAT32_SUMMED_NORMS = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def model_of(kind: str) -> torch.nn.Module:
    cls, config_cls, fields = FAMILIES[kind]
    torch.manual_seed(0)
    return cls(config_cls(**fields)).double()


def reference_of(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    reference.config.use_cache = False
    return reference


def packed_batch(boundaries: str = "cu_seq_lens") -> dict:
    """The collator's batch; ``boundaries="position_ids"`` leaves the cu_seq_lens keys out."""
    input_ids = torch.randint(3, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": input_ids, "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None]}
    if boundaries == "cu_seq_lens":
        cu_seq_lens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
        batch |= dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=70, max_length_k=70)
    return batch


def parts() -> list[slice]:
    return [slice(start, end) for start, end in zip(CU_SEQLENS, CU_SEQLENS[1:], strict=False)]


def summed_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="sum")


def alone(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample's logits run on its own, concatenated, and their summed next-token loss."""
    logits = [model(input_ids=input_ids[:, part]).logits for part in parts()]
    loss = sum(summed_loss(out, input_ids[:, part]) for out, part in zip(logits, parts(), strict=True))
    return torch.cat(logits, dim=1), loss


def packed(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(**batch).logits
    loss = sum(summed_loss(logits[:, part], batch["input_ids"][:, part]) for part in parts())
    return logits, loss


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters() if param.grad is not None}


def split_by_summation(model: torch.nn.Module, gradients: dict) -> tuple[dict, dict]:
    """``gradients`` split into (summed in float64, summed in float32 by ``FLOAT32_SUMMED_NORMS``)."""
    norms = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if type(module).__name__ in FLOAT32_SUMMED_NORMS
    }
    float64 = {name: grad for name, grad in gradients.items() if name not in norms}
    return float64, {name: grad for name, grad in gradients.items() if name in norms}


def assert_same_gradients(model: torch.nn.Module, actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    (actual64, actual32), (expected64, expected32) = (
        split_by_summation(model, g) for g in (actual, expected)
    )
    assert_relatively_close(actual64, expected64, FLOAT64_BOUND)
    if expected32:
        assert_relatively_close(actual32, expected32, 1e-6)


def run_both(kind: str, batch: dict, *, checkpointing: bool = False):
    """Logits and gradients of the patched model on the packed row, and of the reference on each sample."""
    model = model_of(kind).train()
    reference = reference_of(model)
    apply(model, backend="sdpa_segments")
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    logits, loss = packed(model, batch)
    loss.backward()
    expected_logits, expected_loss = alone(reference, batch["input_ids"])
    expected_loss.backward()
    return (logits, grads(model)), (expected_logits, grads(reference))


@pytest.mark.parametrize(
    "kind, boundaries",
    # position_ids alone: the decoder hook reads the boundaries (the same code for every family)
    [(kind, "cu_seq_lens") for kind in EXACT]
    + [("qwen3_next", "position_ids"), ("kimi_linear", "position_ids")],
)
def test_packed_equals_each_sample_alone(monkeypatch, kind, boundaries):
    model = model_of(kind)
    layer_class = type(linear_attention.linear_attention_layers(model)[0])
    seen = []
    real_forward = layer_class.forward

    def spy(layer, hidden_states, **kwargs):
        seen.append(hidden_states.shape[1])
        return real_forward(layer, hidden_states, **kwargs)

    monkeypatch.setattr(layer_class, "forward", spy)
    (logits, grads_packed), (expected, grads_alone) = run_both(kind, packed_batch(boundaries))

    torch.testing.assert_close(logits, expected, atol=1e-10, rtol=0)
    assert relative_error(logits, expected) <= 1e-12
    assert_same_gradients(model, grads_packed, grads_alone)
    # Packed, each linear-attention layer ran once per sample, on the tokens it ran on alone.
    layers = len(linear_attention.linear_attention_layers(model))
    assert seen == LENGTHS * layers + [n for n in LENGTHS for _ in range(layers)]


def test_gradient_checkpointing_recomputes_the_same_pieces():
    (logits, grads_packed), (expected, grads_alone) = run_both(
        "qwen3_next", packed_batch(), checkpointing=True
    )
    torch.testing.assert_close(logits, expected, atol=1e-10, rtol=0)
    assert_same_gradients(model_of("qwen3_next"), grads_packed, grads_alone)


def test_kimi_linear_with_experts_is_exact_to_its_float32_router():
    (logits, grads_packed), (expected, grads_alone) = run_both("kimi_linear_moe", packed_batch())
    assert relative_error(logits, expected) <= 1e-6
    assert_relatively_close(grads_packed, grads_alone, 1e-5)


@pytest.mark.parametrize("kind", EXACT)
def test_without_the_patch_the_state_runs_across_samples(kind):
    """The failure the patch prevents: transformers' own layers given the packed row's position_ids."""
    model = reference_of(model_of(kind))
    batch = packed_batch("position_ids")
    with torch.no_grad():
        leaked = model(**batch).logits
        expected, _ = alone(model, batch["input_ids"])
    assert relative_error(leaked[:, :45], expected[:, :45]) < 1e-12  # the first sample has nothing before it
    assert relative_error(leaked, expected) > 1e-2
    if kind.startswith("qwen"):  # handed cu_seq_lens_q, the torch delta rule refuses it
        with pytest.raises(
            ValueError, match="can't keep packed sequences apart without `flash-linear-attention`"
        ):
            model(**packed_batch())


def test_a_1d_mask_over_two_rows_keeps_the_samples_apart():
    """LongAlign's call: input_ids [2, 72] and boundaries over the 144 tokens; the middle sample crosses rows."""
    model = model_of("qwen3_next")
    reference = reference_of(model)
    apply(model, backend="sdpa_segments")
    ids = packed_batch()["input_ids"]
    with torch.no_grad():
        rows = model(input_ids=ids.view(2, 72), attention_mask=torch.tensor(CU_SEQLENS)).logits
        expected, _ = alone(reference, ids)
    torch.testing.assert_close(rows.view(1, 144, VOCAB), expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", EXACT)
def test_the_families_pass_the_checks_and_every_linear_layer_is_found(kind):
    model = model_of(kind)
    types = model.config.layer_types
    assert check_model(model) == "generic"
    assert linear_attention.install(model) == types.count("linear_attention") >= 2
    assert "full_attention" in types
    # Split over ranks, the linear layers would see one rank's slice of the pack.
    assert any(
        "linear_attention layers" in problem for problem in sequence_parallel_problems(model.config, 2)
    )


def test_the_multimodal_qwen3_5_stays_refused():
    """Images take 3D positions the collator does not make; only the text model is let through."""
    text = {key: value for key, value in FAMILIES["qwen3_5"][2].items() if key != "experts_implementation"}
    config = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=16, num_heads=2))
    with pytest.raises(UnsupportedModelError, match="Qwen3_5ForConditionalGeneration"):
        check_model(Qwen3_5ForConditionalGeneration(config))


def test_seq_idx_marks_each_token_s_sample():
    cu_seqlens = torch.tensor(CU_SEQLENS)
    seq_idx = linear_attention.seq_idx_of(cu_seqlens, 144)
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == (1, 144)
    assert seq_idx[0].bincount().tolist() == LENGTHS


def test_the_kernels_get_cu_seqlens_under_the_name_each_family_reads():
    """Qwen's forward renames cu_seq_lens_q to the kernel's cu_seqlens; Kimi-Linear's passes cu_seqlens on."""
    assert linear_attention.kernel_keyword(modeling_qwen3_next.Qwen3NextGatedDeltaNet) == "cu_seq_lens_q"
    assert linear_attention.kernel_keyword(modeling_kimi_linear.KimiLinearDeltaAttention) == "cu_seqlens"


def torch_path(function):
    """The torch function behind transformers' kernel wrapper: through ``__wrapped__``, and from transformers
    5.25 out of the kernels library's ``Func`` module that holds the wrapper."""
    if isinstance(function, torch.nn.Module):
        function = inspect.getclosurevars(type(function).forward).nonlocals["func"]
    return inspect.unwrap(function)


def varlen_conv(reference):
    """causal-conv1d's ``causal_conv1d_fn`` as a stand-in: ``seq_idx [1, T]`` restarts the convolution."""

    def conv(x, weight, bias=None, seq_idx=None, activation=None, **_):
        assert x.shape[0] == 1 and seq_idx is not None and seq_idx.dtype == torch.int32
        counts = torch.unique_consecutive(seq_idx[0], return_counts=True)[1].tolist()
        return torch.cat(
            [reference(x_i, weight, bias, activation) for x_i in x.split(counts, dim=-1)], dim=-1
        )

    return conv


def varlen_delta_rule(reference):
    """flash-linear-attention's chunked delta rule as a stand-in: ``cu_seqlens`` int64, batch 1, zero states."""

    def delta_rule(
        q, k, v, g, beta, *, cu_seqlens=None, initial_state=None, output_final_state=False, **options
    ):
        assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens.dtype == torch.long
        assert initial_state is None and not output_final_state
        counts = cu_seqlens.diff().tolist()
        options = {key: value for key, value in options.items() if key == "use_qk_l2norm_in_kernel"}
        pieces = zip(*(x.split(counts, dim=1) for x in (q, k, v, g, beta)), strict=True)
        return torch.cat([reference(*piece, **options)[0] for piece in pieces], dim=1), None

    return delta_rule


@pytest.mark.parametrize(
    "kind, module, rule",
    [
        ("qwen3_next", modeling_qwen3_next, "torch_chunk_gated_delta_rule"),
        ("kimi_linear", modeling_kimi_linear, "chunk_kimi_delta_attention"),
    ],
    ids=["qwen3_next", "kimi_linear"],
)
def test_the_varlen_kernel_call_keeps_samples_apart_with_stand_ins(monkeypatch, kind, module, rule):
    """The GPU branch's one call over the pack, its kernels replaced by CPU stand-ins with the libraries'
    keywords (the real ones need CUDA): the stand-ins see the boundaries, and the row equals each sample alone."""
    model = model_of(kind)
    reference = reference_of(model)
    apply(model, backend="sdpa_segments")
    with torch.no_grad():
        expected, _ = alone(reference, packed_batch()["input_ids"])
        monkeypatch.setattr(linear_attention, "kernels_ready", lambda hidden_states: True)
        monkeypatch.setattr(module, "causal_conv1d_fn", varlen_conv(torch_path(module.causal_conv1d_fn)))
        monkeypatch.setattr(module, rule, varlen_delta_rule(torch_path(getattr(module, rule))))
        logits = model(**packed_batch("position_ids")).logits
    torch.testing.assert_close(logits, expected, atol=1e-10, rtol=0)
