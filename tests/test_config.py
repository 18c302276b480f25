"""Run configuration: TOML sections, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from longalign.config import ConfigError, load_config

RUN = """
[data]
train_file = "out/packed"
max_seq_len = 4096

[packing]
strategy = "ffd"

[loss]
weighting = "token_level"

[training]
per_device_batch_size = 2
gradient_accumulation_steps = 4
learning_rate = 2e-5
warmup_ratio = 0.1
lr_scheduler_type = "cosine"
bf16 = true

[model]
model_name_or_path = "some/model"
use_flash_attention = false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_sections_and_aliases(tmp_path):
    cfg = load_config(write(tmp_path, RUN))
    assert cfg.data.train_file == "out/packed" and cfg.data.max_seq_len == 4096
    assert cfg.packing.strategy == "ffd"
    assert cfg.loss.weighting == "token_level" and cfg.loss.ignore_index == -100
    assert cfg.training.args == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 2e-5,
        "warmup_steps": 0.1,
        "lr_scheduler_type": "cosine",
        "bf16": True,
    }
    assert cfg.model.backend == "sdpa_segments"  # use_flash_attention = false pins the exact CPU path


def test_overrides_are_typed_and_win(tmp_path):
    cfg = load_config(
        write(tmp_path, RUN),
        [
            "data.max_seq_len=8192",
            "loss.weighting=sequence_level",
            "training.max_steps=3",
            "model.attn_backend=auto",
        ],
    )
    assert cfg.data.max_seq_len == 8192
    assert cfg.loss.weighting == "sequence_level"
    assert cfg.training.args["max_steps"] == 3
    assert cfg.model.attn_backend == "auto"


def test_sort_by_length_means_sorted_batching():
    cfg = load_config(None, ["model.model_name_or_path=m", "packing.sort_by_length=true"])
    assert cfg.packing.strategy == "sorted"
    with pytest.raises(ConfigError, match="sort_by_length"):
        load_config(
            None, ["model.model_name_or_path=m", "packing.sort_by_length=true", "packing.strategy=ffd"]
        )


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_seq_lenn=3", r"data.max_seq_lenn: unknown key; did you mean 'max_seq_len'\?"),
        ("optimizer.lr=3", r"unknown section \[optimizer\]"),
        ("data.max_seq_len='long'", "data.max_seq_len: expected int, got str"),
        ("packing.packing=1", "packing.packing: expected bool, got int"),
        ("loss.weighting=per_token", "loss.weighting: 'per_token' is not one of sequence_level, token_level"),
        ("packing.strategy=knapsack", "packing.strategy: 'knapsack' is not one of"),
        (
            "training.learning_rat=1e-4",
            r"training.learning_rat: unknown key .*did you mean 'learning_rate'\?",
        ),
        ("training.num_train_epochs='two'", "training.num_train_epochs: expected float, got str"),
        ("training.bf16=2", "training.bf16: expected bool, got int"),
        ("model.torch_dtype=int8", "model.torch_dtype"),
        ("novalue", "expected section.key=value"),
    ],
)
def test_bad_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.model_name_or_path=m", override])


def test_model_needs_a_source():
    with pytest.raises(ConfigError, match="model_name_or_path"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="model_type"):
        load_config(None, ["model.init_from_config={hidden_size = 8}"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[data\n"))


def test_to_dict_is_flat_tables(tmp_path):
    out = load_config(write(tmp_path, RUN)).to_dict()
    assert list(out) == ["data", "packing", "loss", "training", "model"]
    assert out["training"]["per_device_train_batch_size"] == 2 and "args" not in out["training"]
    assert out["model"]["use_flash_attention"] is False


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["demo.toml", "llama3_8b_64k.toml", "glm4_9b_64k.toml"])
def test_shipped_run_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.data.train_file and cfg.data.max_seq_len >= 4096
    if name != "demo.toml":  # the GPU configs train in bf16 with activation checkpointing
        assert cfg.training.args["bf16"] and cfg.training.args["activation_checkpointing"]
        assert cfg.data.max_seq_len == 65536 and cfg.model.torch_dtype == "bfloat16"


def test_deepspeed_sizes_are_integers():
    """DeepSpeed >= 0.15 rejects float bucket sizes and thresholds (e.g. 5e7 written as a float)."""
    import json

    zero = json.loads((CONFIGS / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    sizes = {k: v for k, v in zero.items() if k.endswith(("_size", "_threshold", "_parameters", "_distance"))}
    assert sizes and all(type(v) is int for v in sizes.values()), sizes
