"""Tiny configs of every causal-LM family of the installed transformers, built from each family's own
config class: the registry test's models (``tests/test_families.py``).

``tiny_config(model_type)`` shrinks the family's default config by field name (hidden 64, 4 heads and 2
key/value heads of 16, intermediate 128, vocabulary 512, 4 experts with top-2, windows and attention chunks
of 16 tokens so that they are shorter than the samples, dropout off, special token ids below 8), with as few
layers as still show every kind of layer of the default (a NoPE layer every 4th, hybrid patterns); a few
families need a fix the rules cannot know (``FAMILY_FIXES``, each with its reason). ``build(config)`` makes
the float64 eager model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

VOCAB = 512
LENGTHS = (45, 70, 29)
WINDOW = 16  # sliding windows, attention chunks, SSM / lightning chunks: shorter than every sample
MAX_LAYERS = 8  # never more layers than this, whatever the per-layer patterns ask for
FIRST_SAFE_ID = 8  # special token ids are remapped below this; sample ids are drawn from [8, VOCAB)

# ---------------------------------------------------------------------------------------------------------
# Generic shrinking: (regex on the field name, new value or function of the old value). First match wins;
# applied to every int/float field of the config and of every nested sub-config (text, vision, audio...).
# ---------------------------------------------------------------------------------------------------------
_KEEP = object()


def _positive(new):
    """``new`` where the default is positive (0 / -1 often mean "off" or "derive it")."""
    return lambda old: new if isinstance(old, int | float) and old > 0 else old


def _at_most(new):
    return lambda old: min(old, new) if isinstance(old, int | float) and old > 0 else old


RULES: list[tuple[str, object]] = [
    # fields that look like sizes but are not, or must stay as they are
    (
        r"^(type_vocab_size|task_type_vocab_size|n_langs|num_labels|num_codebooks|num_chroma|"
        r"chunk_size_feed_forward|chunk_size_lm_head|intermediate_multiple_size|num_hashes|"
        r"make_ngram_vocab_size_divisible_by|ngram_size|ngram|num_buckets|rescale_every|"
        r"max_position_embeddings|original_max_position_embeddings|n_positions|n_ctx|max_seq_len|"
        r"context_length|max_source_positions|max_target_positions|model_max_length|position_bias_.*|"
        r"relative_max_distance|floor_scale|log_scaling_n_floor|rel_extent|num_logits_to_keep|"
        r"prompt_length|prompt_types|segment_types|seed|hc_count|hc_mult|hc_sinkhorn_iters|"
        r"block_multiple_of|ffn_round_up_to_multiple_of|mask_.*|max_inference_chunksize|"
        r"num_mel_bins|num_nextn_predict_layers|classifier_proj_size|median_filter_width|"
        r"altup_.*|patch_size|image_size|num_channels|.*_token_index|image_token_id|.*cycles|"
        r"loop_num_passes|n_recurrent_loops|cca_time\d|num_mem_blocks)$",
        _KEEP,
    ),
    # dropout and noise: off
    (r"(dropout|pdrop|drop_prob|layerdrop|jitter)", lambda old: 0.0 if isinstance(old, float) else old),
    # vocabularies
    (
        r"^(vocab_size|.*_vocab_size|vocab_size_.*|unpadded_vocab_size|encoder_hash_byte_group_vocab|"
        r"ngram_vocab_size_base)$",
        _positive(VOCAB),
    ),
    # MoE (before the *_size rules)
    (r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts)$", _positive(4)),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_k|moe_topk|top_k|router_top_k)$", _at_most(2)),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts|zero_expert_num)$", _at_most(1)),
    (r"^(n_group|num_expert_group|topk_group)$", _at_most(1)),
    (r"^(moe_intermediate_size|expert_ffn_hidden_size|moe_shared_expert_intermediate_size)$", _positive(32)),
    (r"(shared_expert.*intermediate_size|shared_intermediate_size)$", _positive(32)),
    # MLA / low rank
    (r"^(q_lora_rank|kv_lora_rank|o_lora_rank)$", _positive(32)),
    (r"^qk_head_dim$", _positive(32)),  # qk_nope_head_dim + qk_rope_head_dim
    (r"_rank$", _positive(16)),
    # head dims (before hidden sizes: "attention_head_size" is a head dim)
    (r"(head_dim|headdim|d_head|dim_head|attention_head_size|kv_channels|mamba_d_head)$", _positive(16)),
    (r"^rotary_dim$", _positive(8)),  # partial rotary (CodeGen, GPT-J): half of the 16-wide head
    # hidden sizes
    (
        r"^(hidden_size|d_model|n_embd|emb_dim|embedding_dim|embedding_size|word_embed_proj_dim|"
        r"input_embedding_size|output_embedding_size|attention_hidden_size|lru_width|router_hidden_size|"
        r"ple_embed_dim|pronunciation_embed_dim|shape_embed_dim|d_rel|prompt_mid_dim)$",
        _positive(64),
    ),
    (r"^hidden_size_per_layer_input$", _positive(16)),
    # feed-forward sizes
    (
        r"(intermediate_size|ffn_dim|ffn_hidden_size|^dff$|^dim_ff$|^d_inner$|feed_forward_size|"
        r"intermediate_size_mlp|^mamba_d_ssm$)",
        _positive(128),
    ),
    # heads
    (
        r"(key_value_heads|^num_kv_heads$|^num_query_groups$|^multi_query_group_num$|linear_num_key_heads)",
        _positive(2),
    ),
    (
        r"(attention_heads|^n_head$|^n_heads$|^num_heads$|^attention_heads$|linear_num_heads|"
        r"linear_num_value_heads|index_n_heads|heads_per_ngram|n_mamba_heads|mamba_n_heads|"
        r"mamba_num_heads)",
        _positive(4),
    ),
    (r"^(index_topk|index_topk_blocks)$", _at_most(8)),
    (r"^(index_block_size)$", _at_most(WINDOW)),
    # windows and chunks: shorter than the samples
    (
        r"^(sliding_window|attention_chunk_size|sliding_window_size|attention_window_size|window_size|"
        r"local_attention|keep_window_size|local_attention_window_len|local_attn_chunk_length|"
        r"lsh_attn_chunk_length|chunk_size|mamba_chunk_size|block_size)$",
        _positive(WINDOW),
    ),
    # state-space sizes
    (r"^(state_size|mamba_d_state|ssm_state_size)$", _positive(16)),
    (r"^(n_groups|mamba_n_groups|mamba_ngroups)$", _at_most(1)),
    # split_ngram_parts etc.
    (r"^split_ngram_parts$", _at_most(4)),
]
_COMPILED = [(re.compile(pattern), action) for pattern, action in RULES]

LAYER_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_blocks",
)
TOKEN_IDS = {
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "sep_token_id": 3,
    "cls_token_id": 4,
    "mask_token_id": 5,
    "eod_token_id": 2,
    "forced_eos_token_id": 2,
    "unk_token_id": 6,
    "forced_bos_token_id": 1,
}

# Scalar layer patterns that the config turns into per-layer kinds: shrunk so a few layers show every kind.
LAYER_PATTERN_FIELDS = {
    "first_k_dense_replace": _at_most(1),
    "num_dense_layers": _at_most(1),
    "moe_layer_start_index": _at_most(1),
    "num_kv_shared_layers": _at_most(1),
    "max_window_layers": _at_most(1),
    "n_layers_per_attn_res_block": _at_most(2),
    "layer_group_size": _at_most(2),
}
# Scalar patterns kept as the family has them: enough layers are built to show them.
KEPT_PATTERNS = (
    "no_rope_layer_interval",
    "global_attn_every_n_layers",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "full_attention_interval",
    "interleave_moe_layer_step",
    "decoder_sparse_step",
    "moe_layer_interval",
    "layer_group_size",
)
OFFSET_PATTERNS = (
    "first_k_dense_replace",
    "num_dense_layers",
    "attn_layer_offset",
    "expert_layer_offset",
    "num_kv_shared_layers",
    "moe_layer_start_index",
    "max_window_layers",
)

# Fields the model needs that some default configs leave None (their models then fail to build).
FILL_NONE = {
    "head_dim": 16,
    "num_key_value_heads": 2,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
}
# Derived fields that the rules set on purpose (so they are not handed back to the config to derive).
KEEP_DERIVED = {
    "num_key_value_heads",
    "num_kv_heads",
    "head_dim",
    "rope_parameters",
    "eos_token_id",
    "bos_token_id",
    "pad_token_id",
    "initializer_range",
    "embedding_initializer_range",
}
BASE_FIELDS = {f.name for f in dataclasses.fields(PreTrainedConfig)} | {
    "_name_or_path",
    "model_type",
    "output_attentions",
    "transformers_version",
}

# ---------------------------------------------------------------------------------------------------------
# Per-family fixes: only where the generic rules cannot know a family's constraint. Each says why.
# Values are dicts deep-merged into the shrunk config dict (None deletes nothing, it sets None).
# ---------------------------------------------------------------------------------------------------------


def _mamba2_heads(d):
    """Mamba2 mixers: heads x head_dim must equal expand x hidden (128 = 8 heads x 16)."""
    for heads, head in (
        ("num_heads", "head_dim"),
        ("mamba_n_heads", "mamba_d_head"),
        ("mamba_num_heads", "mamba_head_dim"),
        ("n_mamba_heads", "mamba_headdim"),
    ):
        if isinstance(d.get(heads), int) and isinstance(d.get(head), int):
            expand = d.get("expand", d.get("mamba_expand", 2))
            d[heads] = expand * d.get("hidden_size", 64) // d[head]


def _zamba2(d):
    # Zamba2: mamba_headdim is derived (2 x hidden / n_mamba_heads); heads 8 gives 16. Its first hybrid
    # (shared attention) layer is the 7th: two layers show both kinds.
    d["n_mamba_heads"] = 8
    d["num_hidden_layers"], d["layers_block_type"] = 2, ["linear_attention", "hybrid"]


def _zamba(d):
    # Zamba ties one shared attention block across its hybrid layers and fails to build with a single
    # hybrid layer: hybrid layers 1 and 3 of 4.
    d.update(
        num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]
    )


def _gemma4_assistant(d):
    # Gemma 4 assistant (a drafter): every layer shares the target model's KV.
    d["text_config"]["num_kv_shared_layers"] = d["text_config"]["num_hidden_layers"]
    if "backbone_hidden_size" in d:
        d["backbone_hidden_size"] = 64


FAMILY_FIXES: dict[str, object] = {
    "gemma4_assistant": _gemma4_assistant,
    "gemma4_unified_assistant": _gemma4_assistant,
    # Mamba2-style SSMs: heads x head_dim = expand x hidden.
    "mamba2": _mamba2_heads,
    "bamba": _mamba2_heads,
    "granitemoehybrid": _mamba2_heads,
    "nemotron_h": _mamba2_heads,
    "falcon_h1": _mamba2_heads,
    "zamba2": _zamba2,
    "zamba": _zamba,
    # Dory: input + recurrent + output layers must add up to num_hidden_layers.
    # (its layer_types are derived from those counts: left to the config)
    # (every 4th layer is full attention: 4 layers)
    "dory": {
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "num_hidden_layers": 4,
        "layer_types": None,
    },
    # GPT-Neo: attention_layers is expanded from attention_types ([["global", "local"], 12] = 24 layers).
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Reformer: axial position embedding dims must add up to hidden_size, and the axial shape must
    # cover the longest input (256 >= 144 tokens).
    # (Its reversible layers still refuse backward in eval mode, and train mode wants every sample a
    # multiple of the chunk length: the survey records that as the reference's crash.)
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [16, 16]},
    # LFM2 / LFM2-MoE: the default config has no conv layers (lfm2: all attention; lfm2_moe: None, which
    # does not build); real checkpoints interleave short convolutions with attention.
    "lfm2": {"full_attn_idxs": [1], "layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # DBRX: the modeling reads attn_config.rope_theta, which its config class no longer has.
    # (and attention without clip_qkv crashes in clamp(min=None, max=None); real DBRX clips at 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
    # Qwen4-Exp: its indexed-attention (QSA) fields default to None, and the model needs them.
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    "qwen4_exp": {
        "text_config": {
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 16,
            "indexer_compress_ratio": 4,
        }
    },
    # Cohere Compass text: default config has no rope_parameters, the model needs one per layer type.
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    # dots3 (MLA): its sliding layers' head_dim must be their qk_nope (an override, 32 here) + qk_rope (16).
    "dots3_note_text": {"head_dim": 48},
    "dots3_note": {"text_config": {"head_dim": 48}},
}
# Keyword arguments for configs whose default instance does not validate.
DEFAULT_KWARGS: dict[str, dict] = {
    # Gemma 4 assistant (drafter): its text config must have no per-layer inputs and share every layer's KV.
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        }
    },
}


HIDDEN_NAMES = ("hidden_size", "d_model", "n_embd")
_HIDDEN_SIZES: set[int] = set()  # the default config tree's hidden sizes, while one config is shrunk


def _shrink_value(name, value):
    for pattern, action in _COMPILED:
        if pattern.search(name):
            if action is _KEEP:
                return value
            return action(value) if callable(action) else action
    # a field no rule knows that has a hidden size's value (adapter_in_dim, projector dims) is one
    if isinstance(value, int) and not isinstance(value, bool) and value >= 256 and value in _HIDDEN_SIZES:
        return 64
    return value


def _hidden_sizes(d):
    found = {v for k, v in d.items() if k in HIDDEN_NAMES and isinstance(v, int)}
    for v in d.values():
        if isinstance(v, dict):
            found |= _hidden_sizes(v)
    return found


def _is_number(value):
    return isinstance(value, int | float) and not isinstance(value, bool)


def _layer_count(d):
    for name in LAYER_FIELDS:
        if isinstance(d.get(name), int) and d[name] > 0:
            return name, d[name]
    return None, None


def _covering_prefix(values):
    """The shortest prefix of ``values`` that holds every distinct value."""
    distinct = {json.dumps(v, sort_keys=True, default=str) for v in values}
    seen = set()
    for i, v in enumerate(values):
        seen.add(json.dumps(v, sort_keys=True, default=str))
        if seen == distinct:
            return i + 1
    return len(values)


def _index_keys(value, total):
    """The layer indices of a dict keyed by layer index ("05": {...}), or None."""
    if not isinstance(value, dict) or not value:
        return None
    try:
        keys = [int(k) for k in value]
    except (TypeError, ValueError):
        return None
    return keys if all(0 <= k < total for k in keys) else None


def _is_index_list(field, value, total):
    return (
        all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and all(0 <= v < total for v in value)
        and value == sorted(set(value))
        and re.search(r"layer|idx|ids", field) is not None
    )


def _layers_needed(d):
    """How many layers show every per-layer kind of the default config (at least 2, at most MAX_LAYERS)."""
    _, total = _layer_count(d)
    if total is None:
        return None
    need = 2
    for field, value in d.items():
        if field in LAYER_FIELDS or field in BASE_FIELDS:
            continue
        if isinstance(value, list) and value:
            if _is_index_list(field, value, total):
                need = max(need, _covering_prefix([i in value for i in range(total)]))
            elif len(value) == total and total > 2:
                need = max(need, _covering_prefix(value))
        keys = _index_keys(value, total)
        if keys is not None and total > 2:
            need = max(need, _covering_prefix([i in keys for i in range(total)]))
    shrunk = {f: fn(d[f]) for f, fn in LAYER_PATTERN_FIELDS.items() if _is_number(d.get(f))}
    for field in KEPT_PATTERNS:
        value = shrunk.get(field, d.get(field))
        if _is_number(value) and 1 < value <= MAX_LAYERS:
            need = max(need, int(value))
    for field in OFFSET_PATTERNS:
        value = shrunk.get(field, d.get(field))
        if _is_number(value) and value > 0:
            need = max(need, int(value) + 1 + (1 if field == "num_kv_shared_layers" else 0))
    return min(need, MAX_LAYERS, total)


def _config_class(d, fallback=None):
    model_type = d.get("model_type")
    if model_type and model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    return fallback


def _derived_extras(cls, d):
    """Keys of ``d`` that are no field of ``cls`` and that ``cls`` derives again when left out (attention
    sizes computed from hidden_size, ...): they must be left out of the tiny config, or they keep the
    default's value."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    fields = {f.name for f in dataclasses.fields(cls)}
    fields |= set(getattr(cls, "attribute_map", {}).values())  # stored under the alias's target name
    found = []
    for key in d:
        if key in fields or key in BASE_FIELDS or isinstance(d[key], dict) and key.endswith("config"):
            continue
        try:
            rebuilt = cls.from_dict({k: v for k, v in d.items() if k != key})
        except Exception:  # noqa: BLE001 - not derivable without it
            continue
        if getattr(rebuilt, key, _KEEP) == d[key]:
            found.append(key)
    return found


