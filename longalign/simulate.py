"""``longalign probe --simulate``: the run's own training step, counted at any length on a CPU, nothing computed.

The model is built from its config alone (``longalign.run.load_model`` on ``init_from_config``: every patch
the run applies, tiled MLP or layer, offloaded inputs, sequence parallelism, with ``[lora]``'s adapters on
top) under torch's ``FakeTensorMode``: every tensor has its shape, dtype and storage size but no data, so
an operation costs the same few microseconds at 1M tokens as at 1k. One optimizer step runs on a synthetic
pack of each length (``probe.synthetic_pack``, collated by the trainer's own ``PackCollator``): the loss
of ``longalign.loss``, backward, gradient clipping, the optimizer's step, as the trainer runs them. Every
allocation is counted by ``tensor_memory.LiveTensors``, the counter the CPU probe counts its real steps
with, so that the two are one measurement::

    length 1m, Llama-3.1-8B, one 80 GB GPU                  counted               from the run's settings
    weights, gradients, optimizer states (ZeRO, offload)    -                     probe.model_states
    activations: what the step holds above them             the fake step         -
    pinned host memory of the offloaded layer inputs        the fake step         x GPUs per node

What cannot run on fake tensors stands in, as small as it can be:

- the GPU attention kernel: a stand-in that allocates what the kernel allocates, read from its source
  (:data:`KERNELS`); ``sdpa_segments`` runs itself;
- the few operations that read values (the loss's ``nonzero`` over its targets, the optimizer's step
  count): they run on real copies of the batch's index tensors (:class:`_Values`);
- the process group of sequence parallelism: torch's fake backend (``FakeStore``), so DeepSpeed's
  Ulysses layer allocates its all-to-all buffers as on rank 0 of a real group;
- the engines: DeepSpeed ZeRO and FSDP are not run. Their weights, gradients and optimizer states per GPU
  are ``probe.model_states`` (as ``--plan`` splits them), and their working set is estimated
  (:func:`engine_buffers`).

Why not torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which counts the same storages
with the same categories (parameters, gradients, optimizer states, activations): what was measured is
that this counter, shared with the CPU probe, gives the probe's counted peak of real steps exactly
(``tests/test_simulate.py``), so simulated and measured are one count; MemTracker also attributes every
operation to the modules running (hooks on every module, a snapshot copied at each new peak), which the
simulation does not need, and was not timed against it.

A model of L > 2 decoder layers is counted with 1 and with 2 of them and each part extrapolated to L
(``parts(L) = parts(2) + (L - 2) x (parts(2) - parts(1))``): the layers are identical, so the second layer
adds exactly what each further one adds (its weights, gradients, optimizer states, and the input
checkpointing keeps of it), while the peak stays in the last layer's backward and the loss; measured
equal, part by part, to counting all 8 layers of an 8-layer model (checkpointing alone, tiled MLP, +
offload). Where the first F layers are built unlike the rest (the dense layers before the experts of
GLM-4.5 and DeepSeek-V3, ``first_k_dense_replace``), it is counted with F + 1 and F + 2 layers instead,
so that the layer the line adds is one of the rest; equal, part by part, to counting every layer of a
4-layer model of GLM-4.5's shape (``tests/test_simulate.py``). ``full_depth=True`` counts every layer.

The same step counts its FLOPs as it runs (``flops.StepFlops``): matrix products by torch's
``FlopCounterMode``, attention by the FlashAttention stand-in from each call's shapes and samples; the
layers are extrapolated as the bytes are, and with a GPU (``Setup.throughput``) they become the step's
seconds and the run's GPU-hours (:func:`timed`).

A tiled MLP or layer runs only the tiles that can reach a new peak (``tiled_mlp.distinct_tiles_only``: the
first two of each loop and the first of each further tile size), which count what all of them count
(equal in bytes, ``tests/test_simulate.py``; ``every_tile=True`` runs them all). Llama-3.1-8B at 1M tokens
with the tiled layer (256 tiles a loop) simulates in 24 s on two shared cores, 220 s with every tile; with
the tiled MLP in 28 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from longalign.errors import ConfigError
from longalign.flops import (
    BACKWARD_PER_FORWARD,
    GPU_PEAK_FLOPS,
    RunTokens,
    StepFlops,
    Throughput,
    attention_flops,
    causal_pairs,
    format_amount,
    format_flops,
    format_tokens,
    model_flops,
    run_gpu_hours,
    run_tokens,
)
from longalign.probe import Sharding, format_bytes, format_length, model_states, synthetic_pack
from longalign.tensor_memory import PARTS, CopiesToHost, LiveTensors

# Kernels with a stand-in, and what each allocates beyond q, k, v and their gradients (T tokens, B samples,
# Hq query and Hkv key/value heads of size D):
KERNELS = {
    # flash-attn 2.8.3, csrc/flash_attn/flash_api.cpp: mha_varlen_fwd keeps out [T, Hq, D] and softmax_lse
    # float32 [Hq, T]; mha_varlen_bwd allocates softmax_d float32 [Hq, T + 128 B], dq_accum float32
    # [T + 128 B, Hq, D rounded up to 32], and for grouped-query attention dk/dv expanded to all query heads
    # [T, Hq, D] (summed into dk/dv at the end); its Python layer (flash_attn_interface.py) saves q, k, v,
    # out and softmax_lse for backward and allocates dq, dk, dv.
    "flash_attn_2": "FlashAttention 2 (flash_attn_varlen_func)",
    # hopper/flash_api.cpp: mha_fwd as FA2 (out, softmax_lse float32 [Hq, T]); mha_bwd allocates softmax_d
    # and softmax_lse_log2 float32 [Hq, Tp], dq_accum float32 [Hq, Tp x Dr], and for grouped-query
    # attention dk_accum/dv_accum float32 [Hkv, Tkp, Dr], Tp = T + B kBlockM rounded up to kBlockM.
    "flash_attn_3": "FlashAttention 3 (flash_attn_interface, Hopper)",
    # torch/nn/attention/varlen.py over aten::_flash_attention_forward/_backward, PyTorch's copy of FA2's
    # mha_varlen_fwd/_bwd: the same buffers as flash_attn_2; the Python layer saves q, k, v, out, lse.
    "torch_varlen": "PyTorch varlen_attn (aten::_flash_attention_*)",
    # longalign's own per-sample scaled_dot_product_attention: runs as it is, on fake tensors.
    "sdpa_segments": "sdpa_segments (scaled_dot_product_attention per sample)",
}
GPUS_PER_NODE = 8


class SimulationError(ConfigError):
    """What cannot be simulated, in one line naming it (a config that does not build, a kernel without a
    stand-in, an operation that reads values no stand-in provides)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the simulation runs, besides the run file: the GPUs and their memory, the kernel, the engine."""

    gpus: int = 1
    gpu_memory: int | None = None
    host_memory: int | None = None  # per node
    gpus_per_node: int = GPUS_PER_NODE
    kernel: str | None = None  # None: the one the run's attn_backend picks on a GPU (kernel_for)
    how: Sharding = Sharding(zero_stage=None, fsdp=False, offloaded=frozenset(), optimizer="adamw_torch")
    deepspeed: Mapping[str, Any] | None = None  # the DeepSpeed JSON, for its bucket sizes
    seed: int = 0
    full_depth: bool = False  # count every layer instead of extrapolating from counted_layers
    every_tile: bool = False  # run every tile of a tiled MLP or layer, not the distinct ones alone
    counted_layers: int = 2  # a deeper model is counted with this many of its repeated layers and one fewer
    sample_tokens: int | None = None  # packs of samples this long (the last one cut), not a synthetic mix
    throughput: Throughput | None = None  # the GPU and efficiency the step's time is for
    run_tokens: RunTokens | None = None  # the whole run's tokens, for its GPU-hours


def kernel_for(cfg, kernel: str | None = None) -> str:
    """The attention kernel the simulated step stands in for: ``kernel`` if given, else the one the run's
    ``model.attn_backend`` runs on a GPU (``auto``: FlashAttention 2; on a CPU run: ``sdpa_segments``)."""
    if kernel is not None:
        if kernel not in KERNELS:
            raise SimulationError(f"--kernel {kernel}: no stand-in; these have one: {', '.join(KERNELS)}")
        return kernel
    backend = cfg.model.attn_backend
    if backend == "sdpa_segments" or (backend == "auto" and cfg.training.args.get("use_cpu")):
        return "sdpa_segments"
    if backend in ("auto", "flash_attn"):
        return "flash_attn_2"
    if backend == "torch_varlen":
        return "torch_varlen"
    raise SimulationError(
        f"model.attn_backend = {backend!r}: FlashAttention 4 (flash_attn.cute) has no stand-in, its buffers "
        "are not read from its source yet; --kernel flash_attn_3 simulates the Hopper kernel before it"
    )


# --- values that the step reads ---------------------------------------------------------------------------

_READS = {torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default}
_LARGEST_VALUE = 1 << 27  # elements; index tensors of a 100M-token pack, never activations


class _Values(LiveTensors):
    """The counter of the simulated step (:class:`~longalign.tensor_memory.LiveTensors`), keeping real values
    next to the fake tensors that the step reads: the batch's index tensors (labels, loss weights,
    positions, ``cu_seqlens``), what is computed from them alone, and scalars.

    An operation whose tensor inputs all have values runs on the values too; ``nonzero`` and ``item`` of a
    fake tensor are answered from its value. Weights and activations never get one. One dispatch mode for
    both, so that every operation pays for one Python layer, not two.
    """

    def __init__(self, fake_mode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.values = torch.utils.weak.WeakTensorKeyDictionary()

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        if tensor in self.values:
            return self.values[tensor]
        return getattr(tensor, "constant", None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = list(_tensors((args, kwargs)))
        known = all(self.value(t) is not None for t in tensors)
        if func in _READS:
            if not known:
                raise SimulationError(
                    f"the step reads the values of a tensor ({func.overloadpacket.__name__}) that no stand-in provides"
                )
            real = self._run_on_values(func, args, kwargs)
            if not isinstance(real, torch.Tensor):
                return real
            out = self.fake_mode.from_tensor(real)
            self.values[out] = real
            self._account(out.untyped_storage(), "activations")
            return out
        out = func(*args, **kwargs)
        outputs = list(_tensors(out))
        self.account_outputs(outputs, (args, kwargs))
        if known and outputs and all(o.numel() <= _LARGEST_VALUE for o in outputs):
            if tensors or all(not o.is_floating_point() or o.numel() <= 4096 for o in outputs):
                real = self._run_on_values(func, args, kwargs)
                for fake, value in zip(outputs, _tensors(real), strict=False):
                    self.values[fake] = value
        elif not known:  # a tensor written from unknown values no longer has its value
            for argument, leaf in zip(func._schema.arguments, args, strict=False):
                if isinstance(leaf, torch.Tensor) and argument.alias_info and argument.alias_info.is_write:
                    self.values.pop(leaf, None)
        return out

    def _run_on_values(self, func, args, kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        real = [self.value(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        real_args, real_kwargs = tree_unflatten(real, spec)
        with torch._C._DisableTorchDispatch():
            return func(*real_args, **real_kwargs)


def _tensors(tree) -> Iterator[torch.Tensor]:
    """The tensors of an operation's arguments or results (tuples, lists and dicts of them), in order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


