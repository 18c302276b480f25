"""Stand-ins for the compiled attention kernels, so that the kernels' own Python layers run on CPU.

What runs for real, unmodified: flash-attn's ``flash_attn/flash_attn_interface.py`` (its released source
distribution from the package index, fetched by ``pip download`` and cached), FlashAttention 3's
``hopper/flash_attn_interface.py`` (when ``LONGALIGN_FA3_INTERFACE`` names a copy: FA3 is not published on
the package index), and PyTorch's own ``torch/nn/attention/varlen.py``. What stands in for the compiled
code below them (FA3: its ``flash_attn_3._C`` operators, as ``FA3_KERNEL``):

    flash_attn_varlen_func (flash-attn's Python)        varlen_attn (torch's Python)
      -> torch.ops.flash_attn._flash_attn_varlen_*        -> torch.ops.torch_attn._varlen_attn*
        -> flash_attn_2_cuda.varlen_fwd / varlen_bwd        -> aten::_flash_attention_forward / _backward
           = FA2_KERNEL below                                  = registered for CPU by install_torch_varlen()

Each stand-in first enforces what the real kernel checks before it computes (``flash_api.cpp``'s
``TORCH_CHECK``s in ``mha_varlen_fwd`` / ``mha_varlen_bwd``, which PyTorch's copy of the kernel shares):
float16/bfloat16 only and one dtype for all, int32 contiguous ``cu_seqlens`` on the tensors' device, a
contiguous last dimension, a head size that is a multiple of 8 and at most 256, query heads a multiple of
key/value heads, the shapes; and what the kernel trusts without checking: ``cu_seqlens`` rising from 0 to
the tokens, ``max_seqlen`` at least the longest sample. A violation raises :class:`KernelPreconditionError`,
which fails the test: longalign must never hand a kernel such a tensor. Then it computes attention exactly,
in float64 per sample, with the kernels' conventions: an inclusive window ``(left, right)`` with -1 for
unbounded, ``causal`` meaning ``right = 0``, a window at least ``max_seqlen_k`` meaning unbounded, logit
soft-capping ``softcap * tanh(scores / softcap)`` for ``softcap > 0`` (FlashAttention 2/3; torch's kernel has
none), and an analytic backward (kernels run below autograd).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from itertools import pairwise
from pathlib import Path

import torch

FLASH_ATTN_VERSION = "2.8.3"  # the flash-attn release whose Python layer the tests run
FLASH_DTYPES = (torch.float16, torch.bfloat16)
CACHE = Path(os.environ.get("LONGALIGN_TEST_CACHE", Path.home() / ".cache" / "longalign-tests"))


class KernelPreconditionError(RuntimeError):
    """A call the real kernel would refuse (or silently get wrong): the caller handed it a bad tensor."""


class SourcesUnavailable(RuntimeError):
    """A kernel's Python layer could not be fetched; the message says why."""


# ----------------------------------------------------------------------------------------------------------
# The exact computation, in the kernels' conventions


def _window(is_causal: bool, left: int, right: int, max_seqlen_k: int, *, single_queries: bool = False):
    """The kernel's own reading of causality and window bounds (``mha_varlen_fwd``/``_bwd``), -1 = unbounded.

    ``single_queries``: the forward's rule that with one query per sample causal is the same as not.
    """
    if single_queries:
        is_causal = False
    if is_causal:
        right = 0
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    return left, right


