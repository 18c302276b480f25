"""Sequence-tiled decoder layer: every part of the layer that treats each token alone runs over the tokens in
tiles, and each tile is recomputed in backward. Exact.

A decoder layer is token-wise everywhere but in its attention kernel. Tiled, the layer runs in three parts;
for one micro-batch of ``T`` tokens (hidden ``H``, ``Hq`` query and ``Hkv`` key/value heads of ``D``)::

    before    x [T, H] tile by tile: input norm, q/k/v projections (+ biases, + Qwen3's per-head
              norms), RoPE                                  -> q [T, Hq, D], k, v [T, Hkv, D]
    kernel    the model's attention function on the whole q, k, v (varlen, and the Ulysses exchange
              under sequence parallelism), its kernel run once per key/value head
                                                            -> attention output [T, Hq x D]
    after     x and the attention output tile by tile: o-projection (+ GLM-4's post-attention norm),
              residual, norm, MLP (+ GLM-4's post-MLP norm), residual               -> out [T, H]

So the tensors that span the whole micro-batch are the layer's input, q, k, v, the attention output (and
what the kernel keeps), and their gradients; the norms' outputs, the projections' ``[T, intermediate]``
tensors and the residual sums exist for one tile at a time, in forward and in backward. The attention
kernel's own backward buffers exist for one key/value head and its query heads at a time (longalign's
varlen attention with ``per_kv_head``, after the exchange): FlashAttention 2's float32 ``dq`` accumulator
and its ``dk``/``dv`` expanded to every query head, 8 bytes per token per unit of hidden for Llama-3.1-8B's
32/8 heads, become an eighth of that. The model's final norm runs in tiles too: untiled, its float32
backward holds more than any tiled layer (24 bytes per token per unit of hidden). The part after
the kernel is two autograd nodes, ``h = x + o_proj(attention output)`` and ``h + mlp(norm(h))``: the first
passes ``h``'s gradient on to ``x`` as it is, and the second keeps ``x`` and the attention output (kept
anyway) instead of ``h`` and rebuilds each tile of ``h`` in its backward, so the gradient arriving at the
layer's output is freed before the attention output's is made, and no whole ``h`` is kept. Each part is an
autograd function built as ``tiled_mlp``'s: its trained parameters are inputs, its backward computes
each tile's gradients with ``torch.autograd.grad`` (no gradient hook fires there) and returns their sum,
so every parameter's hook fires once per backward (DDP, ZeRO); autocast and each tile's random state
(LoRA dropout) are replayed for the recompute. Under ZeRO-3 the whole decoder layer is made a leaf module:
DeepSpeed gathers its parameters once when the layer starts and runs no collective inside it, so ranks
with different token counts (and tile counts) never wait on each other.

The tiles reuse the layer's own modules (norms, projections or their LoRA wrappers, the MLP) and the
family's own ``apply_rotary_pos_emb``; the layer's class is replaced by a subclass of the same name whose
``forward`` is the tiled one, so transformers' activation checkpointing (which wraps the class's
``forward``) and longalign's offloading of checkpointed inputs apply to it unchanged. With a KV cache
(generation) the layer runs its own forward.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longalign.errors import ModelError

from .tiled_mlp import _autocast_state, _cast, _rng_state, _tiles, tile_count

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
    """Run every decoder layer of ``model``, and the norm after them, in tiles of ``tile_tokens`` tokens
    (0: ``hidden_size``).

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
    norm = _final_norm(model)
    if norm is not None:
        norm.forward = functools.partial(_tiled_norm_forward, norm, tile_tokens=tile_tokens)
    if zero3:
        from deepspeed.utils import set_z3_leaf_module

        for module in [*layers, *([norm] if norm is not None else [])]:
            set_z3_leaf_module(module, True)
    return model


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last decoder layer (``model.model.norm`` for every family in ``TILEABLE_LAYERS``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return getattr(decoder, "norm", None)


def _tiled_norm_forward(norm: nn.Module, hidden_states: torch.Tensor, *, tile_tokens: int) -> torch.Tensor:
    """The final norm over ``hidden_states [B, T, H]`` in tiles, recomputed in backward.

    Untiled, its backward holds several float32 ``[T, H]`` temporaries at once (the norm computes in float32),
    more than any tiled layer holds; tiled, one tile of them.
    """
    batch, length, hidden = hidden_states.shape
    tiles = _Tiles(min(length, tile_count(batch * length, hidden, tile_tokens)), norm)
    (out,) = tiles.run(lambda x: (type(norm).forward(norm, x),), [hidden_states], [norm])
    return out


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
    tiles = _Tiles(min(length, tile_count(batch * length, hidden, layer.tile_tokens)), layer)
    cos, sin = position_embeddings
    q, k, v = tiles.run(
        functools.partial(_before_attention, layer, spec),
        [hidden_states, cos, sin],
        [layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, *_qk_norms(attn, spec)],
    )
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, sys.modules[type(attn).__module__].eager_attention_forward
    )
    options = {}
    if spec["window"] == "module":
        options["sliding_window"] = attn.sliding_window
    elif spec["window"] == "config":
        options["sliding_window"] = getattr(attn.config, "sliding_window", None)
    attended, _ = interface(
        attn,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        position_ids=position_ids,
        per_kv_head=True,  # longalign's varlen attention: the kernel's backward buffers one group at a time
        **options,
        **kwargs,
    )
    del q, k, v
    attended = attended.reshape(batch, length, -1)
    # Two autograd nodes after attention, so that the gradient arriving at the layer's output is freed
    # before the attention output's is made: h = x + o_proj(attended), then h + mlp(norm(h)). The second
    # keeps not h but x and the attention output (kept anyway), and rebuilds each tile of h in backward.
    branch = functools.partial(_attention_branch, layer, spec)
    (h,) = tiles.run(
        branch, [hidden_states, attended], [attn.o_proj, *_post_norms(layer, spec)[:1]], residual=True
    )
    block = functools.partial(_mlp_block, layer, spec)
    rebuild = functools.partial(_rebuild_residual, branch, tiles)
    return tiles.run_rebuilt(
        block,
        h,
        rebuild,
        [hidden_states, attended],
        [layer.post_attention_layernorm, layer.mlp, *_post_norms(layer, spec)[1:]],
    )


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