# --- the attention kernels' stand-ins ---------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _kernel_buffers(kernel: str, q: torch.Tensor, k: torch.Tensor, samples: int) -> list[torch.Tensor]:
    """The buffers the kernel's backward allocates for itself (see :data:`KERNELS`), on q's device."""
    tokens, heads, dim = q.shape
    kv_tokens, kv_heads = k.shape[0], k.shape[1]
    f32 = {"dtype": torch.float32, "device": q.device}
    if kernel in ("flash_attn_2", "torch_varlen"):
        padded = tokens + 128 * samples
        buffers = [
            torch.empty((heads, padded), **f32),  # softmax_d
            torch.empty((padded, heads, _round_up(dim, 32 if dim <= 128 else 64)), **f32),  # dq_accum
        ]
        if kv_heads != heads:  # dk, dv expanded to every query head, summed into dk, dv at the end
            buffers += [q.new_empty((kv_tokens, heads, dim)), q.new_empty((kv_tokens, heads, dim))]
        return buffers
    # FlashAttention 3 on sm90, causal: kBlockM 64 for head sizes 65-256 (128 up to 64), kBlockN 128 up to
    # head size 128, then 96 and 80; the head size rounded up to 64, 96, 128, 192 or 256.
    rounded = next(size for size in (64, 96, 128, 192, 256) if dim <= size)
    block_m, block_n = (
        (128 if rounded <= 64 else 64),
        (128 if rounded <= 128 else 96 if rounded <= 192 else 80),
    )
    padded = _round_up(tokens + samples * block_m, block_m)
    buffers = [
        torch.empty((heads, padded), **f32),  # softmax_d
        torch.empty((heads, padded), **f32),  # softmax_lse_log2
        torch.empty((heads, padded * rounded), **f32),  # dq_accum
    ]
    if kv_heads != heads:
        kv_padded = _round_up(kv_tokens + samples * block_n, block_n)
        buffers += [torch.zeros((kv_heads, kv_padded, rounded), **f32) for _ in range(2)]  # dk/dv_accum
    return buffers


