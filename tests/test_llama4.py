"""Llama 4 packed: chunked attention restarts at every sample, the NoPE layers' temperature counts from it.

A tiny ``Llama4ForCausalLM`` (text only, 4 layers: 3 chunked RoPE layers and 1 NoPE layer; MoE layers of 2
experts) with ``attention_chunk_size`` 16 and temperature tuning from ``floor_scale`` 8, so that both act
within samples of 45, 70 and 29 tokens. Float64: one packed row through ``longalign.patch.apply(model,
backend="sdpa_segments")`` against each sample alone through transformers' eager attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FLOAT64_BOUND, packed_and_alone, relative_error
from transformers import Llama4ForCausalLM, Llama4TextConfig
from transformers.models.llama4 import modeling_llama4

import longalign.patch
import longalign.patch.interface
from longalign import attention
from longalign.patch import check_model, llama4

LENGTHS = [45, 70, 29]


@pytest.fixture(autouse=True)
def llama4_in_float64(monkeypatch):
    """Llama 4 computes RoPE, its q/k L2 norm and its router's sigmoid in float32 whatever the model's dtype.
    A pack and a sample alone reach them through matmuls of other shapes, ~1e-16 apart in float64, which
    float32 rounding turns into ~1e-8; here the three compute in the inputs' dtype, in both runs."""

    def rotate(xq, xk, freqs_cis):
        def turn(x):
            pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
            return torch.view_as_real(pairs * freqs_cis[:, :, None, :]).flatten(3)

        return turn(xq), turn(xk)

    def l2_norm(self, x):
        # variance_epsilon since transformers 5.25, eps before it
        eps = getattr(self, "variance_epsilon", None) or self.eps
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def route(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        top, chosen = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, chosen, top)
        return torch.sigmoid(scores), logits

    monkeypatch.setattr(modeling_llama4, "apply_rotary_emb", rotate)
    monkeypatch.setattr(modeling_llama4.Llama4TextL2Norm, "forward", l2_norm)
    monkeypatch.setattr(modeling_llama4.Llama4Router, "forward", route)


def llama4_model() -> Llama4ForCausalLM:
    config = Llama4TextConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,  # each expert's
        intermediate_size_mlp=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        attention_chunk_size=16,
        attn_temperature_tuning=True,
        floor_scale=8,
        attn_scale=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return Llama4ForCausalLM(config).double().train()


def patched_and_eager() -> tuple[Llama4ForCausalLM, Llama4ForCausalLM]:
    model = llama4_model()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")  # Llama 4's eager softmax keeps the model's dtype
    reference.config.use_cache = False
    return longalign.patch.apply(model, backend="sdpa_segments"), reference


def test_the_tiny_model_has_chunked_rope_layers_and_a_tuned_nope_layer():
    config = llama4_model().config
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert config.no_rope_layers == [1, 1, 1, 0] and config.moe_layers == [0, 1, 2, 3]


def test_packed_equals_each_sample_alone(monkeypatch):
    calls = []
    real = attention._BACKEND_FUNCTIONS["sdpa_segments"]

    def spy(q, k, v, cu_seqlens, max_seqlen, *args, **options):
        calls.append((cu_seqlens.diff().tolist(), max_seqlen))
        return real(q, k, v, cu_seqlens, max_seqlen, *args, **options)

    monkeypatch.setitem(attention._BACKEND_FUNCTIONS, "sdpa_segments", spy)
    model, reference = patched_and_eager()
    got, want = packed_and_alone(model, reference, LENGTHS)
    assert relative_error(got["logits"], want["logits"]) <= FLOAT64_BOUND
    assert relative_error(got["grads"], want["grads"]) <= FLOAT64_BOUND
    chunked = ([16, 16, 13, 16, 16, 16, 16, 6, 16, 13], 16)
    assert calls == [
        chunked,
        chunked,
        chunked,
        (LENGTHS, 70),
    ]  # 3 RoPE layers in chunks, the NoPE layer whole


@pytest.mark.parametrize("without", ["chunks", "temperature"])
def test_packing_without_either_fix_is_off(monkeypatch, without):
    """What the test above catches, measured: no chunks (as before) moves the logits by 0.75 and the gradients
    by 0.91; the NoPE layer's temperature from the row's offsets (transformers' own) by 3.3e-4 and 6.2e-4."""
    if without == "chunks":
        monkeypatch.setattr(longalign.patch.interface, "attention_chunk", lambda module: None)
    else:
        monkeypatch.setattr(llama4, "install", lambda model: 0)
    model, reference = patched_and_eager()
    got, want = packed_and_alone(model, reference, LENGTHS)
    assert relative_error(got["logits"], want["logits"]) > 1e-5


def test_install_hands_the_temperature_to_varlen_attention_only_while_it_is_selected():
    model = llama4_model()
    plain = copy.deepcopy(model).eval()
    assert llama4.install(model) == 1 and llama4.install(model) == 1  # the NoPE layer, once
    nope = model.model.layers[3].self_attn
    assert type(nope).__name__ == "Llama4TextAttention" and nope.packed_query_scale is not None
    assert not hasattr(model.model.layers[0].self_attn, "packed_query_scale")
    longalign.patch.apply(model, backend="sdpa_segments")
    assert nope.attn_temperature_tuning is False  # the varlen attention scales the queries
    model.set_attn_implementation("eager")
    assert nope.attn_temperature_tuning is True  # the layer's own scaling again, as for generation
    plain.set_attn_implementation("eager")
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids, use_cache=True).logits, plain(input_ids=ids).logits)


def test_temperature_counts_positions_from_each_sample_s_start():
    scales = llama4.temperature(torch.tensor([0, 6, 7, 15, 0, 7]), floor_scale=8, attn_scale=0.1)
    expected = 1 + 0.1 * torch.log1p(torch.tensor([0.0, 0.0, 1.0, 2.0, 0.0, 1.0]))
    torch.testing.assert_close(scales, expected)
    positions = longalign.patch.interface.positions_in_samples(
        torch.tensor([0, 16, 22], dtype=torch.int32), 22
    )
    assert positions.tolist() == [*range(16), *range(6)]


def test_llama4_is_a_named_family():
    assert check_model(llama4_model()) == "Llama 4"