def _allowed(length_q: int, length_k: int, left: int, right: int) -> torch.Tensor:
    """``[length_q, length_k]``: query i sees key j when ``i + length_k - length_q - left <= j <= ... + right``."""
    i = torch.arange(length_q)[:, None] + (length_k - length_q)  # aligned to the bottom right
    j = torch.arange(length_k)[None, :]
    allowed = torch.ones(length_q, length_k, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def _probabilities(q, k, cu_q, cu_k, scale, left, right, softcap=0.0):
    """Per sample ``(rows, P [H, Lq, Lk], lse [H, Lq], slope)`` in float64, K heads repeated for their query
    groups. ``softcap > 0`` caps the scores to ``softcap * tanh(scores / softcap)`` before the mask (the
    kernels' convention, 0 = off); ``slope [H, Lq, Lk]`` is the cap's derivative (``None`` without one)."""
    group = q.shape[1] // k.shape[1]
    for (qs, qe), (ks, ke) in zip(pairwise(cu_q), pairwise(cu_k), strict=True):
        q_i = q[qs:qe].double()
        k_i = k[ks:ke].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_i, k_i) * scale
        slope = None
        if softcap > 0:
            capped = torch.tanh(scores / softcap)
            scores, slope = softcap * capped, 1 - capped**2
        scores = scores.masked_fill(~_allowed(qe - qs, ke - ks, left, right), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probabilities = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # a row that sees nothing is 0
        yield (qs, qe, ks, ke), probabilities, lse, slope


def exact_forward(q, k, v, cu_q, cu_k, scale, left, right, softcap=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [Tq, Hq, Dv]`` in q's dtype and the float32 ``softmax_lse [Hq, Tq]``, computed in float64."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for (qs, qe, ks, ke), probabilities, lse_i, _ in _probabilities(
        q, k, cu_q, cu_k, scale, left, right, softcap
    ):
        v_i = v[ks:ke].double().repeat_interleave(group, dim=1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probabilities, v_i)
        lse[:, qs:qe] = lse_i
    return out.to(q.dtype), lse.float()


def exact_backward(dout, q, k, v, cu_q, cu_k, scale, left, right, softcap=0.0):
    """``dq, dk, dv`` (float64) of the attention above for the output gradient ``dout``; K/V gradients summed
    over each key/value head's query group."""
    group = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=torch.float64)
    dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    samples = _probabilities(q, k, cu_q, cu_k, scale, left, right, softcap)
    for (qs, qe, ks, ke), probabilities, _, slope in samples:
        q_i, do_i = q[qs:qe].double(), dout[qs:qe].double()
        k_i, v_i = (x[ks:ke].double().repeat_interleave(group, dim=1) for x in (k, v))
        o_i = torch.einsum("hqk,khd->qhd", probabilities, v_i)
        d_probabilities = torch.einsum("qhd,khd->hqk", do_i, v_i)
        row = (do_i * o_i).sum(-1).transpose(0, 1)  # [H, Lq]
        d_scores = probabilities * (d_probabilities - row[..., None])
        if slope is not None:
            d_scores = d_scores * slope  # back through the cap to the scaled scores
        dq[qs:qe] = torch.einsum("hqk,khd->qhd", d_scores, k_i) * scale
        dk[ks:ke] = torch.einsum("hqk,qhd->khd", d_scores, q_i) * scale
        dv[ks:ke] = torch.einsum("hqk,qhd->khd", probabilities, do_i)
    fold = lambda x: x.view(x.shape[0], k.shape[1], group, x.shape[2]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


# ----------------------------------------------------------------------------------------------------------
# The kernels' preconditions


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise KernelPreconditionError(message)


def check_varlen_call(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    others: dict[str, torch.Tensor | None] | None = None,
) -> tuple[list[int], list[int]]:
    """What ``mha_varlen_fwd``/``mha_varlen_bwd`` check, and what they trust; returns the boundaries."""
    _require(
        q.dtype in FLASH_DTYPES, f"FlashAttention only support fp16 and bf16 data type, got {q.dtype} (query)"
    )
    tensors = {"q": q, "k": k, "v": v, **(others or {})}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        _require(tensor.dtype == q.dtype, f"query and {name} must have the same dtype, got {tensor.dtype}")
        _require(tensor.device == q.device, f"{name} must be on {q.device}, is on {tensor.device}")
        _require(tensor.stride(-1) == 1, f"{name} must have contiguous last dimension")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _require(cu.dtype == torch.int32, f"{name} must have dtype int32, got {cu.dtype}")
        _require(cu.device == q.device, f"{name} must be on {q.device}, is on {cu.device}")
        _require(cu.is_contiguous(), f"{name} must be contiguous")
        _require(cu.ndim == 1, f"{name} must be 1D, got shape {tuple(cu.shape)}")
    batch = cu_seqlens_q.numel() - 1
    _require(batch > 0, "batch size must be positive")
    _require(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_q and cu_seqlens_k hold different sample counts")
    head_size = q.shape[-1]
    _require(head_size <= 256, f"FlashAttention only supports head dimension at most 256, got {head_size}")
    _require(head_size % 8 == 0, f"head_size must be a multiple of 8, got {head_size}")
    _require(q.ndim == 3 and k.ndim == 3 and v.ndim == 3, "q, k, v must be [total_tokens, heads, head_dim]")
    _require(
        q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query"
    )
    _require(k.shape == v.shape and k.shape[2] == head_size, f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, bounds, total, longest in (
        ("cu_seqlens_q", bounds_q, q.shape[0], max_seqlen_q),
        ("cu_seqlens_k", bounds_k, k.shape[0], max_seqlen_k),
    ):
        lengths = [b - a for a, b in pairwise(bounds)]
        _require(
            bounds[0] == 0 and bounds[-1] == total and min(lengths) >= 0,
            f"{name} {bounds} must rise from 0 to the {total} tokens",
        )
        _require(longest >= max(lengths), f"max_seqlen {longest} is shorter than a sample of {max(lengths)}")
    return bounds_q, bounds_k


def _no_extras(**extras) -> None:
    """Features the stand-in does not compute; longalign passes none of them."""
    for name, value in extras.items():
        _require(value is None or value is False or value == 0, f"the stand-in computes no {name}")


def varlen_forward(q, k, v, out_, cu_q, cu_k, max_q, max_k, scale, is_causal, left, right, softcap=0.0):
    """What every varlen forward kernel does here: its checks, its window rules, then ``(out, lse)`` exactly."""
    bounds_q, bounds_k = check_varlen_call(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        others={"out": out_},
    )  # fmt: skip
    left, right = _window(is_causal, left, right, max_k, single_queries=max_q == 1)
    out, lse = exact_forward(q, k, v, bounds_q, bounds_k, scale, left, right, softcap)
    return (out if out_ is None else out_.copy_(out)), lse


def varlen_backward(
    dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, is_causal, left, right, softcap=0.0
):
    """What every varlen backward kernel does here: its checks, then ``dq, dk, dv`` (into the buffers given)
    and ``softmax_d``."""
    bounds_q, bounds_k = check_varlen_call(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        others={"out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv},
    )  # fmt: skip
    _require(lse.dtype == torch.float32, f"softmax_lse must be float32, got {lse.dtype}")
    _require(lse.device == q.device, f"softmax_lse must be on {q.device}, is on {lse.device}")
    heads, tokens = q.shape[1], q.shape[0]
    _require(
        tuple(lse.shape) == (heads, tokens),
        f"softmax_lse must be [heads, total_q] = [{heads}, {tokens}], got {tuple(lse.shape)}",
    )
    for name, tensor in (("out", out), ("dout", dout)):
        _require(
            tuple(tensor.shape) == (tokens, heads, v.shape[2]),
            f"{name} must be [total_q, heads, head_size_v] = [{tokens}, {heads}, {v.shape[2]}], "
            f"got {tuple(tensor.shape)}",
        )
    left, right = _window(is_causal, left, right, max_k)
    grads = exact_backward(dout, q, k, v, bounds_q, bounds_k, scale, left, right, softcap)
    dq, dk, dv = (
        (torch.empty_like(x) if buffer is None else buffer).copy_(grad)
        for buffer, x, grad in zip((dq, dk, dv), (q, k, v), grads, strict=True)
    )
    softmax_d = (dout.double() * out.double()).sum(-1).transpose(0, 1).float()
    return dq, dk, dv, softmax_d


# ----------------------------------------------------------------------------------------------------------
# flash-attn 2: the compiled module flash_attn_2_cuda


def _fa2_varlen_fwd(
    q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
    max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
    window_size_right, softcap, return_softmax, gen,
):  # fmt: skip
    """``flash_attn_2_cuda.varlen_fwd``: ``(out, softmax_lse, S_dmask, rng_state)``."""
    _no_extras(
        seqused_k=seqused_k, leftpad_k=leftpad_k, paged_kv=block_table, alibi=alibi_slopes,
        dropout=p_dropout, returned_softmax=return_softmax,
    )  # fmt: skip
    out, lse = varlen_forward(
        q, k, v, out_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap,
    )  # fmt: skip
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


def _fa2_varlen_bwd(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
    max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
    softcap, deterministic, gen, rng_state,
):  # fmt: skip
    """``flash_attn_2_cuda.varlen_bwd``: fills ``dq, dk, dv``; returns them and ``softmax_d``."""
    _no_extras(alibi=alibi_slopes, dropout=p_dropout)
    return varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, is_causal, window_size_left, window_size_right, softcap,
    )  # fmt: skip


def _not_stood_in(name: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"the flash_attn_2_cuda stand-in has only varlen_fwd and varlen_bwd, not {name}"
        )

    return refuse


FA2_KERNEL = types.ModuleType("flash_attn_2_cuda", "Stand-in for flash-attn's compiled CUDA module.")
FA2_KERNEL.varlen_fwd = _fa2_varlen_fwd
FA2_KERNEL.varlen_bwd = _fa2_varlen_bwd
for _name in ("fwd", "bwd", "fwd_kvcache"):
    setattr(FA2_KERNEL, _name, _not_stood_in(_name))


def flash_attn_sources(version: str = FLASH_ATTN_VERSION) -> Path:
    """A folder holding flash-attn's ``flash_attn`` package from its released sdist; fetched once, cached.

    ``pip download`` brings the sdist as pip would install it (its ``setup.py`` imports torch, hence no
    build isolation; no CUDA is built). Raises :class:`SourcesUnavailable` saying why when it cannot.
    """
    target = CACHE / f"flash_attn-{version}"
    if (target / "flash_attn" / "flash_attn_interface.py").exists():
        return target
    with tempfile.TemporaryDirectory() as scratch:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--no-build-isolation", f"flash-attn=={version}", "-d", scratch,
        ]  # fmt: skip
        env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
        try:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise SourcesUnavailable(f"pip download flash-attn=={version} took over 10 minutes") from None
        archives = list(Path(scratch).glob("flash_attn-*.tar.gz"))
        if result.returncode != 0 or not archives:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SourcesUnavailable(f"pip download flash-attn=={version} failed: {last}")
        unpacked = Path(scratch) / "unpacked"
        prefix = f"flash_attn-{version}/"
        with tarfile.open(archives[0]) as archive:
            members = [
                m
                for m in archive.getmembers()
                if m.name.startswith(prefix + "flash_attn/") or m.name == prefix + "LICENSE"
            ]
            archive.extractall(unpacked, members=members, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=target.parent))
        (unpacked / prefix).rename(staged / "src")
        try:
            (staged / "src").rename(target)  # atomic: a concurrent run that won the race keeps its copy
        except OSError:
            pass
        shutil.rmtree(staged, ignore_errors=True)
    return target


_LOADED: dict[str, types.ModuleType] = {}


def load_flash_attn() -> types.ModuleType:
    """flash-attn's real ``flash_attn`` package over the stand-in kernel, imported once per process.

    Its two varlen custom ops are registered for CUDA only; they get their own Python bodies as the CPU
    kernel, so the path from ``flash_attn_varlen_func`` to ``flash_attn_2_cuda.varlen_fwd`` is the released
    one. The modules are then taken out of ``sys.modules`` again: :func:`kernels_on_cpu` puts them back
    for one test, so that no other test finds a flash-attn installed.
    """
    if "flash_attn" not in _LOADED:
        sources = flash_attn_sources()
        before = set(sys.modules)
        sys.modules["flash_attn_2_cuda"] = FA2_KERNEL
        sys.path.insert(0, str(sources))
        try:
            import flash_attn
        finally:
            sys.path.remove(str(sources))
        interface = flash_attn.flash_attn_interface
        for op in (interface._flash_attn_varlen_forward, interface._flash_attn_varlen_backward):
            op.register_kernel("cpu", op._init_fn)
        for name in set(sys.modules) - before:
            _LOADED[name] = sys.modules.pop(name)
    return _LOADED["flash_attn"]


# ----------------------------------------------------------------------------------------------------------
# FlashAttention 3: the compiled module flash_attn_3._C, reached as torch.ops.flash_attn_3


def _fa3_fwd(
    q, k, v, k_new, v_new, qv, out_, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
    q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
    attention_chunk, softcap, rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin,
):  # fmt: skip
    """``flash_attn_3._C.fwd``: ``(out, softmax_lse, out_accum, softmax_lse_accum)``."""
    _no_extras(
        appended_kv=k_new, qv=qv, seqused_q=seqused_q, seqused_k=seqused_k, paged_kv=page_table,
        kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary=rotary_cos, fp8_descale=q_descale,
        attention_chunk=attention_chunk,
    )  # fmt: skip
    out, lse = varlen_forward(
        q, k, v, out_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap,
    )  # fmt: skip
    return out, lse, None, None


def _fa3_bwd(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
    max_seqlen_q, max_seqlen_k, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
    deterministic, sm_margin,
):  # fmt: skip
    """``flash_attn_3._C.bwd``: fills ``dq, dk, dv``; returns ``softmax_d`` first."""
    _no_extras(seqused_q=seqused_q, seqused_k=seqused_k)
    dq, dk, dv, softmax_d = varlen_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, is_causal, window_size_left, window_size_right, softcap,
    )  # fmt: skip
    return softmax_d, dq, dk, dv


