"""Llama 4 (``Llama4ForCausalLM``): chunked attention in its RoPE layers, tuned temperature in its NoPE layers.

Three layers in four rotate queries and keys (RoPE) and attend within chunks of ``attention_chunk_size``
tokens (8192 in the released checkpoints) counted from the start of the sequence: transformers marks them
``layer_types[i] == "chunked_attention"`` and builds their mask from that, and the varlen attention reads
the same two fields (``interface.attention_chunk``) and restarts the chunks at every sample's start. The
fourth (``no_rope_layers[i] == 0``) has no positions in its keys and attends to its whole sample; with
``attn_temperature_tuning`` it scales each query by

    1 + attn_scale * log(1 + floor((position + 1) / floor_scale))

where transformers takes ``position`` to be the token's index in the row (plus the cache's length), the
pack's offset rather than the sample's. Samples of 45 and 70 tokens in one row, chunk 16::

    row index            0 .. 44 | 45 .. 114      what transformers' NoPE layers scale by
    position_ids         0 .. 44 |  0 .. 69       what each sample alone is scaled by
    RoPE layers attend   16 16 13 | 16 16 16 16 6

:func:`install` hands the scaling to the varlen attention, which knows each token's position within its
sample (from ``cu_seqlens``; the decoder layer does not pass ``position_ids`` on to its attention). The
layer's class is replaced by a subclass of the same name whose ``attn_temperature_tuning`` reads ``False``
while longalign's varlen attention is selected, so the layer's own code skips its scaling then, and does it
as before under any other attention (generation with sdpa and a KV cache, for example).
"""

from __future__ import annotations

import functools

import torch

from .interface import selects_varlen


def install(model: torch.nn.Module) -> int:
    """Let the varlen attention scale the queries of ``model``'s temperature-tuned layers; how many it found.

    Layers are found by what the scaling needs (``attn_temperature_tuning``, ``floor_scale``,
    ``attn_scale``, no RoPE), so any model built of Llama 4's text layers is covered; a second call changes
    nothing.
    """
    found = 0
    for module in model.modules():
        if _tunes_temperature(module):
            if not isinstance(module, _PackedTemperature):
                tuning = module.__dict__.pop("attn_temperature_tuning")
                module.__class__ = _packed_class(type(module))
                module.configured_temperature_tuning = tuning
            found += 1
    return found


def temperature(positions: torch.Tensor, *, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale at each position, in float32 as transformers computes it.

    >>> temperature(torch.tensor([0, 7, 15, 23]), floor_scale=8, attn_scale=0.1)
    tensor([1.0000, 1.0693, 1.1099, 1.1386])
    """
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _tunes_temperature(module: torch.nn.Module) -> bool:
    """A NoPE attention layer with Llama 4's temperature settings (``use_rope`` is 0 or 1 there)."""
    names = ("attn_temperature_tuning", "floor_scale", "attn_scale", "use_rope")
    return all(hasattr(module, name) for name in names) and not module.use_rope


class _PackedTemperature:
    """Mixed into a NoPE attention layer's class: its temperature comes from positions within samples."""

    configured_temperature_tuning: bool

    @property
    def attn_temperature_tuning(self) -> bool:
        """The layer scales its queries itself only when the attention is not longalign's varlen attention."""
        return self.configured_temperature_tuning and not selects_varlen(self.config._attn_implementation)

    @property
    def packed_query_scale(self):
        """What the varlen attention scales the queries by, from each token's position in its sample."""
        if not self.configured_temperature_tuning:
            return None
        return functools.partial(temperature, floor_scale=self.floor_scale, attn_scale=self.attn_scale)


@functools.cache
def _packed_class(cls: type) -> type:
    """``cls`` with :class:`_PackedTemperature` mixed in, under the same name (checkpointing and printing
    see the class they expect)."""
    return type(cls.__name__, (_PackedTemperature, cls), {"__module__": cls.__module__})
