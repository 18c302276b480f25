"""A run from its config: the one TrainingArguments, dtype and tokenizer resolution, and clean exits."""

from __future__ import annotations

import json
import sys
import types

import datasets
import pytest
import torch
from conftest import DEMO, count_packs, demo_overrides, launch, needs_launcher, save_packs, tiny_model

from longalign.config import ConfigError, load_config
from longalign.run import (
    check_sequence_parallel,
    check_vocabulary,
    model_dtype,
    resolve_packs,
    resume_point,
    training_arguments,
)
from longalign.trainer import CHECKPOINT_RECORD


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


# --- sequence parallelism: refused before any work ------------------------------------------------------


def test_sequence_parallel_refusal_names_every_reason_in_one_line():
    cfg = load_config(DEMO, ["training.sequence_parallel_size=3"])
    with pytest.raises(ConfigError) as err:
        check_sequence_parallel(cfg, 2)
    assert str(err.value) == (
        "training.sequence_parallel_size = 3 cannot run: the world size 2 is not a multiple of it (each pack is "
        "split over 3 consecutive ranks); llama model: its 4 attention heads are not a multiple of 3; llama "
        "model: its 2 key/value heads neither divide by 3 nor divide 3"
    )


def test_sequence_parallel_fits_the_demo_model_in_groups_of_two_and_four():
    check_sequence_parallel(load_config(DEMO), 3)  # off: nothing to check
    check_sequence_parallel(load_config(DEMO, ["training.sequence_parallel_size=2"]), 4)
    check_sequence_parallel(
        load_config(DEMO, ["training.sequence_parallel_size=4"]), 4
    )  # 2 KV heads, each twice
    with pytest.raises(ConfigError, match="its 4 attention heads are not a multiple of 8"):
        check_sequence_parallel(load_config(DEMO, ["training.sequence_parallel_size=8"]), 8)


def test_another_split_and_a_missing_deepspeed_are_refused(monkeypatch):
    cfg = load_config(DEMO, ["training.sequence_parallel_size=2"])
    with pytest.raises(
        ConfigError, match="accelerate's parallelism config sets cp_size = 2, which would split"
    ):
        check_sequence_parallel(cfg, 4, environ={"PARALLELISM_CONFIG_CP_SIZE": "2"})
    tensor_parallel = types.SimpleNamespace(tp_size=2, cp_size=1, sp_size=1)
    with pytest.raises(ConfigError, match="sets tp_size = 2"):
        check_sequence_parallel(cfg, 4, parallelism=tensor_parallel)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed
    with pytest.raises(
        ConfigError, match=r"it runs on DeepSpeed, which is not installed: pip install 'longalign\[sp\]'"
    ):
        check_sequence_parallel(cfg, 2)


# --- resuming --------------------------------------------------------------------------------------------

RECORD = {
    "decides": {
        "data": "3 packs, cu_seqlens 0a1b2c",
        "training.gradient_accumulation_steps": 2,
        "world size": 2,
    },
    "kept": {"training.learning_rate": 0.003},
}


def fake_trainer(output_dir, resume, record=RECORD):
    args = types.SimpleNamespace(output_dir=str(output_dir), resume_from_checkpoint=resume)
    return types.SimpleNamespace(args=args, run_record=record, is_world_process_zero=lambda: True)


def checkpoint(output_dir, step, record=None):
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    if record is not None:
        (path / CHECKPOINT_RECORD).write_text(json.dumps({"complete": True, "step": step, **record}))
    return path


def test_last_is_the_newest_complete_checkpoint(tmp_path):
    cfg = load_config(DEMO)
    checkpoint(tmp_path, 2, RECORD)
    checkpoint(tmp_path, 10, RECORD)
    checkpoint(tmp_path, 12)  # killed while saving: no record
    assert resume_point(fake_trainer(tmp_path, "last"), cfg) == str(tmp_path / "checkpoint-10")
    assert resume_point(fake_trainer(tmp_path / "new", "last"), cfg) is None  # nothing to resume: fresh