FA3_KERNEL = types.SimpleNamespace(fwd=_fa3_fwd, bwd=_fa3_bwd)


def fa3_interface_path() -> Path:
    """FA3's ``hopper/flash_attn_interface.py``, named by ``LONGALIGN_FA3_INTERFACE``.

    FA3 is not published on the package index (it builds from the ``hopper/`` folder of the
    flash-attention repository), so the tests cannot fetch it: :class:`SourcesUnavailable` says so.
    """
    named = os.environ.get("LONGALIGN_FA3_INTERFACE")
    if not named:
        raise SourcesUnavailable(
            "FlashAttention 3's Python layer is not on the package index; set LONGALIGN_FA3_INTERFACE to a "
            "copy of hopper/flash_attn_interface.py from the flash-attention repository to run it"
        )
    if not Path(named).is_file():
        raise SourcesUnavailable(f"LONGALIGN_FA3_INTERFACE={named} is not a file")
    return Path(named)


def load_flash_attn_3() -> types.ModuleType:
    """FA3's real ``flash_attn_interface`` over the stand-in kernel, imported once per process.

    Importing it imports ``flash_attn_3._C`` (which registers FA3's operators; an empty module here), then
    the interface reaches the kernel as its module global ``flash_attn_3_gpu``: that is what stands in.
    Its two custom ops get their own Python bodies as the CPU kernel, as in :func:`load_flash_attn`.
    """
    if "flash_attn_interface" not in _LOADED:
        path = fa3_interface_path()
        package = types.ModuleType("flash_attn_3")
        package.__path__ = []
        compiled = types.ModuleType("flash_attn_3._C", "Stand-in: FA3's operators are FA3_KERNEL here.")
        package._C = compiled
        spec = importlib.util.spec_from_file_location("flash_attn_interface", path)
        interface = importlib.util.module_from_spec(spec)
        saved = {name: sys.modules.get(name) for name in ("flash_attn_3", "flash_attn_3._C")}
        sys.modules.update({"flash_attn_3": package, "flash_attn_3._C": compiled})
        try:
            spec.loader.exec_module(interface)
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
        interface.flash_attn_3_gpu = FA3_KERNEL
        for op in (interface._flash_attn_forward, interface._flash_attn_backward):
            op.register_kernel("cpu", op._init_fn)
        _LOADED["flash_attn_interface"] = interface
    return _LOADED["flash_attn_interface"]


