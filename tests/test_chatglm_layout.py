"""The ChatGLM layout <-> GlmForCausalLM mapping on dicts and tensors in memory, no files.

Loading, saving and converting real checkpoint directories through it is tests/test_checkpoints.py's.
"""

from __future__ import annotations

import pytest
import torch

from longalign.chatglm_layout import (
    RECORD_KEY,
    chatglm_config,
    glm_config,
    override_chatglm_config,
    to_chatglm,
    to_native,
)
from longalign.errors import ConfigError, ModelError

# 4 heads of 8, 2 key-value groups: query_key_value has (4 + 2 x 2) x 8 = 64 rows.
CHATGLM = {
    "model_type": "chatglm",
    "padded_vocab_size": 32,
    "hidden_size": 32,
    "ffn_hidden_size": 48,
    "num_layers": 1,
    "num_attention_heads": 4,
    "multi_query_group_num": 2,
    "kv_channels": 8,
    "add_qkv_bias": True,
    "seq_length": 8192,
    "rope_ratio": 1.0,
}


def chatglm_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "transformer.embedding.word_embeddings.weight": (32, 32),
        "transformer.encoder.layers.0.input_layernorm.weight": (32,),
        "transformer.encoder.layers.0.self_attention.query_key_value.weight": (64, 32),
        "transformer.encoder.layers.0.self_attention.query_key_value.bias": (64,),
        "transformer.encoder.layers.0.self_attention.dense.weight": (32, 32),
        "transformer.encoder.layers.0.post_attention_layernorm.weight": (32,),
        "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight": (96, 32),
        "transformer.encoder.layers.0.mlp.dense_4h_to_h.weight": (32, 48),
        "transformer.encoder.final_layernorm.weight": (32,),
        "transformer.output_layer.weight": (32, 32),
    }
    return {key: torch.randn(shape, generator=gen, dtype=torch.float64) for key, shape in shapes.items()}


def test_the_fused_qkv_splits_by_rows_and_fuses_back_bit_exact():
    state = chatglm_weights()
    native = to_native(state | {"transformer.rotary_pos_emb.inv_freq": torch.ones(4)}, CHATGLM)
    qkv = "transformer.encoder.layers.0.self_attention.query_key_value"
    assert torch.equal(native["model.layers.0.self_attn.q_proj.weight"], state[f"{qkv}.weight"][:32])  # 4 x 8
    assert torch.equal(
        native["model.layers.0.self_attn.k_proj.weight"], state[f"{qkv}.weight"][32:48]
    )  # 2 x 8
    assert torch.equal(native["model.layers.0.self_attn.v_proj.bias"], state[f"{qkv}.bias"][48:])
    back = to_chatglm(native)
    assert back.keys() == state.keys()  # inv_freq dropped: recomputed from the config
    assert all(torch.equal(back[key], state[key]) for key in state)


def test_a_fused_qkv_of_the_wrong_size_or_with_a_part_missing_is_refused_by_name():
    state = chatglm_weights()
    key = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
    with pytest.raises(
        ModelError, match=f"{key}: 63 rows, but the config gives .* for 64 \\(32 \\+ 16 \\+ 16\\)"
    ):
        to_native(state | {key: state[key][:63]}, CHATGLM)
    with pytest.raises(ModelError, match=f"{key}: needs q, k and v; got k, v"):
        to_chatglm({name: t for name, t in to_native(state, CHATGLM).items() if "q_proj" not in name})


def test_the_config_maps_to_glm_config_and_back_to_its_original():
    config = glm_config(CHATGLM)
    assert (config.num_key_value_heads, config.head_dim, config.max_position_embeddings) == (2, 8, 8192)
    assert (
        config.rope_parameters["rope_theta"] == 10000.0
        and config.rope_parameters["partial_rotary_factor"] == 0.5
    )
    assert chatglm_config(config) == CHATGLM  # the recorded original, unchanged
    delattr(config, RECORD_KEY)
    written = chatglm_config(config)
    assert {key: written[key] for key in CHATGLM} == CHATGLM


def test_overrides_map_back_onto_seq_length_and_rope_ratio_and_the_rest_is_refused():
    config = glm_config(CHATGLM)
    config.max_position_embeddings = 32768
    config.rope_parameters = config.rope_parameters | {"rope_theta": 5e5}
    overrides = {"max_position_embeddings": 32768, "rope_theta": 5e5}
    assert override_chatglm_config(CHATGLM, config, overrides) == CHATGLM | {
        "seq_length": 32768,
        "rope_ratio": 50.0,
    }
    with pytest.raises(
        ConfigError, match="model.config_overrides.hidden_act: the ChatGLM layout has no place for it"
    ):
        override_chatglm_config(CHATGLM, config, {"hidden_act": "gelu"})
    config.rope_parameters = {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
    }
    with pytest.raises(ConfigError, match='holds plain RoPE .* not rope_parameters = \\{"rope_type": "yarn"'):
        override_chatglm_config(CHATGLM, config, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