def _derived_fields(cls, d):
    """Fields declared None in ``cls`` that the default instance filled in (layer_types from a pattern,
    sizes from hidden_size): handed back as None so the class derives them for the tiny sizes."""
    if cls is None or not dataclasses.is_dataclass(cls):
        return []
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is None
        and f.name not in BASE_FIELDS
        and f.name not in KEEP_DERIVED
        and d.get(f.name) is not None
        and not isinstance(d.get(f.name), dict | list)
    ]


def _fix_token_ids(d):
    for field, value in list(d.items()):
        if not field.endswith("_token_id"):
            continue
        target = TOKEN_IDS.get(field, 7)
        if _is_number(value) and value >= FIRST_SAFE_ID:
            d[field] = target
        elif isinstance(value, list) and any(_is_number(v) and v >= FIRST_SAFE_ID for v in value):
            kept = [v for v in value if _is_number(v) and v < FIRST_SAFE_ID]
            d[field] = kept or [target]


def _shrink_dict(d, cls):
    """Shrink one config dict in place (recursing into sub-configs); ``cls`` is its config class."""
    name, total = _layer_count(d)
    need = _layers_needed(d)
    original = dict(d)
    # MLA families keep as many key/value heads as query heads (their eager attention needs it).
    mha = [
        kv
        for kv in d
        if "key_value_heads" in kv
        and isinstance(d[kv], int)
        and d[kv] == d.get(kv.replace("key_value", "attention"))
        and d.get("kv_lora_rank")
    ]
    for key in _derived_extras(cls, d):
        del d[key]
    for key in _derived_fields(cls, d):
        d[key] = None
    for key, value in list(d.items()):
        if isinstance(value, dict) and total and _index_keys(value, total) is not None:
            pass  # per-layer overrides: below
        elif isinstance(value, dict) and (
            "model_type" in value
            or key.endswith("config")
            or key
            in ("text_config", "vision_config", "audio_config", "decoder", "text_encoder", "audio_encoder")
        ):
            _shrink_dict(value, _config_class(value, _sub_config_class(cls, key)))
        elif _is_number(value):
            d[key] = _shrink_value(key, value)
        elif isinstance(value, list) and value and all(_is_number(v) for v in value):
            d[key] = [_shrink_value(key, v) for v in value]
    for key, value in list(d.items()):  # after the base fields, which the overrides are compared with
        if (
            total and key not in BASE_FIELDS and _index_keys(value, total) is not None
        ):  # per-layer overrides keyed by layer index
            for override in value.values():
                if isinstance(override, dict):
                    before = dict(override)
                    for k, v in override.items():
                        if _is_number(v):
                            small = _shrink_value(k, v)
                            # keep the override different from the base (e.g. a larger global head_dim)
                            override[k] = small * 2 if small == d.get(k) and v != small else small
                    for kv in [k for k in before if "key_value_heads" in k]:
                        if before[kv] == before.get(kv.replace("key_value", "attention")):
                            override[kv] = override[kv.replace("key_value", "attention")]
    for field, fn in LAYER_PATTERN_FIELDS.items():
        if _is_number(d.get(field)):
            d[field] = fn(d[field])
    if need is not None:
        for field, value in list(d.items()):
            if field in LAYER_FIELDS or field in BASE_FIELDS or value is None:
                continue
            if isinstance(value, list) and value:
                if _is_index_list(field, value, total):
                    d[field] = [v for v in value if v < need]
                elif len(value) == total and total > 2:
                    d[field] = value[:need]
            keys = _index_keys(value, total)
            if keys is not None and total > 2:
                d[field] = {k: v for k, v in value.items() if int(k) < need}
        if isinstance(d.get("moe_layer_end_index"), int) and d["moe_layer_end_index"] >= need:
            d["moe_layer_end_index"] = need - 1
        for field in LAYER_FIELDS:
            if isinstance(d.get(field), int) and d[field] > 0:
                d[field] = need if field == name else min(d[field], need)
        if isinstance(d.get("encoder_layers"), int):
            d["encoder_layers"] = min(d["encoder_layers"], 2)
    for field, value in FILL_NONE.items():
        if field in d and d[field] is None:
            d[field] = value
    for kv in mha:
        d[kv] = d[kv.replace("key_value", "attention")]
    for field in ("head_dim", "swa_head_dim", "qk_head_dim"):  # head_dim = nope + rope in the family: keep
        if (
            field in d
            and _is_number(original.get(field))
            and _is_number(original.get("qk_nope_head_dim"))
            and original[field] == original["qk_nope_head_dim"] + original.get("qk_rope_head_dim", 0)
        ):
            d[field] = d["qk_nope_head_dim"] + d.get("qk_rope_head_dim", 0)
    _fix_token_ids(d)


