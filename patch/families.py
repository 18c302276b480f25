"""What longalign knows of model families, in one place, read from a model's config and modules by what
they do, never by class name.

One decision per model, made before any data is prepared (the dry run, the preflight and the training run
all call :func:`decide` on the run's config; :func:`longalign.patch.apply` calls :func:`check` on the model
it patches)::

    decide(LlamaConfig(...))      -> Decision(model_type="llama", features=Features(...), refusals=())
    decide(GPT2Config())          -> refusals ("it has no rotary position embedding (...)",)
    decide(Gemma2Config(), backend="torch_varlen")
                                  -> refusals ("it soft-caps attention logits, which torch_varlen cannot ...",)

The model is built on the meta device for the decision (no memory, nothing initialised), so an 8B config
decides in a second on any machine. What each feature is, where it is read, and
what packing does with it:

=====================  ===========================================  ==========================================
feature                read from                                    what packing does
=====================  ===========================================  ==========================================
sliding window         ``sliding_window``, ``layer_types``          the kernel's window, per layer
attention chunks       ``attention_chunk_size`` (Llama 4)           attention restarts every chunk of a sample
attention soft-cap     ``attn_logit_softcapping`` (Gemma 2)         the kernel's ``softcap``
attention sinks        parameters named ``*sinks`` (gpt-oss)        one logit per head in the denominator
logit scale, soft-cap  :data:`LOGIT_FIELDS` (Granite, Cohere,       applied inside the chunked loss
                       Gemma 2)
router loss            ``output_router_logits``,                    the load-balancing loss per pack, over
                       ``router_aux_loss_coef`` (MoE)               the pack's real tokens
linear attention       token-mixing convolutions and recurrences    state restarts at every sample
=====================  ===========================================  ==========================================

Everything a decision refuses names what is missing and what to do instead. ``tests/test_families.py``
holds every causal-LM family of the installed transformers to its decision: exact when packed, or refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Config fields that transform the logits after the LM head, and the factor each puts on them; the
# chunked loss applies them (longalign.loss).
LOGIT_SCALE_FIELDS = {
    "logit_scale": lambda value: value,  # Cohere, Cohere2: logits * logit_scale
    "lm_head_multiplier": lambda value: value,  # Falcon-H1: logits * lm_head_multiplier
    "logits_scaling": lambda value: 1 / value,  # Granite 3.x: logits / logits_scaling
}
FINAL_SOFTCAP_FIELD = "final_logit_softcapping"  # Gemma 2/3: softcap * tanh(logits / softcap)
# Other config fields that look like they touch the logits; a model that sets one is refused, since the
# loss would not apply it. Attention and router soft-caps and initialisation values act elsewhere.
_LOGIT_LIKE_FIELD = re.compile(r"(logit|lm_head|output).*(scal|mult|cap)|(scal|mult|cap).*logit")
_NOT_OUTPUT_FIELD = re.compile(r"attn|attention|router|init")

# Layer types whose token mixing is softmax attention through transformers' AttentionInterface.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

# Families with a name of their own (messages, LoRA's default targets); every other family is "generic".
NAMED = {
    "LlamaForCausalLM": "Llama 3",
    "GlmForCausalLM": "GLM",
    "Glm4ForCausalLM": "GLM-4",
    "Llama4ForCausalLM": "Llama 4",
}

# Remote-code model types that have a native transformers class under another name.
REMOTE_CODE_HINTS = {
    "chatglm": (
        "For GLM-4-9B load the same checkpoint with longalign.checkpoints.load_model (GlmForCausalLM, its code "
        "not run), or convert it once with `longalign convert`. ChatGLM2/3 have no native class."
    ),
}


@dataclass(frozen=True)
class Features:
    """What a family adds that packing must follow (``None`` / empty: the family does not have it)."""

    sliding_window: int | None = None  # tokens a query sees, itself included
    attention_chunk: int | None = None  # attention restarts every this many tokens (Llama 4)
    attention_softcap: float | None = None  # softcap * tanh(scores / softcap) before the softmax
    sinks: bool = False  # a learnable logit per head in the softmax's denominator
    logit_scale: float | None = None  # multiplies the logits after the LM head
    final_softcap: float | None = None  # softcap * tanh(logits / softcap) after the scale
    router_loss_coef: float | None = None  # the MoE load-balancing loss's coefficient, when it is on
    linear_attention_layers: tuple[int, ...] = ()  # layers whose token mixing is a recurrence or convolution

    def described(self) -> list[str]:
        """One phrase per feature the family has, for the dry run and the manual's table."""
        found = []
        if self.sliding_window:
            found.append(f"sliding window {self.sliding_window}")
        if self.attention_chunk:
            found.append(f"attention chunks of {self.attention_chunk}")
        if self.attention_softcap:
            found.append(f"attention soft-cap {self.attention_softcap:g}")
        if self.sinks:
            found.append("attention sinks")
        if self.logit_scale:
            found.append(f"logit scale {self.logit_scale:g}")
        if self.final_softcap:
            found.append(f"final logit soft-cap {self.final_softcap:g}")
        if self.router_loss_coef is not None:
            found.append(f"router loss x {self.router_loss_coef:g}")
        if self.linear_attention_layers:
            found.append(f"linear attention in {len(self.linear_attention_layers)} layers")
        return found


