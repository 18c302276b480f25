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

import contextlib
import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
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

    kept = _KEPT_FUNCTIONS.get(name)
    if _KEEPING.get() is not None:  # a layer that keeps its attention (keeping_attention)
        if (
            dropout
            or kept is None
            or (sinks is not None and not kept.sinks)
            or not _kept_arguments_taken(name, kept)
        ):
            why = "attention dropout" if dropout else f"the {name} backend's kernel"
            raise ConfigError(
                f"training.keep_attention: {why} does not hand back the output and log-sum-exp its backward "
                "takes; set training.keep_attention = false"
            )
        call = _Call(cu_seqlens, int(max_seqlen), causal, scale, window, softcap)
        return _PerKVHead.apply(kept, call, q, k, v, sinks)
    # With dropout the kernel runs whole: its backward would need each group's random state.
    if not per_kv_head or k.shape[1] == 1 or dropout:
        return kernel(q, k, v, sinks)
    if kept is not None and (sinks is None or kept.sinks) and _kept_arguments_taken(name, kept):
        call = _Call(cu_seqlens, int(max_seqlen), causal, scale, window, softcap)
        return _PerKVHead.apply(kept, call, q, k, v, sinks)
    # A kernel whose backward cannot be called on its own: each group through the kernel's own autograd,
    # which keeps that group's output besides the one concatenated here.
    groups = _kv_head_groups(q.shape[1], k.shape[1])
    return torch.cat(
        [kernel(q[:, h], k[:, g], v[:, g], None if sinks is None else sinks[h]) for h, g in groups], dim=1
    )


# What the attention calls inside ``keeping_attention`` do with what their kernels' forward hands back.
_KEEPING: contextvars.ContextVar[tuple[str, list] | None] = contextvars.ContextVar("keeping", default=None)


@contextlib.contextmanager
def keeping_attention(mode: str, kept: list) -> Iterator[None]:
    """Attention calls that keep, or are handed back, their kernels' output and log-sum-exp.

    ``"record"``: each ``varlen_attention`` call runs its kernel one key/value head at a time
    (:class:`_PerKVHead`, even with one head) and appends ``(out, [lse per group])`` to ``kept``.
    ``"replay"``: each call takes the next ``(out, lses)`` from ``kept`` instead of running the kernel's
    forward, and its backward calls the kernel's backward on them, as if it had run. The tiled layer's
    ``keep_attention`` records in forward and replays in its backward. A backend whose kernel's backward
    cannot be called on its own, or attention dropout, raises ``ConfigError``.
    """
    if mode not in ("record", "replay"):
        raise ValueError(f"keeping_attention: mode must be 'record' or 'replay', got {mode!r}")
    token = _KEEPING.set((mode, kept))
    try:
        yield
    finally:
        _KEEPING.reset(token)


def _kept_arguments_taken(name: str, kept: _Kept) -> bool:
    """Whether this release of ``name``'s kernel takes what ``kept`` passes it."""
    return all(_accepts(_kernel(name)[0], argument) for argument in kept.arguments)


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


class _Call(NamedTuple):
    """What every kernel call of one ``varlen_attention`` shares besides the tensors."""

    cu_seqlens: torch.Tensor  # int32, on the tensors' device
    max_seqlen: int
    causal: bool
    scale: float | None
    window: int | None
    softcap: float | None


