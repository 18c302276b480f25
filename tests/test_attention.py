"""Every attention backend against a dense block-diagonal reference: values, gradients, refusals."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import assert_relatively_close, kept_kernel_calls, relative_error
from hypothesis import given, settings
from hypothesis import strategies as st

from longalign import attention
from longalign.attention import (
    available_backends,
    chunked_cu_seqlens,
    cu_seqlens_from_position_ids,
    resolve_backend,
    varlen_attention,
)
from longalign.config import BACKENDS
from longalign.errors import ConfigError

GPU_BACKENDS = ("flash_attn", "flash_attn_cute", "torch_varlen")
CPU = torch.device("cpu")


def allowed_pairs(
    cu_seqlens: torch.Tensor,
    *,
    causal: bool,
    left: int | None,
    right: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``[T, T]`` bool: query i may see key j (same sample, j in [i - left, i + right]; None = unbounded;
    with ``chunk``, also the same chunk of ``chunk`` tokens counted from the sample's start).

    cu_seqlens [0, 2, 3], causal::

        1 0 0
        1 1 0
        0 0 1
    """
    sample = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long())
    position = torch.arange(len(sample))
    offset = position[None, :] - position[:, None]  # key minus query
    allowed = sample[:, None] == sample[None, :]
    if chunk is not None:
        within = position - cu_seqlens.long()[sample]
        allowed &= (within[:, None] // chunk) == (within[None, :] // chunk)
    if causal:
        allowed &= offset <= 0
    if left is not None:
        allowed &= offset >= -left
    if right is not None:
        allowed &= offset <= right
    return allowed


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain softmax attention on ``[T, H, D]`` with K/V heads repeated: slow and obvious.

    ``softcap``: scores become ``softcap * tanh(scores / softcap)``. ``sinks [H]``: every query also sees one
    more key, of score ``sinks[h]`` and value zero.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)], dim=-1)
        v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def dense_reference(
    q, k, v, cu_seqlens, *, causal=True, scale=None, window=None, softcap=None, sinks=None, chunk=None
):
    """What ``varlen_attention`` promises, through one dense mask (window: itself plus window-1 before)."""
    reach = None if window is None else window - 1
    allowed = allowed_pairs(
        cu_seqlens, causal=causal, left=reach, right=None if causal else reach, chunk=chunk
    )
    return masked_attention(q, k, v, allowed, scale, softcap, sinks)


def random_pack(lengths, q_heads, kv_heads, head_dim, dtype=torch.float64, device=CPU, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, head_dim, generator=generator, dtype=dtype).to(device).requires_grad_()
        for heads in (q_heads, kv_heads, kv_heads)
    )
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


def values_and_grads(function, q, k, v, cotangent):
    out = function(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), cotangent))


