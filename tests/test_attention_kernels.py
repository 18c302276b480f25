"""longalign's GPU backends through their kernels' real Python layers, on CPU (``kernel_standins.py``).

flash-attn's released ``flash_attn_interface.py`` and PyTorch's ``torch/nn/attention/varlen.py`` run
unmodified; only the compiled kernel below each is a stand-in that checks what the kernel checks and
computes exactly. So these tests catch what longalign can get wrong at that boundary (a dtype, an int64
or non-contiguous ``cu_seqlens``, a window or causality spelled the other kernel's way, GQA heads), and
the values and gradients that come back, alone and inside one training step of a packed model.
FlashAttention 4's interface needs the CUDA DSL to import: our exact call is bound to its parsed
signature instead.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import kept_kernel_calls, launch, needs_deepspeed, needs_launcher, relative_error, tiny_model
from kernel_standins import (
    CACHE,
    FLASH_ATTN_VERSION,
    STOOD_IN,
    KernelPreconditionError,
    SourcesUnavailable,
    flash_attn_sources,
    kernels_on_cpu,
    load_flash_attn,
)
from sequence_parallel_run import outcome
from tiled_mlp_run import one_step, reference_step

from longalign import attention
from longalign.attention import available_backends, varlen_attention

# Each element of a bf16 result computed exactly and rounded to nearest once is within 2^-9 of it
# relatively, and so is the whole tensor by norm; 2^-8 leaves room for the float64 reference's own
# rounding (~1e-16). A real fault (a sample seeing another, a wrong window, scale or head group) is off
# by 1e-1 or more.
BF16_BOUND = 2.0**-8
FA4_VERSION = "4.0.0b36"  # the pre-release docs/install.md pins


@pytest.fixture(scope="module", params=list(STOOD_IN))
def kernel(request):
    """A kernel (FA2, FA3, torch varlen) whose real Python layer runs over its stand-in; ``STOOD_IN[kernel]``
    is the longalign backend that calls it."""
    try:
        with kernels_on_cpu(request.param):
            yield request.param
    except SourcesUnavailable as error:
        pytest.skip(f"{request.param}'s Python layer is not available here: {error}")


def pack(lengths, q_heads, kv_heads, head_dim=16, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(sum(lengths), heads, head_dim, generator=generator).to(dtype).requires_grad_()
        for heads in (q_heads, kv_heads, kv_heads)
    )
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


def values_and_grads(q, k, v, cotangent, **options):
    out = varlen_attention(q, k, v, **options)
    return [out, *torch.autograd.grad(out, (q, k, v), cotangent)]


@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa-4", "mqa"])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, None), (False, 3)])
@pytest.mark.parametrize("lengths", [[1, 9, 1, 30, 4, 1], [1, 1, 1]], ids=["long-tail", "one-token"])
def test_backend_equals_sdpa_segments_in_float64(kernel, heads, causal, window, lengths):
    backend = STOOD_IN[kernel]
    q, k, v, cu_seqlens = pack(lengths, *heads)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    options = {"cu_seqlens": cu_seqlens, "max_seqlen": max(lengths), "causal": causal, "window": window}
    got = values_and_grads(q, k, v, cotangent, backend=backend, **options)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = values_and_grads(q64, k64, v64, cotangent.double(), backend="sdpa_segments", **options)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape, name
        assert relative_error(a, b) <= BF16_BOUND, f"{name}: {relative_error(a, b):.3g}"


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa-4"])
@pytest.mark.parametrize(
    "window, softcap, chunk", [(None, 2.0, None), (5, 2.0, None), (None, None, 4), (3, 2.0, 4)]
)
def test_softcap_and_chunks_reach_the_kernel(kernel, heads, window, softcap, chunk):
    """Gemma 2's soft-capping goes to the kernel (FlashAttention 2/3; torch's varlen_attn refuses it) and
    Llama 4's chunks become samples of their own that every kernel runs."""
    backend = STOOD_IN[kernel]
    lengths = [1, 9, 1, 30, 4, 1]
    q, k, v, cu_seqlens = pack(lengths, *heads)
    q = (q * 4).detach().requires_grad_()  # scores of a few units, where a cap of 2 bends them
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    options = {
        "cu_seqlens": cu_seqlens,
        "max_seqlen": 30,
        "window": window,
        "softcap": softcap,
        "chunk": chunk,
    }
    if softcap is not None and kernel == "torch_varlen":
        with pytest.raises(ValueError, match="varlen_attn has no attention logit soft-capping"):
            varlen_attention(q, k, v, backend=backend, **options)
        return
    got = values_and_grads(q, k, v, cotangent, backend=backend, **options)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = values_and_grads(q64, k64, v64, cotangent.double(), backend="sdpa_segments", **options)
    uncapped = varlen_attention(q64, k64, v64, **{**options, "softcap": None}, backend="sdpa_segments")
    if softcap is not None:
        assert relative_error(uncapped, want[0]) > 0.1  # the cap matters here
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative_error(a, b) <= BF16_BOUND, f"{name}: {relative_error(a, b):.3g}"


