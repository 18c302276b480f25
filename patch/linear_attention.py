"""Linear-attention layers that restart at every packed sample (Qwen3-Next, Qwen3.5 dense and MoE, Kimi-Linear).

These decoders mix full-attention layers with linear-attention layers: a short causal convolution over the
tokens (``linear_conv_kernel_dim``, 4) feeding a gated delta rule, whose state runs from token to token.
Packed, both must restart where a sample starts, as they do when the sample runs alone::

    tokens        a0 a1 a2 | b0 | c0 c1                 cu_seqlens [0, 3, 4, 6]
    convolution   b0 sees b0 alone (not a1, a2); c1 sees c0 and c1
    state         0 -> a0 -> a1 -> a2 | 0 -> b0 | 0 -> c0 -> c1

What transformers 5.24 and 5.25 do on their own: the Qwen layers hand ``cu_seq_lens_q`` to the delta rule as
``cu_seqlens`` but give the convolution no ``seq_idx``, so even with both kernels installed a sample's first
tokens read the previous sample's last ones; Kimi-Linear hands the kernels no boundaries at all. Without
flash-linear-attention the torch delta rule refuses ``cu_seqlens`` (a ValueError), and a batch that marks
its samples by ``position_ids`` alone reaches the layers with no boundaries: the state runs straight through.

``install(model)`` gives every linear-attention layer (a module whose ``layer_type`` is
``"linear_attention"`` and that has a ``conv1d``) a forward that reads the batch's ``cu_seq_lens_q`` and
takes one of two paths:

- per sample (CPU, and wherever the kernels are missing): the layer's own forward on each sample's tokens,
  from zero state, the outputs concatenated. Exact by construction; one call per sample and layer.
- varlen kernels (CUDA, bfloat16/float16, flash-linear-attention and causal-conv1d installed): one call
  over the pack flattened to one row, with ``cu_seqlens`` for fla's ``chunk_gated_delta_rule`` /
  ``chunk_kda`` and ``seq_idx`` for causal-conv1d's ``causal_conv1d_fn``. Written from the libraries'
  signatures and untested here (no GPU).

The layers never see ``position_ids``: when a batch has no ``cu_seq_lens_q``, a hook on the decoder reads
the boundaries off ``position_ids`` once per forward and passes them on as the collator would.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Any

import torch
from torch import nn

from longalign.attention import cu_seqlens_from_position_ids

LINEAR_ATTENTION = "linear_attention"  # the layer type transformers' configs give these layers
# The batch's boundary keywords: a piece run alone gets none of them, the varlen call only its own two.
_BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cu_seqlens", "seq_idx")
_HOOKED = (
    "_longalign_linear_attention_boundaries"  # marks a decoder with the hook, so install() can run twice
)


def linear_attention_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that carry state across tokens: ``layer_type == "linear_attention"`` and a
    short convolution ``conv1d``, as Qwen3-Next's ``Qwen3NextGatedDeltaNet`` and Kimi-Linear's
    ``KimiLinearDeltaAttention`` have."""
    return [
        module
        for module in model.modules()
        if getattr(module, "layer_type", None) == LINEAR_ATTENTION
        and isinstance(getattr(module, "conv1d", None), nn.Conv1d)
    ]


def install(model: nn.Module) -> int:
    """Make every linear-attention layer of ``model`` restart at each packed sample; how many there are.

    A model without such layers is left as it is.
    """
    layers = linear_attention_layers(model)
    for layer in layers:
        if not hasattr(type(layer), "unpacked"):
            layer.__class__ = _packed_class(type(layer))
    decoder = model.base_model
    if layers and not getattr(decoder, _HOOKED, False):
        decoder.register_forward_pre_hook(_boundaries_from_positions, with_kwargs=True)
        setattr(decoder, _HOOKED, True)
    return len(layers)


def kernels_ready(hidden_states: torch.Tensor) -> bool:
    """Whether the varlen kernels run on ``hidden_states``: CUDA, half precision (fla's chunked delta rule
    refuses float32), and both flash-linear-attention and causal-conv1d importable."""
    return (
        hidden_states.is_cuda
        and hidden_states.dtype in (torch.bfloat16, torch.float16)
        and _installed("fla")
        and _installed("causal_conv1d")
    )


def seq_idx_of(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """causal-conv1d's ``seq_idx [1, total]`` int32: the sample each token belongs to, without a device sync.

    >>> seq_idx_of(torch.tensor([0, 3, 4, 6]), 6)
    tensor([[0, 0, 0, 1, 2, 2]], dtype=torch.int32)
    """
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True).to(torch.int32)[None]


