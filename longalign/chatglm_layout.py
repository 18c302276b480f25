"""The ChatGLM layout of GLM-4-9B and transformers' ``GlmForCausalLM``, mapped both ways, without files.

GLM-4-9B (glm-4-9b, glm-4-9b-chat, LongWriter-glm4-9b) ships for its own remote code: ``model_type =
"chatglm"``, fused weights. This module maps its ``config.json`` (as a dict) to a ``GlmConfig`` and back,
its weights to ``GlmForCausalLM``'s names and back, and peft LoRA adapters of either to the other::

    config = glm_config(chatglm)                 # config.json as a dict -> GlmConfig, keeping the original
    state = native_weights(weights, chatglm, config, name=name)  # renamed and checked against config
    weights = to_chatglm(model.state_dict())     # back in the layout, q, k and v fused again
    chatglm = chatglm_config(model.config)       # the config.json to save with them

The weights, per layer N (``kv`` = ``kv_channels``, ``h`` heads, ``g`` = ``multi_query_group_num``)::

    transformer.embedding.word_embeddings          model.embed_tokens
    ...layers.N.input_layernorm                    model.layers.N.input_layernorm
    ...layers.N.self_attention.query_key_value     rows [0, h*kv)            -> self_attn.q_proj
                                                   rows [h*kv, (h+g)*kv)     -> self_attn.k_proj
                                                   rows [(h+g)*kv, (h+2g)*kv) -> self_attn.v_proj
    ...layers.N.self_attention.dense               self_attn.o_proj
    ...layers.N.post_attention_layernorm           post_attention_layernorm
    ...layers.N.mlp.dense_h_to_4h                  mlp.gate_up_proj   (gate rows first, as GLM has them)
    ...layers.N.mlp.dense_4h_to_h                  mlp.down_proj
    transformer.encoder.final_layernorm            model.norm
    transformer.output_layer                       lm_head
    transformer.rotary_pos_emb.inv_freq            (dropped: recomputed from the config)

(``...`` is ``transformer.encoder``.) Anything else, in the weights or in ``config.json``, is refused in
one line naming it rather than guessed. Reading and writing the files is ``longalign.checkpoints``'s.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from longalign.errors import ConfigError, ModelError, as_json

if TYPE_CHECKING:
    from transformers import GlmConfig, PretrainedConfig

CHATGLM = "chatglm"  # the layout of GLM-4-9B's remote-code checkpoints (its model_type)
NATIVE = "native"  # a checkpoint transformers loads with its own classes
LAYOUTS = (NATIVE, CHATGLM)

ROPE_BASE = 10000.0  # rope theta = ROPE_BASE x rope_ratio

# config.json keys of the layout, by what the mapping does with them.
_MAPPED = {
    "padded_vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "multi_query_group_num": "num_key_value_heads",
    "kv_channels": "head_dim",
    "layernorm_epsilon": "rms_norm_eps",
    "seq_length": "max_position_embeddings",
    "add_qkv_bias": "attention_bias",
    "attention_dropout": "attention_dropout",
    "pad_token_id": "pad_token_id",
    "eos_token_id": "eos_token_id",
    "bos_token_id": "bos_token_id",
    "use_cache": "use_cache",
}
# Settings the mapping holds fixed: another value changes the math GlmForCausalLM computes.
_FIXED = {
    "multi_query_attention": True,
    "add_bias_linear": False,
    "apply_residual_connection_post_layernorm": False,
    "rmsnorm": True,
    "post_layer_norm": True,
    "fp32_residual_connection": False,
    "original_rope": True,
    "tie_word_embeddings": False,
    "hidden_dropout": 0.0,
    "pre_seq_len": None,
    "prefix_projection": False,
    "quantization_bit": 0,
    "rope_scaling": None,
}
# Keys that do not change the math: names, code pointers, kernels, and the query-key layer scaling that
# the fp32 softmax multiplies back out.
_IGNORED = {
    "_name_or_path",
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "attn_implementation",
    "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32",
    "bias_dropout_fusion",
    "classifier_dropout",
    "num_hidden_layers",  # checked against num_layers
    "vocab_size",  # the tokenizer's size; the embedding has padded_vocab_size rows
    "rope_ratio",  # read into rope_parameters
}
# The remote code's names, for a config.json written from a native model.
_CHATGLM_AUTO_MAP = {
    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
}
RECORD_KEY = "chatglm_config"  # in a native config.json: the ChatGLM config.json it was converted from


# --- config ------------------------------------------------------------------------------------------------


def glm_config(chatglm: Mapping[str, Any], name: str = "config.json") -> GlmConfig:
    """transformers' ``GlmConfig`` for a ChatGLM-layout ``config.json``; a key it cannot map is an error.

    The original is kept as ``chatglm_config`` so that a native copy converts back to it unchanged.
    """
    from transformers import GlmConfig

    if chatglm.get("rope_ratio") is None:
        raise ModelError(
            f"{name}: no rope_ratio, so the RoPE base of this ChatGLM checkpoint (ChatGLM2/3-6B) is fixed in its "
            "modeling code, not in its config; longalign does not guess it"
        )
    for key in ("padded_vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads"):
        if key not in chatglm:
            raise ModelError(f"{name}: {key} is missing")
    for key, value in chatglm.items():
        if key in _FIXED and value != _FIXED[key] and not (value is None and _FIXED[key] in (0, False)):
            raise ModelError(
                f"{name}: {key} = {as_json(value)} is not supported (GlmForCausalLM computes "
                f"{key} = {as_json(_FIXED[key])})"
            )
        if key not in _MAPPED and key not in _FIXED and key not in _IGNORED:
            raise ModelError(
                f"{name}: {key} is a ChatGLM setting longalign does not map; refusing to guess it"
            )
    layers = chatglm.get("num_hidden_layers", chatglm.get("num_layers"))
    if layers != chatglm.get("num_layers"):
        raise ModelError(f"{name}: num_hidden_layers = {layers} but num_layers = {chatglm.get('num_layers')}")
    settings = {target: chatglm[key] for key, target in _MAPPED.items() if key in chatglm}
    settings.setdefault("num_key_value_heads", chatglm["num_attention_heads"])
    settings.setdefault("head_dim", chatglm["hidden_size"] // chatglm["num_attention_heads"])
    dtype = chatglm.get("torch_dtype", chatglm.get("dtype"))
    return GlmConfig(
        **settings,
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ROPE_BASE * chatglm["rope_ratio"],
            "partial_rotary_factor": 0.5,
        },
        architectures=["GlmForCausalLM"],
        **({"dtype": dtype} if dtype else {}),
        **{RECORD_KEY: dict(chatglm)},
    )


def chatglm_config(config: PretrainedConfig) -> dict[str, Any]:
    """The ChatGLM-layout ``config.json`` of a ``GlmConfig``: the recorded original, else written from it."""
    recorded = getattr(config, RECORD_KEY, None)
    if recorded:
        return dict(recorded)
    if config.model_type != "glm":
        raise ModelError(
            f"a {config.model_type!r} model has no ChatGLM layout (only GlmForCausalLM, model type 'glm', has one)"
        )
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor") != 0.5:
        raise ModelError(
            f"rope_parameters = {rope}: the ChatGLM layout rotates half of each head with plain RoPE"
        )
    if config.hidden_act != "silu" or config.tie_word_embeddings:
        raise ModelError("the ChatGLM layout has a SwiGLU MLP and an untied output layer")
    dtype = config.dtype if isinstance(config.dtype, str) or config.dtype is None else str(config.dtype)
    return {
        "architectures": ["ChatGLMModel"],
        "auto_map": dict(_CHATGLM_AUTO_MAP),
        "model_type": CHATGLM,
        **{key: getattr(config, target) for key, target in _MAPPED.items()},
        "num_hidden_layers": config.num_hidden_layers,
        "rope_ratio": rope["rope_theta"] / ROPE_BASE,
        **{key: value for key, value in _FIXED.items() if key not in ("pre_seq_len", "rope_scaling")},
        "torch_dtype": dtype.removeprefix("torch.") if dtype else "float32",
    }


# --- config overrides, back onto config.json ---------------------------------------------------------------


def override_chatglm_config(
    record: Mapping[str, Any], config: GlmConfig, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The ChatGLM ``config.json`` ``record`` with the overridden keys of ``config`` mapped back onto it.

    ``max_position_embeddings`` goes back as ``seq_length``, plain RoPE's base as ``rope_ratio``; what the
    layout cannot hold (YaRN, another rotary share, a key it has no place for) is a ``ConfigError``::

        record {"seq_length": 8192, "rope_ratio": 1.0, ...}
        overrides max_position_embeddings = 32768, rope_theta = 5e5
            -> {"seq_length": 32768, "rope_ratio": 50.0, ...}
    """
    out = dict(record)
    names = {native: chatglm for chatglm, native in _MAPPED.items()}
    fix = 'set model.save_format = "native" to train and save it as GlmForCausalLM'
    for key in overrides:
        if key in ("rope_theta", "rope_parameters"):
            rope = config.rope_parameters or {}
            plain = {
                "rope_type": "default",
                "rope_theta": rope.get("rope_theta"),
                "partial_rotary_factor": 0.5,
            }
            if rope != plain:
                raise ConfigError(
                    f"model.config_overrides.{key}: the ChatGLM layout holds plain RoPE on half of each head, base "
                    f"{ROPE_BASE:g} x rope_ratio, not rope_parameters = {as_json(rope)}; {fix}"
                )
            out["rope_ratio"] = rope["rope_theta"] / ROPE_BASE
        elif config.attribute_map.get(key, key) in names:
            out[names[config.attribute_map.get(key, key)]] = getattr(config, key)
        else:
            raise ConfigError(f"model.config_overrides.{key}: the ChatGLM layout has no place for it; {fix}")
    return out


