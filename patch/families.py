"""What longalign knows of model families, in one place, read from a model's config and modules by what
they do, never by class name.

One decision per model, made before any data is prepared (the dry run, the preflight and the training run
all call :func:`decide` on the run's config; :func:`longalign.patch.apply` holds the model it patches to
:func:`decide_model`)::

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
logit scale, soft-cap  :data:`LOGIT_TRANSFORMS` (Granite, Cohere,   applied inside the chunked loss
                       Gemma 2), where each forward reads it
router loss            ``output_router_logits``,                    the load-balancing loss per pack, over
                       ``router_aux_loss_coef`` (MoE)               the pack's real tokens
linear attention       token-mixing layer types and convolutions    state restarts at every sample (gated
                                                                    delta rules: ``linear_attention``)
token-wise MLP         each decoder layer's children               ``sequence_tiling = "mlp"`` tiles it
                       (:func:`token_wise_mlp`)                     (``tiled_mlp``); refused without one
=====================  ===========================================  ==========================================

Everything a decision refuses names what is missing and what to do instead. ``tests/test_families.py``
holds every causal-LM family of the installed transformers to its decision: exact when packed, or refused.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .linear_attention import linear_attention_layers


@dataclass(frozen=True)
class LogitTransform:
    """How a family transforms its logits after the LM head, as its ``ForCausalLM.forward`` does it."""

    field: str  # the name the forward reads; dotted for an attribute of a submodule
    read_from: str  # "config": the text config, every forward; "module": the causal LM, set at init
    kind: str  # "multiply": logits * v; "divide": logits / v; "softcap": v * tanh(logits / v), off if None


# The families whose causal LM transforms the logits after ``self.lm_head(...)`` (transformers 5.24 and 5.25), by
# ``config.model_type``. Any other transform after the head is caught by the check on the model's output
# (:meth:`LossHead.returned_sum`). Families that transform always, with no neutral value (Inkling's softcap
# module, RecurrentGemma, xLSTM), are left to that check.
LOGIT_TRANSFORMS: dict[str, LogitTransform] = {
    **dict.fromkeys(  # Granite 3.x: logits / 16
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
        LogitTransform("logits_scaling", "config", "divide"),
    ),
    "hyperclovax": LogitTransform("logits_scaling", "config", "multiply"),  # multiplies, unlike Granite
    **dict.fromkeys(
        ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"),
        LogitTransform("logit_scale", "module", "multiply"),
    ),
    "falcon_h1": LogitTransform("model.lm_head_multiplier", "module", "multiply"),
    **dict.fromkeys(  # Gemma 3's multimodal class (model_type "gemma3") does not cap in 5.24 or 5.25
        (
            "gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
            "gemma4_unified_text", "vaultgemma", "nanochat", "beam",
        ),
        LogitTransform("final_logit_softcapping", "config", "softcap"),
    ),
}  # fmt: skip


def logit_transform(model: nn.Module) -> tuple[LogitTransform, Any, str] | None:
    """The row of :data:`LOGIT_TRANSFORMS` for ``model``, the object holding its value, and the name there.

    ``model`` is a transformers causal LM, or a wrapper that hands it out with ``get_base_model()`` (PEFT).
    The value is ``getattr(holder, name)``; None when the family has no transform after its head::

        GraniteForCausalLM   ->  (LogitTransform("logits_scaling", ...), model.config, "logits_scaling")
        FalconH1ForCausalLM  ->  (LogitTransform("model.lm_head_multiplier", ...), model.model,
                                  "lm_head_multiplier")
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    transform = LOGIT_TRANSFORMS.get(getattr(causal_lm.config, "model_type", None))
    if transform is None:
        return None
    *path, name = transform.field.split(".")
    holder = causal_lm.config.get_text_config() if transform.read_from == "config" else causal_lm
    for part in path:
        holder = getattr(holder, part)
    return transform, holder, name