@dataclass(frozen=True)
class Decision:
    """Whether a model trains on packed samples exactly (no refusals), and what packing follows for it."""

    model_type: str
    architecture: str
    features: Features = field(default_factory=Features)
    refusals: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return not self.refusals

    def message(self) -> str:
        """The one-line refusal: the model, every reason, and what to do instead."""
        return (
            f"{self.architecture} (model type {self.model_type!r}) cannot train on packed samples exactly: "
            f"{'; '.join(self.refusals)}. Choose a model whose family longalign packs exactly "
            "(docs/training/families.md lists every family of the installed transformers)"
        )


def decide(config: Any, *, backend: str = "auto") -> Decision:
    """The decision for a model of ``config`` (a transformers config), on attention ``backend``."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", "?")
    try:
        model = _on_meta(lambda: AutoModelForCausalLM.from_config(config))
    except Exception as err:  # noqa: BLE001 - any failure to build is the reason
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return Decision(
            model_type, "?", refusals=(f"transformers cannot build it from its config ({first})",)
        )
    return decide_model(model, backend=backend)


def decide_model(model: nn.Module, *, backend: str = "auto") -> Decision:
    """The decision for a built model (on any device, the meta device included)."""
    config = model.config
    text = config.get_text_config()
    features = read_features(model)
    refusals = _structure_problems(model) + _feature_problems(model, features, backend)
    return Decision(
        getattr(config, "model_type", "?"),
        type(model).__name__,
        features,
        tuple(refusals) + tuple(_logit_problems(text)),
    )


def read_features(model: nn.Module) -> Features:
    """The :class:`Features` of ``model``, from its config and its modules."""
    text = model.config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    router = None
    if getattr(text, "output_router_logits", False):
        router = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    return Features(
        sliding_window=window or None,
        attention_chunk=getattr(text, "attention_chunk_size", None) or None,
        attention_softcap=getattr(text, "attn_logit_softcapping", None) or None,
        sinks=any(name.endswith("sinks") for name, _ in model.named_parameters()),
        logit_scale=logit_scale(text),
        final_softcap=final_softcap(text),
        router_loss_coef=router,
        linear_attention_layers=tuple(_token_mixing_layers(model)),
    )


def logit_scale(config: Any) -> float | None:
    """The factor the model puts on its logits after the LM head (``None``: 1)."""
    scale = 1.0
    # getattr, not to_dict: some configs (MiniCPM3's logits_scaling) derive the field as a property.
    for name, factor in LOGIT_SCALE_FIELDS.items():
        value = getattr(config, name, None)
        if isinstance(value, int | float):
            scale *= factor(value)
    return None if scale == 1.0 else float(scale)


def final_softcap(config: Any) -> float | None:
    value = getattr(config, FINAL_SOFTCAP_FIELD, None)
    return float(value) if isinstance(value, int | float) else None


def _logit_problems(config: Any) -> list[str]:
    found = []
    for name, value in config.to_dict().items():
        if value is None or not _LOGIT_LIKE_FIELD.search(name) or _NOT_OUTPUT_FIELD.search(name):
            continue
        known = name in LOGIT_SCALE_FIELDS or name == FINAL_SOFTCAP_FIELD
        if not known or not isinstance(value, int | float):
            found.append(
                f"its config field {name!r} = {value!r} changes the logits in a way the loss does not apply"
            )
    return found


def _structure_problems(model: nn.Module) -> list[str]:
    """What no packing can follow: attention outside the interface, positions that are not rotary or
    depend on the batch, encoders."""
    config = model.config
    found = []
    if getattr(config, "is_encoder_decoder", False):
        found.append("it is an encoder-decoder model")
    if not getattr(type(model), "_supports_attention_backend", False):
        found.append("its attention does not go through transformers' AttentionInterface")
    if not any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules()):
        found.append("it has no rotary position embedding (learned absolute positions or ALiBi, for example)")
    for params in _rope_parameters(config.get_text_config()):
        rope_type = params.get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            found.append(
                f"its rope_type {rope_type!r} derives frequencies from the largest position in the batch, so "
                "packed samples would change each other's positions"
            )
        if "mrope_section" in params:
            found.append("it uses multimodal rotary embeddings (3D position ids)")
    return found


def _feature_problems(model: nn.Module, features: Features, backend: str) -> list[str]:
    """What the family adds that longalign's attention, loss or patches do not follow yet."""
    found = []
    if features.attention_chunk:
        found.append(
            f"its attention restarts every {features.attention_chunk} tokens (attention_chunk_size), which "
            "the varlen attention does not follow"
        )
    if features.attention_softcap:
        found.append("it soft-caps attention logits, which the varlen attention does not apply")
    if features.sinks:
        found.append("it has attention sinks, which the varlen attention does not apply")
    if features.logit_scale or features.final_softcap:
        found.append(
            "it scales or soft-caps its logits after the LM head, which the chunked loss does not follow"
        )
    if features.router_loss_coef is not None:
        found.append(
            "output_router_logits is on and the router loss is not computed; set it to false in "
            "model.config_overrides (or init_from_config)"
        )
    if features.linear_attention_layers:
        layers = features.linear_attention_layers
        shown = ", ".join(map(str, layers[:4])) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
        found.append(
            f"its layers {shown} mix tokens through a recurrence or convolution whose state would run from one "
            "packed sample into the next"
        )
    return found