# --- weights -----------------------------------------------------------------------------------------------

_LAYER = re.compile(r"transformer\.encoder\.layers\.(\d+)\.(.+)")
_LAYER_NAMES = {  # ChatGLM name inside a layer -> GLM name inside a layer, for the one-to-one weights
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.dense_h_to_4h.weight": "mlp.gate_up_proj.weight",
    "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "transformer.encoder.final_layernorm.weight": "model.norm.weight",
    "transformer.output_layer.weight": "lm_head.weight",
}
_DROPPED = "transformer.rotary_pos_emb.inv_freq"


def _qkv_rows(config: Mapping[str, Any]) -> list[int]:
    """Rows of ``query_key_value`` for q, k and v: heads x kv_channels, then groups x kv_channels twice."""
    head_dim = config.get("kv_channels") or config["hidden_size"] // config["num_attention_heads"]
    groups = config.get("multi_query_group_num", config["num_attention_heads"])
    return [config["num_attention_heads"] * head_dim, groups * head_dim, groups * head_dim]


def to_native(state: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """ChatGLM weight names -> ``GlmForCausalLM``'s (the fused qkv split by rows); views, no copies.

    ``transformer.encoder.layers.0.self_attention.query_key_value.weight [(h+2g)*kv, H]`` becomes
    ``model.layers.0.self_attn.{q,k,v}_proj.weight`` of ``[h*kv, H]``, ``[g*kv, H]``, ``[g*kv, H]``.
    """
    rows = _qkv_rows(config)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key == _DROPPED:
            continue
        if key in _TOP_NAMES:
            out[_TOP_NAMES[key]] = tensor
            continue
        match = _LAYER.fullmatch(key)
        inner = match.group(2) if match else None
        if inner in _LAYER_NAMES:
            out[f"model.layers.{match.group(1)}.{_LAYER_NAMES[inner]}"] = tensor
        elif inner in ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias"):
            if tensor.shape[0] != sum(rows):
                raise ModelError(
                    f"{key}: {tensor.shape[0]} rows, but the config gives heads, groups and kv_channels for "
                    f"{sum(rows)} ({' + '.join(map(str, rows))})"
                )
            kind = inner.rsplit(".", 1)[1]
            for part, name in zip(torch.split(tensor, rows), ("q_proj", "k_proj", "v_proj"), strict=True):
                out[f"model.layers.{match.group(1)}.self_attn.{name}.{kind}"] = part
        else:
            raise ModelError(
                f"{key}: a ChatGLM weight that GlmForCausalLM has no place for; refusing to guess"
            )
    return out


def to_chatglm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``GlmForCausalLM``'s weight names -> the ChatGLM layout (q, k, v fused again by rows)."""
    top = {native: chatglm for chatglm, native in _TOP_NAMES.items()}
    inner = {native: chatglm for chatglm, native in _LAYER_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if key in top:
            out[top[key]] = tensor
        elif match and match.group(2) in inner:
            out[f"transformer.encoder.layers.{match.group(1)}.{inner[match.group(2)]}"] = tensor
        elif match and (part := re.fullmatch(r"self_attn\.([qkv])_proj\.(weight|bias)", match.group(2))):
            target = f"transformer.encoder.layers.{match.group(1)}.self_attention.query_key_value.{part[2]}"
            fused.setdefault(target, {})[part[1]] = tensor
        else:
            raise ModelError(f"{key}: a GlmForCausalLM weight that the ChatGLM layout has no place for")
    for target, parts in fused.items():
        if set(parts) != {"q", "k", "v"}:
            raise ModelError(f"{target}: needs q, k and v; got {', '.join(sorted(parts))}")
        out[target] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def native_weights(
    state: Mapping[str, torch.Tensor], chatglm: Mapping[str, Any], config: GlmConfig, *, name: str
) -> dict[str, torch.Tensor]:
    """ChatGLM weights under ``GlmForCausalLM``'s names, checked name by name and shape by shape against ``config``."""
    from transformers import GlmForCausalLM

    native = to_native(state, chatglm)
    with torch.device("meta"):
        expected = {key: tensor.shape for key, tensor in GlmForCausalLM(config).state_dict().items()}
    for key in sorted(expected.keys() - native.keys()):
        raise ModelError(f"{name}: no weight for {key} (a ChatGLM checkpoint with a part missing?)")
    for key, shape in expected.items():
        if native[key].shape != shape:
            raise ModelError(
                f"{name}: {key} has shape {list(native[key].shape)}, config.json gives {list(shape)}"
            )
    return native


# --- adapters ----------------------------------------------------------------------------------------------


def module_to_chatglm(name: str) -> str:
    """A ``GlmForCausalLM`` module's name in the ChatGLM layout (``model.norm`` -> ``transformer.encoder.final_layernorm``)."""
    top = {native[:-7]: chatglm[:-7] for chatglm, native in _TOP_NAMES.items()}
    inner = {native[:-7]: chatglm[:-7] for chatglm, native in _LAYER_NAMES.items()}
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if name in top:
        return top[name]
    if match and match[2] in inner:
        return f"transformer.encoder.layers.{match[1]}.{inner[match[2]]}"
    raise ModelError(f"{name}: a GlmForCausalLM module with no single counterpart in the ChatGLM layout")


def module_to_native(name: str) -> str:
    """A ChatGLM-layout module's name in ``GlmForCausalLM`` (the inverse of :func:`module_to_chatglm`)."""
    top = {chatglm[:-7]: native[:-7] for chatglm, native in _TOP_NAMES.items()}
    inner = {chatglm[:-7]: native[:-7] for chatglm, native in _LAYER_NAMES.items()}
    match = _LAYER.fullmatch(name)
    if name in top:
        return top[name]
    if match and match[2] in inner:
        return f"model.layers.{match[1]}.{inner[match[2]]}"
    raise ModelError(f"{name}: a ChatGLM module with no single counterpart in GlmForCausalLM")


PEFT_PREFIX = "base_model.model."  # peft's prefix of every saved adapter tensor
_QKV_MODULE = "self_attention.query_key_value"
_ADAPTER_TARGETS = {
    "q_proj": "query_key_value",
    "k_proj": "query_key_value",
    "v_proj": "query_key_value",
    "o_proj": "dense",
    "gate_up_proj": "dense_h_to_4h",
    "down_proj": "dense_4h_to_h",
}
_LORA = re.compile(r"(.+)\.lora_([AB])\.weight")


def _check_plain_lora(settings: Mapping[str, Any], *, patterns: bool) -> None:
    for key in (
        "use_dora",
        "use_rslora",
        "lora_bias",
        "fan_in_fan_out",
        "layers_to_transform",
        "trainable_token_indices",
    ):
        if settings.get(key):
            raise ModelError(
                f"adapter_config.json: {key} = {as_json(settings[key])}: only plain LoRA adapters change layout"
            )
    for key in ("rank_pattern", "alpha_pattern") if patterns else ():
        if settings.get(key):
            raise ModelError(f"adapter_config.json: {key} is set: only adapters with one rank change layout")
    if not isinstance(settings.get("target_modules"), list):
        raise ModelError(
            "adapter_config.json: target_modules must be a list of module names to change layout"
        )


def adapter_to_chatglm(
    state: Mapping[str, torch.Tensor], settings: Mapping[str, Any], chatglm: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A peft LoRA adapter of ``GlmForCausalLM`` -> the same adapter for the ChatGLM layout (tensors, config).

    The q, k and v adapters of a layer become one adapter on ``query_key_value`` that makes the same
    update ``B A x alpha / r``: their A matrices stacked, their B matrices on the block diagonal, rank and
    alpha times the number of adapted projections (``rank_pattern``, ``alpha_pattern``)::

        q: A_q [r, H], B_q [h*kv, r]               query_key_value: A [3r, H] = [A_q; A_k; A_v]
        k: A_k [r, H], B_k [g*kv, r]      ->                         B [(h+2g)*kv, 3r] = diag(B_q, B_k, B_v)
        v: A_v [r, H], B_v [g*kv, r]                                 rank 3r, alpha 3 x alpha
    """
    _check_plain_lora(settings, patterns=True)
    rank, alpha = settings["r"], settings["lora_alpha"]
    rows = dict(zip("qkv", _qkv_rows(chatglm), strict=True))
    starts = {"q": 0, "k": rows["q"], "v": rows["q"] + rows["k"]}
    out: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}  # modules trained whole (modules_to_save)
    fused: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # layer -> projection -> A/B
    for key, tensor in state.items():
        inner = key.removeprefix(PEFT_PREFIX)
        lora = _LORA.fullmatch(inner)
        qkv = lora and re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj", lora[1])
        if qkv:
            fused.setdefault(qkv[1], {}).setdefault(qkv[2], {})[lora[2]] = tensor
        elif lora:
            out[f"{PEFT_PREFIX}{module_to_chatglm(lora[1])}.lora_{lora[2]}.weight"] = tensor
        else:
            whole[inner] = tensor
    out |= {PEFT_PREFIX + key: tensor for key, tensor in to_chatglm(whole).items()}
    adapted = [part for part in "qkv" if f"{part}_proj" in settings["target_modules"]]
    for layer, parts in fused.items():
        a = torch.cat([parts[part]["A"] for part in adapted])
        b = a.new_zeros(sum(rows.values()), len(adapted) * rank)
        for i, part in enumerate(adapted):
            b[starts[part] : starts[part] + rows[part], i * rank : (i + 1) * rank] = parts[part]["B"]
        prefix = f"{PEFT_PREFIX}transformer.encoder.layers.{layer}.{_QKV_MODULE}"
        out |= {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}
    for target in settings["target_modules"]:
        if target not in _ADAPTER_TARGETS:
            raise ModelError(
                f"adapter_config.json: target module {target!r} has no counterpart in the ChatGLM layout"
            )
    converted = dict(settings)
    converted["target_modules"] = sorted({_ADAPTER_TARGETS[target] for target in settings["target_modules"]})
    converted["modules_to_save"] = [
        module_to_chatglm(name) for name in settings.get("modules_to_save") or []
    ] or None
    if adapted:
        converted["rank_pattern"] = {"query_key_value": rank * len(adapted)}
        converted["alpha_pattern"] = {"query_key_value": alpha * len(adapted)}
    return out, converted


def adapter_to_native(
    state: Mapping[str, torch.Tensor], settings: Mapping[str, Any], chatglm: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A peft LoRA adapter for the ChatGLM layout -> the same adapter for ``GlmForCausalLM``.

    The ``query_key_value`` adapter (rank R) becomes three of rank R on q, k and v that share its A and
    take their rows of its B: ``B_q A`` is the q rows of ``B A``, exactly.
    """
    _check_plain_lora(settings, patterns=False)
    rank = settings.get("rank_pattern", {}).get("query_key_value", settings["r"])
    alpha = settings.get("alpha_pattern", {}).get("query_key_value", settings["lora_alpha"])
    native_targets = {
        value: key for key, value in _ADAPTER_TARGETS.items() if key not in ("k_proj", "v_proj")
    }
    out: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        inner = key.removeprefix(PEFT_PREFIX)
        lora = _LORA.fullmatch(inner)
        layer = lora and _LAYER.fullmatch(lora[1])
        if layer and layer[2] == _QKV_MODULE:
            parts = torch.split(tensor, _qkv_rows(chatglm)) if lora[2] == "B" else (tensor, tensor, tensor)
            for part, value in zip("qkv", parts, strict=True):
                out[f"{PEFT_PREFIX}model.layers.{layer[1]}.self_attn.{part}_proj.lora_{lora[2]}.weight"] = (
                    value.clone()
                )
        elif lora:
            out[f"{PEFT_PREFIX}{module_to_native(lora[1])}.lora_{lora[2]}.weight"] = tensor
        else:
            whole[inner] = tensor
    out |= {PEFT_PREFIX + key: tensor for key, tensor in to_native(whole, chatglm).items()}
    for target in settings["target_modules"]:
        if target not in native_targets:
            raise ModelError(
                f"adapter_config.json: target module {target!r} has no counterpart in GlmForCausalLM"
            )
    converted = dict(settings)
    targets = [native_targets[target] for target in settings["target_modules"]]
    if "q_proj" in targets:
        targets += ["k_proj", "v_proj"]
        converted["rank_pattern"] = dict.fromkeys(("q_proj", "k_proj", "v_proj"), rank)
        converted["alpha_pattern"] = dict.fromkeys(("q_proj", "k_proj", "v_proj"), alpha)
    converted["target_modules"] = sorted(targets)
    converted["modules_to_save"] = [
        module_to_native(name) for name in settings.get("modules_to_save") or []
    ] or None
    return out, converted