def _attention_branch(layer: nn.Module, spec: dict, attended: torch.Tensor) -> tuple[torch.Tensor]:
    """One tile of what attention adds to the residual: the o-projection (and GLM-4's norm after it)."""
    out = layer.self_attn.o_proj(attended)
    return (layer.post_self_attn_layernorm(out) if spec["post_norms"] else out,)


def _mlp_block(layer: nn.Module, spec: dict, h: torch.Tensor) -> tuple[torch.Tensor]:
    """One tile of ``h`` plus the MLP's contribution: norm, MLP (and GLM-4's norm after it)."""
    out = layer.mlp(layer.post_attention_layernorm(h))
    return (h + (layer.post_mlp_layernorm(out) if spec["post_norms"] else out),)


def _rebuild_residual(
    branch: Callable, tiles: _Tiles, index: int, x: torch.Tensor, attended: torch.Tensor
) -> torch.Tensor:
    """Tile ``index`` of ``h = x + branch(attended)`` again, drawing the random numbers its forward drew."""
    tiles.restore(index)
    return x + branch(attended)[0]


def _qk_norms(attn: nn.Module, spec: dict) -> list[nn.Module]:
    return [attn.q_norm, attn.k_norm] if spec["qk_norms"] else []


def _post_norms(layer: nn.Module, spec: dict) -> list[nn.Module]:
    return [layer.post_self_attn_layernorm, layer.post_mlp_layernorm] if spec["post_norms"] else []


def _trained(*modules: nn.Module) -> list[torch.Tensor]:
    """The trained parameters of ``modules`` (base weights, or LoRA's adapters on a frozen base)."""
    return [param for module in modules for param in module.parameters() if param.requires_grad]


