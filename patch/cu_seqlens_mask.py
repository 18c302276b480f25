"""LongAlign's forward call: a 1D integer ``attention_mask`` read as the batch's ``cu_seqlens``.

A patched model takes the sample boundaries of its packed input as the attention mask, the way LongAlign's
own scripts call it. Samples of 3, 1 and 2 tokens in one row::

    model(input_ids=ids, attention_mask=torch.tensor([0, 3, 4, 6], dtype=torch.int32))    # ids [1, 6]

    reaches the decoder as
    position_ids     [[0 1 2 0 0 1]]        restart per sample (unless the call gives its own)
    cu_seq_lens_q/k  [0, 3, 4, 6]           int32
    max_length_q/k   3
    attention_mask   None

For ``input_ids [b, L]`` the boundaries run over the ``b x L`` tokens flattened row after row, and the
logits stay ``[b, L, vocab]``. A 1D tensor that is not such boundaries is an error saying what is wrong.

Why a forward pre-hook on the decoder: transformers computes ``position_ids`` (an ``arange``) before it
asks the ``AttentionMaskInterface`` entry for a mask, so a mask hook could keep samples apart in attention
but could not restart their rotary positions; the hook sees the call's arguments first and turns the mask
into the keyword arguments the collator's batches carry. It sits on the decoder (``model.base_model``)
rather than on the ``*ForCausalLM``, because PEFT calls the outer model's ``forward`` directly, which skips
that module's hooks, while the outer model always calls its decoder as a module.
"""

from __future__ import annotations

from typing import Any

import torch

from longalign.errors import InputError

_HOOKED = "_longalign_cu_seqlens_mask"  # marks a decoder that has the hook, so apply() can run twice


def install(model: torch.nn.Module) -> None:
    """Read a 1D integer ``attention_mask`` given to ``model`` as ``cu_seqlens``; once per model."""
    decoder = model.base_model
    if not getattr(decoder, _HOOKED, False):
        decoder.register_forward_pre_hook(_mask_as_boundaries, with_kwargs=True)
        setattr(decoder, _HOOKED, True)


def cu_seqlens_of(mask: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, int]:
    """Check a 1D ``attention_mask`` as boundaries of ``batch x length`` tokens: ``(cu_seqlens int32, longest)``.

    >>> cu_seqlens_of(torch.tensor([0, 3, 4, 6]), 1, 6)
    (tensor([0, 3, 4, 6], dtype=torch.int32), 3)
    """
    total = batch * length
    said = f"the 1D attention_mask, read as cu_seqlens for input_ids [{batch}, {length}] ({total} tokens),"
    if mask.is_floating_point() or mask.is_complex() or mask.dtype == torch.bool:
        raise InputError(
            f"{said} has dtype {mask.dtype}; it must be an integer tensor such as [0, ..., {total}]"
        )
    values = mask.tolist()  # one small copy to the host per forward
    if len(values) < 2:
        raise InputError(f"{said} has fewer than 2 entries; it needs at least [0, {total}]")
    if values[0] != 0:
        raise InputError(f"{said} starts at {values[0]}, not 0")
    steps = [b - a for a, b in zip(values, values[1:], strict=False)]
    bad = next((i for i, step in enumerate(steps) if step <= 0), None)
    if bad is not None:
        raise InputError(
            f"{said} is not strictly increasing: entry {bad + 1} is {values[bad + 1]} after {values[bad]}"
        )
    if values[-1] != total:
        raise InputError(f"{said} ends at {values[-1]}, not at {total}")
    return mask.to(torch.int32), max(steps)


def _mask_as_boundaries(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 1:
        return None  # no mask, or a 2D one: the attention's mask hook deals with it
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    if tokens is None:
        raise InputError("a 1D attention_mask (cu_seqlens) needs input_ids or inputs_embeds to describe")
    batch, length = tokens.shape[:2]
    cu_seqlens, longest = cu_seqlens_of(mask, batch, length)
    cu_seqlens = cu_seqlens.to(tokens.device)
    if kwargs.get("position_ids") is None:
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
        kwargs["position_ids"] = (torch.arange(batch * length, device=tokens.device) - starts).view(
            batch, length
        )
    kwargs.update(
        attention_mask=None,
        cu_seq_lens_q=cu_seqlens,
        cu_seq_lens_k=cu_seqlens,
        max_length_q=longest,
        max_length_k=longest,
    )
    return args, kwargs