class _Kept(NamedTuple):
    """A kernel's forward that hands back its log-sum-exp, and the kernel's backward that takes it.

    ``forward(q, k, v, sinks, call) -> (out, lse)``;
    ``backward(dout, q, k, v, out, lse, sinks, call) -> (dq, dk, dv, dsinks or None)``. ``lse`` is whatever
    the kernel returns (FlashAttention's and torch's: float32 ``[heads, tokens]``), handed back unread.
    ``sinks`` says whether the pair takes attention sinks; ``arguments`` are keyword arguments the
    backend's varlen entry point must take for the pair to exist in that release.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor | None, ...]]
    sinks: bool = False
    arguments: tuple[str, ...] = ()


class _PerKVHead(torch.autograd.Function):
    """Attention one key/value head at a time: the kernel runs on that head and its query heads alone.

    Heads are independent, so the result is the kernel's on all heads at once. What changes is the memory of
    backward: a FlashAttention kernel's backward allocates buffers the size of all the query heads it is
    given (FlashAttention 2: a float32 ``dq`` accumulator, and under grouped-query attention ``dk``/``dv``
    expanded to every query head, 8 bytes per token per unit of hidden for Llama-3.1-8B's 32/8 heads),
    and here they exist for one key/value head's group at a time. For Hq = 4, Hkv = 2::

        q [T, 4, D]   heads 0 1 | 2 3        out [T, 4, D]: each group's output written into its heads
        k, v [T, 2, D]      0   |   1        lse: one per group, [2, T] float32 each (FlashAttention's)

    Forward runs each group's kernel once and keeps, as the kernel's own autograd would, ``q``, ``k``,
    ``v``, the output (one buffer, the o-projection's input, which that layer keeps anyway) and each group's
    log-sum-exp (float32 ``[heads, tokens]``: 4 bytes per token per query head, 0.03 bytes per token per
    unit of hidden for Llama-3.1-8B's head size 128). Backward calls the kernel's backward on each group
    (no forward runs again), writing the group's gradients into ``dq``, ``dk``, ``dv`` (and the sinks',
    one per query head, into ``dsinks``).
    """

    @staticmethod
    def forward(
        ctx,
        kept: _Kept,
        call: _Call,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.kept, ctx.call = kept, call
        keeping = _KEEPING.get()
        if keeping is not None and keeping[0] == "replay":
            out, lses = keeping[1].pop(0)
        else:
            out, lses = None, []
            for heads, kv_head in _kv_head_groups(q.shape[1], k.shape[1]):
                group_sinks = None if sinks is None else sinks[heads]
                y, lse = kept.forward(q[:, heads], k[:, kv_head], v[:, kv_head], group_sinks, call)
                if out is None:
                    out = y.new_empty((q.shape[0], q.shape[1], y.shape[-1]))
                out[:, heads] = y
                lses.append(lse)
            if keeping is not None:
                keeping[1].append((out, lses))
        ctx.save_for_backward(q, k, v, sinks, out, *lses)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, sinks, out, *lses = ctx.saved_tensors
        inputs = (q, k, v, sinks)
        wanted = [want and x is not None for x, want in zip(inputs, ctx.needs_input_grad[2:], strict=True)]
        grads = [torch.empty_like(x) if want else None for x, want in zip(inputs, wanted, strict=True)]
        grad_out = grad_out.to(out.dtype)  # the kernels take dout in their output's dtype
        groups = _kv_head_groups(q.shape[1], k.shape[1])
        for (heads, kv_head), lse in zip(groups, lses, strict=True):
            where = (heads, kv_head, kv_head, heads)
            parts = [None if x is None else _heads(x, at) for x, at in zip(inputs, where, strict=True)]
            found = ctx.kept.backward(grad_out[:, heads], *parts[:3], out[:, heads], lse, parts[3], ctx.call)
            for grad, at, part in zip(grads, where, found, strict=True):
                if grad is not None:
                    _heads(grad, at).copy_(part)
        return None, None, *grads


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
    bounds = _sample_bounds(cu_seqlens, q.shape[0])
    lengths = [end - start for start, end in pairwise(bounds)]
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


def _segments_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: _Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sdpa_segments``' forward with its log-sum-exp: ``out [T, Hq, Dv]`` and ``lse [Hq, T]``.

    Each sample through CPU's fused kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns
    its log-sum-exp and never holds the scores whole), or, with soft-capping or sinks, which it lacks,
    written out as in :func:`_explicit_attention` (the sinks in the denominator:
    ``lse = log(sum_k exp(s_qk) + exp(sink))``), in float32 at least; ``lse`` is kept in that dtype.
    """
    bounds = _sample_bounds(call.cu_seqlens, q.shape[0])
    work = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=work, device=q.device)
    for start, end in pairwise(bounds):
        if end == start:
            continue
        if _fused_runs(q, v, sinks, call):  # CPU's fused kernel, scores never held whole
            fused = _fused_inputs(q[start:end], k[start:end], v[start:end], call)
            out_i, lse_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*fused[:5], **fused[5])
            out[start:end] = out_i[0].transpose(0, 1)
            lse[:, start:end] = lse_i[0]
            continue
        probabilities, lse_i, _ = _sample_probabilities(q[start:end], k[start:end], sinks, call, work)
        out_i = torch.einsum("hgqk,khd->qhgd", probabilities, v[start:end].to(work))
        out[start:end] = out_i.reshape(end - start, q.shape[1], v.shape[2])
        lse[:, start:end] = lse_i.reshape(q.shape[1], end - start)
    return out, lse


def _segments_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    call: _Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The exact backward of :func:`_segments_forward` from its ``out`` and ``lse``, as a flash kernel's.

    CPU's fused backward where the forward was fused; written out otherwise, per sample, with ``P = exp(scores - lse)`` rebuilt from the kept ``lse`` and ``D = rowsum(dO * O)``::

        dV = P^T dO      dP = dO V^T      dS = P * (dP - D)   (times 1 - tanh^2 under a soft-cap)
        dQ = scale dS K  dK = scale dS^T Q                    dsink = -sum_q exp(sink - lse) * D

    (the sink is one more column of the softmax with no value: its ``dP`` is 0).
    """
    bounds = _sample_bounds(call.cu_seqlens, q.shape[0])
    work = lse.dtype
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    scale = dim**-0.5 if call.scale is None else call.scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(kv_heads, heads // kv_heads, dtype=work, device=q.device)
    for start, end in pairwise(bounds):
        if end == start:
            continue
        if _fused_runs(q, v, sinks, call):
            fused = _fused_inputs(q[start:end], k[start:end], v[start:end], call)
            dout_i, out_i = (x[start:end].transpose(0, 1)[None] for x in (dout, out))
            lse_i = lse[None, :, start:end].contiguous()
            dq_i, dk_i, dv_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout_i, *fused[:3], out_i, lse_i, *fused[3:5], **fused[5]
            )
            dq[start:end] = dq_i[0].transpose(0, 1)
            for grad, grad_i in ((dk, dk_i), (dv, dv_i)):  # each key/value head's query group summed
                grad[start:end] = grad_i[0].unflatten(0, (kv_heads, -1)).sum(1, dtype=work).transpose(0, 1)
            continue
        lse_i = lse[:, start:end].reshape(kv_heads, heads // kv_heads, end - start)
        probabilities, _, slope = _sample_probabilities(q[start:end], k[start:end], sinks, call, work, lse_i)
        q_i, do_i, o_i = (
            x[start:end].to(work).reshape(end - start, kv_heads, -1, x.shape[-1]) for x in (q, dout, out)
        )
        k_i, v_i = k[start:end].to(work), v[start:end].to(work)
        row = torch.einsum("qhgd,qhgd->hgq", do_i, o_i)
        d_scores = probabilities * (torch.einsum("qhgd,khd->hgqk", do_i, v_i) - row[..., None])
        if slope is not None:
            d_scores = d_scores * slope
        dv[start:end] = torch.einsum("hgqk,qhgd->khd", probabilities, do_i)
        dk[start:end] = torch.einsum("hgqk,qhgd->khd", d_scores, q_i) * scale
        dq[start:end] = (torch.einsum("hgqk,khd->qhgd", d_scores, k_i) * scale).reshape(
            end - start, heads, dim
        )
        if dsinks is not None:
            sink = sinks.to(work).view(kv_heads, -1, 1)
            dsinks -= (torch.exp(sink - lse_i) * row).sum(-1)
    return dq, dk, dv, None if dsinks is None else dsinks.reshape(heads).to(sinks.dtype)


def _fused_runs(q: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: _Call) -> bool:
    """Whether CPU's fused kernel runs a sample: it has no soft-cap and no sinks, and takes values of the
    queries' head size only (multi-head latent attention's are narrower)."""
    return sinks is None and call.softcap is None and q.shape[-1] == v.shape[-1]


def _fused_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> tuple[Any, ...]:
    """One sample's arguments of CPU's fused attention and its backward: ``[1, Hq, L, D]`` tensors (K/V
    heads repeated for their query groups), dropout, causality, the window's mask, the scale."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.repeat_interleave(group, dim=1) if x is not q else x for x in (q, k, v))
    q, k, v = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))
    mask = _window_mask(q.shape[2], call.window, call.causal, q.device)
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return q, k, v, 0.0, call.causal and mask is None, {"attn_mask": bias, "scale": call.scale}