class _Tiles:
    """The tiles of one call of a layer: how many, and the random states its parts' tiles started from.

    In training (where LoRA dropout may draw) each tile's random state is kept, so that a recompute in
    backward draws what the forward drew, tile by tile, in whatever order backward visits the tiles.
    """

    def __init__(self, count: int, layer: nn.Module) -> None:
        self.count, self.layer = count, layer
        self.branch_states: dict | None = None  # the attention branch's, for rebuilding h
        self.device = torch.device("cpu")

    def trained(self, modules: list[nn.Module]) -> list[torch.Tensor]:
        trained = _trained(*modules)
        if any(getattr(param, "ds_numel", 0) and not param.numel() for param in trained):
            raise ModelError(
                f"training.sequence_tiling: the {type(self.layer).__name__}'s parameters are partitioned by "
                "ZeRO-3 inside it; tile the layers (longalign.patch.tile_layers) before DeepSpeed starts, so it "
                "gathers them for the whole layer"
            )
        return trained

    def run(
        self, step: Callable, inputs: list[torch.Tensor], modules: list[nn.Module], *, residual: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """``step`` over ``inputs [B, T, ...]`` tile by tile along the tokens, recomputed in backward.

        With ``residual`` the first input is not passed to ``step`` but added to its first output, and that
        output's gradient is passed through to it.
        """
        trained = self.trained(modules)
        return _TiledTokens.apply(step, self, len(inputs), residual, *inputs, *trained)

    def run_rebuilt(
        self,
        step: Callable,
        h: torch.Tensor,
        rebuild: Callable,
        sources: list[torch.Tensor],
        modules: list[nn.Module],
    ) -> torch.Tensor:
        """``step(h)`` tile by tile, keeping ``sources`` for backward instead of ``h``: ``rebuild(i, *tiles)``
        makes tile ``i`` of ``h`` from them again."""
        trained = self.trained(modules)
        return _TiledRebuilt.apply(step, self, rebuild, len(sources), h, *sources, *trained)

    def new_states(self) -> dict | None:
        """Where a part keeps each tile's random state, by tile index (None out of training)."""
        return {} if self.layer.training else None

    def restore(self, index: int) -> None:
        """Set the random state that tile ``index`` of the attention branch started from."""
        if self.branch_states is not None:
            _set_rng(self.device, self.branch_states[index])


def _set_rng(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device).set_rng_state(state[1], device)


@contextlib.contextmanager
def _recompute(device: torch.device, autocast: tuple[bool, torch.dtype], forked: bool):
    """Run a recompute as the forward ran (same autocast); the random state is restored afterwards."""
    enabled, dtype = autocast
    devices = [] if device.type == "cpu" else [device]
    with (
        torch.random.fork_rng(devices=devices, enabled=forked, device_type=device.type),
        torch.autocast(device.type, dtype=dtype, enabled=enabled),
    ):
        yield


def _sum_into(sums: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            # Summed in at least float32: bfloat16 partial sums would round once per tile.
            grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
            sums[i] = grad if sums[i] is None else sums[i].add_(grad)


def _param_grads(params: tuple, wanted: tuple, sums: list) -> list[torch.Tensor | None]:
    by_param = iter(sums)
    return [_cast(next(by_param), p.dtype) if w else None for p, w in zip(params, wanted, strict=True)]


class _TiledTokens(torch.autograd.Function):
    """``step`` tile by tile along dim 1 of its inputs; backward recomputes each tile and returns the trained
    parameters' gradients summed over the tiles."""

    @staticmethod
    def forward(ctx, step, tiles: _Tiles, count: int, residual: bool, *tensors: torch.Tensor):
        inputs, ctx.params = tensors[:count], tensors[count:]
        stepped = inputs[1:] if residual else inputs
        ctx.step, ctx.tiles, ctx.count, ctx.residual = step, tiles, count, residual
        device = inputs[0].device
        ctx.autocast = _autocast_state(device.type)
        ctx.states = tiles.new_states()
        if residual:
            tiles.branch_states, tiles.device = ctx.states, device
        ctx.save_for_backward(*stepped)
        length = inputs[0].shape[1]
        outputs: list[torch.Tensor] = []
        for index, start, stop in _tiles(length, tiles.count):
            if ctx.states is not None:
                ctx.states[index] = _rng_state(device)
            ys = list(step(*(x[:, start:stop] for x in stepped)))
            if residual:
                ys[0] = inputs[0][:, start:stop] + ys[0]
            if not outputs:  # one buffer per output, not a list of tiles and their concatenation
                outputs = [y.new_empty((y.shape[0], length, *y.shape[2:])) for y in ys]
            for out, y in zip(outputs, ys, strict=True):
                out[:, start:stop] = y
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        stepped = ctx.saved_tensors
        wanted_inputs = ctx.needs_input_grad[4 : 4 + ctx.count]
        wants = wanted_inputs[1:] if ctx.residual else wanted_inputs
        wanted_params = ctx.needs_input_grad[4 + ctx.count :]
        trained = [param for param, wanted in zip(ctx.params, wanted_params, strict=True) if wanted]
        grads_in = [torch.empty_like(x) if wanted else None for x, wanted in zip(stepped, wants, strict=True)]
        sums: list[torch.Tensor | None] = [None] * len(trained)
        device = stepped[0].device
        with _recompute(device, ctx.autocast, ctx.states is not None):
            for index, start, stop in _tiles(stepped[0].shape[1], ctx.tiles.count):
                if ctx.states is not None:
                    _set_rng(device, ctx.states[index])
                tiles = [
                    x[:, start:stop].detach().requires_grad_(wanted)
                    for x, wanted in zip(stepped, wants, strict=True)
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
                        grad_in[:, start:stop] = 0 if grad is None else grad
                _sum_into(sums, list(by_input))
        # The residual input's gradient is its sum's: passed on as it came, no copy.
        passed = [grad_outputs[0] if wanted_inputs[0] else None] if ctx.residual else []
        return None, None, None, None, *passed, *grads_in, *_param_grads(ctx.params, wanted_params, sums)


class _TiledRebuilt(torch.autograd.Function):
    """``step(h)`` tile by tile; backward rebuilds each tile of ``h`` from the kept sources, recomputes the
    tile, and returns ``h``'s gradient and the trained parameters' (summed over the tiles)."""

    @staticmethod
    def forward(ctx, step, tiles: _Tiles, rebuild, count: int, h: torch.Tensor, *tensors: torch.Tensor):
        sources, ctx.params = tensors[:count], tensors[count:]
        ctx.step, ctx.tiles, ctx.rebuild, ctx.count = step, tiles, rebuild, count
        ctx.autocast = _autocast_state(h.device.type)
        ctx.states = tiles.new_states()
        ctx.save_for_backward(*sources)
        out = h  # each tile of the output replaces its tile of h, which nothing keeps: no second buffer
        for index, start, stop in _tiles(h.shape[1], tiles.count):
            if ctx.states is not None:
                ctx.states[index] = _rng_state(h.device)
            (y,) = step(h[:, start:stop])
            if y.dtype != out.dtype:
                out = y.new_empty((y.shape[0], h.shape[1], *y.shape[2:]))
            out[:, start:stop] = y
        if out is h:
            ctx.mark_dirty(h)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sources = ctx.saved_tensors
        wants_h = ctx.needs_input_grad[4]
        wanted_params = ctx.needs_input_grad[5 + ctx.count :]
        trained = [param for param, wanted in zip(ctx.params, wanted_params, strict=True) if wanted]
        grad_h = torch.empty_like(grad_out) if wants_h else None
        sums: list[torch.Tensor | None] = [None] * len(trained)
        device = grad_out.device
        with _recompute(device, ctx.autocast, ctx.states is not None):
            for index, start, stop in _tiles(grad_out.shape[1], ctx.tiles.count):
                with torch.no_grad():
                    h = ctx.rebuild(index, *(x[:, start:stop] for x in sources))
                if ctx.states is not None:
                    _set_rng(device, ctx.states[index])
                h.requires_grad_(wants_h)
                with torch.enable_grad():
                    (y,) = ctx.step(h)
                grads = torch.autograd.grad(
                    y, ([h] if wants_h else []) + trained, grad_out[:, start:stop], allow_unused=True
                )
                if wants_h:
                    grad_h[:, start:stop] = grads[0]
                _sum_into(sums, list(grads[wants_h:]))
        nones = [None] * ctx.count
        return None, None, None, None, grad_h, *nones, *_param_grads(ctx.params, wanted_params, sums)