# ----------------------------------------------------------------------------------------------------------
# PyTorch's varlen_attn: aten::_flash_attention_forward / _backward for CPU

_ATEN_LIBRARY: torch.library.Library | None = None


def _aten_forward(
    query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
    scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
    block_table=None, num_splits=None,
):  # fmt: skip
    """``aten::_flash_attention_forward``, varlen form: ``(out, logsumexp, rng_state, unused, debug_mask)``."""
    _require(cum_seq_q is not None and cum_seq_k is not None, "the stand-in runs the varlen form only")
    _no_extras(dropout=dropout_p, debug_mask=return_debug_mask, seqused_k=seqused_k, alibi=alibi_slopes)
    _no_extras(paged_kv=block_table)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = varlen_forward(
        query, key, value, None, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal,
        _unbounded(window_size_left), _unbounded(window_size_right),
    )  # fmt: skip
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse, rng_state, torch.empty(0, dtype=torch.uint64), query.new_empty(0)


def _aten_backward(
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None,
):  # fmt: skip
    """``aten::_flash_attention_backward``, varlen form: ``(grad_query, grad_key, grad_value)``."""
    _no_extras(dropout=dropout_p)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv, _ = varlen_backward(
        grad_out, query, key, value, out, logsumexp, None, None, None, cum_seq_q, cum_seq_k, max_q, max_k,
        scale, is_causal, _unbounded(window_size_left), _unbounded(window_size_right),
    )  # fmt: skip
    return dq, dk, dv