# Config fields that look like they transform the logits: a family that sets one and has no row above is
# refused, since the loss would not apply it. Attention and router soft-caps and initialisation act elsewhere.
_LOGIT_LIKE_FIELD = re.compile(r"(logit|lm_head|output).*(scal|mult|cap)|(scal|mult|cap).*logit")
_NOT_OUTPUT_FIELD = re.compile(r"attn|attention|router|init")

# What each attention backend runs besides windows and chunks (every backend runs those), checked before
# any data is prepared; "auto" takes the first kernel on the machine that runs what the model needs.
BACKEND_RUNS = {
    "auto": {"softcap", "sinks"},
    "sdpa_segments": {"softcap", "sinks"},
    "flash_attn": {"softcap"},  # FlashAttention 2/3: softcap; its log-sum-exp carries no gradient for sinks
    "flash_attn_cute": {"softcap", "sinks"},  # FlashAttention 4: softcap, learnable_sink
    "torch_varlen": set(),
}

# Layer types whose token mixing is softmax attention through transformers' AttentionInterface.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

_CHECK_NAME = "longalign_family_check"  # the custom attention a decision asks a model to take

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
    # Why ``training.sequence_tiling`` cannot tile the model, by mode ("mlp": :func:`mlp_tiling_problem`,
    # "layer": :func:`tiling_problem`); None: it can.
    mlp_tiling: str | None = None
    layer_tiling: str | None = None

    def tiling_problem(self, mode: str) -> str | None:
        """Why ``sequence_tiling = mode`` cannot tile the model ('' tiles nothing: None)."""
        return {"mlp": self.mlp_tiling, "layer": self.layer_tiling}.get(mode)

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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", "?")
    try:
        # The class itself, not from_config: under DeepSpeed ZeRO-3 from_config partitions the weights as
        # they are made, which a meta tensor cannot be.
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        wanted = getattr(cls, "config_class", None)
        own = config if wanted is None or isinstance(config, wanted) else config.get_text_config()
        model = _on_meta(lambda: cls(own))
    except Exception as err:  # noqa: BLE001 - any failure to build is the reason
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return Decision(
            model_type, "?", refusals=(f"transformers cannot build it from its config ({first})",)
        )
    return decide_model(model, backend=backend)


def decide_model(model: nn.Module, *, backend: str = "auto") -> Decision:
    """The decision for a built model (on any device, the meta device included)."""
    features = read_features(model)
    refusals = _structure_problems(model) + _feature_problems(model, features, backend)
    return Decision(
        getattr(model.config, "model_type", "?"),
        type(model).__name__,
        features,
        tuple(refusals),
        mlp_tiling=mlp_tiling_problem(model),
        layer_tiling=tiling_problem(model, features),
    )


def tiling_problem(model: nn.Module, features: Features | None = None) -> str | None:
    """Why ``longalign.patch.tile_layers`` cannot tile ``model``'s decoder layers; None when it can.

    The tiled layer runs the layer's own forward over tiles of tokens around one call on the whole
    sequence: the attention function, or in a linear-attention layer its token mixer (Qwen3-Next's gated
    delta net: projections, short convolution and recurrence, run whole). Every other part of a layer must
    treat each token alone: norms, projections, RoPE, MLPs and token-routed experts do; a recurrence or a
    convolution outside one token mixer does not::

        Qwen3MoeForCausalLM  ->  None
        Qwen3NextForCausalLM ->  None (its linear-attention layers' gated delta nets run whole)
        Lfm2ForCausalLM      ->  "3 of its layers mix tokens by a convolution or a recurrence outside ..."
    """
    features = features if features is not None else read_features(model)
    if getattr(model.config.get_text_config(), "altup_num_inputs", None):
        return "its layers carry a stack of hidden states per token (AltUp), not one"
    layers = _layers(model)
    mixers = {id(module) for module in linear_attention_layers(model)}
    loose = [
        index
        for index in features.linear_attention_layers
        if sum(id(module) in mixers for module in layers[index].modules()) != 1
    ]
    if loose:
        return (
            f"{len(loose)} of its layers mix tokens by a convolution or a recurrence outside one linear-attention "
            "module, which the tiled layer cannot run whole between its tiles"
        )
    calls = attention_calls_per_layer(model)
    if calls is not None and calls > 1:
        return (
            f"its layers call the attention function {calls} times (the tiled layer runs one call on the whole "
            "sequence between its tiles)"
        )
    return None