def _sample_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    sinks: torch.Tensor | None,
    call: _Call,
    work: torch.dtype,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One sample's softmax ``P [Hkv, G, L, L]``, its ``lse [Hkv, G, L]`` and the soft-cap's slope (or None).

    With ``lse`` given (backward), ``P`` is rebuilt from it rather than normalised again.
    """
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.to(work).reshape(length, kv_heads, heads // kv_heads, dim)
    scale = dim**-0.5 if call.scale is None else call.scale
    scores = torch.einsum("qhgd,khd->hgqk", grouped, k.to(work)) * scale
    slope = None
    if call.softcap is not None:
        capped = torch.tanh(scores / call.softcap)
        scores, slope = call.softcap * capped, 1 - capped**2
    mask = _window_mask(length, call.window, call.causal, q.device)
    if mask is None and call.causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = scores.logsumexp(-1)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.to(work).view(kv_heads, -1, 1))
    return torch.exp(scores - lse[..., None]), lse, slope


def _sample_bounds(cu_seqlens: torch.Tensor, tokens: int) -> list[int]:
    """``cu_seqlens`` as a list, checked to rise from 0 to ``tokens``."""
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != tokens or min(lengths, default=0) < 0:
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the {tokens} tokens")
    return bounds


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
    return _kernel("torch_varlen")[0](
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        scale=scale,
        window_size=_torch_window(window, causal),
        enable_gqa=q.shape[1] != k.shape[1],
    )


# ---- each kernel's forward that returns the log-sum-exp, and its backward (for _PerKVHead)


def _flash_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: _Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention 2's ``_flash_attn_varlen_forward`` or 3's ``_flash_attn_forward``: ``(out, softmax_lse)``.

    FlashAttention 2's kernel takes head sizes that are multiples of 8: as its own ``FlashAttnVarlenFunc``
    does, the heads are padded with zeros for the call and the output cut back.
    """
    interface = _interface("flash_attn")
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    left, right = _flash_window(call.window, call.causal)
    softcap = 0.0 if call.softcap is None else call.softcap
    shared = (call.cu_seqlens, call.cu_seqlens, call.max_seqlen, call.max_seqlen)
    if interface.__name__ == "flash_attn_interface":  # FlashAttention 3
        out, lse, *_ = interface._flash_attn_forward(
            q, k, v, cu_seqlens_q=shared[0], cu_seqlens_k=shared[1], max_seqlen_q=shared[2],
            max_seqlen_k=shared[3], softmax_scale=scale, causal=call.causal, window_size_left=left,
            window_size_right=right, softcap=softcap,
        )  # fmt: skip
        return out, lse
    out, lse, _, _ = interface._flash_attn_varlen_forward(
        *_pad_heads(q, k, v), *shared, 0.0, scale, call.causal,
        window_size_left=left, window_size_right=right, softcap=softcap,
    )  # fmt: skip
    return out[..., : v.shape[-1]], lse


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    call: _Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """FlashAttention 2's ``_flash_attn_varlen_backward`` or 3's ``_flash_attn_backward`` into fresh buffers."""
    interface = _interface("flash_attn")
    head_size = q.shape[-1]
    scale = head_size**-0.5 if call.scale is None else call.scale
    left, right = _flash_window(call.window, call.causal)
    softcap = 0.0 if call.softcap is None else call.softcap
    shared = (call.cu_seqlens, call.cu_seqlens, call.max_seqlen, call.max_seqlen)
    if interface.__name__ == "flash_attn_interface":  # FlashAttention 3
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        interface._flash_attn_backward(
            dout, q, k, v, out, lse, cu_seqlens_q=shared[0], cu_seqlens_k=shared[1],
            max_seqlen_q=shared[2], max_seqlen_k=shared[3], dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            is_causal=call.causal, window_size_left=left, window_size_right=right, softcap=softcap,
        )  # fmt: skip
        return dq, dk, dv, None
    q, k, v, out, dout = _pad_heads(q, k, v, out, dout)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    interface._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, *shared, 0.0, scale, call.causal, left, right, softcap,
        None, False,  # alibi_slopes, deterministic
    )  # fmt: skip
    return dq[..., :head_size], dk[..., :head_size], dv[..., :head_size], None


