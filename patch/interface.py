"""The bridge between transformers' ``AttentionInterface`` and :func:`longalign.attention.varlen_attention`.

A decoder layer hands its attention function ``query [B, Hq, T, D]`` and ``key/value [B, Hkv, T, D]``
plus the batch's keyword arguments. The collator's packed batch (``B = 1``)::

    input_ids      [[a0 a1 a2 b0 c0 c1]]
    position_ids   [[ 0  1  2  0  0  1]]      -> rotary positions restart per sample
    cu_seq_lens_q  [0, 3, 4, 6]               -> reaches the attention function untouched
    max_length_q   3

The attention function flattens ``B x T`` into one token axis, runs varlen attention over the samples and
returns ``[B, T, Hq, D]``. Without ``cu_seq_lens_q`` the samples are read off ``position_ids`` (each row
starts a sample, and so does every break in the count), costing one device sync per layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longalign.attention import cu_seqlens_from_position_ids, varlen_attention

# Registered names, one per backend choice. None contains "flash" or "/" (transformers would load its own
# flash-attention or a Hub kernel instead of calling ours) or "sdpa" (it would check for sdpa support).
ATTENTION_NAMES = {
    "auto": "longalign_varlen",
    "flash_attn": "longalign_varlen_fa",
    "flash_attn_cute": "longalign_varlen_fa4",
    "torch_varlen": "longalign_varlen_torch",
    "sdpa_segments": "longalign_varlen_segments",
}


def register(backend: str = "auto", *, name: str | None = None) -> str:
    """Register the varlen attention (and its mask hook) for ``backend``; return the name to select it by.

    ``name`` defaults to the backend's entry of ``ATTENTION_NAMES``. A name that DeepSpeed's Ulysses layer
    has wrapped for sequence parallelism is refused: registering it again silently either drops the
    wrapper (sequence parallelism off) or is shadowed by it (the new function never runs), depending on
    which of the registry's mappings each entry sits in (the wrapper's, in transformers 5.2x, shadows).
    """
    if backend not in ATTENTION_NAMES:
        raise ValueError(
            f"unknown attention backend {backend!r}; expected one of {', '.join(ATTENTION_NAMES)}"
        )
    name = name or ATTENTION_NAMES[backend]
    if is_ulysses(ALL_ATTENTION_FUNCTIONS.get(name)):
        raise ValueError(
            f"attention {name!r} is wrapped by DeepSpeed's Ulysses layer for sequence parallelism; registering "
            "it again would silently turn sequence parallelism off or never take effect"
        )
    AttentionInterface.register(name, functools.partial(varlen_attention_forward, backend=backend))
    AttentionMaskInterface.register(name, padding_free_mask)
    return name


def selects_varlen(attn_implementation: Any) -> bool:
    """Whether a config's ``_attn_implementation`` is longalign's varlen attention (under any backend's name,
    or wrapped for sequence parallelism: ``longalign_varlen_fa_ulysses``)."""
    return isinstance(attn_implementation, str) and attn_implementation.startswith(ATTENTION_NAMES["auto"])


def is_ulysses(function: Any) -> bool:
    """Whether an attention registry entry is DeepSpeed's Ulysses wrapper (``UlyssesSPAttentionHF``)."""
    return "UlyssesSPAttentionHF" in getattr(function, "__qualname__", "")


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    per_kv_head: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``[B, Hq, T, D]`` in, ``([B, T, Hq, Dv], None)`` out.

    ``per_kv_head`` (from the tiled layer, through DeepSpeed's Ulysses exchange when it wraps this
    function) runs the kernel once per key/value head of the heads this rank holds. ``softcap`` (Gemma 2)
    and ``s_aux`` (gpt-oss's sinks) go to the kernel; a layer of type ``"chunked_attention"`` (Llama 4's
    RoPE layers) attends within chunks of ``attention_chunk_size`` from each sample's start; a module that
    carries ``packed_query_scale`` (``longalign.patch.llama4``) has its queries scaled by the position of
    each token within its sample.
    """
    if attention_mask is not None:
        raise ValueError(
            f"longalign's varlen attention got a {attention_mask.dim()}D attention mask; packed batches carry "
            "their sample boundaries in cu_seq_lens_q/position_ids and need no mask"
        )
    batch, heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(
            f"{length} queries against {key.shape[2]} keys: longalign's varlen attention is for training "
            "without a KV cache; generate with model.set_attn_implementation('sdpa')"
        )
    cu_seqlens, max_seqlen = _sample_boundaries(kwargs, batch, length)
    if s_aux is not None and s_aux.shape[0] != heads:
        s_aux = _sinks_of_this_rank(s_aux, heads)
    query_scale = getattr(module, "packed_query_scale", None)
    if query_scale is not None:
        scales = query_scale(positions_in_samples(cu_seqlens, batch * length))
        query = (query * scales.view(batch, 1, length, 1)).to(query.dtype)
    device_type = query.device.type
    # Under autocast the rotary embedding leaves q/k in float32 while v is already in the autocast dtype.
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    q, k, v = (
        x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]).to(dtype)
        for x in (query, key, value)
    )
    out = varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        max_seqlen,
        causal=getattr(module, "is_causal", True) if is_causal is None else is_causal,
        scale=scaling,
        dropout=dropout,
        window=sliding_window,
        softcap=softcap,
        sinks=s_aux,
        chunk=attention_chunk(module),
        backend=backend,
        per_kv_head=per_kv_head,
    )
    return out.view(batch, length, heads, out.shape[-1]), None


def attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk a layer attends within: ``attention_chunk_size`` for layers of type ``"chunked_attention"``.

    transformers builds those layers' mask with ``create_chunked_causal_mask`` from the same two config
    fields (Llama 4: its RoPE layers, 3 of every 4); the varlen attention gets no mask, so it reads them.
    """
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types is None or index is None or layer_types[index] != "chunked_attention":
        return None
    return config.attention_chunk_size