def attention_calls_per_layer(model: nn.Module) -> int | None:
    """How many times the first decoder layer of each layer type calls the attention function, at most; None
    when it cannot be told. Read off a model on the meta device (the decision's, no memory, no data): a copy
    of the layer in bfloat16 (a mixture of experts' grouped products take nothing else) runs on 4 meta
    tokens, every attention call counted and answered with zeros. DiffLlama calls it twice in one module,
    LongCat-Flash has two attention modules a layer; a linear-attention layer calls it none."""
    from .interface import attention_calls

    layers = _layers(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not layers or embedding is None or embedding.weight.device.type != "meta":
        return None  # a model with weights: what the decision before it read from its config holds
    text = model.config.get_text_config()
    kinds = list(getattr(text, "layer_types", None) or [])
    firsts = {kinds[i] if i < len(kinds) else None: i for i in reversed(range(len(layers)))}
    count = [0]

    def counted(function: Any) -> Any:
        def call(
            module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs
        ):
            count[0] += 1
            shape = (query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
            return query.new_zeros(shape), None

        return call

    most = 0
    for kind, index in firsts.items():
        try:
            layer = copy.deepcopy(layers[index]).to(torch.bfloat16)
            for module in layer.modules():  # experts as grouped products: the others read routes' values
                if getattr(getattr(module, "config", None), "_experts_implementation", None) is not None:
                    module.config._experts_implementation = "grouped_mm"
            hidden = torch.zeros(1, 4, text.hidden_size, device="meta", dtype=torch.bfloat16)
            positions = torch.arange(4, device="meta")[None]
            arguments: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
            rotary = (
                getattr(model.get_decoder(), "rotary_emb", None) if hasattr(model, "get_decoder") else None
            )
            if rotary is not None:
                typed = "layer_type" in inspect.signature(rotary.forward).parameters
                arguments["position_embeddings"] = (
                    rotary(hidden, positions, kind or "full_attention")
                    if typed
                    else rotary(hidden, positions)
                )
            count[0] = 0
            with torch.no_grad(), attention_calls(counted):
                layer(hidden, **arguments)
        except Exception:  # noqa: BLE001 - a layer that cannot run on meta tensors: not told here
            return None
        most = max(most, count[0])
    return most


def read_features(model: nn.Module) -> Features:
    """The :class:`Features` of ``model``, from its config and its modules."""
    text = model.config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    chunk = getattr(text, "attention_chunk_size", None)
    if "chunked_attention" not in layer_types:
        chunk = None  # the attention reads chunks off these layers only, as transformers' masks do
    router = None
    if getattr(text, "output_router_logits", False):
        router = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    scale, softcap = _logit_transform_values(model)
    return Features(
        sliding_window=window or None,
        attention_chunk=chunk or None,
        attention_softcap=getattr(text, "attn_logit_softcapping", None) or None,
        sinks=any(name.endswith("sinks") for name, _ in model.named_parameters()),
        logit_scale=scale,
        final_softcap=softcap,
        router_loss_coef=router,
        linear_attention_layers=tuple(_token_mixing_layers(model)),
    )


def _logit_transform_values(model: nn.Module) -> tuple[float | None, float | None]:
    """The logit scale and final soft-cap the family applies after its head (``LOGIT_TRANSFORMS``)."""
    found = logit_transform(model)
    if found is None:
        return None, None
    transform, holder, name = found
    value = getattr(holder, name, None)
    if not isinstance(value, int | float):
        return None, None
    if transform.kind == "softcap":
        return None, float(value)
    scale = float(value) if transform.kind == "multiply" else 1 / float(value)
    return (None if scale == 1.0 else scale), None


def _logit_problems(model: nn.Module) -> list[str]:
    """Config fields that look like a logit transform the loss would not apply (no row in LOGIT_TRANSFORMS)."""
    found = logit_transform(model)
    known = {found[0].field.rsplit(".", 1)[-1]} if found else set()
    problems = []
    for name, value in model.config.get_text_config().to_dict().items():
        if value is None or name in known:
            continue
        if _LOGIT_LIKE_FIELD.search(name) and not _NOT_OUTPUT_FIELD.search(name):
            problems.append(
                f"its config field {name!r} = {value!r} looks like a change to the logits that the loss does "
                "not apply"
            )
    return problems


def _structure_problems(model: nn.Module) -> list[str]:
    """What no packing can follow: attention outside the interface, positions that are not rotary or
    depend on the batch, encoders, logit transforms the loss does not know. Text models whose other layers
    are linear attention (``linear_attention``) take their order from those layers: their attention needs
    no rotary table of its own."""
    config = model.config
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or [])
    hybrid = (
        bool(linear_attention_layers(model))
        and bool(layer_types & ATTENTION_LAYER_TYPES)
        and getattr(config, "vision_config", None) is None
    )
    found = []
    if getattr(config, "is_encoder_decoder", False):
        found.append("it is an encoder-decoder model")
    outside = [
        type(module).__name__
        for module in model.modules()
        if isinstance(module, PreTrainedModel)
        and not getattr(type(module), "_supports_attention_backend", False)
    ]
    if outside and not hybrid:
        found.append(
            f"its attention ({', '.join(dict.fromkeys(outside))}) does not go through transformers' AttentionInterface"
        )
    kept = _kept_attention(model)
    if kept is not None:
        found.append(f"transformers cannot select a custom attention for it (it keeps {kept!r})")
    if "shared_kv_states" in inspect.signature(type(model).forward).parameters:
        found.append("it is a drafter that attends to another model's key/value states (shared_kv_states)")
    if getattr(config.get_text_config(), "keep_window_size", None):
        found.append(
            "its attention keeps the keys a learned dynamic mask chooses (keep_window_size), a mask the varlen "
            "attention cannot apply"
        )
    rotary = any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules())
    if not rotary and not hybrid:
        found.append("it has no rotary position embedding (learned absolute positions or ALiBi, for example)")
    for params in _rope_parameters(config.get_text_config()):
        rope_type = params.get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            found.append(
                f"its rope_type {rope_type!r} derives frequencies from the largest position in the batch, so "
                "packed samples would change each other's positions"
            )
        if "mrope_section" in params and not hybrid:
            found.append("it uses multimodal rotary embeddings (3D position ids)")
    return found + _logit_problems(model)