def test_auto_is_sdpa_segments_on_cpu():
    assert resolve_backend("cpu", torch.float32) == "sdpa_segments"
    assert resolve_backend("cpu", torch.bfloat16, window=8, dropout=0.1) == "sdpa_segments"
    assert list(available_backends("cpu", torch.float32)) == list(BACKENDS)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 17), min_size=1, max_size=6),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([4, 8]),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 6),
    scale=st.none() | st.just(0.3),
    seed=st.integers(0, 2**16),
)
def test_sdpa_segments_matches_dense_reference(
    lengths, kv_heads, group, head_dim, causal, window, scale, seed
):
    q, k, v, cu_seqlens = random_pack(lengths, kv_heads * group, kv_heads, head_dim, seed=seed)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype).to(q.device)
    options = {"causal": causal, "scale": scale, "window": window}
    got = values_and_grads(
        lambda q, k, v: varlen_attention(
            q, k, v, cu_seqlens, max(lengths), backend="sdpa_segments", **options
        ),
        q,
        k,
        v,
        cotangent,
    )
    expected = values_and_grads(
        lambda q, k, v: dense_reference(q, k, v, cu_seqlens, **options), q, k, v, cotangent
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 17), min_size=1, max_size=5),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 6),
    softcap=st.none() | st.sampled_from([0.5, 3.0]),
    with_sinks=st.booleans(),
    chunk=st.none() | st.integers(1, 7),
    per_kv_head=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_softcap_sinks_and_chunks_match_dense_reference(
    lengths, kv_heads, group, causal, window, softcap, with_sinks, chunk, per_kv_head, seed
):
    """sdpa_segments with Gemma 2's soft-capping, gpt-oss's sinks and Llama 4's chunks, any mix, against
    one dense float64 softmax: values and the gradients of q, k, v and the sinks."""
    q, k, v, cu_seqlens = random_pack(lengths, kv_heads * group, kv_heads, 8, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    sinks = (
        torch.randn(q.shape[1], generator=generator, dtype=q.dtype).requires_grad_() if with_sinks else None
    )
    cotangent = torch.randn(q.shape, generator=generator, dtype=q.dtype)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    options = {"causal": causal, "window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
    out = varlen_attention(
        q, k, v, cu_seqlens, max(lengths), backend="sdpa_segments", per_kv_head=per_kv_head, **options
    )
    expected = dense_reference(q, k, v, cu_seqlens, **options)
    torch.testing.assert_close(out, expected)
    got = torch.autograd.grad(out, inputs, cotangent)
    want = torch.autograd.grad(expected, inputs, cotangent)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=False):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_a_sink_takes_its_share_of_the_softmax_and_no_value():
    """One query, two keys of scores 0 and ln 3, a sink of ln 4: weights 1/8 and 3/8, the sink's 4/8 lost."""
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64).expand(2, 1, 2).contiguous()
    k = torch.tensor(
        [[[0.0, 0.0]], [[2**0.5 * torch.log(torch.tensor(3.0)).item(), 0.0]]], dtype=torch.float64
    )
    v = torch.tensor([[[8.0, 0.0]], [[0.0, 8.0]]], dtype=torch.float64)
    sinks = torch.log(torch.tensor([4.0], dtype=torch.float64))
    out = varlen_attention(q, k, v, torch.tensor([0, 2]), 2, sinks=sinks)
    torch.testing.assert_close(out[1, 0], torch.tensor([1.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(out[0, 0], torch.tensor([8 / 5, 0.0], dtype=torch.float64))  # sees key 0 alone


def test_chunks_restart_at_every_sample_s_start():
    cu_seqlens = chunked_cu_seqlens(torch.tensor([0, 45, 115, 144], dtype=torch.int32), 16)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == [0, 16, 32, 45, 61, 77, 93, 109, 115, 131, 144]
    assert chunked_cu_seqlens(torch.tensor([0, 0, 5, 5]), 4).tolist() == [0, 4, 5]  # empty samples vanish


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 12))
def test_chunked_cu_seqlens_cut_each_sample_into_chunks(lengths, chunk):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    pieces = chunked_cu_seqlens(cu_seqlens, chunk).diff().tolist()
    expected = [min(chunk, n - start) for n in lengths for start in range(0, n, chunk)]
    assert pieces == expected


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_available_backend_matches_reference_on_cpu(dtype, tolerance):
    lengths = [1, 9, 1, 30, 4, 1]  # odd lengths and single-token samples
    q, k, v, cu_seqlens = random_pack(lengths, 6, 2, 16, dtype=dtype)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = values_and_grads(
        lambda q, k, v: dense_reference(q.double(), k.double(), v.double(), cu_seqlens), q, k, v, cotangent
    )
    runnable = [name for name, reason in available_backends(CPU, dtype).items() if reason is None]
    assert "sdpa_segments" in runnable
    for name in runnable:
        got = values_and_grads(
            lambda q, k, v, name=name: varlen_attention(q, k, v, cu_seqlens, 30, backend=name),
            q,
            k,
            v,
            cotangent,
        )
        for a, b in zip(got, expected, strict=True):
            assert_relatively_close(a, b, tolerance)


def test_single_token_samples_return_their_own_values():
    q, k, v, cu_seqlens = random_pack([1, 1, 1], 4, 2, 8)
    out = varlen_attention(q, k, v, cu_seqlens, 1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1))