def test_flash_attn_2_s_log_sum_exp_carries_no_gradient():
    """Why sinks are refused on flash-attn 2: out * sigmoid(lse - sink) needs the gradient through lse, and
    ``flash_attn_varlen_func(..., return_attn_probs=True)`` hands back an lse whose gradient its backward
    drops (it differentiates ``out`` alone): zero where the true gradient is not."""
    try:
        flash_attn = load_flash_attn()
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")
    q, k, v, cu_seqlens = pack([5, 4], 4, 2)
    with kernels_on_cpu("flash_attn"):
        out, lse, _ = flash_attn.flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, 5, 5, causal=True, return_attn_probs=True
        )
        dq_through_lse = torch.autograd.grad(lse.sum(), q)[0]
        reason = available_backends("cpu", torch.bfloat16, sinks=torch.zeros(4))["flash_attn"]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, dim=1)) / 4
    mask = torch.block_diag(torch.ones(5, 5), torch.ones(4, 4)).tril().bool()
    true_lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    assert relative_error(lse, true_lse) <= 1e-6  # the value is right ...
    assert torch.count_nonzero(dq_through_lse) == 0  # ... its gradient is not there
    assert torch.autograd.grad(true_lse.sum(), q)[0].abs().max() > 0.1
    assert "has no attention sinks (gpt-oss)" in reason and "use flash_attn_cute" in reason


def test_a_sample_attends_only_to_itself(kernel):
    backend = STOOD_IN[kernel]
    q, k, v, cu_seqlens = pack([5, 4], 4, 2)
    out = varlen_attention(q, k, v, cu_seqlens, 5, backend=backend)
    alone = varlen_attention(q[5:], k[5:], v[5:], torch.tensor([0, 4]), 4, backend=backend)
    assert torch.equal(out[5:], alone)  # exact per sample, so bit for bit


def test_longalign_hands_the_kernel_int32_cu_seqlens_whatever_it_is_given(kernel):
    backend = STOOD_IN[kernel]
    q, k, v, cu_seqlens = pack([3, 6], 4, 2)
    strided = torch.tensor([0, -1, 3, -1, 9], dtype=torch.int32)[::2]  # a view, not contiguous
    for given in (cu_seqlens.long(), strided, cu_seqlens.tolist()):
        given = torch.as_tensor(given)
        torch.testing.assert_close(
            varlen_attention(q, k, v, given, 6, backend=backend),
            varlen_attention(q, k, v, cu_seqlens, 6, backend=backend),
        )


# What a kernel's own Python layer mends before its kernel sees it.
REPAIRED_BY_THE_PYTHON_LAYER = {
    ("flash_attn", "head size 12"),  # flash-attn pads the head to a multiple of 8, and cuts the output back
    ("flash_attn_3", "strided cu_seqlens"),  # FA3 makes cu_seqlens contiguous
}