class _FlashKernel(torch.autograd.Function):
    """A FlashAttention-style varlen kernel that allocates what the kernel does and computes nothing; with
    ``flops``, it adds its forward's FLOPs (``forward_flops``) to them, and its backward's as it runs."""

    @staticmethod
    def forward(
        ctx, q, k, v, kernel: str, samples: int, flops: StepFlops | None = None, forward_flops: int = 0
    ):
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        ctx.kernel, ctx.samples, ctx.flops, ctx.forward_flops = kernel, samples, flops, forward_flops
        ctx.save_for_backward(q, k, v, out, lse)
        if flops is not None:
            flops.add_attention(forward_flops)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        buffers = _kernel_buffers(ctx.kernel, q, k, ctx.samples)
        del buffers  # freed as the kernel returns
        if ctx.flops is not None:
            ctx.flops.add_attention(int(BACKWARD_PER_FORWARD * ctx.forward_flops))
        return *grads, None, None, None, None


@contextlib.contextmanager
def kernel_stand_in(kernel: str, values: _Values, flops: StepFlops | None = None) -> Iterator[None]:
    """Within the block, ``longalign.attention.varlen_attention`` runs ``kernel``'s stand-in, whatever backend
    the tensors' device would pick; everything else of ``varlen_attention`` runs as it is. A FlashAttention
    stand-in adds the FLOPs of each call to ``flops`` (:func:`~longalign.flops.attention_flops` of the
    samples of its ``cu_seqlens``; ``sdpa_segments`` runs itself, and is not counted)."""
    from longalign import attention

    def run(q, k, v, cu_seqlens, max_seqlen, causal, scale, dropout, window, sinks=None):
        # Attention sinks (gpt-oss: one logit per head in the softmax's denominator) run on a GPU in
        # FlashAttention 4 (flash_attn_cute), which has no stand-in of its own: a FlashAttention stand-in
        # allocates its named kernel's buffers for them, and the sinks' gradient (one float per head) is
        # not counted. sdpa_segments writes each sample's attention out with sinks, as it runs.
        bounds = values.value(cu_seqlens)
        if kernel == "sdpa_segments":
            if bounds is None:
                raise SimulationError("sdpa_segments: the sample boundaries of the pack are not known")
            return attention._sdpa_segments(
                q, k, v, bounds, max_seqlen, causal, scale, dropout, window, sinks=sinks
            )
        return _FlashKernel.apply(
            q, k, v, kernel, cu_seqlens.numel() - 1, flops, forward_flops(q, v, cu_seqlens, causal, window)
        )

    def forward_flops(q, v, cu_seqlens, causal, window) -> int:
        if flops is None:
            return 0
        bounds = values.value(cu_seqlens)
        if bounds is None:
            raise SimulationError(f"{kernel}: the sample boundaries of the pack are not known, nor its FLOPs")
        with torch._C._DisableTorchDispatch():  # a real tensor: read as it is, not through the modes
            seq_lens = bounds.diff().tolist()
        return attention_flops(
            seq_lens, heads=q.shape[1], qk_dim=q.shape[2], v_dim=v.shape[2], window=window, causal=causal
        )

    # One key/value head at a time (per_kv_head), as the kernels' own forward and backward run it: each group's
    # forward keeps its output and log-sum-exp, its backward allocates the group's gradients and buffers.
    def kept_forward(q, k, v, sinks, call):
        out = q.new_empty((*q.shape[:2], v.shape[2]))
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        if flops is not None:
            flops.add_attention(forward_flops(q, v, call.cu_seqlens, call.causal, call.window))
        return out, lse

    def kept_backward(dout, q, k, v, out, lse, sinks, call):
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        buffers = _kernel_buffers(kernel, q, k, call.cu_seqlens.numel() - 1)
        del buffers  # freed as the kernel returns
        if flops is not None:
            forward = forward_flops(q, v, call.cu_seqlens, call.causal, call.window)
            flops.add_attention(int(BACKWARD_PER_FORWARD * forward))
        return *grads, None

    def known(call):
        bounds = values.value(call.cu_seqlens)
        if bounds is None:
            raise SimulationError("sdpa_segments: the sample boundaries of the pack are not known")
        return call._replace(cu_seqlens=bounds)

    resolve, functions = attention.resolve_backend, dict(attention._BACKEND_FUNCTIONS)
    kept = dict(attention._KEPT_FUNCTIONS)
    attention.resolve_backend = lambda *args, **kwargs: "simulated"
    attention._BACKEND_FUNCTIONS["simulated"] = run
    if kernel == "sdpa_segments":  # its own forward and backward, on the pack's known sample boundaries
        own = kept["sdpa_segments"]
        attention._KEPT_FUNCTIONS["simulated"] = own._replace(
            forward=lambda *args: own.forward(*args[:4], known(args[4])),
            backward=lambda *args: own.backward(*args[:7], known(args[7])),
        )
    else:
        attention._KEPT_FUNCTIONS["simulated"] = attention._Kept(kept_forward, kept_backward)
    try:
        yield
    finally:
        attention.resolve_backend = resolve
        attention._BACKEND_FUNCTIONS.clear()
        attention._BACKEND_FUNCTIONS.update(functions)
        attention._KEPT_FUNCTIONS.clear()
        attention._KEPT_FUNCTIONS.update(kept)