def test_samples_do_not_see_each_other():
    q, k, v, cu_seqlens = random_pack([5, 4], 2, 2, 8)
    out = varlen_attention(q, k, v, cu_seqlens, 5)
    second_alone = varlen_attention(q[5:], k[5:], v[5:], torch.tensor([0, 4]), 4)
    torch.testing.assert_close(out[5:], second_alone)


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backends_refuse_cpu_tensors_and_say_why(name):
    reason = available_backends(CPU, torch.float32)[name]
    assert "needs a CUDA device" in reason and "needs float16 or bfloat16, got float32" in reason
    q, k, v, cu_seqlens = random_pack([3, 2], 2, 2, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"attention backend '{name}' cannot run here: .*CUDA"):
        varlen_attention(q, k, v, cu_seqlens, 3, backend=name)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_missing_flash_attn_is_reported_as_not_installed():
    assert available_backends(CPU, torch.bfloat16)["flash_attn"].startswith(
        "not installed (pip install flash-attn"
    )


def test_torch_varlen_refuses_dropout_but_honours_windows():
    reasons = available_backends(CPU, torch.bfloat16, window=4, dropout=0.1)
    assert "varlen_attn has no attention dropout" in reasons["torch_varlen"]
    assert "sliding window" not in reasons["torch_varlen"]


def every_kernel_on_cpu(monkeypatch):
    """The kernel backends whose module imports here (torch's varlen_attn) pass the device check on CPU."""
    monkeypatch.setattr(attention, "_device_problem", lambda name, device: None)