def _feature_problems(model: nn.Module, features: Features, backend: str) -> list[str]:
    """What the family adds that the chosen attention backend or longalign's patches do not follow."""
    runs = BACKEND_RUNS.get(backend, set())
    found = []
    if features.attention_softcap and "softcap" not in runs:
        found.append(
            f"it soft-caps attention logits, which model.attn_backend {backend!r} cannot apply: use flash_attn, "
            "flash_attn_cute or sdpa_segments"
        )
    if features.sinks and "sinks" not in runs:
        found.append(
            f"it has attention sinks, which model.attn_backend {backend!r} cannot apply: use flash_attn_cute "
            "(FlashAttention 4) or sdpa_segments"
        )
    covered = {id(module) for module in linear_attention_layers(model)}
    layers = _layers(model)
    uncovered = [
        index
        for index in features.linear_attention_layers
        if not any(id(module) in covered for module in layers[index].modules())
    ]
    if uncovered:
        text = model.config.get_text_config()
        layer_types = list(getattr(text, "layer_types", None) or [])
        kinds = sorted(
            {
                layer_types[index]
                if index < len(layer_types) and layer_types[index] not in ATTENTION_LAYER_TYPES
                else "a convolution over the tokens"
                for index in uncovered
            }
        )
        found.append(
            f"{len(uncovered)} of its layers mix tokens by {', '.join(map(str, kinds))}, which longalign does not "
            "restart at each packed sample (it does for gated delta rules with a short convolution)"
        )
    return found