# --- the model and the step -------------------------------------------------------------------------------


def simulated_config(cfg, layers: int | None = None):
    """``cfg`` building its model from the model's config alone (``init_from_config``, overrides applied),
    with ``layers`` decoder layers if given, and without the engine settings the simulation does not run.

    A multimodal model's text model stands in for it (:func:`text_model_note`): its text config (Gemma 3's
    ``text_config``, a ``gemma3_text`` model) builds the causal language model that a text-only fine-tune
    trains."""
    config, dtype = _read_config(cfg)
    text = config.get_text_config()
    settings = {
        key: value
        for key, value in text.to_dict().items()
        if key not in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype")
        and not key.startswith("_")
    }
    if layers is not None:  # each per-layer list (gpt-oss's and Gemma 3's layer_types) held to the count
        settings["num_hidden_layers"] = layers
        if isinstance(settings.get("layer_types"), list):
            settings["layer_types"] = settings["layer_types"][:layers]
    model = dataclasses.replace(cfg.model, config_overrides={}, torch_dtype=str(dtype).removeprefix("torch."))
    # Set after the dataclass's checks, which hold a user's init_from_config to its class's fields: these are
    # the checkpoint's own settings as transformers read them, keys its class does not declare included (the
    # head_dim of Qwen3-MoE and GLM-4.5, read with getattr; gpt-oss's experts_per_token), which the model
    # loads with.
    model.model_name_or_path, model.init_from_config = None, settings
    args = {k: v for k, v in cfg.training.args.items() if k not in ("deepspeed", "fsdp", "fsdp_config")}
    training = dataclasses.replace(cfg.training, args=args)
    return dataclasses.replace(cfg, model=model, training=training, eval_tasks=None)


def _read_config(cfg):
    """The model's transformers config and dtype, or the reason they cannot be read, in one line."""
    from longalign.run import model_config, model_dtype

    try:
        return model_config(cfg), model_dtype(cfg)
    except Exception as err:  # a Hub id not in the cache, a config transformers cannot read
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SimulationError(
            f"model {cfg.model.model_name_or_path}: its config cannot be read here ({first})"
        ) from None


def text_model_note(cfg) -> str | None:
    """What the simulation builds instead of a multimodal model, in one line; ``None`` for a text model."""
    config, _ = _read_config(cfg)
    text = config.get_text_config()
    if text is config:
        return None
    return (
        f"the {config.model_type} model is simulated as its text model: its text config as a "
        f"{text.model_type} model, what a text-only fine-tune trains; the weights outside it (a vision "
        "tower, its projector) are not counted"
    )


def _first_repeated_layer(config) -> int:
    """The first decoder layer from which every layer is built alike (the same modules, the same parameter
    shapes): 0 for most models, ``first_k_dense_replace`` for GLM-4.5 and DeepSeek-V3, whose first layers
    have a dense MLP where the rest have experts. Read off the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kinds = [
        (
            [(name, type(module).__name__) for name, module in layer.named_modules()],
            [(name, p.shape, p.dtype) for name, p in layer.named_parameters()],
        )
        for layer in _decoder_layers(model)
    ]
    first = len(kinds) - 1
    while first > 0 and kinds[first - 1] == kinds[-1]:
        first -= 1
    return first


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and any(
            isinstance(child, GradientCheckpointingLayer) for child in module
        ):
            return module
    raise SimulationError(f"{type(model).__name__}: no decoder layers found to simulate")


@dataclasses.dataclass
class Counted:
    """One simulated (or real) step, counted: device bytes by part at the peak, each part's own peak, host."""

    peak: int
    peak_parts: dict[str, int]
    part_peaks: dict[str, int]
    host: int
    seconds: float = 0.0
    flops: dict[str, int] | None = None  # executed: {"matmul": n, "attention": n}; None: not counted


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def build_model(cfg, *, layers: int | None, fake_mode):
    """The run's model (``load_model``, with ``[lora]``'s adapters) on fake tensors, checkpointing on as the
    trainer turns it on, and the ``TrainingArguments`` the run's steps use; ``(model, read_head, args)``."""
    from longalign.loss import linear_head
    from longalign.run import dry_run_arguments, load_model

    sim = simulated_config(cfg, layers)
    args, _ = dry_run_arguments(sim)
    if cfg.lora is not None and (cfg.lora.load_in_4bit or cfg.lora.load_in_8bit):
        raise SimulationError(
            "lora.load_in_4bit/load_in_8bit: bitsandbytes quantizes real weights as they load, which fake "
            "tensors do not have; simulate the run without them for an upper bound"
        )
    try:
        with fake_mode, _conversions_in_place():
            model = load_model(sim)
            read_head = linear_head
            if cfg.lora is not None:
                from longalign.lora import adapted_head, add_adapters

                model, read_head = add_adapters(model, cfg.lora, base_model="simulated"), adapted_head
    except SimulationError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        model_type = sim.model.init_from_config.get("model_type", "?")
        raise SimulationError(
            f"{model_type} model: cannot be built on fake tensors ({type(err).__name__}: {first[:200]})"
        ) from None
    if args.activation_checkpointing:  # as the Trainer turns it on when training starts
        kwargs = dict(args.activation_checkpointing_kwargs or {})
        every = kwargs.pop("every_n_layers", 1)
        kwargs.pop("offload", None)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=kwargs or None, every_n_layers=every, offload=False
        )
    return model, read_head, args


@contextlib.contextmanager
def _conversions_in_place() -> Iterator[None]:
    """``module.to(dtype)`` of fake parameters (peft moves its adapters to the base layer's dtype): torch
    swaps a fake parameter for the converted one, which the fake mode's own references to it forbid; the
    converted data is set into the parameter instead, as torch does for ordinary tensors."""
    swap = torch.utils.swap_tensors

    def set_data(old: torch.Tensor, new: torch.Tensor) -> None:
        old.data = new.data if isinstance(new, torch.nn.Parameter) else new

    torch.utils.swap_tensors = set_data
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