def test_torch_varlen_refuses_softcap_in_one_line_and_auto_skips_it(monkeypatch):
    every_kernel_on_cpu(monkeypatch)
    assert resolve_backend(CPU, torch.bfloat16) == "torch_varlen"  # flash-attn is not installed here
    assert resolve_backend(CPU, torch.bfloat16, softcap=50.0) == "sdpa_segments"
    q, k, v, cu_seqlens = random_pack([3, 2], 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as error:
        varlen_attention(q, k, v, cu_seqlens, 3, softcap=50.0, backend="torch_varlen")
    assert str(error.value) == (
        "attention backend 'torch_varlen' cannot run here: torch.nn.attention.varlen.varlen_attn has no "
        "attention logit soft-capping (Gemma 2's attn_logit_softcapping): use flash_attn (FlashAttention 2/3), "
        "flash_attn_cute (FlashAttention 4) or sdpa_segments"
    )


def test_kernels_without_learnable_sink_refuse_sinks_and_auto_skips_them(monkeypatch):
    every_kernel_on_cpu(monkeypatch)
    sinks = torch.zeros(4)
    assert resolve_backend(CPU, torch.bfloat16, sinks=sinks) == "sdpa_segments"
    reason = available_backends(CPU, torch.bfloat16, sinks=sinks)["torch_varlen"]
    assert reason == (
        "torch.nn.attention.varlen.varlen_attn has no attention sinks (gpt-oss), and the log-sum-exp it returns "
        "passes no gradient back: use flash_attn_cute (FlashAttention 4) or sdpa_segments"
    )


def fa2_signature(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):  # fmt: skip
    """flash-attn 2.8.3's ``flash_attn_varlen_func``: soft-capping, no sinks."""
    raise AssertionError("never called")


def fa4_signature(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0,
    return_lse=False,
):  # fmt: skip
    """flash-attn-4's ``flash_attn_varlen_func`` (the arguments longalign uses): both."""
    raise AssertionError("never called")


@pytest.mark.parametrize(
    "name, signature, softcap_refused, sinks_refused",
    [("flash_attn", fa2_signature, False, True), ("flash_attn_cute", fa4_signature, False, False)],
)
def test_flash_kernels_take_softcap_and_only_fa4_takes_sinks(
    monkeypatch, name, signature, softcap_refused, sinks_refused
):
    every_kernel_on_cpu(monkeypatch)
    monkeypatch.setattr(attention, "_kernel", lambda _: (signature, None))
    with_softcap = available_backends(CPU, torch.bfloat16, softcap=50.0)[name]
    with_sinks = available_backends(CPU, torch.bfloat16, sinks=torch.zeros(4))[name]
    assert (with_softcap is not None) == softcap_refused and (with_sinks is not None) == sinks_refused
    if sinks_refused:
        assert "has no attention sinks (gpt-oss)" in with_sinks and "use flash_attn_cute" in with_sinks


def test_kernel_without_window_refuses_sliding_window(monkeypatch):
    def flash_attn_varlen_func(  # flash-attn 2.2 and older
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, return_attn_probs=False,
    ):  # fmt: skip
        raise AssertionError("never called")

    monkeypatch.setattr(attention, "_kernel", lambda name: (flash_attn_varlen_func, None))
    assert "cannot apply a sliding window" in available_backends(CPU, torch.bfloat16, window=4)["flash_attn"]
    assert "sliding window" not in available_backends(CPU, torch.bfloat16)["flash_attn"]
    assert "too old" not in available_backends(CPU, torch.bfloat16)["flash_attn"]


def test_kernel_too_old_for_the_adapter_is_refused(monkeypatch):
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("never called")

    monkeypatch.setattr(attention, "_kernel", lambda name: (varlen_attn, None))
    reason = available_backends(CPU, torch.bfloat16)["torch_varlen"]
    assert "is too old: it takes no scale, window_size, enable_gqa" in reason


def test_bad_arguments_are_errors():
    q, k, v, cu_seqlens = random_pack([3, 2], 4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        varlen_attention(q, k, v, cu_seqlens, 3, backend="flash")
    with pytest.raises(ValueError, match="not a multiple"):
        varlen_attention(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), cu_seqlens, 3)
    with pytest.raises(ValueError, match="must rise from 0 to the 5 tokens"):
        varlen_attention(q, k, v, torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="window must be a positive"):
        varlen_attention(q, k, v, cu_seqlens, 3, window=0)
    with pytest.raises(ValueError, match=r"\[total_tokens, heads, head_dim\]"):
        varlen_attention(q[None], k[None], v[None], cu_seqlens, 3)


# Stand-ins that follow each kernel's documented call convention, run on CPU through the dense reference:
# they check how the adapters spell causality, windows, GQA and scale, which no CPU machine can run for real.
def fake_flash_attn(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0,
):  # fmt: skip
    """flash_attn (FA2): window_size is inclusive (left, right), -1 = unbounded; softcap 0.0 = none."""
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q is cu_seqlens_k and dropout_p == 0.0
    left, right = (None if reach == -1 else reach for reach in window_size)
    allowed = allowed_pairs(cu_seqlens_q, causal=causal, left=left, right=right)
    return masked_attention(q, k, v, allowed, softmax_scale, softcap or None)


def fake_flash_attn_cute(
    q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
    causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, return_lse=False,
):  # fmt: skip
    """flash_attn.cute (FA4): None = unbounded, learnable_sink float32 [Hq], and it returns (out, lse)."""
    assert learnable_sink is None or learnable_sink.dtype == torch.float32
    left, right = window_size
    allowed = allowed_pairs(cu_seqlens_q, causal=causal, left=left, right=right)
    sinks = None if learnable_sink is None else learnable_sink.to(q.dtype)
    return masked_attention(q, k, v, allowed, softmax_scale, softcap or None, sinks), None


def fake_torch_varlen(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """torch varlen_attn: no causal flag; (-1, 0) means causal, (W, 0) a causal window."""
    assert enable_gqa == (query.shape[1] != key.shape[1])
    left, right = (None if reach == -1 else reach for reach in window_size)
    allowed = allowed_pairs(cu_seq_q, causal=tuple(window_size) == (-1, 0), left=left, right=right)
    return masked_attention(query, key, value, allowed, scale)


@pytest.mark.parametrize(
    "name, fake",
    [
        ("flash_attn", fake_flash_attn),
        ("flash_attn_cute", fake_flash_attn_cute),
        ("torch_varlen", fake_torch_varlen),
    ],
)
@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
def test_kernel_adapters_speak_each_kernels_convention(monkeypatch, name, fake, causal, window):
    monkeypatch.setattr(attention, "_kernel", lambda _: (fake, None))
    q, k, v, cu_seqlens = random_pack([4, 1, 7], 4, 2, 8)
    run = attention._BACKEND_FUNCTIONS[name]
    got = run(q, k, v, cu_seqlens, 7, causal, 0.25, 0.0, window)
    expected = dense_reference(q, k, v, cu_seqlens, causal=causal, scale=0.25, window=window)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "name, fake, with_sinks",
    [("flash_attn", fake_flash_attn, False), ("flash_attn_cute", fake_flash_attn_cute, True)],
)
@pytest.mark.parametrize("window", [None, 3])
def test_kernel_adapters_pass_softcap_and_sinks(monkeypatch, name, fake, with_sinks, window):
    monkeypatch.setattr(attention, "_kernel", lambda _: (fake, None))
    q, k, v, cu_seqlens = random_pack([4, 1, 7], 4, 2, 8)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2), dtype=q.dtype) if with_sinks else None
    run = attention._BACKEND_FUNCTIONS[name]
    got = run(q, k, v, cu_seqlens, 7, True, 0.25, 0.0, window, softcap=0.5, sinks=sinks)
    expected = dense_reference(q, k, v, cu_seqlens, scale=0.25, window=window, softcap=0.5, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # the fake takes the sinks in float32


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA; benchmarks/gpu_check.py runs these checks on a GPU machine",
)
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 64])
def test_gpu_backend_matches_sdpa_segments_in_bf16(name, window):
    device = torch.device("cuda")
    reason = available_backends(device, torch.bfloat16, window=window)[name]
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    lengths = [1, 300, 17, 1, 1000, 129]
    q, k, v, cu_seqlens = random_pack(lengths, 8, 2, 64, dtype=torch.bfloat16, device=device)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype).to(q.device)
    expected = values_and_grads(
        lambda q, k, v: varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, 1000, window=window),
        q,
        k,
        v,
        cotangent,
    )
    got = values_and_grads(
        lambda q, k, v: varlen_attention(q, k, v, cu_seqlens, 1000, window=window, backend=name),
        q,
        k,
        v,
        cotangent,
    )
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)


