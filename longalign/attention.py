"""Varlen attention: every packed sample attends only to itself.

A pack is one row of tokens holding several samples back to back; ``cu_seqlens`` says where each one
starts. Three samples of lengths 3, 1 and 2::

    tokens        a0 a1 a2 b0 c0 c1
    position_ids   0  1  2  0  0  1
    cu_seqlens    [0, 3, 4, 6]          max_seqlen = 3

    causal mask   a0 a1 a2 b0 c0 c1     (1 = may attend; a block-diagonal of causal triangles)
              a0   1
              a1   1  1
              a2   1  1  1
              b0            1
              c0               1
              c1               1  1

Tensors are ``[total_tokens, heads, head_dim]``; K/V may have fewer heads than Q (grouped-query attention)
and are never repeated in memory. Backends, in the order ``backend="auto"`` tries them:

- ``flash_attn``       FlashAttention 2/3 (``flash_attn`` or ``flash_attn_interface``), optional install
- ``flash_attn_cute``  FlashAttention 4 (``flash_attn.cute``, Hopper/Blackwell), optional install; tried
                       before ``flash_attn`` on Blackwell
- ``torch_varlen``     ``torch.nn.attention.varlen.varlen_attn``, part of PyTorch, CUDA only
- ``sdpa_segments``    ``scaled_dot_product_attention`` once per sample: runs anywhere, and is the reference
                       every other backend is tested against

A sliding window of ``window`` tokens means each query sees itself and the ``window - 1`` tokens before it
(transformers' ``sliding_window``). A backend that cannot honour a window or dropout refuses the call.

What some families add to the scores, each exact when packed (``auto`` skips a backend that lacks it):

- ``softcap`` (Gemma 2's ``attn_logit_softcapping``): scores become ``softcap * tanh(scores / softcap)``
  before the mask and the softmax. FlashAttention 2/3/4 take it; torch's ``varlen_attn`` refuses.
- ``sinks`` (gpt-oss): one logit per query head that joins each row's softmax denominator and nothing
  else, so ``out = out_without_sink * sigmoid(lse - sink)``. On a GPU only FlashAttention 4 runs it
  (``learnable_sink``, forward and backward); FlashAttention 2/3 and torch's ``varlen_attn`` refuse, as the
  log-sum-exp they return passes no gradient back.
- ``chunk`` (Llama 4's ``attention_chunk_size`` in its RoPE layers): attention restarts every ``chunk``
  tokens counted from each sample's start, by cutting the samples into chunks (any backend)::

      cu_seqlens [0, 45, 115], chunk 16  ->  [0, 16, 32, 45, 61, 77, 93, 109, 115]
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from itertools import pairwise
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from longalign.config import BACKENDS
from longalign.errors import ConfigError

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The install that provides each kernel, for the messages below (docs/install.md explains each route).
FA2_INSTALL = "pip install flash-attn --no-build-isolation, after the CUDA build of torch"
FA3_INSTALL = (
    "on Hopper, FlashAttention 3: git clone https://github.com/Dao-AILab/flash-attention && "
    "pip install --no-build-isolation flash-attention/hopper"
)
FA4_INSTALL = "pip install flash-attn-4==4.0.0b36 (a pre-release; Hopper and Blackwell)"
_KERNELS = {  # backend: (modules tried in order, varlen entry point, how to get it)
    "flash_attn": (
        ("flash_attn_interface", "flash_attn"),  # FA3 first: its top-level module; then FA2
        "flash_attn_varlen_func",
        f"{FA2_INSTALL}; or {FA3_INSTALL}",
    ),
    "flash_attn_cute": (("flash_attn.cute",), "flash_attn_varlen_func", FA4_INSTALL),
    "torch_varlen": (
        ("torch.nn.attention.varlen",),
        "varlen_attn",
        f"needs a PyTorch with torch.nn.attention.varlen, this is {torch.__version__}",
    ),
}
# (lowest, highest) compute capability major the kernels are built for.
_CAPABILITY = {"flash_attn": (8, 12), "flash_attn_cute": (9, 11), "torch_varlen": (8, 12)}
# Keyword arguments the adapters below rely on; older releases of the kernels lack some of them.
_REQUIRED_ARGUMENTS = {
    "flash_attn": ("softmax_scale", "causal"),
    # flash-attn 2.8's copy of flash_attn/cute, which overwrites FA4's when installed after it, has no max_seqlen_*.
    "flash_attn_cute": ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_size"),
    "torch_varlen": ("scale", "window_size", "enable_gqa"),
}


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    dropout: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    backend: str = "auto",
    per_kv_head: bool = False,
) -> torch.Tensor:
    """Attention within each packed sample: ``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` -> ``[T, Hq, Dv]``.

    ``cu_seqlens`` is ``[0, l1, l1+l2, ..., T]`` (any integer dtype, any device); ``max_seqlen`` is the
    longest sample. ``scale`` defaults to ``1/sqrt(D)``. ``softcap`` caps the scores, ``sinks [Hq]`` adds
    one logit per query head to each softmax's denominator, ``chunk`` restarts attention every ``chunk``
    tokens of each sample (module docstring). ``backend`` is ``"auto"`` or one of ``BACKENDS``; a named
    backend that cannot run these tensors raises ``ValueError`` saying why. ``per_kv_head`` runs the kernel
    once per key/value head (see :class:`_PerKVHead`), without dropout.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(
            f"q, k, v must be [total_tokens, heads, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"q, k, v disagree on tokens or K/V heads: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if cu_seqlens.ndim != 1:
        raise ValueError(f"cu_seqlens must be 1D, got shape {tuple(cu_seqlens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive bound on the scores, got {softcap}")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"sinks must hold one logit per query head, [{q.shape[1]}], got {tuple(sinks.shape)} (under "
            "sequence parallelism each rank holds only some of the heads)"
        )
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    name = resolve_backend(
        q.device, q.dtype, window=window, dropout=dropout, softcap=softcap, sinks=sinks, backend=backend
    )
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()  # as the kernels take it
    if chunk is not None:
        cu_seqlens, max_seqlen = chunked_cu_seqlens(cu_seqlens, chunk), min(int(max_seqlen), chunk)
    function = _BACKEND_FUNCTIONS[name]
    # Passed only when used, so that a backend function of the plain signature runs every other model.
    extras = {"softcap": softcap} if softcap is not None else {}

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        options = extras if sinks is None else {**extras, "sinks": sinks}
        return function(q, k, v, cu_seqlens, int(max_seqlen), causal, scale, dropout, window, **options)

    # With dropout a recompute would draw other masks than the forward: the kernel runs whole.
    if per_kv_head and k.shape[1] > 1 and not dropout:
        return _PerKVHead.apply(kernel, q, k, v, sinks)
    return kernel(q, k, v, sinks)


def chunked_cu_seqlens(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """``cu_seqlens`` with every sample cut into pieces of ``chunk`` tokens from its start (the last shorter).

    Samples of 45, 70 and 29 tokens, chunk 16: 16 16 13 | 16 16 16 16 6 | 16 13::

        [0, 45, 115, 144]  ->  [0, 16, 32, 45, 61, 77, 93, 109, 115, 131, 144]

    Empty samples vanish (they hold no token). One device sync (the number of pieces).
    """
    starts, lengths = cu_seqlens[:-1], cu_seqlens.diff()
    pieces = torch.div(lengths + chunk - 1, chunk, rounding_mode="floor")
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), pieces)
    first_piece = pieces.cumsum(0) - pieces
    within = torch.arange(len(sample), device=cu_seqlens.device) - first_piece[sample]
    return torch.cat([starts[sample] + within * chunk, cu_seqlens[-1:]]).to(cu_seqlens.dtype)


class _PerKVHead(torch.autograd.Function):
    """Attention one key/value head at a time: the kernel runs on that head and its query heads alone.

    Heads are independent, so the result is the kernel's on all heads at once. What changes is the memory of
    backward: a FlashAttention kernel's backward allocates buffers the size of all the query heads it is
    given (FlashAttention 2: a float32 ``dq`` accumulator, and under grouped-query attention ``dk``/``dv``
    expanded to every query head, 8 bytes per token per unit of hidden for Llama-3.1-8B's 32/8 heads),
    and here they exist for one key/value head's group at a time. For Hq = 4, Hkv = 2::

        q [T, 4, D]   heads 0 1 | 2 3        out [T, 4, D]: each group's output written into its heads
        k, v [T, 2, D]      0   |   1        (one buffer, no list of groups and their concatenation)

    The kernel's own autograd keeps what its backward needs (its output, the log-sum-exp) out of reach, so
    nothing of it is kept: backward runs each group's forward again and differentiates that alone, writing
    the group's gradients into ``dq``, ``dk``, ``dv`` (and the sinks', one per query head, into ``dsinks``).
    This costs one more forward of the kernel; the memory kept is ``q``, ``k``, ``v``, as every attention
    keeps them.
    """

    @staticmethod
    def forward(
        ctx,
        kernel: Callable,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.kernel = kernel
        ctx.autocast = torch.is_autocast_enabled(q.device.type), torch.get_autocast_dtype(q.device.type)
        ctx.save_for_backward(q, k, v, sinks)
        out = None
        for heads, kv_head in _kv_head_groups(q.shape[1], k.shape[1]):
            y = kernel(q[:, heads], k[:, kv_head], v[:, kv_head], None if sinks is None else sinks[heads])
            if out is None:
                out = y.new_empty((q.shape[0], q.shape[1], y.shape[-1]))
            out[:, heads] = y
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks = ctx.saved_tensors
        inputs = (q, k, v, sinks)
        wanted = [want and x is not None for x, want in zip(inputs, ctx.needs_input_grad[1:], strict=True)]
        grads = [torch.empty_like(x) if want else None for x, want in zip(inputs, wanted, strict=True)]
        enabled, dtype = ctx.autocast
        for heads, kv_head in _kv_head_groups(q.shape[1], k.shape[1]):
            where = (heads, kv_head, kv_head, heads)
            parts = [
                None if x is None else _heads(x, at).detach().requires_grad_(want)
                for x, at, want in zip(inputs, where, wanted, strict=True)
            ]
            with torch.enable_grad(), torch.autocast(q.device.type, dtype=dtype, enabled=enabled):
                y = ctx.kernel(*parts)
            needed = [x for x in parts if x is not None and x.requires_grad]
            found = iter(torch.autograd.grad(y, needed, grad_out[:, heads]))
            for grad, at in zip(grads, where, strict=True):
                if grad is not None:
                    _heads(grad, at).copy_(next(found))
        return None, *grads


def _heads(x: torch.Tensor, at: slice) -> torch.Tensor:
    """The heads ``at`` of ``q/k/v [T, H, D]`` or of ``sinks [H]``, as a view."""
    return x[at] if x.ndim == 1 else x[:, at]


def _kv_head_groups(heads: int, kv_heads: int) -> list[tuple[slice, slice]]:
    """``(query heads, key/value head)`` of each key/value head, as slices.

    >>> _kv_head_groups(4, 2)
    [(slice(0, 2, None), slice(0, 1, None)), (slice(2, 4, None), slice(1, 2, None))]
    """
    per = heads // kv_heads
    return [(slice(g * per, (g + 1) * per), slice(g, g + 1)) for g in range(kv_heads)]


def available_backends(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    window: int | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> dict[str, str | None]:
    """Each backend, in the order ``auto`` tries them on ``device``, mapped to why it cannot run (``None``: it can).

    >>> available_backends("cpu", torch.float32)["sdpa_segments"] is None
    True
    """
    device = torch.device(device)
    needs = _Needs(window is not None, dropout > 0, softcap is not None, sinks is not None)
    return {name: _why_unavailable(name, device, dtype, needs) for name in _preference(device)}


def resolve_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    window: int | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    backend: str = "auto",
) -> str:
    """The backend a call with these tensors runs on: the first that can for ``"auto"``, else ``backend`` itself.

    Raises ``ConfigError`` for an unknown name, or for a named backend that cannot run, with the reason.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ConfigError(
            f"unknown attention backend {backend!r}; expected 'auto' or one of {', '.join(BACKENDS)}"
        )
    reasons = available_backends(device, dtype, window=window, dropout=dropout, softcap=softcap, sinks=sinks)
    if backend == "auto":
        return next(name for name, reason in reasons.items() if reason is None)
    if reasons[backend] is not None:
        raise ConfigError(f"attention backend {backend!r} cannot run here: {reasons[backend]}")
    return backend


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` (int32) and ``max_seqlen`` of the samples in ``position_ids [B, T]``, rows concatenated.

    A sample starts at the beginning of each row and wherever the position does not follow the previous
    one by exactly 1::

        position_ids  [[0, 1, 2, 0, 0, 1]]  ->  cu_seqlens [0, 3, 4, 6], max_seqlen 3
        position_ids  [[0, 1, 2], [0, 1, 0]] ->  cu_seqlens [0, 3, 5, 6], max_seqlen 3
    """
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    start_index = torch.nonzero(starts.flatten()).flatten()
    total = torch.tensor([position_ids.numel()], device=position_ids.device)
    cu_seqlens = torch.cat([start_index, total]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def _preference(device: torch.device) -> tuple[str, ...]:
    """Backend order for ``auto``: FA4 leads on Blackwell (capability 10+), FA2/FA3 elsewhere."""
    if device.type == "cuda" and torch.cuda.is_available() and _capability(device)[0] >= 10:
        return ("flash_attn_cute", "flash_attn", "torch_varlen", "sdpa_segments")
    return BACKENDS


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _device_problem(name: str, device: torch.device) -> str | None:
    """Why the kernel of ``name`` cannot run on ``device``, or ``None`` when it can.

    The tests replace this one check to run the kernels' Python layers on CPU against stand-ins of their
    compiled code (``tests/kernel_standins.py``); everything else here runs as on a GPU.
    """
    if device.type != "cuda":
        return f"needs a CUDA device, tensors are on {device.type}"
    if not torch.cuda.is_available():
        return "needs CUDA, and torch sees no CUDA device"
    lowest, highest = _CAPABILITY[name]
    major, minor = _capability(device)
    if not lowest <= major <= highest or (name == "flash_attn_cute" and torch.version.hip is not None):
        return f"needs an NVIDIA GPU of compute capability {lowest}.x to {highest}.x, this is {major}.{minor}"
    return None


class _Needs(NamedTuple):
    """What a call asks of a backend beyond plain causal attention."""

    window: bool
    dropout: bool
    softcap: bool
    sinks: bool


def _why_unavailable(name: str, device: torch.device, dtype: torch.dtype, needs: _Needs) -> str | None:
    """Every reason ``name`` cannot run these tensors, joined by "; ", or ``None`` when it can."""
    if name == "sdpa_segments":
        return None
    kernel, import_problem = _kernel(name)
    reasons = [] if import_problem is None else [import_problem]
    device_problem = _device_problem(name, device)
    if device_problem is not None:
        reasons.append(device_problem)
    if dtype not in _FLASH_DTYPES:
        reasons.append(f"needs float16 or bfloat16, got {str(dtype).removeprefix('torch.')}")
    if kernel is not None:
        label = _kernel_label(kernel)
        missing = [argument for argument in _REQUIRED_ARGUMENTS[name] if not _accepts(kernel, argument)]
        if missing:
            reasons.append(f"{label} is too old: it takes no {', '.join(missing)}")
        if needs.window and not _accepts(kernel, "window_size"):
            reasons.append(f"{label} cannot apply a sliding window")
        if needs.dropout and not _accepts(kernel, "dropout_p"):
            reasons.append(f"{label} has no attention dropout")
        if needs.softcap and not _accepts(kernel, "softcap"):
            reasons.append(
                f"{label} has no attention logit soft-capping (Gemma 2's attn_logit_softcapping): use "
                "flash_attn (FlashAttention 2/3), flash_attn_cute (FlashAttention 4) or sdpa_segments"
            )
        if needs.sinks and not _accepts(kernel, "learnable_sink"):
            reasons.append(
                f"{label} has no attention sinks (gpt-oss), and the log-sum-exp it returns passes no "
                "gradient back: use flash_attn_cute (FlashAttention 4) or sdpa_segments"
            )
    return "; ".join(reasons) or None


@functools.cache
def _kernel(name: str) -> tuple[Callable[..., Any] | None, str | None]:
    """The varlen entry point of a kernel backend, or ``None`` and why it cannot be imported."""
    modules, entry_point, install = _KERNELS[name]
    failures = []
    for module_name in modules:
        try:
            return getattr(importlib.import_module(module_name), entry_point), None
        except ModuleNotFoundError as error:
            missing = error.name is not None and (module_name + ".").startswith(error.name + ".")
            if not missing:
                failures.append(f"{module_name} failed to import ({error})")
        except (ImportError, AttributeError, OSError, RuntimeError) as error:
            failures.append(f"{module_name} failed to import ({type(error).__name__}: {error})")
    return None, "; ".join(failures) or f"not installed ({install})"


def _accepts(function: Callable[..., Any], argument: str) -> bool:
    return argument in inspect.signature(function).parameters


def _kernel_label(function: Callable[..., Any]) -> str:
    return f"{function.__module__}.{function.__name__}"


def _flash_window(
    window: int | None, causal: bool, infinite: int | None = -1
) -> tuple[int | None, int | None]:
    """FlashAttention's inclusive ``(left, right)`` reach for a window of ``window`` tokens.

    window 3, causal: query 5 sees keys 3, 4, 5 -> ``(2, 0)``; no window -> ``(infinite, infinite)``.
    """
    if window is None:
        return (infinite, infinite)
    return (window - 1, 0 if causal else window - 1)


def _sdpa_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    dropout: float,
    window: int | None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` per sample, on ``[1, heads, length, head_dim]`` views.

    ``split`` rather than slicing: its backward concatenates the samples' gradients once, where slices would
    each scatter into a zero tensor the size of the whole pack. SDPA has neither soft-capping nor sinks:
    with either, each sample's attention is written out (:func:`_explicit_attention`).
    """
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the {q.shape[0]} tokens")
    outputs = []
    for q_i, k_i, v_i in zip(*(x.split(lengths) for x in (q, k, v)), strict=True):
        if len(q_i) == 0:
            continue
        mask = _window_mask(len(q_i), window, causal, q.device)
        if softcap is not None or sinks is not None:
            if mask is None and causal:
                mask = torch.ones(len(q_i), len(q_i), dtype=torch.bool, device=q.device).tril()
            outputs.append(_explicit_attention(q_i, k_i, v_i, mask, scale, dropout, softcap, sinks))
            continue
        out = F.scaled_dot_product_attention(
            *(x[None].transpose(1, 2) for x in (q_i, k_i, v_i)),  # the 4D layout CPU's fused kernel takes
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=causal and mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs) if outputs else q.new_empty(0, q.shape[1], v.shape[2])


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    dropout: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One sample's attention written out: ``q [L, Hq, D]``, ``k/v [L, Hkv, D]``, ``mask [L, L]`` (None: all).

    Scores ``s = scale q.k``, capped to ``softcap * tanh(s / softcap)``, masked; then the softmax, whose
    denominator also holds ``exp(sink)`` of the head when ``sinks`` is given. For a query that sees keys
    with scores 0 and ln 3 and a sink of ln 4: ``exp`` gives 1, 3 and 4, so the weights are 1/8 and 3/8 (the
    sink takes the rest and no value). Computed in float32 at least (float64 stays float64); K/V heads are
    not repeated (each query head group meets its key/value head through the einsum).
    """
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    grouped = q.to(work).view(length, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("qhgd,khd->hgqk", grouped, k.to(work)) * (dim**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    normaliser = scores.logsumexp(-1, keepdim=True)
    if sinks is not None:
        normaliser = torch.logaddexp(normaliser, sinks.to(work).view(kv_heads, -1, 1, 1))
    weights = torch.exp(scores - normaliser)
    if dropout:
        weights = F.dropout(weights, dropout)
    out = torch.einsum("hgqk,khd->qhgd", weights, v.to(work))
    return out.reshape(length, heads, v.shape[-1]).to(q.dtype)


def _window_mask(length: int, window: int | None, causal: bool, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[length, length]`` mask for a sliding window, or ``None`` when the window covers everything.

    length 4, window 2, causal::

        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1
    """
    if window is None or window >= length:
        return None
    position = torch.arange(length, device=device)
    distance = position[:, None] - position[None, :]
    return (distance < window) & (distance >= 0 if causal else distance > -window)