@pytest.mark.parametrize(
    "fault, message",
    [
        ("int64 cu_seqlens", "cu_seqlens_q must have dtype int32"),
        ("strided cu_seqlens", "cu_seqlens_q must be contiguous"),
        ("float32 tensors", "only support fp16 and bf16"),
        ("mixed dtypes", "must have the same dtype"),
        ("head size 12", "head_size must be a multiple of 8"),
        ("short max_seqlen", "max_seqlen 3 is shorter than a sample of 6"),
        ("cu_seqlens past the tokens", r"must rise from 0 to the 9 tokens"),
    ],
)
def test_the_stand_in_refuses_what_the_kernel_refuses(kernel, fault, message):
    """Behind longalign's checks, the adapter alone: what reaches the kernel must pass the kernel's own."""
    backend = STOOD_IN[kernel]
    q, k, v, cu_seqlens = pack([3, 6], 4, 2)
    max_seqlen = 6
    if fault == "int64 cu_seqlens":
        cu_seqlens = cu_seqlens.long()
    elif fault == "strided cu_seqlens":
        cu_seqlens = torch.tensor([0, 99, 3, 99, 9, 99], dtype=torch.int32)[::2]
    elif fault == "float32 tensors":
        q, k, v = q.float(), k.float(), v.float()
    elif fault == "mixed dtypes":
        v = v.half()
    elif fault == "head size 12":
        q, k, v = (x[..., :12] for x in (q, k, v))
    elif fault == "short max_seqlen":
        max_seqlen = 3
    elif fault == "cu_seqlens past the tokens":
        cu_seqlens = torch.tensor([0, 3, 10], dtype=torch.int32)
    run = attention._BACKEND_FUNCTIONS[backend]
    if (kernel, fault) in REPAIRED_BY_THE_PYTHON_LAYER:
        assert run(q, k, v, cu_seqlens, max_seqlen, True, None, 0.0, None).shape == q.shape
        return
    with pytest.raises(KernelPreconditionError, match=message):
        run(q, k, v, cu_seqlens, max_seqlen, True, None, 0.0, None)


def test_flash_attn_is_the_released_interface_running_unmodified():
    try:
        flash_attn = load_flash_attn()
        sources = flash_attn_sources()
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")
    assert flash_attn.__version__ == FLASH_ATTN_VERSION
    interface = Path(inspect.getfile(flash_attn.flash_attn_interface))
    assert interface == sources / "flash_attn" / "flash_attn_interface.py"
    assert "import flash_attn_2_cuda as flash_attn_gpu" in interface.read_text()  # what the stand-in replaces
    with kernels_on_cpu("flash_attn"):
        assert attention._kernel("flash_attn")[0] is flash_attn.flash_attn_varlen_func
    assert "not installed" in available_backends("cpu", torch.bfloat16)["flash_attn"]  # gone again after


# ---- a packed model's training step

# One SGD step of bf16 mixed precision (float32 weights, autocast) with each GPU backend against the same
# step with sdpa_segments, parameter by parameter. The two attentions round their bf16 outputs apart by up
# to one unit in the last place (2^-8), which the following bf16 matmuls and the backward carry on:
# measured at most 1.5e-2 over these families and switches. Samples that see each other, or a pack that
# loses causality, move some parameter's update by 0.9 or more.
STEP_BOUND = 5e-2
MODEL_STEPS = [
    pytest.param(family, switches, marks=[pytest.mark.integration] if family != "llama" else [])
    for family, variants in (
        ("llama", ("", "+checkpointing", "+tiled", "+layer")),
        # Tiled layers hand the kernel q, k, v from their tiles (a tiled MLP does not touch attention).
        ("glm4", ("", "+checkpointing+layer")),  # fused gate_up_proj, partial rotary, q/k/v biases
        ("qwen3", ("", "+checkpointing+layer")),  # per-head q/k norms
    )
    for switches in variants
]