def _optimizer(model: torch.nn.Module, args):
    """The Trainer's optimizer for ``args``, over the same two parameter groups (decay, no decay)."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls([g for g in groups if g["params"]], **kwargs)


def _pack(length: int, vocab_size: int, window: int | None, setup: Setup) -> dict[str, list[int]]:
    """A synthetic pack of ``length`` tokens: ``synthetic_pack``'s mix of samples, or with
    ``setup.sample_tokens`` samples of that many tokens (the last one cut to fill the pack)."""
    pack = synthetic_pack(length, vocab_size=vocab_size, seed=setup.seed, longest=window)
    if setup.sample_tokens is None:
        return pack
    full, rest = divmod(length, setup.sample_tokens)
    seq_lens = [setup.sample_tokens] * full + ([rest] if rest else [])
    return {**pack, "seq_lens": seq_lens, "cu_seqlens": [0, *itertools.accumulate(seq_lens)]}


def _batch(cfg, pack: Mapping[str, list[int]]) -> dict[str, Any]:
    """Rank 0's batch of the trainer's collator on ``pack`` in every pack row."""
    from longalign.batching import PackCollator

    rows = cfg.training.args.get("per_device_train_batch_size", 1)
    collate = PackCollator(
        weighting=cfg.loss.weighting,
        longwriter_divisor=cfg.loss.longwriter_divisor,
        pad_packs_to=cfg.data.max_seq_len if cfg.packing.pad_to_max else None,
        sequence_parallel_size=cfg.training.sequence_parallel_size,
        sequence_parallel_rank=0,
    )
    return collate([pack] * rows)


def counted_step(
    model: torch.nn.Module,
    read_head,
    args,
    batch: Mapping[str, Any],
    *,
    chunk_size: int,
    kernel: str,
    fake_mode,
    every_tile: bool = False,
) -> Counted:
    """One optimizer step of the trainer on ``batch`` with the model's fake weights, counted.

    The optimizer's states are made first (a step on zero gradients), so that the counted step is the
    steady one, as the probe's second step is. A tiled MLP or layer runs only its distinct tiles
    (``tiled_mlp.distinct_tiles_only``: the same count), or with ``every_tile`` all of them.
    """
    import longalign.patch.offload as offload
    from longalign.loss import weighted_loss_sum
    from longalign.patch.tiled_mlp import distinct_tiles_only

    before = _Values(fake_mode)  # the optimizer's states and the batch, made before the counted step
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(model, args)
    with fake_mode, before:
        for param in trained:
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        inputs = {}
        for key, item in batch.items():
            if isinstance(item, torch.Tensor):
                inputs[key] = fake_mode.from_tensor(item)
                before.values[inputs[key]] = item
            else:
                inputs[key] = item
    live = values = _Values(fake_mode)
    values.values.update(before.values)
    hooks = offload.host_memory_hooks
    offload.host_memory_hooks = lambda: CopiesToHost(live)
    tiles = contextlib.nullcontext() if every_tile else distinct_tiles_only()
    flops = None if kernel == "sdpa_segments" else StepFlops()
    counting = contextlib.nullcontext() if flops is None else flops
    weighing = contextlib.nullcontext() if flops is None else flops.weighing_tiles()
    start = time.perf_counter()
    try:
        # The FLOP counter below the memory counter: it runs an operation it has no formula for as its
        # decomposition, whose pieces the memory counter must not see (the kernel runs the operation whole).
        with fake_mode, kernel_stand_in(kernel, values, flops), tiles, counting, live, weighing:
            live.track(model.parameters(), "weights")
            live.track(model.buffers(), "weights")
            live.track(_states(optimizer), "optimizer states")
            live.track([t for t in inputs.values() if isinstance(t, torch.Tensor)], "activations")
            live.watch_gradients(trained)
            model.train()
            total = weighted_loss_sum(model, inputs, chunk_size=chunk_size, read_head=read_head)
            loss = total / max(float(batch["loss_denominator"]), 1e-12)
            loss.backward()
            del total, loss
            if args.max_grad_norm and args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(trained, args.max_grad_norm)
            optimizer.step()
            model.zero_grad(set_to_none=True)
    finally:
        offload.host_memory_hooks = hooks
    return Counted(
        peak=live.peak,
        peak_parts=dict(live.peak_parts),
        part_peaks=dict(live.part_peaks),
        host=live.host_peak,
        seconds=time.perf_counter() - start,
        flops=None if flops is None else flops.totals(),
    )


def _states(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def fake_process_group(size: int) -> Iterator[None]:
    """A process group of ``size`` ranks of which this process is rank 0, on torch's fake backend: every
    collective returns at once, with the buffers DeepSpeed allocates for it."""
    import torch.distributed as dist

    if size == 1 or dist.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _extrapolate(low: Counted, high: Counted, steps: int, attention_steps: float) -> Counted:
    """``high`` plus ``steps`` times what one more layer added from ``low`` to ``high``; its attention FLOPs
    ``attention_steps`` times (the layers left differ from the last one counted in their windows)."""

    def line(a: float, b: float, times: float = steps) -> int:
        return int(b + times * (b - a))

    return Counted(
        peak=line(low.peak, high.peak),
        peak_parts={p: line(low.peak_parts[p], high.peak_parts[p]) for p in PARTS},
        part_peaks={p: line(low.part_peaks[p], high.part_peaks[p]) for p in PARTS},
        host=line(low.host, high.host),
        seconds=low.seconds + high.seconds,
        flops=None
        if high.flops is None
        else {
            key: line(low.flops[key], high.flops[key], attention_steps if key == "attention" else steps)
            for key in high.flops
        },
    )


def simulate_lengths(cfg, lengths: list[int], setup: Setup) -> list[dict[str, Any]]:
    """The simulated step at each of ``lengths``: the counted step (extrapolated to the model's depth), its
    parts per GPU as the engine places them, the host memory per node, and whether both fit."""
    from longalign.run import model_config, parameter_sizes

    kernel = kernel_for(cfg, setup.kernel)
    text = model_config(simulated_config(cfg))  # the text model's config
    depth = text.num_hidden_layers
    counted_layers = depth if setup.full_depth else _first_repeated_layer(text) + setup.counted_layers
    counted_layers = min(counted_layers, depth)
    split = cfg.training.sequence_parallel_size
    if setup.gpus % split:
        raise ConfigError(
            f"--gpus {setup.gpus}: not a multiple of training.sequence_parallel_size = {split} (each pack is "
            "split over a group of that many GPUs)"
        )
    with fake_process_group(split):
        fake_mode = _fake_mode()
        model, read_head, args = build_model(cfg, layers=counted_layers, fake_mode=fake_mode)

        def measure(batch):
            return counted_step(
                model,
                read_head,
                args,
                batch,
                chunk_size=cfg.loss.chunk_size,
                kernel=kernel,
                fake_mode=fake_mode,
                every_tile=setup.every_tile,
            )

        sizes = _full_sizes(cfg, model, counted_layers, depth, parameter_sizes)
        layer_bytes = _layer_bytes(model)
        largest = _largest_module_bytes(model)
        parameters = _multiplied_parameters(model, sizes, counted_layers, depth)
        rows = []
        window = getattr(text, "max_position_embeddings", None)
        for length in lengths:
            pack = _pack(length, text.vocab_size, window, setup)
            batch = _batch(cfg, pack)
            high = measure(batch)
            if counted_layers < depth:
                layers = _decoder_layers(model)
                last = layers[-1]
                del layers[-1]
                _set_layers(model, counted_layers - 1)
                try:
                    low = measure(batch)
                finally:
                    layers.append(last)
                    _set_layers(model, counted_layers)
                pairs = _layer_pairs(text, pack["seq_lens"])
                more_attention = sum(pairs[counted_layers:]) / max(pairs[counted_layers - 1], 1)
                counted = _extrapolate(low, high, depth - counted_layers, more_attention)
            else:
                counted = high
            tokens = batch["input_ids"].shape[-1]
            row = placed(
                counted,
                length=length,
                tokens_per_gpu=tokens,
                hidden=text.hidden_size,
                sizes=sizes,
                setup=setup,
                layer_bytes=layer_bytes,
                largest_module_bytes=largest,
            )
            packs = batch["input_ids"].shape[0] / split  # pack rows per GPU: a pack is split over its group
            reference = _model_flops(text, pack["seq_lens"], parameters, packs)
            rows.append({**row, **timed(counted, model_flops=reference, tokens=packs * length, setup=setup)})
    return rows


def _multiplied_parameters(model: torch.nn.Module, sizes: Mapping[str, int], counted: int, depth: int) -> int:
    """The parameters a token is multiplied by, over the whole model: all of them but the input embedding,
    which is looked up (unless the head shares it), and but the experts a token is not routed to: of a
    mixture of experts' weights (``[experts, ...]``, as transformers keeps them), ``top_k`` in ``experts``."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    shared = head is not None and head.weight is embedding
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    idle = _idle_expert_parameters(model, top_k) if isinstance(top_k, int) else 0
    if idle and counted < depth:
        idle += (depth - counted) * _idle_expert_parameters(_decoder_layers(model)[-1], top_k)
    return sizes["parameters"] - (0 if shared else embedding.numel()) - idle


def _idle_expert_parameters(module: torch.nn.Module, top_k: int) -> int:
    """The expert weights in ``module`` that a token routed to ``top_k`` experts does not use (a router's
    ``[experts, hidden]`` weight is used by every token: only 3-D weights are experts')."""
    idle = 0
    for experts in module.modules():
        count = getattr(experts, "num_experts", None)
        if not isinstance(count, int) or count <= top_k:
            continue
        for weight in experts.parameters(recurse=False):
            if weight.dim() == 3 and weight.shape[0] == count:
                idle += weight.numel() * (count - top_k) // count
    return idle


def _model_flops(text, seq_lens: list[int], parameters: int, packs: float) -> float:
    """Model FLOPs of ``packs`` packs of ``seq_lens``, each layer's attention within its window, if any."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return packs * model_flops(
        parameters=parameters,
        tokens=sum(seq_lens),
        pairs=sum(_layer_pairs(text, seq_lens)),
        layers=1,  # the pairs are summed over the layers already
        heads=heads,
        qk_dim=head_dim,
        v_dim=head_dim,
    )


def _layer_pairs(text, seq_lens: list[int]) -> list[int]:
    """Each layer's causal pairs over samples of ``seq_lens``: a sliding-window layer's within its window."""
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    return [causal_pairs(seq_lens, window if kind == "sliding_attention" else None) for kind in kinds]


def timed(counted: Counted, *, model_flops: float, tokens: float, setup: Setup) -> dict[str, Any]:
    """The counted step's FLOPs per GPU, its ratio to the model's, and with ``setup.throughput`` its time,
    tokens per second per GPU and (with ``setup.run_tokens``) the run's GPU-hours; ``tokens``: the step's
    tokens per GPU. Nothing but the model's FLOPs where nothing was counted (``sdpa_segments``)."""
    row: dict[str, Any] = {"model_flops": model_flops}
    if counted.flops is None:
        return row
    executed = sum(counted.flops.values())
    row.update(
        executed_flops=executed,
        executed_matmul_flops=counted.flops["matmul"],
        executed_attention_flops=counted.flops["attention"],
        executed_per_model=executed / model_flops,
    )
    if setup.throughput is None:
        return row
    seconds = setup.throughput.step_seconds(executed)
    row.update(
        gpu=setup.throughput.gpu,
        efficiency=setup.throughput.efficiency,
        step_seconds=seconds,
        tokens_per_second_per_gpu=tokens / seconds,
    )
    if setup.run_tokens is not None:
        row.update(
            run_tokens=setup.run_tokens.tokens,
            run_tokens_source=setup.run_tokens.source,
            gpu_hours=run_gpu_hours(setup.run_tokens.tokens, tokens / seconds),
        )
    return row


def packed_run_tokens(cfg, *, epoch_tokens: int | None, gpus: int) -> RunTokens | None:
    """The tokens the whole run trains on (``flops.run_tokens``), from ``epoch_tokens`` a pass over its data
    (``--tokens``), else from the ``report.json`` of its packed data (``data.train_file``); None when the
    data is not packed yet (raw chats, a mix of sources): its tokens are not known before it is.
    """
    from longalign.artifacts import read_report

    packs, source = None, "--tokens"
    if epoch_tokens is None:
        if not cfg.data.train_file:
            return None
        try:
            report = read_report(cfg.data.train_file)
        except (OSError, ValueError):
            return None
        if "packs" not in report or "tokens" not in report:  # a tokenized, not packed, directory
            return None
        epoch_tokens, packs = report["tokens"], report["packs"]
        source = os.path.join(cfg.data.train_file, "report.json")
    return run_tokens(
        cfg.training.args,
        epoch_tokens=epoch_tokens,
        epoch_packs=packs,
        pack_tokens=cfg.data.max_seq_len,
        data_parallel=gpus // cfg.training.sequence_parallel_size,
        source=source,
    )


def _set_layers(model, layers: int) -> None:
    text = model.config.get_text_config()
    text.num_hidden_layers = layers


def _full_sizes(cfg, model, counted: int, depth: int, parameter_sizes) -> dict[str, int]:
    """``parameter_sizes`` of the whole model: the counted one's, with its layers scaled to ``depth``."""
    sizes = parameter_sizes(model)
    if counted == depth:
        return sizes
    layers = _decoder_layers(model)
    one = parameter_sizes(layers[-1])
    return {key: value + (depth - counted) * one[key] for key, value in sizes.items()}


def _layer_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in _decoder_layers(model)[-1].parameters())


