"""What transformers hands the attention function beyond q, k, v reaches varlen attention, exactly when packed:
Gemma 2's soft-capping (``softcap``) and gpt-oss's sinks (``s_aux``), each with its sliding-window layers.

Tiny models in float64, one packed row through ``longalign.patch.apply(model, backend="sdpa_segments")``
against each sample alone through transformers' eager attention: logits and the gradients of the summed
next-token loss within 1e-10 relative. The samples (29, 40 and 17 tokens) are longer than the windows (16).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FLOAT64_BOUND, packed_and_alone, relative_error
from transformers import AttentionInterface, Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.gemma2 import modeling_gemma2

import longalign.patch
import longalign.patch.interface

LENGTHS = [29, 40, 17]
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,  # sliding_attention, full_attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EAGER_IN_FLOAT64 = "float64_eager_reference"


def eager_in_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    """transformers' eager attention as Gemma 2 computes it, but with the softmax in the inputs' dtype
    (Gemma 2's own takes it in float32, ~1e-7 off in a float64 model): scores, cap, additive mask, softmax."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    return (scores.softmax(-1) @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(EAGER_IN_FLOAT64, eager_in_float64)
AttentionMaskInterface.register(EAGER_IN_FLOAT64, eager_mask)


@pytest.fixture
def gemma2_norms_in_float64(monkeypatch):
    """Gemma 2's RMSNorm computes in float32 whatever the model's dtype; its weight's gradient then sums the
    tokens in float32, in another order packed than alone (~1e-7). Here it computes in the input's dtype."""

    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    monkeypatch.setattr(modeling_gemma2.Gemma2RMSNorm, "forward", norm)


def gemma2(softcap: float | None = 50.0) -> Gemma2ForCausalLM:
    """A tiny Gemma 2 whose attention scores reach the cap of 50 (query/key projections scaled up)."""
    config = Gemma2Config(
        **SMALL,
        intermediate_size=64,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        query_pre_attn_scalar=8,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).double()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def gpt_oss() -> GptOssForCausalLM:
    """A tiny gpt-oss (4 experts, 2 per token) with sinks drawn from N(0, 1) (initialised at 0 they would be
    a constant 1 in every denominator)."""
    torch.manual_seed(0)
    config = GptOssConfig(**SMALL, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    model = GptOssForCausalLM(config).double()
    model.set_experts_implementation("eager")  # the grouped matmul takes no float64
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def patched_and_reference(model, reference_attention: str):
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(reference_attention)
    reference.config.use_cache = False
    return longalign.patch.apply(model.train(), backend="sdpa_segments"), reference.train()


def assert_packed_equals_alone(got: dict, want: dict) -> None:
    assert relative_error(got["logits"], want["logits"]) <= FLOAT64_BOUND
    assert relative_error(got["grads"], want["grads"]) <= FLOAT64_BOUND


def test_gemma2_soft_capped_attention_packed_equals_each_sample_alone(gemma2_norms_in_float64, monkeypatch):
    seen = []
    real = longalign.patch.interface.varlen_attention

    def spy(q, k, v, cu_seqlens, max_seqlen, **options):
        seen.append((options["softcap"], options["window"]))
        return real(q, k, v, cu_seqlens, max_seqlen, **options)

    monkeypatch.setattr(longalign.patch.interface, "varlen_attention", spy)
    got, want = packed_and_alone(*patched_and_reference(gemma2(), EAGER_IN_FLOAT64), LENGTHS)
    assert_packed_equals_alone(got, want)
    assert seen[:2] == [(50.0, 16), (50.0, None)]  # the sliding layer, then the full one


def test_gemma2_reference_is_transformers_eager_up_to_its_float32_softmax(gemma2_norms_in_float64):
    """The float64 reference above is Gemma 2's eager attention: the same to ~1e-7, where eager's float32
    softmax rounds; and the cap matters here far beyond that."""
    ids = torch.randint(3, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, softcap, attention in [
        ("eager", 50.0, "eager"),
        ("float64", 50.0, EAGER_IN_FLOAT64),
        ("uncapped", None, EAGER_IN_FLOAT64),
    ]:
        model = gemma2(softcap)
        model.set_attn_implementation(attention)
        with torch.no_grad():
            logits[name] = model(input_ids=ids, use_cache=False).logits
    assert relative_error(logits["eager"], logits["float64"]) <= 1e-6
    assert relative_error(logits["uncapped"], logits["float64"]) > 1e-3


def test_gpt_oss_sinks_packed_equal_each_sample_alone(monkeypatch):
    seen = []
    real = longalign.patch.interface.varlen_attention

    def spy(q, k, v, cu_seqlens, max_seqlen, **options):
        seen.append((options["sinks"] is not None, options["window"]))
        return real(q, k, v, cu_seqlens, max_seqlen, **options)

    monkeypatch.setattr(longalign.patch.interface, "varlen_attention", spy)
    got, want = packed_and_alone(*patched_and_reference(gpt_oss(), "eager"), LENGTHS)
    assert_packed_equals_alone(got, want)
    assert seen[:2] == [(True, 16), (True, None)]
    sinks = [name for name in want["grads"] if name.endswith("sinks")]
    assert len(sinks) == 2 and all(got["grads"][name].abs().min() > 0 for name in sinks)


def test_gpt_oss_sinks_matter_here():
    """Without its sinks (each at -1e4: nothing in the denominator) the model is another by ~1e-1."""
    model, reference = patched_and_reference(gpt_oss(), "eager")
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    got, want = packed_and_alone(model, reference, LENGTHS)
    assert relative_error(got["logits"], want["logits"]) > 1e-2
