"""Sequence parallelism: what a model must have to split its attention over ranks, and the registry guard."""

from __future__ import annotations

import pytest
from conftest import tiny_model
from transformers import DeepseekV3Config, LlamaConfig, Qwen3NextConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import longalign.patch
from longalign.patch import ATTENTION_NAMES, UnsupportedModelError, sequence_parallel_problems
from longalign.patch.sequence_parallel import SUFFIX

# --- what a model needs ----------------------------------------------------------------------------------


def test_heads_must_split_over_the_group():
    config = LlamaConfig(num_attention_heads=32, num_key_value_heads=8)
    assert sequence_parallel_problems(config, 8) == []
    assert sequence_parallel_problems(config, 16) == []  # 16 / 8: each key/value head goes to 2 ranks
    assert sequence_parallel_problems(config, 3) == [
        "its 32 attention heads are not a multiple of 3",
        "its 8 key/value heads neither divide by 3 nor divide 3",
    ]
    assert sequence_parallel_problems(
        LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=6), 4
    ) == ["its 6 key/value heads neither divide by 4 nor divide 4"]


def test_attention_that_is_not_split_by_heads_is_refused():
    latent = sequence_parallel_problems(DeepseekV3Config(num_attention_heads=8, num_key_value_heads=8), 2)
    assert len(latent) == 1 and "multi-head latent attention" in latent[0]
    hybrid = sequence_parallel_problems(Qwen3NextConfig(num_hidden_layers=4), 2)
    assert hybrid == [
        "it has linear_attention layers, which mix tokens outside attention and would see only one rank's "
        "slice of the pack"
    ]


def test_apply_refuses_a_model_that_cannot_split_before_touching_the_registry():
    with pytest.raises(
        UnsupportedModelError, match="cannot split its attention over 3 ranks: its 4 attention"
    ):
        tiny_model(backend="sdpa_segments", sequence_parallel_size=3)


def test_a_name_wrapped_for_sequence_parallelism_is_not_registered_again(monkeypatch):
    """Registering over DeepSpeed's wrapper would silently change what sequence-parallel models run."""

    def wrapper(*args, **kwargs):
        raise AssertionError("not called")

    wrapper.__qualname__ = "UlyssesSPAttentionHF.register_with_transformers.<locals>.uattn_wrapper"
    name = ATTENTION_NAMES["sdpa_segments"] + SUFFIX
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, name, wrapper)
    with pytest.raises(ValueError, match="is wrapped by DeepSpeed's Ulysses layer"):
        longalign.patch.register("sdpa_segments", name=name)
    assert longalign.patch.register("sdpa_segments") == ATTENTION_NAMES["sdpa_segments"]  # others still can


def test_splitting_needs_a_process_group():
    with pytest.raises(ValueError, match="needs a process group: start the run with accelerate launch"):
        tiny_model(backend="sdpa_segments", sequence_parallel_size=2)