def _largest_module_bytes(model) -> int:
    """The largest single weight (the embedding or the head, for a language model), in bytes."""
    return max(p.numel() * p.element_size() for p in model.parameters())


def engine_buffers(setup: Setup, *, layer_bytes: int, largest_module_bytes: int, hidden: int) -> int:
    """The engine's working set on a GPU beyond the sharded states, estimated (nothing of it is counted).

    ZeRO-3 gathers each module's parameters while it runs and prefetches the next: the largest of the
    embedding or head alone, or two decoder layers, plus its reduce bucket (``reduce_bucket_size``
    elements of 2 bytes; ``auto``: hidden^2). FSDP unshards a decoder layer and prefetches the next, and
    reduce-scatters a layer's gradients. ZeRO-1/2 keep a reduce bucket. Plain DDP keeps its gradient
    buckets, a second copy of the gradients (counted as :func:`placed` does).
    """
    how = setup.how
    bucket = (setup.deepspeed or {}).get("zero_optimization", {}).get("reduce_bucket_size", "auto")
    bucket_bytes = 2 * (hidden * hidden if bucket == "auto" else int(float(bucket)))
    if how.fsdp:
        return 3 * layer_bytes
    if how.zero_stage == 3:
        return max(largest_module_bytes, 2 * layer_bytes) + bucket_bytes
    if how.zero_stage in (1, 2):
        return bucket_bytes
    return 0