def test_only_incomplete_checkpoints_are_not_resumed(tmp_path):
    checkpoint(tmp_path, 4)
    with pytest.raises(
        ConfigError, match=r"no complete checkpoint .*\(checkpoint-4: saves that did not finish\)"
    ):
        resume_point(fake_trainer(tmp_path, "last"), load_config(DEMO))


def test_a_fresh_run_does_not_reuse_an_output_dir_with_checkpoints(tmp_path):
    checkpoint(tmp_path, 4, RECORD)
    with pytest.raises(
        ConfigError, match="holds checkpoints of an earlier run \\(checkpoint-4\\); resume it"
    ):
        resume_point(fake_trainer(tmp_path, None), load_config(DEMO))


def test_a_resume_with_other_data_or_split_is_refused_naming_what_changed(tmp_path, capsys):
    path = checkpoint(tmp_path, 4, RECORD)
    changed = {
        "decides": {**RECORD["decides"], "training.gradient_accumulation_steps": 4, "world size": 1},
        "kept": {"training.learning_rate": 0.001},
    }
    with pytest.raises(ConfigError) as err:
        resume_point(fake_trainer(tmp_path, "last", changed), load_config(DEMO))
    message = str(err.value)
    assert "training.gradient_accumulation_steps 2 -> 4; world size 2 -> 1" in message
    assert "resume_ignore_changes=true" in message and "\n" not in message
    forced = load_config(DEMO, ["training.resume_ignore_changes=true"])
    assert resume_point(fake_trainer(tmp_path, str(path), changed), forced) == str(path)
    out = capsys.readouterr().out
    assert "resume: resuming although these changed: training.gradient_accumulation_steps 2 -> 4" in out
    assert (
        "training.learning_rate is 0.001 in the run file, but the restored optimizer and scheduler keep"
        in out
    )


def test_a_resume_that_turns_sequence_parallelism_off_is_refused(tmp_path):
    checkpoint(
        tmp_path, 4, {**RECORD, "decides": {**RECORD["decides"], "training.sequence_parallel_size": 2}}
    )
    with pytest.raises(ConfigError, match="training.sequence_parallel_size 2 -> None"):
        resume_point(fake_trainer(tmp_path, "last"), load_config(DEMO))


def test_a_checkpoint_without_a_record_needs_the_override(tmp_path):
    path = checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match="not a complete longalign checkpoint"):
        resume_point(fake_trainer(tmp_path, str(path)), load_config(DEMO))
    forced = load_config(DEMO, ["training.resume_ignore_changes=true"])
    assert resume_point(fake_trainer(tmp_path, str(path)), forced) == str(path)


# --- what the packs must fit ------------------------------------------------------------------------------


def test_packed_rows_must_fit_max_seq_len(tmp_path):
    packs = save_packs(tmp_path / "packs", count_packs([[300, 212], [100]]))
    cfg = load_config(DEMO, ["data.max_seq_len=512"])
    args = training_arguments(cfg)
    assert len(resolve_packs(str(packs), cfg, args)) == 2
    small = load_config(DEMO, ["data.max_seq_len=500"])
    with pytest.raises(ConfigError, match=r"rows of up to 512 tokens do not fit data.max_seq_len = 500"):
        resolve_packs(str(packs), small, args)


def test_labels_must_use_the_configured_ignore_index(tmp_path):
    rows = count_packs([[4, 3]])
    rows[0]["labels"][0] = -100
    packs = save_packs(tmp_path / "packs", rows)
    cfg = load_config(DEMO, ["loss.ignore_index=-1"])
    with pytest.raises(ConfigError, match=r"loss.ignore_index: -1, but .* marks non-targets with -100"):
        resolve_packs(str(packs), cfg, training_arguments(cfg))


def test_token_ids_must_fit_the_model_vocabulary(tmp_path):
    rows = count_packs([[4, 3]])
    rows[0]["input_ids"][2] = 4096
    packs = datasets.Dataset.from_list(rows)
    model = tiny_model(vocab_size=4096)
    with pytest.raises(ConfigError, match="token id 4096 is outside the model's vocabulary of 4096"):
        check_vocabulary(model, packs, "packs")
    check_vocabulary(tiny_model(vocab_size=4097), packs, "packs")
