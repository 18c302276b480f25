"""Sequence-tiled decoder layer: the layer's own forward runs over the tokens in tiles around one call of
the attention function on the whole sequence; the layer keeps only its input and recomputes itself. Exact.

A decoder layer is token-wise everywhere but in its attention call. For one micro-batch of ``T`` tokens
(hidden ``H``) in tiles of ``t``, the family's own ``forward`` runs twice per tile::

    first pass   x[:, i:i+t] -> the family's norm, projections, RoPE (q/k norms, MLA, ...) up to the
                 attention call, which is stopped there: q, k, v [B, heads, t, D] are kept, and of what
                 the attention module's children (q_proj, k_proj, ...) returned before it, the outputs
                 the layer reads after the call (a gate; found once per layer on one token)
    attention    the attention function once, on the whole q, k, v [B, heads, T, D], with the kwargs
                 the module passed (window, chunks, soft-cap, sinks, scaling), position_ids whole, and
                 per_kv_head=True (longalign's varlen attention: backward buffers one group at a time)
                                                                  -> attended [B, T, heads, D]
    second pass  x[:, i:i+t] again through the layer: the attention module's children hand back what
                 was kept (zeros for the rest, which only lead to the call), the attention call hands
                 back attended[:, i:i+t]; everything after it
                 (o-projection, gates, sandwich norms, multipliers, residuals, MLP or experts) is the
                 family's code                                    -> out[:, i:i+t]

Per-token arguments are cut to the tile (position_ids, RoPE's cos and sin, Gemma 4's per-layer inputs,
a per-position scale); the attention mask and the varlen ``cu_seq_lens``/``max_length`` stay whole, for
the attention call. In a linear-attention layer the call run whole is its token mixer's (the module
``longalign.patch.linear_attention`` restarts per sample: projections, short convolution, recurrence) on
the normed hidden states ``[B, T, H]``, in place of the attention function's on q, k, v. Which families fit
is :func:`longalign.patch.families.tiling_problem`'s (AltUp's stacked hidden states, token mixing outside
one such module, and a layer that calls attention twice, counted on the meta device, are refused before
any data and when the model loads); a layer that cannot run there and calls attention twice is refused at
its first step.

The layer is one autograd function that keeps its input alone (as activation checkpointing keeps it, so
``offload_checkpointed_inputs`` moves it to host memory; with ``keep_attention`` also the attention
call's output and log-sum-exps, :func:`longalign.attention.keeping_attention`) and whose backward runs:

1. every tile's first pass again, without gradients: the whole q, k, v and the kept children's outputs;
2. the attention call on them, with gradients (kept: its forward hands back what it kept);
3. every tile's second pass, differentiated: gradients of the tile's input, of its tile of the
   attention output, of the kept children's outputs and of the parameters;
4. the attention call's backward: q's, k's, v's gradients (and a sink's);
5. every tile's first pass once more, differentiated into the tile's input and the parameters.

Steps 3 and 5 differentiate passes whose outputs' values backward never reads; a linear product whose
output only such steps follow computes nothing there (:class:`_ValuelessProduct`: zeros in forward, the
product's backward): the down projection before the residual sum in step 3, q/k/v projections before
RoPE in step 5 (found once per layer on one token, :func:`_valueless_linears`). So per step each
token-wise part runs in forward and once in backward, as under activation checkpointing (whose recompute
skips the down projection: torch stops it at the last tensor backward needs); transformers' activation
checkpointing does not wrap a tiled layer (its checkpointing function runs the layer as it is), which
would recompute all of it once more. The tensors that span the micro-batch exist
only while the layer's backward runs: q, k, v, the attention output, the kept children's outputs, their
gradients, and the input's gradient, which is written over the incoming gradient (:func:`_reusable`) as
each tile's second pass has read its tile; the input itself is let go during step 4 (offloaded, it is
copied back for step 5), and what the attention call consumes is held only by what it keeps
(:class:`_Handed`, :class:`_Root`: the tensors on either side of the Ulysses exchange go once it has
run). The norms' outputs, the residual sums and the MLP's ``[t, intermediate]`` tensors exist for one tile
at a time, in forward and in backward.

What the model records inside a layer (a mixture of experts' router logits, through transformers'
output-recording hooks) is collected per tile in the second pass, joined in token order and handed to
the model once per layer call, as an output of the autograd function: the router loss's gradient comes
back to it and enters step 3, so it reaches the router once.

Its trained parameters are inputs of the autograd function: its backward computes each tile's gradients
with ``torch.autograd.grad`` (no gradient hook fires there) and returns their sum, so every parameter's
hook fires once per backward (DDP, ZeRO); autocast and each pass's random state (LoRA dropout) are
replayed for the recompute. Under ZeRO-3 the whole decoder layer is made a leaf module: DeepSpeed gathers
its parameters once when the layer starts and runs no collective inside it, so ranks with different
token counts (and tile counts) never wait on each other. The model's final norm runs in tiles too:
untiled, its float32 backward holds more than a tiled layer (24 bytes per token per unit of hidden).
The layer's class is replaced by a subclass of the same name (wrap policies find layers by name); with
a KV cache (generation) the layer runs its own forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import output_capturing

from longalign import attention
from longalign.errors import ModelError

from .families import decide, tiling_problem
from .interface import attention_calls
from .linear_attention import linear_attention_layers
from .tiled_mlp import _autocast_state, _cast, _rng_state, _tiles, tile_count

_TILED_CLASSES: dict[type, type] = {}  # a layer class -> its tiled subclass
# Arguments of a layer that span the tokens but stay whole in every tile: the kernel reads them whole.
_WHOLE_ARGUMENTS = frozenset(
    {"attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
)


def tile_layers(model: nn.Module, *, tile_tokens: int = 0, keep_attention: bool = False) -> nn.Module:
    """Run every decoder layer of ``model``, and the norm after them, in tiles of ``tile_tokens`` tokens
    (0: ``hidden_size``). ``keep_attention``: each layer keeps its attention output and log-sum-exp from
    forward, saved as its input is (offloaded, with ``offload_checkpointed_inputs``), and its backward runs
    the attention's backward on them, no attention forward.

    Raises ``ModelError`` in one line when the model's layers cannot be tiled
    (:func:`longalign.patch.families.tiling_problem`). Call it after the run's ``TrainingArguments`` and
    before the engine wraps the model (ZeRO-3 reads the leaf flag when it starts); LoRA adapters and
    ``offload_checkpointed_inputs`` may come before or after.
    """
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ModelError(f"training.sequence_tiling: {type(model).__name__} has no decoder layers to tile")
    problem = tiling_problem(model)
    if problem is None and hasattr(model, "config"):
        # what a meta-device copy of its layers shows when they run (attention called twice), as decided
        # before any data from the config alone
        problem = decide(model.config).layer_tiling
    if problem is not None:
        raise ModelError(
            f"training.sequence_tiling = 'layer': longalign cannot tile {type(layers[0]).__name__}: {problem} "
            "(sequence_tiling = 'mlp' tiles the MLP alone)"
        )
    for layer in layers:
        if not hasattr(type(layer), "untiled"):
            layer.__class__ = _tiled_class(type(layer))
        layer.tile_tokens = tile_tokens
        layer.keep_attention = keep_attention
    norm = _final_norm(model)
    if norm is not None:
        norm.forward = functools.partial(_tiled_norm_forward, norm, tile_tokens=tile_tokens)
    if is_deepspeed_zero3_enabled():
        from deepspeed.utils import set_z3_leaf_module

        for module in [*layers, *([norm] if norm is not None else [])]:
            set_z3_leaf_module(module, True)
    return model


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last decoder layer (``model.model.norm`` in transformers' decoders)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return getattr(decoder, "norm", None)


def _tiled_norm_forward(norm: nn.Module, hidden_states: torch.Tensor, *, tile_tokens: int) -> torch.Tensor:
    """The final norm over ``hidden_states [B, T, H]`` in tiles, recomputed in backward.

    Untiled, its backward holds several float32 ``[T, H]`` temporaries at once (the norm computes in float32),
    more than any tiled layer holds; tiled, one tile of them.
    """
    batch, length, hidden = hidden_states.shape
    count = min(length, tile_count(batch * length, hidden, tile_tokens))
    trained = _trained(norm, norm)
    return _TiledNorm.apply(norm, count, hidden_states, *trained)


class _NotCheckpointed:
    """A checkpointing function that runs the layer as it is: a tiled layer recomputes itself."""

    def __get__(self, layer: nn.Module, owner: type) -> Callable:
        return lambda function, *args: function(*args)

    def __set__(self, layer: nn.Module, value: Callable) -> None:
        pass  # transformers' activation checkpointing sets its function here; the tiled layer keeps its own


def _tiled_class(cls: type) -> type:
    """``cls`` with the tiled forward, under the same name (wrap policies and checks find layers by name).

    Its ``gradient_checkpointing`` flag is left to transformers (longalign's offloading reads it), but the
    checkpointing function it sets runs the layer as it is: the tiled forward keeps the layer's input alone
    and recomputes the rest itself, so checkpointing would recompute it a second time.
    """
    if cls not in _TILED_CLASSES:
        # Created through type(): transformers' __init_subclass__ wraps the new forward for checkpointing.
        _TILED_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _tiled_layer_forward,
                "untiled": cls,
                "_gradient_checkpointing_func": _NotCheckpointed(),
                "__module__": cls.__module__,
            },
        )
    return _TILED_CLASSES[cls]


def _tiled_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The layer's own forward on ``hidden_states [B, T, H]``, run tile by tile around one attention call."""
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        # Generation: the cache is written whole, by the layer's own code.
        return layer.untiled.forward(layer, hidden_states, *args, **kwargs)
    batch, length, hidden = hidden_states.shape
    call = _LayerCall(
        layer, hidden_states, args, kwargs, min(length, tile_count(batch * length, hidden, layer.tile_tokens))
    )
    collector = output_capturing._active_collector.get()
    call.recorded_keys = [
        key for key in (collector or {}) if key != "hidden_states" and not key.startswith("_")
    ]
    out, *recorded = _TiledLayer.apply(call, hidden_states, *call.graded, *call.trained())
    for key, tensor in zip(call.recorded_names, recorded, strict=True):
        collector[key].append(tensor)  # once per layer call, the tiles joined in token order
    return out


class _Stop(Exception):
    """Raised at the attention call of a tile's first pass: what follows needs the whole attention output."""


class _LayerCall:
    """One call of a tiled layer: its arguments, its tiles, and the two passes of the layer's own forward
    over one tile.

    ``before`` runs a tile up to the attention call and returns what the call was given (q, k, v
    ``[B, heads, t, D]``) and the outputs of the attention module's children that ran before it (its
    projections and norms); ``after`` runs the tile again from the start, those children handing back
    their outputs instead of running, and the attention call handing back the tile of the whole output.
    """

    def __init__(self, layer: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict, count: int) -> None:
        self.layer, self.args, self.kwargs, self.count = layer, args, kwargs, count
        self.keep = getattr(layer, "keep_attention", False)  # keep the attention's output (tile_layers)
        self.batch, self.length = x.shape[:2]
        self.wholes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(tile) -> (tile, whole)
        self.leaves: dict[int, torch.Tensor] = {}  # id(whole) -> this tile's leaf, in backward's passes
        # Per-token arguments that need a gradient besides the hidden states (Gemma 4's per-layer inputs).
        self.graded = [
            value
            for value in _flat([*args, *(v for k, v in kwargs.items() if k not in _WHOLE_ARGUMENTS)])
            if isinstance(value, torch.Tensor) and value.requires_grad and self.token_dim(value) is not None
        ]
        # A linear-attention layer's token mixer (Qwen3-Next's gated delta net): its call runs whole, as the
        # attention function's does in an attention layer
        mixers = linear_attention_layers(layer)
        self.mixer: nn.Module | None = mixers[0] if mixers else None
        # The tokens' dimension of the call's inputs: [B, t, H] (a mixer's) or [B, heads, t, D] (q, k, v)
        self.input_dim = 1 if self.mixer is not None else -2
        self.attention: dict[str, Any] = {}  # the module, function and arguments of the attention call
        self.recorded_keys: list[str] = []  # the model's recorded outputs (router logits) to collect
        self.recorded_names: list[str] = []  # the key of each recorded output of the layer, in order
        self.layouts: list[str] = []  # how each recorded output holds the tokens: "flat" or "batch"
        self.states: dict | None = {} if layer.training else None  # random states, by pass and tile

    def trained(self) -> list[torch.Tensor]:
        return _trained(self.layer, self.layer)

    def tile_arguments(self, start: int, stop: int) -> tuple[tuple, dict]:
        """The layer's arguments for tokens ``start:stop``: per-token tensors sliced, the rest whole."""
        args = tuple(self._sliced(value, start, stop) for value in self.args)
        kwargs = {
            key: value if key in _WHOLE_ARGUMENTS else self._sliced(value, start, stop)
            for key, value in self.kwargs.items()
        }
        return args, kwargs

    def _sliced(self, value: Any, start: int, stop: int) -> Any:
        if isinstance(value, tuple | list):
            return type(value)(self._sliced(item, start, stop) for item in value)
        dim = self.token_dim(value)
        if dim is None:
            return value
        leaf = self.leaves.get(id(value))
        tile = leaf if leaf is not None else value.narrow(dim, start, stop - start)
        self.wholes[id(tile)] = (tile, value)
        return tile

    def token_dim(self, value: Any) -> int | None:
        """The dimension of a layer argument that runs over the tokens, None if none does: position_ids
        ``[B, T]``, RoPE's cos and sin ``[B, T, D]``, per-layer inputs ``[B, T, ...]``, a per-position
        scale ``[B, 1, T, 1]``, cache_position ``[T]``."""
        if not isinstance(value, torch.Tensor):
            return None
        shape = tuple(value.shape)
        if len(shape) >= 2 and shape[0] in (1, self.batch) and shape[1] == self.length:
            return 1
        if len(shape) >= 3 and shape[0] in (1, self.batch) and shape[1] == 1 and shape[2] == self.length:
            return 2
        return 0 if shape == (self.length,) else None

    def whole(self, value: Any) -> Any:
        """``value`` as the whole call has it: a tile of an argument made whole again."""
        if isinstance(value, tuple | list):
            return type(value)(self.whole(item) for item in value)
        kept = self.wholes.get(id(value))
        return kept[1] if kept is not None and kept[0] is value else value

    def before(self, x: torch.Tensor, start: int, stop: int) -> tuple[list[torch.Tensor], list]:
        """The tile ``start:stop`` of ``x`` up to the attention call: (q, k, v), and the attention module's
        children's outputs before it, as ``(child, output)``."""
        found: list = []
        finished: list = []

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            finished.append((module, output))

        def attention(function: Callable) -> Callable:
            def captured(module, query, key, value, *args, **kwargs):
                found.append((query, key, value))
                self.attention.update(module=module, function=function, args=args, kwargs=kwargs)
                raise _Stop

            return captured

        def mixer(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs.pop("hidden_states")
            found.append((hidden,))
            self.attention.update(module=self.mixer, function=None, args=args[1:], kwargs=kwargs)
            raise _Stop

        args, kwargs = self.tile_arguments(start, stop)
        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            with attention_calls(attention), _recording(None), _replaced(self.mixer, mixer):
                self.layer.untiled.forward(self.layer, x, *args, **kwargs)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not found:
            raise ModelError(
                f"training.sequence_tiling = 'layer': {type(self.layer).__name__} ran without calling "
                "transformers' attention interface, around which longalign tiles it"
            )
        children = {id(child) for child in self.attention["module"].children()}
        cached = [(module, out) for module, out in finished if id(module) in children and _is_float(out)]
        return list(found[0]), cached

    def read_after_call(self, x: torch.Tensor, start: int, stop: int, children: list, qkv: list) -> frozenset:
        """The names of the attention module's children whose outputs the layer reads after the attention
        call (a gate that q_proj makes, say), given a tile ``x`` (tokens ``start:stop``), its children's
        outputs and q, k, v. Found by running the tile's first token after the call, those outputs as
        leaves and zeros standing in for the attention output, and walking the autograd graph of the
        result back to them; the other outputs only lead to the call's inputs, so the second pass needs no
        values of them. Run once per layer, on one token: its cost is nil."""
        if not children:  # nothing of the call's module ran before it (a token mixer called whole)
            return frozenset()
        tokens = slice(0, 1)

        def first_token(out: torch.Tensor) -> torch.Tensor:
            return out[:, tokens] if tuple(out.shape[:2]) == (self.batch, stop - start) else out

        leaves = [(module, first_token(out).detach().requires_grad_()) for module, out in children]
        q, _, v = qkv
        stand_in = q.new_zeros((q.shape[0], 1, q.shape[1], v.shape[-1]))
        devices = [] if x.device.type == "cpu" else [x.device]
        forked = torch.random.fork_rng(
            devices=devices, enabled=self.layer.training, device_type=x.device.type
        )
        kept_here = torch.autograd.graph.saved_tensors_hooks(_itself, _itself)  # not offloaded, not seen
        with torch.enable_grad(), forked, kept_here:
            y, recorded = self.after(x[:, tokens].detach(), start, start + 1, leaves, stand_in)
        reached = _reached_leaves([y, *recorded])
        names = {id(child): name for name, child in self.attention["module"].named_children()}
        return frozenset(names[id(module)] for module, leaf in leaves if id(leaf) in reached)

    @property
    def valueless_after(self) -> frozenset | None:
        return getattr(self.layer, "tiling_valueless_after", None)

    @property
    def valueless_before(self) -> frozenset | None:
        return getattr(self.layer, "tiling_valueless_before", None)

    def find_valueless_after(
        self, leaves: list, handed: list, attended: torch.Tensor, trained: list, start: int
    ) -> None:
        """Which linear products of the second pass backward needs no output of (the down projection that
        only a residual sum follows, say), found on the first token of a tile (``leaves``: the tile's leaf
        inputs, the hidden states first; ``handed``: its children's outputs; ``attended``: its attention
        output tile). Kept on the layer: once per layer."""
        tokens = slice(0, 1)

        def first_token(out: torch.Tensor) -> torch.Tensor:
            return out[:, tokens] if tuple(out.shape[:2]) == tuple(attended.shape[:2]) else out

        one = [leaf[:, tokens].detach().clone().requires_grad_(leaf.requires_grad) for leaf in leaves]
        self.leaves = {id(whole): leaf for whole, leaf in zip(self.graded, one[1:], strict=True)}
        children = [
            (
                module,
                out.first_token(tuple(attended.shape[:2]))
                if isinstance(out, _Unread)
                else first_token(out).detach().clone().requires_grad_(),
            )
            for module, out in handed
        ]
        attended = first_token(attended).detach().clone().requires_grad_()
        inputs = [attended, *(out for _, out in children if not isinstance(out, _Unread)), *one, *trained]

        def run() -> tuple[list, list]:
            _drawing(self, attended.device, ("after", 0), True)
            y, recorded = self.after(one[0], start, start + 1, children, attended)
            return [y, *(t for t in recorded if t.requires_grad)], [t for t in inputs if t.requires_grad]

        self.layer.tiling_valueless_after = _valueless_linears(self.layer, run)

    def find_valueless_before(self, leaves: list, trained: list, start: int) -> None:
        """Which linear products of the first pass backward needs no output of (q/k/v projections that only
        RoPE and reshapes follow before the attention call), found on the first token of a tile. Kept on the
        layer: once per layer."""
        one = [leaf[:, 0:1].detach().clone().requires_grad_(leaf.requires_grad) for leaf in leaves]
        self.leaves = {id(whole): leaf for whole, leaf in zip(self.graded, one[1:], strict=True)}
        read = self.layer.tiling_read_children
        names = {id(child): name for name, child in self.attention["module"].named_children()}

        def run() -> tuple[list, list]:
            _drawing(self, one[0].device, ("before", 0), True)
            qkv, children = self.before(one[0], start, start + 1)
            outputs = [*qkv, *(out for module, out in children if names[id(module)] in read)]
            inputs = [*one, *trained]
            return [t for t in outputs if t.requires_grad], [t for t in inputs if t.requires_grad]

        self.layer.tiling_valueless_before = _valueless_linears(self.layer, run)

    def kernel(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The attention call on the whole ``q, k, v [B, heads, T, D]`` -> ``[B, T, heads, D]``; a token
        mixer's on the whole hidden states ``[B, T, H]`` -> ``[B, T, H']``."""
        call = self.attention
        kwargs = {name: self.whole(value) for name, value in call["kwargs"].items()}
        if self.mixer is not None:
            return self.mixer(*inputs, *self.whole(call["args"]), **kwargs)
        q, k, v = inputs
        kwargs["per_kv_head"] = True  # longalign's varlen attention: backward buffers one group at a time
        args = self.whole(call["args"])
        return call["function"](call["module"], q, k, v, *args, **kwargs)[0]

    def after(
        self, x: torch.Tensor, start: int, stop: int, cached: list, attended: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tile ``start:stop`` through the layer, given the attention output's tile ``attended`` and
        the children's outputs ``cached``: the layer's output, and the outputs the model records."""
        args, kwargs = self.tile_arguments(start, stop)

        calls = []

        def once(function: Any) -> None:
            calls.append(function)
            if len(calls) > 1:
                raise ModelError(
                    f"training.sequence_tiling = 'layer': longalign cannot tile {type(self.layer).__name__}: "
                    "it calls the attention function more than once (the tiled layer runs one call on the "
                    "whole sequence between its tiles)"
                )

        def attention(function: Callable) -> Callable:
            def handed_back(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
                once(function)
                return attended, None

            return handed_back

        def mixer(*args: Any, **kwargs: Any) -> torch.Tensor:
            once(self.mixer)
            return attended

        recorded: dict[str, list] = {key: [] for key in self.recorded_keys}
        replaced = _replaced(self.mixer, mixer)
        with attention_calls(attention), _recording(recorded), _handing_back(cached), replaced:
            out = self.layer.untiled.forward(self.layer, x, *args, **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ModelError(
                f"training.sequence_tiling = 'layer': {type(self.layer).__name__} returns "
                f"{type(out).__name__}, not its hidden states alone"
            )
        self.recorded_names = [key for key in self.recorded_keys for _ in recorded[key]]
        return out, [tensor for key in self.recorded_keys for tensor in recorded[key]]

    def layout(self, tensor: torch.Tensor, tokens: int) -> str:
        """How ``tensor``, recorded for a tile of ``tokens`` tokens, holds them: ``"batch"`` ([B, t, ...]) or
        ``"flat"`` ([B x t, ...], batch-major)."""
        if tensor.dim() >= 2 and tuple(tensor.shape[:2]) == (self.batch, tokens):
            return "batch"
        if tensor.shape[0] == self.batch * tokens:
            return "flat"
        raise ModelError(
            f"training.sequence_tiling = 'layer': {type(self.layer).__name__} records an output of shape "
            f"{tuple(tensor.shape)} for {tokens} tokens, which cannot be joined over the tiles"
        )

    def write(self, whole: torch.Tensor, layout: str, start: int, stop: int, tile: torch.Tensor) -> None:
        """Put a tile's recorded output into the whole call's."""
        if layout == "batch":
            whole[:, start:stop] = tile
        else:
            rest = whole.shape[1:]
            whole.view(self.batch, self.length, *rest)[:, start:stop] = tile.view(
                self.batch, stop - start, *rest
            )

    def part(self, whole: torch.Tensor, layout: str, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start:stop`` of a recorded output (or its gradient) of the whole call."""
        if layout == "batch":
            return whole[:, start:stop]
        return whole.view(self.batch, self.length, *whole.shape[1:])[:, start:stop].reshape(
            -1, *whole.shape[1:]
        )


def _flat(values: Any) -> list:
    """The items of nested tuples and lists, in order."""
    if isinstance(values, tuple | list):
        return [item for value in values for item in _flat(value)]
    return [values]


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


@contextlib.contextmanager
def _recording(collected: dict | None) -> Iterator[None]:
    """transformers' output recording (router logits) collects into ``collected`` (None: nothing)."""
    token = output_capturing._active_collector.set(collected)
    try:
        yield
    finally:
        output_capturing._active_collector.reset(token)


@contextlib.contextmanager
def _handing_back(cached: list) -> Iterator[None]:
    """Each module of ``cached`` (``(module, output)``, in call order) hands back its outputs, in order,
    instead of running; a module called more often than cached runs for the calls after."""
    queues: dict[int, list] = {}
    modules: dict[int, nn.Module] = {}
    for module, out in cached:
        queues.setdefault(id(module), []).append(out)
        modules[id(module)] = module
    own = {key: module.__dict__.get("forward") for key, module in modules.items()}

    def handed_back(key: int, module: nn.Module) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if queues[key]:
                out = queues[key].pop(0)
                return out.make() if isinstance(out, _Unread) else out
            return (own[key] or type(module).forward.__get__(module))(*args, **kwargs)

        return forward

    for key, module in modules.items():
        module.forward = handed_back(key, module)
    try:
        yield
    finally:
        for key, module in modules.items():
            if own[key] is None:
                del module.forward
            else:
                module.forward = own[key]


class _ValuelessProduct(torch.autograd.Function):
    """``nn.Linear``'s product in a differentiated recompute whose output no backward reads: its forward
    returns zeros of the output's shape and dtype (no product is computed), its backward is the linear's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        device = x.device.type
        ctx.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)
        return x.new_zeros((*x.shape[:-1], weight.shape[0]), dtype=ctx.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight.to(ctx.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (rows.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias


@contextlib.contextmanager
def _valueless(layer: nn.Module, names: frozenset | None) -> Iterator[None]:
    """Within the block, the linear modules ``names`` of ``layer`` compute no product in forward
    (:class:`_ValuelessProduct`)."""
    with contextlib.ExitStack() as stack:
        for name in sorted(names or ()):
            module = layer.get_submodule(name)
            stack.enter_context(_replaced(module, functools.partial(_valueless_forward, module)))
        yield


def _valueless_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _ValuelessProduct.apply(x, module.weight, module.bias)


def _valueless_linears(layer: nn.Module, run: Callable[[], tuple[list, list]]) -> frozenset:
    """The names of ``layer``'s ``nn.Linear`` modules whose outputs no backward of ``run``'s outputs reads.

    ``run()`` runs a differentiated pass of one token and returns its outputs and the inputs to
    differentiate. A product's output is unread when every node of the autograd graph between the outputs
    and it keeps no tensor that needs a gradient (a residual sum, reshapes, RoPE's products with cos and
    sin: what they keep is not computed from it). Checked once more by running the pass with those
    products valueless: the gradients must be equal, bit for bit, or none is taken (a simulated step on
    fake tensors, which have no values, takes what the graph shows). Subclasses of
    ``nn.Linear`` (quantized ones) are never taken."""
    names = {id(module): name for name, module in layer.named_modules() if type(module) is nn.Linear}
    outputs: list = []

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        if id(module) in names and isinstance(output, torch.Tensor):
            outputs.append((names[id(module)], output))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    kept_here = torch.autograd.graph.saved_tensors_hooks(_itself, _itself)  # not offloaded, not seen
    try:
        with torch.enable_grad(), kept_here:
            targets, _ = run()
    finally:
        handle.remove()
    taken = _unread_outputs(targets, outputs)
    del targets
    outputs.clear()
    if not taken:
        return frozenset()

    def gradients(valueless: frozenset) -> tuple:
        with torch.enable_grad(), kept_here, _valueless(layer, valueless):
            targets, inputs = run()
            grads = [_probe_gradient(t) for t in targets]
            return torch.autograd.grad(targets, inputs, grads, allow_unused=True)

    pairs = list(zip(gradients(frozenset()), gradients(taken), strict=True))
    if any(is_fake(a) for a, _ in pairs if a is not None):
        return taken  # a simulated step (fake tensors: no values to compare) takes what the graph shows
    same = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)) for a, b in pairs
    )
    return taken if same else frozenset()


def _probe_gradient(tensor: torch.Tensor) -> torch.Tensor:
    """A fixed, uneven incoming gradient for ``tensor`` (no random state drawn)."""
    steps = torch.arange(tensor.numel(), device=tensor.device, dtype=torch.float32)
    return steps.mul(0.7).sin().reshape(tensor.shape).to(tensor.dtype)


def _unread_outputs(targets: list[torch.Tensor], outputs: list[tuple[str, torch.Tensor]]) -> frozenset:
    """Of ``outputs`` (``(name, tensor)``), the names none of whose tensors a backward of ``targets`` reads:
    reached from them only through nodes that keep no tensor needing a gradient."""
    nodes: set = set()
    reading: list = []
    stack = [t.grad_fn for t in targets if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in nodes:
            continue
        nodes.add(node)
        if _reads_values(node):
            reading.append(node)
        stack.extend(child for child, _ in node.next_functions)
    below: set = set()  # nodes a value-reading node's gradient flows to
    stack = [child for node in reading for child, _ in node.next_functions]
    while stack:
        node = stack.pop()
        if node is None or node in below:
            continue
        below.add(node)
        stack.extend(child for child, _ in node.next_functions)
    read = {name for name, t in outputs if t.grad_fn not in nodes or t.grad_fn in below}
    return frozenset(name for name, _ in outputs if name not in read)


def _reads_values(node: Any) -> bool:
    """Whether an autograd node keeps a tensor that needs a gradient (a value its backward reads that was
    computed in the pass); one it cannot show counts as one."""
    saved: list = []
    try:
        for attribute in dir(node):
            if attribute.startswith("_saved_"):
                value = getattr(node, attribute)
                saved.extend(value if isinstance(value, tuple | list) else [value])
        if hasattr(node, "saved_tensors"):  # an autograd Function's
            saved.extend(node.saved_tensors)
    except RuntimeError:
        return True
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in saved)


@contextlib.contextmanager
def _replaced(module: nn.Module | None, forward: Callable) -> Iterator[None]:
    """Within the block, ``module`` (if any) runs ``forward`` instead of its own."""
    if module is None:
        yield
        return
    own = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _itself(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Unread:
    """A child's output that the layer reads only on the way to the attention call: not kept between the
    passes; the second pass gets zeros of its shape (what they become is handed back by the call)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = out.shape, out.dtype, out.device

    def make(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def first_token(self, tile: tuple) -> _Unread:
        """The same for a tile's first token (``tile``: the tile's ``(batch, tokens)``)."""
        one = _Unread.__new__(_Unread)
        one.dtype, one.device = self.dtype, self.device
        one.shape = (self.shape[0], 1, *self.shape[2:]) if tuple(self.shape[:2]) == tile else self.shape
        return one


def _reached_leaves(outputs: list[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors that ``outputs``' autograd graph reaches."""
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set = set()
    reached: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return reached


def _trained(layer: nn.Module, *modules: nn.Module) -> list[torch.Tensor]:
    """The trained parameters of ``modules`` (base weights, or LoRA's adapters on a frozen base)."""
    trained = [param for module in modules for param in module.parameters() if param.requires_grad]
    if any(getattr(param, "ds_numel", 0) and not param.numel() for param in trained):
        raise ModelError(
            f"training.sequence_tiling: the {type(layer).__name__}'s parameters are partitioned by "
            "ZeRO-3 inside it; tile the layers (longalign.patch.tile_layers) before DeepSpeed starts, so it "
            "gathers them for the whole layer"
        )
    return list(dict.fromkeys(trained))


def _set_rng(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device).set_rng_state(state[1], device)


@contextlib.contextmanager
def _recompute(device: torch.device, autocast: tuple[bool, torch.dtype], forked: bool) -> Iterator[None]:
    """Run a recompute as the forward ran (same autocast); the random state is restored afterwards."""
    enabled, dtype = autocast
    devices = [] if device.type == "cpu" else [device]
    with (
        torch.random.fork_rng(devices=devices, enabled=forked, device_type=device.type),
        torch.autocast(device.type, dtype=dtype, enabled=enabled),
    ):
        yield


def _drawing(call: _LayerCall, device: torch.device, key: tuple, replay: bool) -> None:
    """Keep (forward) or set again (recompute) the random state a pass of a tile starts from."""
    if call.states is None:
        return
    if replay:
        _set_rng(device, call.states[key])
    else:
        call.states[key] = _rng_state(device)


def _sum_into(sums: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> None:
    for i, grad in enumerate(grads):
        if grad is not None:
            # Summed in at least float32: bfloat16 partial sums would round once per tile.
            grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
            sums[i] = grad if sums[i] is None else sums[i].add_(grad)


def _buffer(like: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """An empty tensor shaped as ``like`` with ``length`` along ``dim``."""
    shape = list(like.shape)
    shape[dim] = length
    return like.new_empty(shape)


def _first_pass(
    call: _LayerCall, x: torch.Tensor, replay: bool
) -> tuple[list[torch.Tensor], dict[int, list]]:
    """Every tile of ``x`` up to the attention call, without gradients: the whole q, k, v, and each tile's
    children's outputs, as ``(child, output)``.

    The outputs the layer reads after the call (:meth:`_LayerCall.read_after_call`) are written into one
    tensor over all tokens and handed out as its tiles: memory is that whole tensor, whichever tiles run
    (the memory simulation runs only the distinct ones). The others are not kept (:class:`_Unread`).
    """
    qkv: list[torch.Tensor] = []
    wholes: list[torch.Tensor | None] = []
    cached: dict[int, list] = {}
    with torch.no_grad():
        for index, start, stop in _tiles(call.length, call.count):
            _drawing(call, x.device, ("before", index), replay)
            tile_qkv, children = call.before(x[:, start:stop], start, stop)
            if not qkv:
                if getattr(call.layer, "tiling_read_children", None) is None:
                    call.layer.tiling_read_children = call.read_after_call(
                        x[:, start:stop], start, stop, children, tile_qkv
                    )
                read = call.layer.tiling_read_children
                names = {id(child): name for name, child in call.attention["module"].named_children()}
                qkv = [_buffer(t, call.input_dim, call.length) for t in tile_qkv]
                wholes = [
                    _buffer(out, 1, call.length)
                    if names[id(module)] in read and tuple(out.shape[:2]) == (call.batch, stop - start)
                    else None
                    for module, out in children
                ]
                kept = [names[id(module)] in read for module, _ in children]
            for whole, tile in zip(qkv, tile_qkv, strict=True):
                whole.narrow(call.input_dim, start, stop - start).copy_(tile)
            cached[index] = []
            for (module, out), whole, keep in zip(children, wholes, kept, strict=True):
                if whole is not None:
                    whole[:, start:stop] = out
                    out = whole[:, start:stop]
                elif not keep:
                    out = _Unread(out)
                cached[index].append((module, out))
    return qkv, cached


class _TiledLayer(torch.autograd.Function):
    """A decoder layer over ``x [B, T, H]``: its own forward tile by tile around one attention call on the
    whole sequence; keeps ``x`` alone, and backward recomputes each part once.

    Outputs the layer's output and the outputs the model records inside it (router logits), each joined
    over the tiles in token order.
    """

    @staticmethod
    def forward(ctx, call: _LayerCall, x: torch.Tensor, *tensors: torch.Tensor):
        ctx.call, ctx.params = call, tensors[len(call.graded) :]
        ctx.autocast = _autocast_state(x.device.type)
        qkv, cached = _first_pass(call, x, replay=False)
        _drawing(call, x.device, ("kernel",), False)
        kept: list = []
        with attention.keeping_attention("record", kept) if call.keep else contextlib.nullcontext():
            attended = call.kernel(*qkv)
        del qkv
        # The input alone, or with each attention call's output and log-sum-exps (keep_attention).
        ctx.kept_lses = [len(lses) for _, lses in kept]
        ctx.save_for_backward(x, *(t for out, lses in kept for t in (out, *lses)))
        del kept
        out = x.new_empty(x.shape)
        recorded: list[torch.Tensor] = []
        for index, start, stop in _tiles(call.length, call.count):
            _drawing(call, x.device, ("after", index), False)
            y, tile_recorded = call.after(
                x[:, start:stop], start, stop, cached.pop(index), attended[:, start:stop]
            )
            if y.dtype != out.dtype:
                out = out.to(y.dtype)
            out[:, start:stop] = y
            if not recorded:
                call.layouts = [call.layout(t, stop - start) for t in tile_recorded]
                recorded = [
                    _buffer(
                        t,
                        1 if layout == "batch" else 0,
                        call.length * (1 if layout == "batch" else call.batch),
                    )
                    for t, layout in zip(tile_recorded, call.layouts, strict=True)
                ]
            for whole, tile, layout in zip(recorded, tile_recorded, call.layouts, strict=True):
                call.write(whole, layout, start, stop, tile)
        ctx.mark_non_differentiable(*(t for t in recorded if not t.is_floating_point()))
        return (out, *recorded)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *grad_recorded: torch.Tensor | None):
        call, params = ctx.call, ctx.params
        x, *flat = ctx.saved_tensors
        kept, flat = [], iter(flat)
        for count in ctx.kept_lses:
            kept.append((next(flat), [next(flat) for _ in range(count)]))
        wants_x = ctx.needs_input_grad[1]
        graded = len(call.graded)
        wanted = ctx.needs_input_grad[2 + graded :]
        trained = [param for param, want in zip(params, wanted, strict=True) if want]
        sums: list[torch.Tensor | None] = [None] * len(trained)
        # The hidden states' gradient and the other per-token inputs', each tile written by the second pass
        # and added to by the first. The hidden states' is written over the incoming gradient, whose tile
        # the second pass has read just before (see _reusable).
        grad_x = (grad_out if _reusable(grad_out, x) else torch.empty_like(x)) if wants_x else None
        grad_inputs = [grad_x, *(torch.zeros_like(g) for g in call.graded)]
        device = x.device

        def tile_leaves(x: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
            """This tile's leaves of the per-token inputs (the hidden states first), for the layer's passes."""
            leaves = [x[:, start:stop].detach().requires_grad_(wants_x)]
            for whole in call.graded:
                dim = call.token_dim(whole)
                leaves.append(whole.narrow(dim, start, stop - start).detach().requires_grad_())
            call.leaves = {id(whole): leaf for whole, leaf in zip(call.graded, leaves[1:], strict=True)}
            return leaves

        def add_inputs(grads: list, start: int, stop: int, first: bool) -> None:
            for index, (grad_in, grad) in enumerate(zip(grad_inputs, grads, strict=True)):
                if grad_in is None:
                    continue
                dim = 1 if index == 0 else call.token_dim(call.graded[index - 1])
                tile = grad_in.narrow(dim, start, stop - start)
                if first and index == 0:
                    tile.copy_(grad) if grad is not None else tile.zero_()
                elif grad is not None:
                    tile.add_(grad)

        def differentiated(leaves: list) -> list[torch.Tensor]:
            return [leaf for leaf, grad_in in zip(leaves, grad_inputs, strict=True) if grad_in is not None]

        with _recompute(device, ctx.autocast, call.states is not None):
            # 1. q, k, v again, and the children's outputs the layer reads after the call.
            qkv, cached = _first_pass(call, x, replay=True)
            _drawing(call, device, ("kernel",), True)
            # The attention call's inputs and output are held by what the call keeps for its backward, not
            # here: under sequence parallelism the tensors on either side of the Ulysses exchange are freed
            # as soon as it has run (see _Handed and _Root).
            caught: list[torch.Tensor | None] = []
            anchor = torch.zeros((), device=device, requires_grad=True)
            replayed = attention.keeping_attention("replay", kept) if call.keep else contextlib.nullcontext()
            with torch.enable_grad(), replayed:  # kept: the attention's forward is handed back what it kept
                attended = call.kernel(*_Handed.apply(caught, anchor, *qkv))
                held = [torch.zeros_like(attended)]
                root = _Root.apply(held, attended)
            del qkv, kept
            # 2. Each tile after the call: the gradients of its inputs, the attention output, the read
            #    children's outputs and the parameters.
            grad_attended = held[0]
            grad_cached: dict[int, list] = {}
            for index, start, stop in _tiles(call.length, call.count):
                leaves = tile_leaves(x, start, stop)
                attended_tile = attended[:, start:stop].detach().requires_grad_()
                handed = [
                    (module, out if isinstance(out, _Unread) else out.detach().requires_grad_())
                    for module, out in cached.pop(index)
                ]
                read = [out for _, out in handed if not isinstance(out, _Unread)]
                if call.valueless_after is None:
                    call.find_valueless_after(leaves, handed, attended_tile, trained, start)
                    leaves = tile_leaves(x, start, stop)
                _drawing(call, device, ("after", index), True)
                with torch.enable_grad(), _valueless(call.layer, call.valueless_after):
                    y, tile_recorded = call.after(leaves[0], start, stop, handed, attended_tile)
                pairs = [(y, grad_out[:, start:stop])] + [
                    (t, call.part(g, layout, start, stop))
                    for t, g, layout in zip(tile_recorded, grad_recorded, call.layouts, strict=True)
                    if g is not None and t.requires_grad
                ]
                inputs = [attended_tile, *read, *differentiated(leaves), *trained]
                grads = torch.autograd.grad(
                    [t for t, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
                )
                del pairs, y, tile_recorded
                grad_attended[:, start:stop] = 0 if grads[0] is None else grads[0]
                by_read = iter(grads[1 : 1 + len(read)])
                grad_cached[index] = [
                    None if isinstance(out, _Unread) else next(by_read) for _, out in handed
                ]
                rest = _spread(grads[1 + len(read) :], grad_inputs)
                add_inputs(rest[0], start, stop, first=True)
                _sum_into(sums, rest[1])
            del leaves, handed, read, cached, inputs, attended_tile  # views of x among them
            # 3. The attention call's backward: q, k, v (and a sink's or other parameter's the kernel reads).
            #    The layer's input is let go meanwhile: offloaded, it comes back from host memory for step 4.
            x = None
            del attended, grad_attended
            grads = torch.autograd.grad(root, [anchor, *trained], allow_unused=True)
            grad_qkv = caught
            _sum_into(sums, list(grads[1:]))
            del root, grads
            x = ctx.saved_tensors[0]  # (with keep_attention the kept ones come back too, and go at once)
            # 4. Each tile before the call again, with gradients, into its inputs and the parameters.
            for index, start, stop in _tiles(call.length, call.count):
                leaves = tile_leaves(x, start, stop)
                if call.valueless_before is None:
                    call.find_valueless_before(leaves, trained, start)
                    leaves = tile_leaves(x, start, stop)
                _drawing(call, device, ("before", index), True)
                with torch.enable_grad(), _valueless(call.layer, call.valueless_before):
                    tile_qkv, children = call.before(leaves[0], start, stop)
                pairs = [
                    (t, g.narrow(call.input_dim, start, stop - start))
                    for t, g in zip(tile_qkv, grad_qkv, strict=True)
                    if g is not None
                ]
                pairs += [
                    (out, g)
                    for (_, out), g in zip(children, grad_cached.pop(index), strict=True)
                    if g is not None
                ]
                pairs = [(t, g) for t, g in pairs if t.requires_grad]
                if not pairs:
                    continue
                inputs = [*differentiated(leaves), *trained]
                grads = torch.autograd.grad(
                    [t for t, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
                )
                rest = _spread(grads, grad_inputs)
                add_inputs(rest[0], start, stop, first=False)
                _sum_into(sums, rest[1])
            call.leaves = {}
        by_param = iter(sums)
        param_grads = [
            _cast(next(by_param), p.dtype) if w else None for p, w in zip(params, wanted, strict=True)
        ]
        wanted_graded = ctx.needs_input_grad[2 : 2 + graded]
        graded_grads = [g if w else None for g, w in zip(grad_inputs[1:], wanted_graded, strict=True)]
        return None, grad_inputs[0], *graded_grads, *param_grads


class _Handed(torch.autograd.Function):
    """q, k, v as they are (views), whose gradients backward hands to ``caught``: it keeps nothing, so the
    tensors live only as long as what consumes them keeps them (the kernel's own backward does; the Ulysses
    exchange does not). ``anchor``, a scalar leaf, puts the node on the graph's way to the inputs asked for."""

    @staticmethod
    def forward(ctx, caught: list, anchor: torch.Tensor, *tensors: torch.Tensor):
        ctx.caught = caught
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.caught.extend(grads)
        return (
            None,
            torch.zeros((), device=next(g for g in grads if g is not None).device),
            *(None,) * len(grads),
        )


class _Root(torch.autograd.Function):
    """A scalar whose backward hands ``held[0]`` (filled meanwhile, then let go) to its input as its
    gradient: the attention output's backward starts here, so the output itself need not be held for it."""

    @staticmethod
    def forward(ctx, held: list, x: torch.Tensor) -> torch.Tensor:
        ctx.held = held
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, ctx.held.pop()


def _reusable(grad_out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the layer's incoming gradient can hold its input's gradient: a plain tensor of the input's
    shape and dtype (not an expanded one, as ``out.sum().backward()`` hands in). Its tile ``i`` is read once,
    by tile ``i``'s second pass, and then holds the input's gradient for that tile: one ``[T, H]`` tensor
    fewer at the attention's backward, the layer's peak."""
    return (
        grad_out.shape == x.shape
        and grad_out.dtype == x.dtype
        and grad_out.is_contiguous()
        and not grad_out.requires_grad
    )


def _spread(grads: tuple, grad_inputs: list) -> tuple[list, list]:
    """``grads`` of (the differentiated inputs, then the parameters) -> (one per input, None where not
    differentiated; the parameters')."""
    by_grad = iter(grads)
    per_input = [next(by_grad) if grad_in is not None else None for grad_in in grad_inputs]
    return per_input, list(by_grad)


class _TiledNorm(torch.autograd.Function):
    """A norm over ``x [B, T, H]`` tile by tile; backward recomputes each tile."""

    @staticmethod
    def forward(ctx, norm: nn.Module, count: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.norm, ctx.count, ctx.params = norm, count, params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        out = None
        for _, start, stop in _tiles(x.shape[1], count):
            y = type(norm).forward(norm, x[:, start:stop])
            if out is None:
                out = _buffer(y, 1, x.shape[1])
            out[:, start:stop] = y
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        wants_x, wanted = ctx.needs_input_grad[2], ctx.needs_input_grad[3:]
        trained = [param for param, want in zip(ctx.params, wanted, strict=True) if want]
        grad_x = torch.empty_like(x) if wants_x else None
        sums: list[torch.Tensor | None] = [None] * len(trained)
        with _recompute(x.device, ctx.autocast, False):
            for _, start, stop in _tiles(x.shape[1], ctx.count):
                tile = x[:, start:stop].detach().requires_grad_(wants_x)
                with torch.enable_grad():
                    y = type(ctx.norm).forward(ctx.norm, tile)
                inputs = [*([tile] if wants_x else []), *trained]
                grads = torch.autograd.grad(y, inputs, grad_out[:, start:stop], allow_unused=True)
                if wants_x:
                    grad_x[:, start:stop] = grads[0]
                _sum_into(sums, list(grads[1:] if wants_x else grads))
        by_param = iter(sums)
        params = [
            _cast(next(by_param), p.dtype) if w else None for p, w in zip(ctx.params, wanted, strict=True)
        ]
        return None, None, grad_x, *params