def _sub_config_class(cls, key):
    spec = getattr(cls, "sub_configs", None) or {}
    sub = spec.get(key)
    return sub if isinstance(sub, type) else None


def _deep_update(d, extra):
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _deep_update(d[key], value)
        else:
            d[key] = value


def tiny_config(model_type: str):
    """The family's own config, shrunk to a tiny float64-friendly model (see module docstring)."""
    cls = CONFIG_MAPPING[model_type]
    default = cls(**copy.deepcopy(DEFAULT_KWARGS.get(model_type, {})))
    d = default.to_dict()
    for drop in ("transformers_version", "architectures", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(drop, None)
    _HIDDEN_SIZES.clear()
    _HIDDEN_SIZES.update(_hidden_sizes(d))
    _shrink_dict(d, cls)
    fix = FAMILY_FIXES.get(model_type)
    if callable(fix):
        fix(d)
    elif isinstance(fix, dict):
        _deep_update(d, copy.deepcopy(fix))
    config = cls.from_dict(d)
    for sub in {id(c): c for c in (config, _text_config(config))}.values():
        sub.use_cache = False
    return config


def causal_lm_class(config):
    """The causal-LM class of ``config``'s type, and the config it takes (a sub-config for some)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    wanted = getattr(model_cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return model_cls, config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, wanted):
            return model_cls, sub
    return model_cls, config


def build(config):
    """The float64 eager model of ``config`` (experts "eager": grouped_mm has no float64 CPU kernel)."""
    model_cls, model_config = causal_lm_class(config)
    options = dict(attn_implementation="eager", dtype=torch.float64, experts_implementation="eager")
    if model_config is config:
        return AutoModelForCausalLM.from_config(config, **options)
    return model_cls._from_config(model_config, **options)


def _text_config(config):
    try:
        return config.get_text_config()
    except Exception:  # noqa: BLE001 - several decoders (musicgen): the decoder
        return getattr(config, "decoder", config)