def worst_parameter_error(got: dict, want: dict) -> float:
    """The largest norm-relative difference of one parameter's update (one parameter cannot hide in another)."""
    assert got.keys() == want.keys()
    return max(relative_error(got[name], want[name]) for name in want)


@pytest.mark.parametrize("family, switches", MODEL_STEPS)
def test_a_packed_model_trains_the_same_step_on_each_gpu_backend(family, switches):
    try:
        want = reference_step(f"{family}+bf16{switches}")
        for name in STOOD_IN if os.environ.get("LONGALIGN_FA3_INTERFACE") else ("flash_attn", "torch_varlen"):
            got = one_step(f"{family}+bf16{switches}+{name}")
            assert worst_parameter_error(got["update"], want["update"]) <= STEP_BOUND, name
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), name
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")


@pytest.mark.parametrize("kind", ["llama", "glm4", "qwen3"])
def test_the_1d_mask_call_reaches_each_gpu_backend_as_cu_seqlens(kernel, kind):
    """LongAlign's forward call (the boundaries as a 1D int32 attention_mask), forward and backward."""
    backend = STOOD_IN[kernel]
    lengths = [7, 1, 12, 4]
    ids = torch.randint(3, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([0, 7, 8, 20, 24], dtype=torch.int32)
    results = {}
    for name in (backend, "sdpa_segments"):
        model = tiny_model(kind, backend=name).to(torch.bfloat16)
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.float().logsumexp(-1).sum().backward()
        results[name] = [logits, *(p.grad for p in model.parameters())]
    # Each attention rounds its exact result to bf16 (one unit in the last place apart), then bf16 layers
    # follow: the same bound as the training step above.
    assert relative_error(results[backend][0], results["sdpa_segments"][0]) <= STEP_BOUND
    assert relative_error(results[backend][1:], results["sdpa_segments"][1:]) <= STEP_BOUND


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_sequence_parallel_2_with_flash_attn_trains_the_one_rank_step(tmp_path):
    """2 ranks, each pack split over both: the Ulysses exchange hands flash-attn's Python layer whole samples,
    half of the heads on each rank (two key/value heads each), in the layout and dtype its kernel takes (the stand-in checks them); with
    tiled layers, from q, k, v their tiles computed.

    DeepSpeed's Ulysses layer wraps one attention per process, hence a launch of its own.
    """
    try:
        flash_attn_sources()  # fetched once here, not by both ranks at once
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")
    # 8 query and 4 key/value heads: each rank holds two key/value heads, over which the tiled layer's
    # attention loops (one head per rank is the split launch of tests/test_tiled_mlp.py).
    variants = [
        "llama+kv4+bf16+flash_attn",
        "llama+kv4+bf16+flash_attn+tiled+checkpointing",
        "llama+kv4+bf16+flash_attn+layer+checkpointing",  # the exchange between the tiled parts and the kernel
    ]
    out, here = tmp_path / "results.pt", Path(__file__).resolve().parent
    cases = [f"ddp/{variant}+split" for variant in variants]
    result = launch(here / "tiled_mlp_run.py", str(out), *cases, env={"PYTHONPATH": str(here)})
    assert result.returncode == 0, result.stderr[-4000:]
    results = torch.load(out)
    for variant, case in zip(variants, cases, strict=True):
        got, want = outcome(results, case), one_step(variant)  # want: one process, packs whole
        assert worst_parameter_error(got["update"], want["update"]) <= STEP_BOUND, variant
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), variant
    halves = outcome(results, cases[1])["mlp_tokens"]  # forward and recompute, on each rank its half
    assert [sorted(set(calls)) for calls in halves] == [[17, 18], [17, 18]]
    # Tiled layers: 3 tiles of each half, and the one token the layer's first call runs after attention.
    tiles = outcome(results, cases[2])["mlp_tokens"]
    assert [sorted(set(calls)) for calls in tiles] == [[1, 5, 6], [1, 5, 6]]


# ---- FlashAttention 4: our call bound to its signature