def positions_in_samples(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position within its sample, what the collator's ``position_ids`` hold.

    >>> positions_in_samples(torch.tensor([0, 3, 4, 6]), 6).tolist()
    [0, 1, 2, 0, 0, 1]
    """
    cu_seqlens = cu_seqlens.long()
    starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def padding_free_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Mask hook, run once per forward: a 2D mask of all ones is dropped, real padding is an error.

    Registering it also stops transformers from silently discarding a padding mask, which it does for an
    attention function that has no mask hook.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "the batch has padding (attention_mask has zeros); longalign's varlen attention expects packed rows "
            "without padding: concatenate the samples and pass cu_seq_lens_q/k or position_ids, or their boundaries as a "
            "1D int32 attention_mask [0, l1, l1+l2, ..., total], instead"
        )
    return None


def _sample_boundaries(kwargs: dict[str, Any], batch: int, length: int) -> tuple[torch.Tensor, int]:
    """``cu_seqlens`` and ``max_seqlen`` from the batch: the collator's, else read off ``position_ids``."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        # Over several rows the boundaries run over the rows' tokens flattened (see cu_seqlens_mask); the
        # check costs a device sync, which the collator's single-row batches never pay.
        if batch != 1 and int(cu_seqlens[-1]) != batch * length:
            raise ValueError(
                f"cu_seq_lens_q ends at {int(cu_seqlens[-1])}, but the batch has {batch} rows of {length} tokens: "
                "mark the samples over all rows flattened, or concatenate the packs into a single row"
            )
        max_seqlen = kwargs.get("max_length_q")
        return cu_seqlens, int(cu_seqlens.diff().max() if max_seqlen is None else max_seqlen)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError(
            "neither cu_seq_lens_q nor position_ids reached the attention function, so sample boundaries are "
            "unknown; this model does not forward its keyword arguments to attention"
        )
    return cu_seqlens_from_position_ids(position_ids.expand(batch, length))


def _sinks_of_this_rank(sinks: torch.Tensor, heads: int) -> torch.Tensor:
    """The sinks of the query heads this rank holds under sequence parallelism: the Ulysses exchange gives
    rank ``r`` of a group of ``N`` heads ``[r H/N, (r+1) H/N)`` of the model's ``H``, and the module's sinks
    are one per head of the model. Each rank's gradient reaches its heads' sinks, and the gradients' sum over
    the group is the whole one, as for every other parameter."""
    if not torch.distributed.is_initialized() or sinks.shape[0] % heads:
        return sinks  # varlen_attention says what is wrong
    # The group DeepSpeed built for the exchange (longalign.patch.sequence_parallel.wrap).
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    rank = torch.distributed.get_rank(parallel_state_sp.get_sequence_parallel_group())
    return sinks[rank * heads : (rank + 1) * heads]


class _WrappedFunctions(dict):
    """A mapping of attention functions by name that hands each out wrapped. (A class of its own, not one
    made per call: a class is cyclic garbage, which would keep the tensors the wrapper refers to alive until
    the garbage collector runs.)"""

    def __init__(self, local: dict, shared: dict, wrap: Callable[[Callable], Callable]) -> None:
        super().__init__()
        self.local, self.shared, self.wrap = local, shared, wrap

    def __contains__(self, key: object) -> bool:
        return key in self.local or key in self.shared

    def __getitem__(self, key: str) -> Callable:
        return self.wrap(self.local[key] if key in self.local else self.shared[key])


@contextlib.contextmanager
def attention_calls(wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Every attention function a module looks up in transformers' ``ALL_ATTENTION_FUNCTIONS`` (by
    ``get_interface`` or by name) is handed out as ``wrap(function)`` (the tiled layer stops at the call or
    hands back its output; the family decision counts the calls)."""
    interface = ALL_ATTENTION_FUNCTIONS
    local = interface._local_mapping

    def get_interface(name: str, default: Callable) -> Callable:
        return wrap(local.get(name, interface._global_mapping.get(name, default)))

    interface._local_mapping = _WrappedFunctions(local, interface._global_mapping, wrap)
    interface.get_interface = get_interface
    try:
        yield
    finally:
        interface._local_mapping = local
        del interface.get_interface