def _pad_heads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors with their last dimension padded with zeros to a multiple of 8 (unchanged when it is)."""
    return [F.pad(x, [0, -x.shape[-1] % 8]) if x.shape[-1] % 8 else x for x in tensors]


def _flash_attn_cute_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: _Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention 4's ``_flash_attn_fwd`` (``flash_attn.cute.interface``) asked for its log-sum-exp."""
    out, lse, *_ = _interface("flash_attn_cute")._flash_attn_fwd(
        q, k, v, **_cute_options(sinks, call), return_lse=True
    )
    return out, lse


def _flash_attn_cute_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    call: _Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FlashAttention 4's ``_flash_attn_bwd``; with ``learnable_sink`` it returns the sinks' gradient too."""
    options = _cute_options(sinks, call)
    options["softcap"] = options["softcap"] or 0.0  # the backward spells "no cap" as 0
    dq, dk, dv, *dsinks = _interface("flash_attn_cute")._flash_attn_bwd(q, k, v, out, dout, lse, **options)
    return dq, dk, dv, None if sinks is None else dsinks[0].to(sinks.dtype)


def _cute_options(sinks: torch.Tensor | None, call: _Call) -> dict[str, Any]:
    """The keyword arguments FlashAttention 4's forward and backward share."""
    left, right = _flash_window(call.window, call.causal, infinite=None)
    return {
        "cu_seqlens_q": call.cu_seqlens,
        "cu_seqlens_k": call.cu_seqlens,
        "max_seqlen_q": call.max_seqlen,
        "max_seqlen_k": call.max_seqlen,
        "softmax_scale": call.scale,
        "causal": call.causal,
        "softcap": call.softcap,
        "window_size_left": left,
        "window_size_right": right,
        "learnable_sink": None if sinks is None else sinks.to(torch.float32),
    }