def fa4_interface_source() -> str:
    """``flash_attn/cute/interface.py`` of the pinned flash-attn-4 wheel, fetched once with pip, cached."""
    target = CACHE / f"flash_attn_4-{FA4_VERSION}-interface.py"
    if not target.exists():
        scratch = CACHE / "downloads"
        command = [sys.executable, "-m", "pip", "download", "--no-deps", f"flash-attn-4=={FA4_VERSION}", "-d"]
        result = subprocess.run([*command, str(scratch)], capture_output=True, text=True, timeout=600)
        wheels = list(scratch.glob(f"flash_attn_4-{FA4_VERSION}-*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.skip(f"pip download flash-attn-4=={FA4_VERSION} failed: {result.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            source = wheel.read("flash_attn/cute/interface.py").decode()
        partial = target.with_suffix(f".{os.getpid()}")
        partial.write_text(source)
        partial.replace(target)
    return target.read_text()


def parsed_signature(source: str, function: str) -> inspect.Signature:
    """The signature of a top-level ``def`` in ``source``, without importing the module."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function)
    arguments, kinds = node.args, inspect.Parameter
    defaults = [None] * (len(arguments.args) - len(arguments.defaults)) + arguments.defaults
    parameters = [
        inspect.Parameter(a.arg, kinds.POSITIONAL_OR_KEYWORD, **({} if d is None else {"default": d}))
        for a, d in zip(arguments.args, defaults, strict=True)
    ]
    parameters += [
        inspect.Parameter(a.arg, kinds.KEYWORD_ONLY, **({} if d is None else {"default": d}))
        for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    ]
    return inspect.Signature(parameters)


def our_fa4_call(monkeypatch, window: int | None, causal: bool, **extras) -> list[tuple[tuple, dict]]:
    """The exact arguments longalign's FA4 adapter passes, recorded by a function that accepts anything."""
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return args[0], None

    q, k, v, cu_seqlens = pack([3, 6], 4, 2)
    with monkeypatch.context() as patched:
        patched.setattr(attention, "_kernel", lambda name: (record, None))
        attention._BACKEND_FUNCTIONS["flash_attn_cute"](
            q, k, v, cu_seqlens, 6, causal, 0.3, 0.0, window, **extras
        )
    return calls


@pytest.mark.parametrize("causal, window", [(True, None), (True, 5), (False, 3)])
def test_our_fa4_call_binds_to_the_pinned_flash_attn_4(monkeypatch, causal, window):
    signature = parsed_signature(fa4_interface_source(), "flash_attn_varlen_func")
    [(args, kwargs)] = our_fa4_call(monkeypatch, window, causal)
    bound = signature.bind(*args, **kwargs)  # a TypeError here is the one a GPU run would hit
    assert bound.arguments["max_seqlen_q"] == 6 and bound.arguments["cu_seqlens_k"] is kwargs["cu_seqlens_k"]
    assert bound.arguments["window_size"] == (
        (None, None) if window is None else (window - 1, 0 if causal else window - 1)
    )
    assert set(attention._REQUIRED_ARGUMENTS["flash_attn_cute"]) <= set(signature.parameters)


def test_our_fa4_call_with_softcap_and_sinks_binds_to_the_pinned_flash_attn_4(monkeypatch):
    """gpt-oss's sinks run in FA4's kernel forward and backward (``learnable_sink``); Gemma 2's cap too."""
    signature = parsed_signature(fa4_interface_source(), "flash_attn_varlen_func")
    sinks = torch.randn(4, dtype=torch.bfloat16)
    [(args, kwargs)] = our_fa4_call(monkeypatch, 5, True, softcap=50.0, sinks=sinks)
    bound = signature.bind(*args, **kwargs)
    assert bound.arguments["softcap"] == 50.0
    assert bound.arguments["learnable_sink"].dtype == torch.float32  # one of the dtypes it takes
    torch.testing.assert_close(bound.arguments["learnable_sink"], sinks.float())

    def flash_attn_varlen_func(*args, **kwargs):
        raise AssertionError("never called")

    flash_attn_varlen_func.__signature__ = signature
    monkeypatch.setattr(attention, "_kernel", lambda name: (flash_attn_varlen_func, None))
    monkeypatch.setattr(attention, "_device_problem", lambda name, device: None)
    reasons = available_backends("cpu", torch.bfloat16, softcap=50.0, sinks=sinks)
    assert reasons["flash_attn_cute"] is None


def test_flash_attn_2_s_older_cute_copy_is_refused_as_too_old_for_fa4(monkeypatch):
    """flash-attn 2.8.3 ships its own ``flash_attn/cute``; installed after flash-attn-4, it replaces FA4's."""
    try:
        sources = flash_attn_sources()
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")
    old = parsed_signature(
        (sources / "flash_attn" / "cute" / "interface.py").read_text(), "flash_attn_varlen_func"
    )
    [(args, kwargs)] = our_fa4_call(monkeypatch, None, True)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        old.bind(*args, **kwargs)

    def flash_attn_varlen_func(*args, **kwargs):
        raise AssertionError("never called")

    flash_attn_varlen_func.__signature__ = old
    monkeypatch.setattr(attention, "_kernel", lambda name: (flash_attn_varlen_func, None))
    reason = available_backends("cpu", torch.bfloat16)["flash_attn_cute"]
    assert "is too old: it takes no max_seqlen_q, max_seqlen_k" in reason


# ---- per_kv_head: each group's kernel forward once, then the kernel's own backward on what it kept


@pytest.mark.parametrize("window, softcap, chunk", [(None, None, None), (5, 2.0, None), (3, None, 4)])
def test_per_kv_head_calls_each_kernel_s_backward_on_its_kept_out_and_lse(kernel, window, softcap, chunk):
    """Through the kernels' real Python layers: one forward per key/value group, whose ``out`` and
    ``softmax_lse`` the kernel's backward then takes (the stand-in checks their shapes, dtypes and layout);
    values and gradients as sdpa_segments' in float64."""
    backend = STOOD_IN[kernel]
    if softcap is not None and kernel == "torch_varlen":
        pytest.skip("torch's varlen_attn has no soft-capping (refused, tested above)")
    lengths = [1, 9, 1, 30, 4, 1]
    q, k, v, cu_seqlens = pack(lengths, 8, 2)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    options = {
        "cu_seqlens": cu_seqlens,
        "max_seqlen": 30,
        "window": window,
        "softcap": softcap,
        "chunk": chunk,
    }
    with kept_kernel_calls(backend) as calls:
        got = values_and_grads(q, k, v, cotangent, backend=backend, per_kv_head=True, **options)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = values_and_grads(q64, k64, v64, cotangent.double(), backend="sdpa_segments", **options)
    assert calls == ["forward", "forward", "backward", "backward"]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert relative_error(a, b) <= BF16_BOUND, f"{name}: {relative_error(a, b):.3g}"


def test_kept_attention_hands_each_kernel_s_backward_what_its_forward_kept(kernel):
    """``keeping_attention``, as the tiled layer's ``keep_attention`` runs it: the forward (no autograd)
    records each group's ``out`` and ``softmax_lse``, which go to host memory and back (copies); the call
    in backward is handed them and runs no forward, and the kernel's backward (the stand-in checks their
    shapes, dtypes and layout) takes them: values and gradients as sdpa_segments' in float64."""
    from longalign.attention import keeping_attention

    backend = STOOD_IN[kernel]
    lengths = [1, 9, 1, 30, 4, 1]
    q, k, v, cu_seqlens = pack(lengths, 8, 2)
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    options = {"cu_seqlens": cu_seqlens, "max_seqlen": 30, "window": 5}
    kept: list = []
    with kept_kernel_calls(backend) as calls:
        with torch.no_grad(), keeping_attention("record", kept):
            varlen_attention(q, k, v, backend=backend, per_kv_head=True, **options)
        kept = [(out.clone(), [lse.clone() for lse in lses]) for out, lses in kept]  # host and back
        with keeping_attention("replay", kept):
            got = values_and_grads(q, k, v, cotangent, backend=backend, per_kv_head=True, **options)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = values_and_grads(q64, k64, v64, cotangent.double(), backend="sdpa_segments", **options)
    assert calls == ["forward", "forward", "backward", "backward"] and not kept
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert relative_error(a, b) <= BF16_BOUND, f"{name}: {relative_error(a, b):.3g}"


def test_per_kv_head_calls_fa4_s_forward_and_backward_as_their_pinned_signatures_take_them(monkeypatch):
    """FlashAttention 4's ``_flash_attn_fwd`` (asked for its lse) and ``_flash_attn_bwd`` (given it, and the
    float32 sinks), bound to the pinned release's parsed signatures, stood in for by longalign's CPU kernel
    in float64: values and gradients, the sinks' included, as sdpa_segments'."""
    source = fa4_interface_source()
    forward_signature, backward_signature = (
        parsed_signature(source, name) for name in ("_flash_attn_fwd", "_flash_attn_bwd")
    )

    def call_of(arguments):
        window = (arguments["window_size_left"], arguments["window_size_right"])
        assert window == (4, 0)  # window 5, causal; None would be unbounded
        return attention._Call(
            arguments["cu_seqlens_q"], arguments["max_seqlen_q"], arguments["causal"],
            arguments["softmax_scale"], 5, arguments["softcap"] or None,
        )  # fmt: skip

    def sinks_of(arguments):
        assert arguments["learnable_sink"].dtype == torch.float32
        return arguments["learnable_sink"].double()

    def _flash_attn_fwd(*args, **kwargs):
        arguments = forward_signature.bind(*args, **kwargs).arguments
        assert arguments["return_lse"] is True
        q, k, v = (arguments[name].double() for name in "qkv")
        out, lse = attention._segments_forward(q, k, v, sinks_of(arguments), call_of(arguments))
        return out.to(arguments["q"].dtype), lse.float(), None, None, None

    def _flash_attn_bwd(*args, **kwargs):
        arguments = backward_signature.bind(*args, **kwargs).arguments
        q, k, v, out, dout = (arguments[name].double() for name in ("q", "k", "v", "out", "dout"))
        grads = attention._segments_backward(
            dout, q, k, v, out, arguments["lse"].double(), sinks_of(arguments), call_of(arguments)
        )
        return tuple(g.to(arguments["q"].dtype if g.ndim == 3 else torch.float32) for g in grads)

    def flash_attn_varlen_func(*args, **kwargs):
        raise AssertionError("per_kv_head calls the forward and backward below it")

    interface = type(sys)("flash_attn_4_interface_stand_in")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    flash_attn_varlen_func.__module__ = interface.__name__
    flash_attn_varlen_func.__signature__ = parsed_signature(source, "flash_attn_varlen_func")
    monkeypatch.setitem(sys.modules, interface.__name__, interface)
    monkeypatch.setattr(attention, "_kernel", lambda name: (flash_attn_varlen_func, None))
    monkeypatch.setattr(attention, "_device_problem", lambda name, device: None)

    q, k, v, cu_seqlens = pack([1, 9, 1, 12], 4, 2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_()
    cotangent = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    options = {"cu_seqlens": cu_seqlens, "max_seqlen": 12, "window": 5, "softcap": 2.0}
    out = varlen_attention(q, k, v, sinks=sinks, backend="flash_attn_cute", per_kv_head=True, **options)
    got = [out, *torch.autograd.grad(out, (q, k, v, sinks), cotangent)]
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    reference = varlen_attention(*inputs[:3], sinks=inputs[3], backend="sdpa_segments", **options)
    want = [reference, *torch.autograd.grad(reference, inputs, cotangent.double())]
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert a.dtype == torch.bfloat16, name
        assert relative_error(a, b) <= BF16_BOUND, f"{name}: {relative_error(a, b):.3g}"
