"""Sequence-tiled MLP: each decoder layer's MLP runs over its tokens in tiles, and each tile is recomputed
in backward, so at most one tile's ``[tile, intermediate]`` tensors are alive at once. Exact.

An MLP treats every token alone, so tiles along the tokens give the untiled output and gradients, to the
rounding of summing the weight gradients tile by tile. For one micro-batch of ``T`` tokens::

    untiled   x [T, H] -> gate, up, act(gate) * up  [T, I] each, kept for backward  -> out [T, H]
    tiled     x [T, H] kept; forward and backward run tile by tile:
              x[0:t] -> [t, I] ... -> out[0:t]      then x[t:2t] -> ...              -> out [T, H]

With ``tile_tokens = 0`` a tile holds about ``hidden_size`` tokens (``ceil(T / hidden)`` tiles, ALST's
rule): each ``[tile, intermediate]`` tensor is then the size of one MLP weight matrix, memory the step
holds anyway, so the MLP no longer adds anything that grows with the pack, and a tile stays large enough
(4096 tokens for an 8B model) for the matrix products to run at full speed.

Which module is the MLP is read off the layer's structure (``families.token_wise_mlp``): the child
called on the hidden states alone, holding two weight matrices or more and no convolution. A dense MLP,
gated or with a fused ``gate_up`` projection, and a mixture of experts alike: each token is routed by its
own router logits, so a tile routes its tokens as the whole micro-batch does (shared experts run on every
token). A router's logits, which transformers records with a forward hook for the router loss, are
recorded here once per MLP call: each tile records into a collector of its own, the tiles' records are
concatenated in token order into outputs of the autograd function, and those reach the model's
collector, so the router loss's gradient flows back into the tiles' recompute with the output's. The
backward's recompute records into its own collector too, and the model's sees nothing of it::

    untiled   router(x [T, H]) -> logits [T, E] -> outputs.router_logits[layer]
    tiled     router(x[0:t]) -> [t, E], router(x[t:2t]) -> [t, E], ... -> one [T, E] -> the same place

Why not DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``): its backward
accumulates each tile's weight gradients through ``torch.autograd.backward``, so every trained
parameter's gradient hook fires once per tile. DDP's reducer expects one firing per backward, and ZeRO
needs its ``ds_grad_is_ready`` flag. Here the MLP's trained parameters (the base weights, or LoRA's
adapters on a frozen base) are inputs of the autograd function: the backward computes each tile's
gradients with ``torch.autograd.grad``, which fires no hook, and returns their sum, which reaches every
parameter once. Under each engine:

- DDP and ZeRO-1/2: one gradient per parameter and backward, as without tiling.
- ZeRO-3: the MLP is made a ZeRO-3 leaf module, so DeepSpeed gathers all of its parameters once when the
  MLP starts, in forward and again in backward, and runs no collective inside it: no gather per tile,
  and ranks with different token counts (hence tile counts) cannot wait on each other. (ALST instead lets
  each projection gather on its own and all-reduces the tile count to its maximum, so that the gathers
  of all ranks stay in step.) The flag is set when the process's ``TrainingArguments`` configure ZeRO-3
  (transformers' ``is_deepspeed_zero3_enabled``), and must be before ``deepspeed.initialize`` registers
  its hooks: ``longalign.run.load_model`` applies the tiling after the arguments, as it loads the model.
- FSDP2: the decoder layer is the sharded unit; its parameters are unsharded around the layer's forward
  and backward, so the tiles see whole tensors, and the summed gradients land on the unsharded
  parameters once, before the layer's reduce-scatter.
- Sequence parallelism: each rank holds its slice of the pack and tiles that.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.utils.output_capturing import _active_collector

from longalign.errors import ModelError

from .families import decoder_layers, mlp_tiling_problem, token_wise_mlp


def tile_mlp(model: nn.Module, *, tile_tokens: int = 0) -> nn.Module:
    """Run every decoder layer's MLP of ``model`` in tiles of ``tile_tokens`` tokens (0: ``hidden_size``).

    The MLP is the layer's token-wise child (``families.token_wise_mlp``): a dense MLP or a mixture of
    experts. Raises ``ModelError`` naming the layer that has none. Call it after the run's
    ``TrainingArguments`` and before the engine wraps the model (ZeRO-3 reads the leaf flag when it
    starts); LoRA adapters may come later.
    """
    problem = mlp_tiling_problem(model)
    if problem:
        raise ModelError(f"training.sequence_tiling = 'mlp': {type(model).__name__}: {problem}")
    zero3 = is_deepspeed_zero3_enabled()
    for layer in decoder_layers(model):
        mlp = token_wise_mlp(layer)
        mlp.forward = functools.partial(tiled_forward, mlp, tile_tokens=tile_tokens)
        if zero3:
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(mlp, True)
    return model


def tile_count(tokens: int, hidden_size: int, tile_tokens: int = 0) -> int:
    """How many tiles ``tokens`` tokens run in: ``ceil(tokens / tile_tokens)``, ``hidden_size`` for 0.

    >>> tile_count(65536, 4096), tile_count(65536, 4096, tile_tokens=1000), tile_count(100, 4096)
    (16, 66, 1)
    """
    return max(1, math.ceil(tokens / (tile_tokens or hidden_size)))


def tiled_forward(mlp: nn.Module, hidden_states: torch.Tensor, *, tile_tokens: int = 0) -> Any:
    """``mlp``'s own forward over ``hidden_states [..., T, H]``, run in tiles along the tokens.

    Returns what the forward returns (gpt-oss's MLP: its output and router scores), whole. What
    transformers records inside the MLP while the model's forward collects outputs (a router's logits,
    ``output_router_logits``) is recorded once for the whole MLP, the tiles' records in token order, and
    carries gradients back through the tiles::

        x [1, 70, H], 3 tiles  ->  router [24, E], [23, E], [23, E]  ->  router_logits gets one [70, E]
    """
    tiles = tile_count(hidden_states.shape[:-1].numel(), hidden_states.shape[-1], tile_tokens)
    trained = [param for param in mlp.parameters() if param.requires_grad]
    if any(getattr(param, "ds_numel", 0) and not param.numel() for param in trained):
        raise ModelError(
            f"training.tiled_mlp: the {type(mlp).__name__}'s parameters are partitioned by ZeRO-3 inside it; "
            "tile the MLP (longalign.patch.tile_mlp) before DeepSpeed starts, so it gathers them for the whole MLP"
        )
    collector = _active_collector.get()
    keys = tuple(key for key, value in (collector or {}).items() if isinstance(value, list))
    layout = _Layout()
    pieces = _TiledMLP.apply(mlp, tiles, keys, layout, hidden_states, *trained)
    lead = hidden_states.shape[:-1]
    whole = [
        piece.view(*lead, *piece.shape[1:]) if batched else piece
        for piece, batched in zip(pieces, layout.batched, strict=True)
    ]
    for key, index in layout.records:
        collector[key].append(whole[index])
    if layout.returned is None:
        return whole[0]
    return tuple(None if index is None else whole[index] for index in layout.returned)


@dataclass
class _Layout:
    """Where the tensors of one MLP call go: the tiled function returns them as one flat list of pieces.

    A piece is a per-token tensor, ``[tile, ...]`` (``batched`` False) or ``[1, tile, ...]`` (True, kept
    as ``[tile, ...]`` while tiled and given the input's leading shape back at the end).
    """

    returned: list[int | None] | None = None  # the forward's tuple, by piece; None: it returns one tensor
    records: list[tuple[str, int]] = field(default_factory=list)  # (recorded output, piece), in order
    batched: list[bool] = field(default_factory=list)


def _call(mlp: nn.Module, tile: torch.Tensor, keys: tuple[str, ...], layout: _Layout) -> list[torch.Tensor]:
    """The pieces of ``mlp(tile)`` for a tile ``[1, t, H]``: what it returns, then what transformers records
    inside it under ``keys``, each as ``[t, ...]``; the first call fills ``layout``."""
    recorded: dict[str, list] = {key: [] for key in keys}
    # The tile's records go to this call's own collector, not the model's: the model gets the whole MLP's.
    token = _active_collector.set(recorded)
    try:
        # The class's forward, looked up at the call: an engine may have swapped the class since (FSDP2).
        returned = type(mlp).forward(mlp, tile)
    finally:
        _active_collector.reset(token)
    outputs = list(returned) if isinstance(returned, tuple) else [returned]
    tensors = [output for output in outputs if output is not None]
    records = [(key, tensor) for key in keys for tensor in recorded[key]]
    pieces = tensors + [tensor for _, tensor in records]
    tokens = tile.shape[1]
    if not layout.batched:
        if isinstance(returned, tuple):
            slots = iter(range(len(tensors)))
            layout.returned = [None if output is None else next(slots) for output in outputs]
        layout.records = [(key, len(tensors) + i) for i, (key, _) in enumerate(records)]
        layout.batched = [piece.shape[:2] == (1, tokens) for piece in pieces]
    if len(pieces) != len(layout.batched):
        raise ModelError(
            f"training.sequence_tiling = 'mlp': {type(mlp).__name__} returned or recorded {len(pieces)} tensors "
            f"for one tile and {len(layout.batched)} for another"
        )
    flat = []
    for piece, batched in zip(pieces, layout.batched, strict=True):
        if (piece.shape[1] if batched else piece.shape[0]) != tokens:
            raise ModelError(
                f"training.sequence_tiling = 'mlp': {type(mlp).__name__} gives a tensor of shape "
                f"{tuple(piece.shape)} for {tokens} tokens, not one row per token: it cannot run in tiles"
            )
        flat.append(piece[0] if batched else piece)
    return flat


class _TiledMLP(torch.autograd.Function):
    """``mlp(x)`` tile by tile; backward recomputes each tile and returns the trained parameters' gradients.

    Its outputs are the pieces of :func:`_call`, each ``[tokens, ...]``: the gradients arriving at the
    recorded router logits go back through the tile's router with the output's.
    """

    @staticmethod
    def forward(ctx, mlp, tiles, keys, layout, x, *params):
        ctx.mlp, ctx.tiles, ctx.keys, ctx.layout, ctx.params = mlp, tiles, keys, layout, params
        ctx.autocast = _autocast_state(x.device.type)
        # Dropout (of LoRA adapters) must draw the same masks when backward recomputes the tiles.
        ctx.rng = _rng_state(x.device) if mlp.training else None
        ctx.save_for_backward(x)
        row = x.reshape(1, -1, x.shape[-1])  # every token in one row: a tile is [1, t, H], as MoE blocks take
        tokens = row.shape[1]
        buffers = None
        for _, start, stop in _tiles(tokens, tiles):
            pieces = _call(mlp, row[:, start:stop], keys, layout)
            if buffers is None:  # one buffer per piece, not a list of tiles and their concatenation
                buffers = [piece.new_empty((tokens, *piece.shape[1:])) for piece in pieces]
            for buffer, piece in zip(buffers, pieces, strict=True):
                buffer[start:stop] = piece
        ctx.mark_non_differentiable(*(buffer for buffer in buffers if not buffer.is_floating_point()))
        return tuple(buffers)

    @staticmethod
    def backward(ctx, *grad_pieces: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        mlp, params = ctx.mlp, ctx.params
        wants_x = ctx.needs_input_grad[4]
        trained = [param for param, wanted in zip(params, ctx.needs_input_grad[5:], strict=True) if wanted]
        row = x.detach().reshape(1, -1, x.shape[-1])
        grad_x = torch.empty_like(row) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(trained)
        with _replay(x.device, ctx.autocast, ctx.rng):
            for _, start, stop in _tiles(row.shape[1], ctx.tiles):
                tile = row[:, start:stop].detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    pieces = _call(mlp, tile, ctx.keys, ctx.layout)
                pairs = [
                    (piece, grad[start:stop])
                    for piece, grad in zip(pieces, grad_pieces, strict=True)
                    if piece.requires_grad and grad is not None
                ]
                inputs = ([tile] if wants_x else []) + trained
                grads = torch.autograd.grad(
                    [piece for piece, _ in pairs], inputs, [grad for _, grad in pairs], allow_unused=True
                )
                if wants_x:
                    grad_x[:, start:stop] = 0 if grads[0] is None else grads[0]
                for i, grad in enumerate(grads[wants_x:]):
                    if grad is not None:
                        # Summed in at least float32: bfloat16 partial sums would round once per tile.
                        grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
                        sums[i] = grad if sums[i] is None else sums[i].add_(grad)
        by_param = iter(sums)
        param_grads = [
            _cast(next(by_param), param.dtype) if wanted else None
            for param, wanted in zip(params, ctx.needs_input_grad[5:], strict=True)
        ]
        return None, None, None, None, grad_x.view_as(x) if wants_x else None, *param_grads


def _cast(grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if grad is None else grad.to(dtype)


# Set while the simulation counts a step on fake tensors (distinct_tiles_only): the tiled loops run only
# the tiles whose allocations differ from those of the tiles before them.
_DISTINCT_TILES_ONLY = False


@contextlib.contextmanager
def distinct_tiles_only() -> Iterator[None]:
    """Within the block, the tiled loops (this MLP's, ``tiled_layer``'s) run only the tiles that can reach a
    new peak of memory, to count a step on fake tensors (``longalign.simulate``); never to compute one.

    A loop's first tile makes what the loop keeps (the output buffers; in backward the input gradients'
    buffers and the parameters' gradient sums); every later tile writes into those and frees all it
    allocated, so it leaves the memory as it found it. Tiles of one size after the first therefore repeat
    the same allocations from the same level, and the first two tiles and the first of each further size
    (the last tiles may be one token shorter) reach every peak the whole loop reaches. On fake tensors
    nothing is computed, so the tiles skipped change the counted memory by nothing. Under tracing
    (``torch.compile``) fake tensors stand for real ones: the flag is set by the simulation alone.
    """
    global _DISTINCT_TILES_ONLY
    before, _DISTINCT_TILES_ONLY = _DISTINCT_TILES_ONLY, True
    try:
        yield
    finally:
        _DISTINCT_TILES_ONLY = before


def _tiles(tokens: int, count: int) -> list[tuple[int, int, int]]:
    """``(index, start, stop)`` of the tiles a loop runs: all of ``_bounds(tokens, count)``; within
    :func:`distinct_tiles_only`, the first two and the first of each further size.

    >>> with distinct_tiles_only():
    ...     _tiles(14, 5)
    [(0, 0, 3), (1, 3, 6), (4, 12, 14)]
    """
    bounds = _bounds(tokens, count)
    sizes = [stop - start for start, stop in bounds]
    return [
        (index, start, stop)
        for index, (start, stop) in enumerate(bounds)
        if not _DISTINCT_TILES_ONLY or index < 2 or sizes[index] != sizes[index - 1]
    ]


def _bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    """Token ranges of ``tiles`` tiles, cut as ``torch.tensor_split`` cuts: the first ones one longer.

    >>> _bounds(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    size, longer = divmod(tokens, tiles)
    edges = [i * size + min(i, longer) for i in range(tiles + 1)]
    return list(zip(edges, edges[1:], strict=False))


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, Any]:
    """The random state dropout draws from on ``device``: the CPU generator's, and the device's own."""
    device_state = None if device.type == "cpu" else torch.get_device_module(device).get_rng_state(device)
    return torch.get_rng_state(), device_state


@contextlib.contextmanager
def _replay(device: torch.device, autocast: tuple[bool, torch.dtype], rng: tuple | None):
    """Run the recompute as the forward ran: same autocast, same random state (then the state is restored)."""
    enabled, dtype = autocast
    devices = [] if device.type == "cpu" else [device]
    with (
        torch.random.fork_rng(devices=devices, enabled=rng is not None, device_type=device.type),
        torch.autocast(device.type, dtype=dtype, enabled=enabled),
    ):
        if rng is not None:
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.get_device_module(device).set_rng_state(rng[1], device)
        yield