def placed(
    counted: Counted,
    *,
    length: int,
    tokens_per_gpu: int,
    hidden: int,
    sizes: Mapping[str, int],
    setup: Setup,
    layer_bytes: int,
    largest_module_bytes: int,
) -> dict[str, Any]:
    """One simulated row: the counted step's parts per GPU as the engine places them, and the fits.

    Without ZeRO or FSDP the counted step is the GPU's memory as it is (weights, gradients and optimizer
    states included; DDP on more GPUs adds its gradient buckets). With either, the weights, gradients and
    optimizer states are ``model_states`` for the GPUs, the engine's working set is
    :func:`engine_buffers`, and the counted step contributes its activations' own peak.
    """
    how, gpus = setup.how, setup.gpus
    sharded = how.fsdp or how.zero_stage is not None
    if sharded:
        parts = dict(model_states(sizes, how, gpus))
        parts["engine"] = engine_buffers(
            setup, layer_bytes=layer_bytes, largest_module_bytes=largest_module_bytes, hidden=hidden
        )
        parts["activations"] = counted.part_peaks["activations"]
        peak = sum(parts.values())
    else:
        parts = {part: counted.peak_parts[part] for part in PARTS}
        parts["engine"] = sizes["trainable_bytes"] if gpus > 1 else 0  # DDP's gradient buckets
        peak = counted.peak + parts["engine"]
    nodes = math.ceil(gpus / setup.gpus_per_node)
    per_node = min(gpus, setup.gpus_per_node)
    host_inputs = counted.host * per_node
    host_states = _offloaded_states(sizes, how) / nodes
    host = host_inputs + host_states
    return {
        "length": length,
        "tokens_per_gpu": tokens_per_gpu,
        **parts,
        "peak": peak,
        "host_inputs_per_node": host_inputs,
        "host_states_per_node": host_states,
        "host_per_node": host,
        "activation_bytes_per_token_per_hidden": parts["activations"] / tokens_per_gpu / hidden,
        "counted_peak": counted.peak,
        "counted_activations_peak": counted.part_peaks["activations"],
        "seconds": counted.seconds,
        "fits_gpu": None if setup.gpu_memory is None else peak <= setup.gpu_memory,
        "fits_host": None if setup.host_memory is None else host <= setup.host_memory,
    }


def _offloaded_states(sizes: Mapping[str, int], how: Sharding) -> float:
    """Bytes of weights, gradients and optimizer states the engine keeps in host memory, for the whole model:
    16-bit weights (offloaded parameters); float32 master weights, Adam's two moments and float32 gradients,
    16 bytes per trainable parameter (DeepSpeed's optimizer offload; FSDP's offload moves all of it)."""
    trainable = sizes["trainable_parameters"]
    host = 0.0
    if "parameters" in how.offloaded:
        host += sizes["parameter_bytes"]
    if "optimizer" in how.offloaded or ("parameters" in how.offloaded and how.fsdp):
        host += 16.0 * trainable
    return host


# --- the report -------------------------------------------------------------------------------------------

_COLUMNS = ("weights", "gradients", "optimizer states", "engine", "activations", "peak", "host_per_node")