def _kept_attention(model: nn.Module) -> str | None:
    """The attention ``model`` keeps when asked to take a custom one (``None``: it takes it), as
    ``longalign.patch.apply`` asks; on a copy of the config, so the model itself is left as it was."""
    from .interface import register

    name = register("sdpa_segments", name=_CHECK_NAME)
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError, NotImplementedError):
        return before
    finally:
        kept = model.config._attn_implementation
        if kept == name:
            model.set_attn_implementation(before or "eager")
    return None if kept == name else kept


def _layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _token_mixing_layers(model: nn.Module) -> list[int]:
    """Decoder layers that mix tokens other than by attention: a convolution over the token axis or a
    recurrent state (linear attention, state-space mixers), by their modules."""
    layers = _layers(model)
    text = model.config.get_text_config()
    layer_types = list(getattr(text, "layer_types", None) or [])
    found = []
    for index, layer in enumerate(layers):
        typed = index < len(layer_types) and layer_types[index] not in ATTENTION_LAYER_TYPES
        if typed or any(isinstance(module, nn.Conv1d) for module in layer.modules()):
            found.append(index)
    return found


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of the text model of ``model`` (a vision or audio tower's layers are not among them);
    every decoder layer of ``model`` where transformers' ``get_decoder`` finds none (ModernBERT's decoder
    names its LM head ``decoder``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return (_layers(decoder) if isinstance(decoder, nn.Module) else []) or _layers(model)


def token_wise_mlp(layer: nn.Module) -> nn.Module | None:
    """The module that runs ``layer``'s MLP, found by what it is, not by its class; None when it has none.

    The MLP of a decoder layer is the child the layer calls on the hidden states ``[B, T, H]`` alone, and
    that treats each token alone: a dense MLP (gated or not, with a fused ``gate_up`` projection or not) or
    a mixture of experts (each token routed by its own router logits, shared experts beside them). By its
    structure, it is a child of the layer

    - whose forward takes one argument, the hidden states: no mask, position, cache or sample boundary
      reaches it, so it has nothing to mix tokens by (an attention or a mixer takes more);
    - that holds two weight matrices or more (an up and a down projection, fused or per expert; a norm
      holds none, a lone projection one);
    - with no convolution inside (a convolution over the tokens mixes them).

    Of several such children the largest, where the ``[tokens, intermediate]`` tensors are::

        LlamaDecoderLayer        -> layer.mlp (gate_proj, up_proj, down_proj)
        Qwen3MoeDecoderLayer     -> layer.mlp (the router ``gate`` and the ``experts``)
        Gemma3nTextDecoderLayer  -> layer.mlp (not the low-rank LAuReL block beside it)
        MoshiDecoderLayer        -> None (its MLP's forward also takes the codebook that picks its weights)
    """
    found = [child for child in layer.children() if _is_token_wise_mlp(child)]
    return max(found, key=lambda child: sum(param.numel() for param in child.parameters()), default=None)


def _is_token_wise_mlp(module: nn.Module) -> bool:
    arguments = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    if len(arguments) != 1 or arguments[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        return False
    matrices = sum(1 for param in module.parameters() if param.dim() >= 2)
    return matrices >= 2 and not any(isinstance(inner, nn.Conv1d) for inner in module.modules())


def mlp_tiling_problem(model: nn.Module) -> str | None:
    """Why ``training.sequence_tiling = "mlp"`` cannot tile ``model``'s MLPs, in words; None when it can."""
    layers = decoder_layers(model)
    if not layers:
        return "it has no decoder layers to tile the MLP of"
    missing = sorted({type(layer).__name__ for layer in layers if token_wise_mlp(layer) is None})
    if missing:
        return (
            f"its {', '.join(missing)} has no token-wise MLP (a child whose forward takes the hidden states "
            "alone, holding two weight matrices or more and no convolution)"
        )
    return None


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