def _unbounded(size: int | None) -> int:
    return -1 if size is None else size


def install_torch_varlen() -> None:
    """CPU kernels for ``aten::_flash_attention_forward/_backward``, once per process (they stay registered:
    nothing else on CPU calls those ops)."""
    global _ATEN_LIBRARY
    if _ATEN_LIBRARY is None:
        library = torch.library.Library("aten", "IMPL")
        library.impl("_flash_attention_forward", _aten_forward, "CPU")
        library.impl("_flash_attention_backward", _aten_backward, "CPU")
        _ATEN_LIBRARY = library


# ----------------------------------------------------------------------------------------------------------
# longalign's backends on CPU

# The kernels that have a stand-in here, and the longalign backend each one runs.
STOOD_IN = {"flash_attn": "flash_attn", "flash_attn_3": "flash_attn", "torch_varlen": "torch_varlen"}


@contextlib.contextmanager
def kernels_on_cpu(*kernels: str):
    """Within the block, the backends of ``kernels`` (keys of :data:`STOOD_IN`) run CPU tensors through the
    kernels' real Python layers.

    longalign's one device check (``attention._device_problem``) lets them take CPU tensors, and the
    kernels' modules are importable; every other check of longalign's runs as on a GPU. Raises
    :class:`SourcesUnavailable` when a kernel's Python layer cannot be had.
    """
    from longalign import attention

    unknown = set(kernels) - set(STOOD_IN)
    assert not unknown, f"no stand-in for {sorted(unknown)}; these have one: {sorted(STOOD_IN)}"
    modules: dict[str, types.ModuleType] = {}
    if "flash_attn" in kernels:
        load_flash_attn()
        modules.update({name: module for name, module in _LOADED.items() if name != "flash_attn_interface"})
    if "flash_attn_3" in kernels:
        modules["flash_attn_interface"] = load_flash_attn_3()
    if "torch_varlen" in kernels:
        install_torch_varlen()
    backends = {STOOD_IN[kernel] for kernel in kernels}
    device_problem = attention._device_problem

    def on_cpu(name: str, device: torch.device) -> str | None:
        return None if device.type == "cpu" and name in backends else device_problem(name, device)

    hidden = {name: sys.modules[name] for name in modules if name in sys.modules}
    sys.modules.update(modules)
    attention._device_problem = on_cpu
    attention._kernel.cache_clear()
    try:
        yield
    finally:
        attention._device_problem = device_problem
        attention._kernel.cache_clear()
        for name in modules:
            sys.modules.pop(name, None)
        sys.modules.update(hidden)
