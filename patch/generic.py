"""What every patched model must satisfy; architectures without a module of their own rely on it alone.

Packed samples stay apart only when all of these hold:

- attention goes through transformers' ``AttentionInterface`` (``_supports_attention_backend``), so our
  function runs and receives the batch's ``cu_seq_lens_q``/``position_ids`` keyword arguments;
- positions are rotary embeddings computed from ``position_ids``, so they restart with every sample;
- the rotary frequencies are fixed: ``dynamic`` NTK scaling and ``longrope`` choose them from the largest
  position in the batch, so a sample's embeddings would depend on its pack-mates::

      pack  [ a: 0..299 | b: 0..8999 ]   max position 8999 -> a is embedded as if it were long

- nothing in the score computation that the varlen kernels skip: logit soft-capping, attention sinks.

Qwen2, Qwen3 and Mistral (sliding window included) pass through this path unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .linear_attention import linear_attention_layers


class Family(NamedTuple):
    """A model family with its own module: checked like every model, and tested by name."""

    label: str  # what users call it, e.g. "GLM-4"
    architectures: tuple[str, ...]  # transformers class names


def problems(model: torch.nn.Module) -> list[str]:
    """Why ``model`` cannot train on packed samples with varlen attention; empty when it can."""
    config = model.config
    found = []
    # Text models of Qwen3-Next/3.5 and Kimi-Linear (linear_attention.py): full attention goes through the
    # interface without the class saying so; Kimi-Linear's has no positions (its order comes from the linear
    # layers); Qwen3.5's text model gives every mrope axis the same 2D position_ids, which is plain RoPE.
    hybrid = bool(linear_attention_layers(model)) and getattr(config, "vision_config", None) is None
    if not getattr(type(model), "_supports_attention_backend", False) and not hybrid:
        found.append("its attention does not go through transformers' AttentionInterface")
    if (
        not any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules())
        and not hybrid
    ):
        found.append("it has no rotary position embedding (learned absolute positions or ALiBi, for example)")
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            found.append(
                f"its rope_type {rope_type!r} derives frequencies from the largest position in the batch, so "
                "packed samples would change each other's positions"
            )
        if "mrope_section" in params and not hybrid:
            found.append("it uses multimodal rotary embeddings (3D position ids)")
    if getattr(config, "is_encoder_decoder", False):
        found.append("it is an encoder-decoder model")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        found.append("it soft-caps attention logits")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        found.append("it has attention sinks")
    return found


def _rope_parameters(config: Any) -> list[dict[str, Any]]:
    """The config's RoPE settings: one dict, or one per layer type (``{"sliding_attention": {...}, ...}``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if all(isinstance(value, dict) for value in rope.values()) and rope:
        return list(rope.values())
    return [rope]
