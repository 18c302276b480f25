"""A run from its config: the one TrainingArguments, dtype and tokenizer resolution, and clean exits."""

from __future__ import annotations

import pytest
import torch
from conftest import DEMO, count_packs, demo_overrides, launch, needs_launcher, save_packs

from longalign.config import ConfigError, load_config
from longalign.run import model_dtype, training_arguments


def test_training_arguments_are_built_from_the_config(tmp_path):
    cfg = load_config(DEMO, [f"training.output_dir='{tmp_path}'", "training.remove_unused_columns=false"])
    args = training_arguments(cfg)
    assert args.output_dir == str(tmp_path) and args.remove_unused_columns is False
    assert args.per_device_train_batch_size == 1 and args.warmup_steps == 0.1  # from the aliases


def test_arguments_transformers_refuses_are_one_line_config_errors(tmp_path):
    cfg = load_config(DEMO, ["training.eval_strategy='steps'", "training.load_best_model_at_end=true",
                             "training.save_strategy='epoch'"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"^\[training\]: ") as err:
        training_arguments(cfg)
    assert "\n" not in str(err.value)


def test_model_dtype_is_resolved_once_from_the_config():
    assert model_dtype(load_config(DEMO)) == torch.float32  # a random model: float32
    assert model_dtype(load_config(DEMO, ["model.torch_dtype='bfloat16'"])) == torch.bfloat16


@pytest.mark.integration
@needs_launcher
def test_two_rank_runs_exit_every_time(tmp_path):
    """The DDP wrapper is freed before the process group: ten two-rank runs in a row all exit on their own."""
    packs = save_packs(tmp_path / "packs", count_packs([[40, 20], [30], [50, 10], [25, 25]]))
    for run in range(10):
        result = launch(
            DEMO.parent.parent / "train.py", "--config", str(DEMO),
            *demo_overrides(tmp_path / f"run{run}", packs), "training.max_steps=1",
            "training.save_strategy='no'", "training.disable_tqdm=true", "data.eval_file=''",
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert (tmp_path / f"run{run}" / "trainer_state.json").exists()