def test_cu_seqlens_from_position_ids():
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1]]))
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 4, 6] and max_seqlen == 3
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2], [3, 4, 5]]))
    assert cu_seqlens.tolist() == [0, 3, 6] and max_seqlen == 3  # every row starts a sample


@given(st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_cu_seqlens_round_trip_through_position_ids(lengths):
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    cu_seqlens, max_seqlen = cu_seqlens_from_position_ids(position_ids)
    assert cu_seqlens.diff().tolist() == lengths and max_seqlen == max(lengths)


# ---- per_kv_head: the kernel's forward once, its backward from the kept output and log-sum-exp


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None), (False, 2)])
@pytest.mark.parametrize("softcap", [None, 0.8])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("chunk", [None, 4])
def test_the_cpu_kernel_s_backward_from_out_and_lse_is_autograd_of_the_formula(
    causal, window, softcap, with_sinks, chunk
):
    """``sdpa_segments``' forward with its log-sum-exp and its backward from ``out``, ``lse`` and ``dout``
    (what ``_PerKVHead`` calls), against autograd of the plain softmax over one dense mask, in float64.
    Three query heads on one key/value head, as one group of ``per_kv_head`` sees them."""
    lengths = [5, 1, 9]
    q, k, v, cu_seqlens = random_pack(lengths, 3, 1, 8, seed=3)
    q = (q * 2).detach().requires_grad_()  # scores of a few units, where a cap of 0.8 bends them
    generator = torch.Generator().manual_seed(4)
    sinks = torch.randn(3, generator=generator, dtype=q.dtype).requires_grad_() if with_sinks else None
    dout = torch.randn(q.shape, generator=generator, dtype=q.dtype)
    options = {"causal": causal, "window": window, "softcap": softcap, "sinks": sinks, "chunk": chunk}
    expected = dense_reference(q, k, v, cu_seqlens, **options)
    inputs = [q, k, v] + ([sinks] if with_sinks else [])
    want = torch.autograd.grad(expected, inputs, dout)

    pieces = cu_seqlens if chunk is None else attention.chunked_cu_seqlens(cu_seqlens, chunk)
    call = attention._Call(pieces, max(lengths), causal, None, window, softcap)
    detached = [x.detach() for x in (q, k, v)]
    out, lse = attention._segments_forward(*detached, None if sinks is None else sinks.detach(), call)
    got = attention._segments_backward(
        dout, *detached, out, lse, None if sinks is None else sinks.detach(), call
    )

    assert relative_error(out, expected) <= 1e-12
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=False):
        assert relative_error(a, b) <= 1e-10, name
    assert (got[3] is None) == (not with_sinks)


