"""Checkpointed activations in host memory: the input that activation checkpointing keeps for each layer's
recompute waits for backward in pinned host memory, not on the accelerator.

With checkpointing on, what the forward leaves on the device for backward is one ``[tokens, hidden]``
input per checkpointed decoder layer: ``layers x tokens x hidden x bytes`` (32 GiB for Llama-3-8B at
128k tokens per GPU in bf16). Offloaded, each layer's input is copied to host memory as the layer's
forward saves it and copied back when backward recomputes the layer::

    forward    layer 0 saves x0 -> host      layer 1 saves x1 -> host   ...   (device: the layer running)
    backward   ... layer 1: x1 host -> device, recompute, backward;  layer 0: x0 host -> device, ...

The hooks are torch's ``save_on_cpu`` around each checkpointed layer's call, outside the checkpoint's
own hooks: only the tensors the checkpoint saves itself (the layer's inputs) pass through them, while
everything the layer saves inside is still dropped and recomputed. Layers that are not checkpointed
(``every_n_layers`` > 1) are left alone. The copies run on the compute stream, as in transformers.

Why not transformers' ``activation_checkpointing_enable(offload=True)``, the same hooks: it always asks
for pinned memory, and on a machine without an accelerator its ``save_on_cpu(pin_memory=True,
device_type="cpu")`` fails at the first checkpointed layer ("pin_memory=True requires a CUDA or other
accelerator backend", transformers 5.24, torch 2.13). Here memory is pinned where an accelerator exists;
without one the hooks run unchanged and keep the tensors where they are, already in host memory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from transformers.modeling_layers import GradientCheckpointingLayer

from longalign.errors import ModelError


def offload_checkpointed_inputs(model: nn.Module) -> nn.Module:
    """Keep the inputs of ``model``'s checkpointed decoder layers in host memory until backward.

    Takes effect in the layers activation checkpointing recomputes, whenever it is enabled (before or
    after this call, as the Trainer does when training starts).
    """
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise ModelError(
            f"training.offload_activations: {type(model).__name__} has no decoder layers that activation "
            "checkpointing recomputes"
        )
    for layer in layers:
        layer.forward = functools.partial(_offloaded_forward, layer)
    return model


def host_memory_hooks() -> save_on_cpu:
    """torch's ``save_on_cpu``, pinning host memory only where an accelerator can copy from it."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None:
        return save_on_cpu(pin_memory=False)
    return save_on_cpu(pin_memory=True, device_type=accelerator.type)


def _offloaded_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward, looked up at the call: an engine may have swapped the class since (FSDP2).
    forward = type(layer).forward
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        with host_memory_hooks():
            return forward(layer, *args, **kwargs)
    return forward(layer, *args, **kwargs)