def _token_mixing_layers(model: nn.Module) -> list[int]:
    """Decoder layers that mix tokens other than by attention: a convolution over the token axis or a
    recurrent state (linear attention, state-space mixers), by their modules."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    text = model.config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or [])
    found = []
    for index, layer in enumerate(layers):
        typed = index < len(layer_types) and layer_types[index] not in ATTENTION_LAYER_TYPES
        if typed or any(isinstance(module, nn.Conv1d) for module in layer.modules()):
            found.append(index)
    return found


def _rope_parameters(config: Any) -> list[Mapping[str, Any]]:
    """The config's RoPE settings: one dict, or one per layer type (``{"sliding_attention": {...}, ...}``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return list(rope.values())
    return [rope]


def _on_meta(build):
    """``build()`` with every tensor on the meta device: no memory, no initialisation."""
    with torch.device("meta"):
        return build()


def remote_code_problem(model: nn.Module) -> str | None:
    """The refusal of a model class from a checkpoint's own code (``trust_remote_code``), with a hint."""
    cls = type(model)
    if not cls.__module__.startswith("transformers_modules"):
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    hint = REMOTE_CODE_HINTS.get(model_type, "Load a checkpoint that transformers supports natively.")
    return (
        f"{cls.__name__} (model type {model_type!r}) is trust_remote_code from {cls.__module__}; longalign "
        f"patches only transformers' own classes. {hint}"
    )