def test_per_kv_head_runs_each_group_s_forward_once_and_its_backward_once():
    """In a small autograd graph (a projection before, a loss after), ``per_kv_head`` calls each key/value
    group's forward once in forward and, in backward, only the kernel's backward: no forward runs again.
    Values and gradients, sinks' included, equal the whole kernel's (float64)."""
    q, k, v, cu_seqlens = random_pack([6, 1, 8], 6, 3, 8, seed=5)
    weight = torch.randn(8, 8, dtype=q.dtype, generator=torch.Generator().manual_seed(6), requires_grad=True)
    sinks = torch.randn(6, dtype=q.dtype, generator=torch.Generator().manual_seed(7), requires_grad=True)
    options = {"cu_seqlens": cu_seqlens, "max_seqlen": 8, "window": 4, "softcap": 2.0, "sinks": sinks}

    def loss_and_grads(per_kv_head: bool) -> list[torch.Tensor]:
        out = varlen_attention(q @ weight, k, v, per_kv_head=per_kv_head, **options)
        loss = (out.tanh() ** 2).sum()
        return [loss, *torch.autograd.grad(loss, (q, k, v, weight, sinks))]

    want = loss_and_grads(False)
    with kept_kernel_calls("sdpa_segments") as calls:
        got = loss_and_grads(True)
    assert calls == ["forward"] * 3 + ["backward"] * 3
    assert relative_error(got, want) <= 1e-12


def test_per_kv_head_without_a_callable_backward_runs_each_group_through_the_kernel_s_autograd(monkeypatch):
    """A backend whose kernel's backward longalign cannot call (none registered, as for a kernel put in by
    the memory simulation): each group runs through the kernel's own autograd, values and gradients as
    whole (float64)."""
    q, k, v, cu_seqlens = random_pack([6, 1, 8], 4, 2, 8, seed=8)
    sinks = torch.randn(4, dtype=q.dtype, generator=torch.Generator().manual_seed(9), requires_grad=True)
    cotangent = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(10))
    options = {"cu_seqlens": cu_seqlens, "max_seqlen": 8, "softcap": 2.0, "sinks": sinks}
    want = varlen_attention(q, k, v, **options)
    heads = []
    whole = attention._BACKEND_FUNCTIONS["sdpa_segments"]

    def recorded(q, k, v, *args, **kwargs):
        heads.append((q.shape[1], k.shape[1]))
        return whole(q, k, v, *args, **kwargs)

    monkeypatch.delitem(attention._KEPT_FUNCTIONS, "sdpa_segments")
    monkeypatch.setitem(attention._BACKEND_FUNCTIONS, "sdpa_segments", recorded)
    got = varlen_attention(q, k, v, per_kv_head=True, **options)
    assert heads == [(2, 1), (2, 1)]
    inputs = (q, k, v, sinks)
    grads_got, grads_want = (torch.autograd.grad(x, inputs, cotangent) for x in (got, want))
    assert relative_error([got, *grads_got], [want, *grads_want]) <= 1e-12
