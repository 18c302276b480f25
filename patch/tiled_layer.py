"""Sequence-tiled decoder layer: every part of the layer that treats each token alone runs over the tokens in
tiles, and each tile is recomputed in backward. Exact.

A decoder layer is token-wise everywhere but in its attention kernel. Tiled, the layer runs in three parts;
for one micro-batch of ``T`` tokens (hidden ``H``, ``Hq`` query and ``Hkv`` key/value heads of ``D``)::

    before    x [T, H] tile by tile: input norm, q/k/v projections (+ biases, + Qwen3's per-head
              norms), RoPE                                  -> q [T, Hq, D], k, v [T, Hkv, D]
    kernel    the model's attention function on the whole q, k, v (varlen, and the Ulysses exchange
              under sequence parallelism)                   -> attention output [T, Hq x D]
    after     x and the attention output tile by tile: o-projection (+ GLM-4's post-attention norm),
              residual, norm, MLP (+ GLM-4's post-MLP norm), residual               -> out [T, H]

So the tensors that span the whole micro-batch are the layer's input, q, k, v, the attention output (and
what the kernel keeps), and their gradients; the norms' outputs, the projections' ``[T, intermediate]``
tensors and the residual sums exist for one tile at a time, in forward and in backward. Each part is an
autograd function built as ``tiled_mlp``'s: its trained parameters are inputs, its backward computes
each tile's gradients with ``torch.autograd.grad`` (no gradient hook fires there) and returns their sum,
so every parameter's hook fires once per backward (DDP, ZeRO); autocast and the random state (LoRA
dropout) are replayed for the recompute. Under ZeRO-3 the whole decoder layer is made a leaf module:
DeepSpeed gathers its parameters once when the layer starts and runs no collective inside it, so ranks
with different token counts (and tile counts) never wait on each other.

The tiles reuse the layer's own modules (norms, projections or their LoRA wrappers, the MLP) and the
family's own ``apply_rotary_pos_emb``; the layer's class is replaced by a subclass of the same name whose
``forward`` is the tiled one, so transformers' activation checkpointing (which wraps the class's
``forward``) and longalign's offloading of checkpointed inputs apply to it unchanged. With a KV cache
(generation) the layer runs its own forward.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longalign.errors import ModelError

from .tiled_mlp import _autocast_state, _bounds, _cast, _replay, _rng_state, tile_count

# Decoder layers whose every part but the attention kernel treats each token alone, by class, and the
# family's extras: q/k norms per head (Qwen3), norms after attention and MLP (GLM-4), and where the
# attention finds its sliding window ("module": its own attribute, "config": the config's; None: none).
TILEABLE_LAYERS = {
    "LlamaDecoderLayer": {"qk_norms": False, "post_norms": False, "window": None},
    "GlmDecoderLayer": {"qk_norms": False, "post_norms": False, "window": None},
    "Glm4DecoderLayer": {"qk_norms": False, "post_norms": True, "window": None},
    "MistralDecoderLayer": {"qk_norms": False, "post_norms": False, "window": "config"},
    "Qwen2DecoderLayer": {"qk_norms": False, "post_norms": False, "window": "module"},
    "Qwen3DecoderLayer": {"qk_norms": True, "post_norms": False, "window": "module"},
}

_TILED_CLASSES: dict[type, type] = {}  # a layer class -> its tiled subclass


def tile_layers(model: nn.Module, *, tile_tokens: int = 0) -> nn.Module:
    """Run every decoder layer of ``model`` in tiles of ``tile_tokens`` tokens (0: ``hidden_size``).

    Raises ``ModelError`` naming the class of a layer that cannot be tiled. Call it after the run's
    ``TrainingArguments`` and before the engine wraps the model (ZeRO-3 reads the leaf flag when it
    starts) and before ``offload_checkpointed_inputs``; LoRA adapters may come later.
    """
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ModelError(f"training.sequence_tiling: {type(model).__name__} has no decoder layers to tile")
    for layer in layers:
        name = type(layer).__name__
        if name not in TILEABLE_LAYERS:
            raise ModelError(
                f"training.sequence_tiling = 'layer': longalign cannot tile {name}; it tiles the decoder "
                f"layers {', '.join(TILEABLE_LAYERS)} (sequence_tiling = 'mlp' tiles the MLP alone)"
            )
    zero3 = is_deepspeed_zero3_enabled()
    for layer in layers:
        if not hasattr(type(layer), "untiled"):
            layer.__class__ = _tiled_class(type(layer))
        layer.tile_tokens = tile_tokens
        if zero3:
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(layer, True)
    return model


def _tiled_class(cls: type) -> type:
    """``cls`` with the tiled forward, under the same name (wrap policies and checks find layers by name)."""
    if cls not in _TILED_CLASSES:
        # Created through type(): transformers' __init_subclass__ wraps the new forward for checkpointing.
        _TILED_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {"forward": _tiled_layer_forward, "untiled": cls, "__module__": cls.__module__},
        )
    return _TILED_CLASSES[cls]


def _tiled_layer_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The layer's own function on ``hidden_states [B, T, H]``, its token-wise parts run in tiles."""
    cache = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
    if cache is not None:  # generation: the cache is written whole, by the layer's own code
        return layer.untiled.forward(
            layer,
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    spec = TILEABLE_LAYERS[type(layer).__name__]
    attn = layer.self_attn
    batch, length, hidden = hidden_states.shape
    tiles = min(length, tile_count(batch * length, hidden, layer.tile_tokens))
    cos, sin = position_embeddings
    q, k, v = _tiled(
        functools.partial(_before_attention, layer, spec),
        tiles,
        [hidden_states, cos, sin],
        _trained(layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, *_qk_norms(attn, spec)),
        layer,
    )
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, sys.modules[type(attn).__module__].eager_attention_forward
    )
    options = {}
    if spec["window"] == "module":
        options["sliding_window"] = attn.sliding_window
    elif spec["window"] == "config":
        options["sliding_window"] = getattr(attn.config, "sliding_window", None)
    out, _ = interface(
        attn,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        position_ids=position_ids,
        **options,
        **kwargs,
    )
    del q, k, v
    (out,) = _tiled(
        functools.partial(_after_attention, layer, spec),
        tiles,
        [hidden_states, out.reshape(batch, length, -1)],
        _trained(attn.o_proj, layer.post_attention_layernorm, layer.mlp, *_post_norms(layer, spec)),
        layer,
    )
    return out