def format_simulation(rows: list[dict[str, Any]], setup: Setup) -> str:
    """The simulated rows as a table, then one line per length saying whether it fits and by how much::

    length  tokens/GPU   weights  gradients  optimizer   engine  activations      peak  host/node  B/token/hidden
    1m       1,048,576         0          0          0  1.40 GiB   66.72 GiB  68.12 GiB  1.02 TiB            16.7
    1m: fits one 80.00 GiB GPU with 11.88 GiB left; host memory 1.02 TiB per node of 2.00 TiB: fits
    """
    head = (
        f"{'length':<7}{'tokens/GPU':>11}{'weights':>12}{'gradients':>12}{'optimizer':>12}{'engine':>12}"
        f"{'activations':>13}{'peak':>12}{'host/node':>12}{'B/token/hidden':>16}"
    )
    lines = [head]
    for row in rows:
        cells = [format_bytes(row[key]) for key in _COLUMNS]
        lines.append(
            f"{format_length(row['length']):<7}{row['tokens_per_gpu']:>11,}"
            + "".join(f"{cell:>{13 if i == 4 else 12}}" for i, cell in enumerate(cells))
            + f"{row['activation_bytes_per_token_per_hidden']:>16.1f}"
        )
    lines += [verdict(row, setup) for row in rows]
    lines += [line for row in rows for line in step_time(row, setup)]
    return "\n".join(lines)


def step_time(row: Mapping[str, Any], setup: Setup) -> list[str]:
    """The step's FLOPs per GPU and, for a GPU, its time and the run's GPU-hours, in one or two lines::

    1m: 3.83 PFLOP per GPU executed (matmuls 1.05 PFLOP, attention 2.78 PFLOP), 1.17 x the model's 3.27 PFLOP
    1m: one H200 at 38% of 989 TFLOP/s: 10.2 s a step, 103,000 tokens/s per GPU; 10.5B tokens
        (out/packed/report.json x 1 epochs): 28.4 GPU-hours
    """
    if "model_flops" not in row:
        return []
    name = format_length(row["length"])
    if "executed_flops" not in row:
        return [f"{name}: the model's {format_flops(row['model_flops'])} per GPU; sdpa_segments is not counted "
                "(--kernel flash_attn_2 counts a GPU's step)"]  # fmt: skip
    lines = [
        f"{name}: {format_flops(row['executed_flops'])} per GPU executed (matmuls "
        f"{format_flops(row['executed_matmul_flops'])}, attention {format_flops(row['executed_attention_flops'])}), "
        f"{row['executed_per_model']:.2f} x the model's {format_flops(row['model_flops'])}"
    ]
    if "step_seconds" not in row:
        lines[-1] += f"; --gpu {'|'.join(GPU_PEAK_FLOPS)} gives its time"
        return lines
    throughput = setup.throughput
    peak = format_flops(GPU_PEAK_FLOPS[throughput.gpu], digits=0).replace("FLOP", "FLOP/s")
    line = (
        f"{name}: one {throughput.gpu.upper()} at {throughput.efficiency:.0%} of {peak}: "
        f"{format_amount(row['step_seconds'])} s a step, {row['tokens_per_second_per_gpu']:,.0f} tokens/s per GPU; "
    )
    if "gpu_hours" in row:
        line += (
            f"the run's {format_tokens(row['run_tokens'])} tokens ({row['run_tokens_source']}): "
            f"{format_amount(row['gpu_hours'])} GPU-hours"
        )
    else:
        line += "the run's GPU-hours: its data is not packed yet, --tokens N gives its tokens per epoch"
    return [*lines, line]


def verdict(row: Mapping[str, Any], setup: Setup) -> str:
    """``1m: fits 80.00 GiB per GPU (11.88 GiB left); host 1.02 TiB per node of 2.00 TiB: fits (...)``."""
    parts = [
        _fit(f"peak {format_bytes(row['peak'])} per GPU", row["peak"], setup.gpu_memory),
        _fit(f"host {format_bytes(row['host_per_node'])} per node", row["host_per_node"], setup.host_memory),
    ]
    return f"{format_length(row['length'])}: " + "; ".join(parts)


def _fit(what: str, used: float, capacity: int | None) -> str:
    """``what``, and whether ``used`` bytes fit ``capacity`` (by how much); ``what`` alone without one."""
    if capacity is None:
        return what
    room = capacity - used
    state = "fits" if room >= 0 else "does not fit"
    return f"{what} {state} {format_bytes(capacity)} ({format_bytes(abs(room))} {'left' if room >= 0 else 'over'})"


def accelerate_environment(path: str | os.PathLike) -> tuple[dict[str, str], int | None]:
    """What ``accelerate launch --config_file PATH`` exports about the engine (as ``probe.sharding`` reads
    it), and its number of processes."""
    import yaml

    from longalign.errors import InputError

    try:
        settings = yaml.safe_load(open(path, encoding="utf-8")) or {}
    except OSError as err:
        raise InputError(f"--accelerate-config {path}: {err.strerror}") from None
    env: dict[str, str] = {}
    kind = settings.get("distributed_type", "NO")
    if kind == "DEEPSPEED":
        deepspeed = settings.get("deepspeed_config", {})
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        if "deepspeed_config_file" in deepspeed:
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(deepspeed["deepspeed_config_file"])
        for key in ("zero_stage", "offload_optimizer_device", "offload_param_device"):
            if key in deepspeed:
                env[f"ACCELERATE_DEEPSPEED_{key.upper()}"] = str(deepspeed[key])
    elif kind == "FSDP":
        env["ACCELERATE_USE_FSDP"] = "true"
        offload = settings.get("fsdp_config", {}).get("fsdp_offload_params", False)
        env["FSDP_OFFLOAD_PARAMS"] = str(bool(offload)).lower()
    return env, settings.get("num_processes")


def run_simulation(
    cfg, lengths: list[int], setup: Setup, say: Callable[[str], None], *, source: str
) -> list[dict[str, Any]]:
    """Simulate and say the table; the rows."""
    kernel = kernel_for(cfg, setup.kernel)
    how = setup.how
    engine = (
        "FSDP"
        if how.fsdp
        else f"DeepSpeed ZeRO-{how.zero_stage}"
        if how.zero_stage is not None
        else "no ZeRO/FSDP"
    )
    offloaded = f", offloaded: {', '.join(sorted(how.offloaded))}" if how.offloaded else ""
    say(
        f"simulated step of {source}: {setup.gpus} GPU(s), {engine}{offloaded}, sequence parallel "
        f"{cfg.training.sequence_parallel_size}, attention {KERNELS[kernel]}; per GPU, nothing computed"
    )
    note = text_model_note(cfg)
    if note:
        say(note)
    start = time.perf_counter()
    rows = simulate_lengths(cfg, lengths, setup)
    say(format_simulation(rows, setup))
    say(f"simulated in {time.perf_counter() - start:.1f} s")
    return rows