def _torch_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, call: _Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """``varlen_attn(..., return_aux=AuxRequest(lse=True))``: ``(out, lse)``."""
    module = _interface("torch_varlen")
    return module.varlen_attn(
        q, k, v, call.cu_seqlens, call.cu_seqlens, call.max_seqlen, call.max_seqlen,
        scale=call.scale, window_size=_torch_window(call.window, call.causal),
        enable_gqa=q.shape[1] != k.shape[1], return_aux=module.AuxRequest(lse=True),
    )  # fmt: skip


def _torch_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor | None,
    call: _Call,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``torch.ops.torch_attn._varlen_attn_backward``, the op ``varlen_attn``'s own autograd calls."""
    window_size = _torch_window(call.window, call.causal)
    # varlen_attn reads causality off the window, and runs without dropout: its random state is all zeros.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
        dout, q, k, v, out, lse, call.cu_seqlens, call.cu_seqlens, call.max_seqlen, call.max_seqlen,
        window_size == (-1, 0), rng_state, call.scale, list(window_size),
    )  # fmt: skip
    return dq, dk, dv, None


def _torch_window(window: int | None, causal: bool) -> tuple[int | None, int | None]:
    """torch's ``window_size``: causality is spelled as the window ``(-1, 0)``."""
    return (-1, 0) if causal and window is None else _flash_window(window, causal)


def _interface(name: str) -> Any:
    """The module that holds the varlen entry point of ``name``'s kernel, and beside it the lower calls."""
    return importlib.import_module(_kernel(name)[0].__module__)


_BACKEND_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "flash_attn": _flash_attn,
    "flash_attn_cute": _flash_attn_cute,
    "torch_varlen": _torch_varlen,
    "sdpa_segments": _sdpa_segments,
}

# The backends whose kernel's backward longalign calls itself (``per_kv_head``, :class:`_PerKVHead`).
_KEPT_FUNCTIONS: dict[str, _Kept] = {
    "flash_attn": _Kept(_flash_attn_forward, _flash_attn_backward),
    "flash_attn_cute": _Kept(_flash_attn_cute_forward, _flash_attn_cute_backward, sinks=True),
    "torch_varlen": _Kept(_torch_varlen_forward, _torch_varlen_backward, arguments=("return_aux",)),
    "sdpa_segments": _Kept(_segments_forward, _segments_backward, sinks=True),
}