def _before_attention(
    layer: nn.Module, spec: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One tile from the layer's input to q, k, v ``[B, t, heads, D]``, as the layer's attention computes them."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k, v = (projection(h).view(shape) for projection in (attn.q_proj, attn.k_proj, attn.v_proj))
    if spec["qk_norms"]:
        q, k = attn.q_norm(q), attn.k_norm(k)
    rotate = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2), v


def _after_attention(
    layer: nn.Module, spec: dict, x: torch.Tensor, attended: torch.Tensor
) -> tuple[torch.Tensor]:
    """One tile from the layer's input and attention output to the layer's output."""
    h = layer.self_attn.o_proj(attended)
    if spec["post_norms"]:
        h = layer.post_self_attn_layernorm(h)
    h = x + h
    out = layer.mlp(layer.post_attention_layernorm(h))
    if spec["post_norms"]:
        out = layer.post_mlp_layernorm(out)
    return (h + out,)


def _qk_norms(attn: nn.Module, spec: dict) -> list[nn.Module]:
    return [attn.q_norm, attn.k_norm] if spec["qk_norms"] else []


def _post_norms(layer: nn.Module, spec: dict) -> list[nn.Module]:
    return [layer.post_self_attn_layernorm, layer.post_mlp_layernorm] if spec["post_norms"] else []


def _trained(*modules: nn.Module) -> list[torch.Tensor]:
    """The trained parameters of ``modules`` (base weights, or LoRA's adapters on a frozen base)."""
    return [param for module in modules for param in module.parameters() if param.requires_grad]