def kernel_keyword(cls: type) -> str:
    """The keyword under which the layer's forward must receive ``cu_seqlens`` for its delta-rule kernel.

    The Qwen layers rename ``cu_seq_lens_q`` to the kernel's ``cu_seqlens`` themselves (their code names
    it); Kimi-Linear passes its keyword arguments through to ``chunk_kda``, which reads ``cu_seqlens``.
    """
    code = inspect.unwrap(cls.forward).__code__
    return "cu_seq_lens_q" if "cu_seq_lens_q" in code.co_consts else "cu_seqlens"


@functools.cache
def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.cache
def _packed_class(cls: type) -> type:
    """``cls`` with the boundary-aware forward, under the same name (checks and wrap policies go by name)."""
    return type(
        cls.__name__, (cls,), {"forward": _packed_forward, "unpacked": cls, "__module__": cls.__module__}
    )


def _packed_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The layer on ``hidden_states [B, T, H]`` with its convolution and state restarting at every sample."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None or cache is not None:  # each row is one sample, or generation with a cache
        return layer.unpacked.forward(
            layer, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
        )
    if attention_mask is not None:
        raise ValueError(
            f"{type(layer).__name__} got a padding mask with packed samples (cu_seq_lens_q); packed rows carry "
            "no padding: concatenate the samples instead"
        )
    others = {key: value for key, value in kwargs.items() if key not in _BOUNDARY_KEYS}
    if kernels_ready(hidden_states):
        return _varlen_kernels(layer, hidden_states, cu_seqlens, others)
    return _per_sample(layer, hidden_states, cu_seqlens, others)


def _per_sample(
    layer: nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """The layer's own forward once per sample of the flattened rows, each from zero state::

    hidden [1, 6, H], cu_seqlens [0, 3, 4, 6]  ->  forward(hidden[:, 0:3]), forward(hidden[:, 3:4]),
                                                   forward(hidden[:, 4:6])  ->  concatenated [1, 6, H']
    """
    batch, length, width = hidden_states.shape
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != batch * length:
        raise ValueError(
            f"cu_seq_lens_q runs from {bounds[0]} to {bounds[-1]}, but {type(layer).__name__} holds {batch} rows "
            f"of {length} tokens: the boundaries must cover every token of the rows flattened (a sequence-"
            "parallel slice of a pack cannot run linear-attention layers)"
        )
    tokens = hidden_states.reshape(1, batch * length, width)
    pieces = [
        layer.unpacked.forward(layer, tokens[:, start:end], cache=None, attention_mask=None, **kwargs)
        for start, end in zip(bounds, bounds[1:], strict=False)
    ]
    return torch.cat(pieces, dim=1).view(batch, length, -1)


def _varlen_kernels(
    layer: nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """The layer's own forward once over the rows flattened into one (fla's varlen calls take batch 1), the
    kernels told the boundaries: ``cu_seqlens`` int64 for the delta rule, ``seq_idx`` for the convolution."""
    batch, length, width = hidden_states.shape
    cu_seqlens = cu_seqlens.to(device=hidden_states.device, dtype=torch.long)
    boundaries = {
        kernel_keyword(layer.unpacked): cu_seqlens,
        "seq_idx": seq_idx_of(cu_seqlens, batch * length),
    }
    tokens = hidden_states.reshape(1, batch * length, width)
    out = layer.unpacked.forward(layer, tokens, cache=None, attention_mask=None, **kwargs, **boundaries)
    return out.view(batch, length, -1)


def _boundaries_from_positions(
    decoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Decoder pre-hook: a batch with ``position_ids`` but no ``cu_seq_lens_q`` gets the ``cu_seq_lens_q/k``
    and ``max_length_q/k`` read off its positions (full attention reads the same samples from them)::

        position_ids [[0 1 2 0 0 1]]  ->  cu_seq_lens_q/k [0, 3, 4, 6], max_length_q/k 3

    Qwen3.5's 3D position ids (``[3 or 4, B, T]``) give their first row, identical to the others for text.
    Generation (a cache, or ``use_cache``) is left alone.
    """
    position_ids = kwargs.get("position_ids")
    cached = any(kwargs.get(key) is not None for key in ("cache", "past_key_values")) or kwargs.get(
        "use_cache"
    )
    if kwargs.get("cu_seq_lens_q") is not None or position_ids is None or cached:
        return None
    if position_ids.dim() == 3:
        position_ids = position_ids[0]
    cu_seqlens, longest = cu_seqlens_from_position_ids(position_ids)
    kwargs.update(
        cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest
    )
    return args, kwargs