def _flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    dropout: float,
    window: int | None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashAttention 2 (``flash_attn``) or 3 (``flash_attn_interface``).

    Window, dropout and soft-capping go in only when used: FA3 has no ``dropout_p``, FA2 before 2.3 no
    ``window_size``, before 2.6 no ``softcap``. Sinks reach here only from a release that takes
    ``learnable_sink`` (flash-attn 2.8.3 does not: ``_why_unavailable`` refuses it).
    """
    options = {"window_size": _flash_window(window, causal)} if window is not None else {}
    if dropout:
        options["dropout_p"] = dropout
    if softcap is not None:
        options["softcap"] = softcap
    if sinks is not None:
        options["learnable_sink"] = sinks
    out = _kernel("flash_attn")[0](
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=causal,
        **options,
    )
    # Some FA3 releases return (out, softmax_lse).
    return out[0] if isinstance(out, tuple) else out


def _flash_attn_cute(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    dropout: float,
    window: int | None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashAttention 4; returns ``(out, lse)`` and spells an unbounded window side as ``None``.

    Its ``learnable_sink`` (float32 here, one of the dtypes it takes) runs forward and backward in the
    kernel, the sinks' gradient included (flash-attn-4 4.0.0b36's varlen interface).
    """
    options = {} if softcap is None else {"softcap": softcap}
    if sinks is not None:
        options["learnable_sink"] = sinks.to(torch.float32)
    out, _ = _kernel("flash_attn_cute")[0](
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=causal,
        window_size=_flash_window(window, causal, infinite=None),
        **options,
    )
    return out


def _torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool,
    scale: float | None,
    dropout: float,
    window: int | None,
) -> torch.Tensor:
    """PyTorch's own varlen kernel (the 2.12+ signature): causality is spelled as the window ``(-1, 0)``."""
    window_size = (-1, 0) if causal and window is None else _flash_window(window, causal)
    return _kernel("torch_varlen")[0](
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=window_size,
        enable_gqa=q.shape[1] != k.shape[1],
    )


_BACKEND_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "flash_attn": _flash_attn,
    "flash_attn_cute": _flash_attn_cute,
    "torch_varlen": _torch_varlen,
    "sdpa_segments": _sdpa_segments,
}