def _tiled(
    step: Callable[..., tuple[torch.Tensor, ...]],
    tiles: int,
    inputs: Sequence[torch.Tensor],
    trained: list[torch.Tensor],
    layer: nn.Module,
) -> tuple[torch.Tensor, ...]:
    """``step`` over ``inputs [B, T, ...]`` in ``tiles`` tiles along the tokens (dim 1), recomputed in backward."""
    if any(getattr(param, "ds_numel", 0) and not param.numel() for param in trained):
        raise ModelError(
            f"training.sequence_tiling: the {type(layer).__name__}'s parameters are partitioned by ZeRO-3 "
            "inside it; tile the layers (longalign.patch.tile_layers) before DeepSpeed starts, so it gathers "
            "them for the whole layer"
        )
    return _TiledTokens.apply(step, tiles, len(inputs), layer.training, *inputs, *trained)


class _TiledTokens(torch.autograd.Function):
    """``step`` tile by tile along dim 1 of its inputs; backward recomputes each tile and returns the trained
    parameters' gradients summed over the tiles."""

    @staticmethod
    def forward(ctx, step, tiles: int, count: int, training: bool, *tensors: torch.Tensor):
        inputs = tensors[:count]
        ctx.step, ctx.tiles, ctx.count, ctx.params = step, tiles, count, tensors[count:]
        device = inputs[0].device
        ctx.autocast = _autocast_state(device.type)
        ctx.rng = _rng_state(device) if training else None
        ctx.save_for_backward(*inputs)
        length = inputs[0].shape[1]
        outputs: list[torch.Tensor] = []
        for start, stop in _bounds(length, tiles):
            ys = step(*(x[:, start:stop] for x in inputs))
            if not outputs:  # one buffer per output, not a list of tiles and their concatenation
                outputs = [y.new_empty((y.shape[0], length, *y.shape[2:])) for y in ys]
            for out, y in zip(outputs, ys, strict=True):
                out[:, start:stop] = y
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors
        wants = ctx.needs_input_grad[4 : 4 + ctx.count]
        wanted_params = ctx.needs_input_grad[4 + ctx.count :]
        trained = [param for param, wanted in zip(ctx.params, wanted_params, strict=True) if wanted]
        grads_in = [torch.empty_like(x) if wanted else None for x, wanted in zip(inputs, wants, strict=True)]
        sums: list[torch.Tensor | None] = [None] * len(trained)
        with _replay(inputs[0].device, ctx.autocast, ctx.rng):
            for start, stop in _bounds(inputs[0].shape[1], ctx.tiles):
                tiles = [
                    x[:, start:stop].detach().requires_grad_(wanted)
                    for x, wanted in zip(inputs, wants, strict=True)
                ]
                with torch.enable_grad():
                    ys = ctx.step(*tiles)
                differentiated = [tile for tile, wanted in zip(tiles, wants, strict=True) if wanted] + trained
                pairs = [
                    (y, g[:, start:stop]) for y, g in zip(ys, grad_outputs, strict=True) if y.requires_grad
                ]
                grads = torch.autograd.grad(
                    [y for y, _ in pairs], differentiated, [g for _, g in pairs], allow_unused=True
                )
                by_input = iter(grads)
                for grad_in, wanted in zip(grads_in, wants, strict=True):
                    if wanted:
                        grad = next(by_input)
                        if grad is None:
                            grad_in[:, start:stop] = 0
                        else:
                            grad_in[:, start:stop] = grad
                for i, grad in enumerate(by_input):
                    if grad is not None:
                        # Summed in at least float32: bfloat16 partial sums would round once per tile.
                        grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
                        sums[i] = grad if sums[i] is None else sums[i].add_(grad)
        by_param = iter(sums)
        param_grads = [
            _cast(next(by_param), param.dtype) if wanted else None
            for param, wanted in zip(ctx.params, wanted_params, strict=True)
        ]
        return None, None, None, None, *grads_in, *param_grads
