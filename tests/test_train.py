"""`longalign train` end to end on the shipped sample: train, checkpoint, resume mid-epoch, reload (in this
process, as the console command runs it; the two-rank recipe as a launch of train.py)."""

from __future__ import annotations

import json
import shutil
import sys
import traceback
from pathlib import Path

import pytest
import tomllib
import torch
import transformers
from conftest import (
    DEMO,
    ROOT,
    SAMPLE,
    TOKENIZER,
    demo_train_arguments,
    launch,
    run_process,
    step_losses,
    train_demo,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from longalign import errors
from longalign.cli import main

pytestmark = pytest.mark.integration


def test_train_save_resume_reload(tokenized_sample, tmp_path, capsys):
    tokenized = tokenized_sample
    straight = tmp_path / "straight"
    train_demo(tokenized, straight, "training.max_steps=4", f"data.eval_file={tokenized}")  # saves at 2 and 4
    expected = step_losses(straight)
    assert sorted(expected) == [1, 2, 3, 4]

    # A run stopped after its checkpoint at step 2, resumed from its last checkpoint up to 4.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    train_demo(tokenized, resumed, "training.max_steps=4", "training.resume_from_checkpoint='last'")
    got = step_losses(resumed)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):  # the same packs in the same order after the resume, so the same losses
        assert got[step] == pytest.approx(expected[step], rel=1e-4)
    record = json.loads((resumed / "checkpoint-4" / "longalign_checkpoint.json").read_text())
    assert record["complete"] and record["decides"]["loss.weighting"] == "sequence_level"

    # A save cut short (no record) is not resumed from: the newest complete checkpoint is.
    (resumed / "checkpoint-4" / "longalign_checkpoint.json").unlink()
    train_demo(tokenized, resumed, "training.max_steps=4", "training.resume_from_checkpoint='last'")
    assert step_losses(resumed)[3] == pytest.approx(expected[3], rel=1e-4)  # steps 3 and 4 again, from 2
    # Refused before the model loads (here, in this process, as the console command runs it):
    # another weighting would change the loss of the resumed steps, in one line naming it;
    resume = (
        "training.max_steps=6",
        "training.resume_from_checkpoint='last'",
        "loss.weighting='token_level'",
    )
    assert main(["train", *demo_train_arguments(tokenized, resumed, *resume)]) == 2
    refusal = capsys.readouterr().err
    assert "loss.weighting 'sequence_level' -> 'token_level'" in refusal and "Traceback" not in refusal
    # a fresh run would rotate the earlier run's checkpoints away.
    assert main(["train", *demo_train_arguments(tokenized, resumed, "training.max_steps=2")]) == 2
    assert "holds checkpoints of an earlier run" in capsys.readouterr().err

    log = json.loads((straight / "trainer_state.json").read_text())["log_history"]
    first = next(e for e in log if "loss" in e)
    for key in (
        "learning_rate",
        "tokens_per_second",
        "samples_per_step",
        "packs_per_step",
        "packing_efficiency",
    ):
        assert key in first
    assert 0.9 < first["packing_efficiency"] <= 1.0
    evals = [e for e in log if "eval_loss" in e]
    kept = json.loads((tokenized / "report.json").read_text())["samples_kept"]
    assert evals and evals[-1]["eval_samples"] == kept

    model = AutoModelForCausalLM.from_pretrained(straight)
    assert (straight / "checkpoint-4").is_dir()
    ids = torch.tensor([[4088, 5, 6, 7]])
    assert model(input_ids=ids).logits.shape == (1, 4, 4096)
    assert AutoTokenizer.from_pretrained(straight).chat_template


def test_the_longalign_recipe_trains_on_raw_chats_on_two_ranks(tmp_path):
    """The recipe's run file as written (every LongAlign-style key), on the shipped raw JSONL, with the
    demo's tiny model on two CPU ranks: the data is prepared on first use and the loss falls.

    It is also the named check that a two-rank run exits on its own: the DDP wrapper is freed before the
    process group (before that, 3 of 20 such runs hung at exit); every other two-rank launch checks it too.
    """
    tiny = tomllib.loads(DEMO.read_text())["model"]["init_from_config"]
    model = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in tiny.items()) + "}"
    overrides = [
        f"data.train_file={json.dumps(str(SAMPLE))}", "data.max_seq_len=2048", "data.max_seq_len_filter=2048",
        f"training.output_dir={json.dumps(str(tmp_path / 'run'))}", "training.use_cpu=true", "training.bf16=false",
        "training.learning_rate=3e-3", "training.max_steps=12", "training.logging_steps=3",
        "training.save_strategy='no'", "model.model_name_or_path=''", f"model.init_from_config={model}",
        f"model.tokenizer={json.dumps(str(TOKENIZER))}", "model.use_flash_attention=false",
        "model.torch_dtype='float32'", "training.activation_checkpointing=false",
    ]  # fmt: skip
    recipe = ROOT / "configs" / "longalign_recipe.toml"
    result = launch(ROOT / "train.py", "--config", str(recipe), *overrides, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = list(step_losses(tmp_path / "run").values())
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    packed = next((tmp_path / "run" / "data").glob("packed-*"))
    report = json.loads((packed / "report.json").read_text())
    assert report["dropped"]["over_max_length"]["samples"] == 0  # over 2048: dropped at pre-tokenize
    tokenized = json.loads((Path(report["input"]) / "report.json").read_text())
    assert tokenized["lines_read"] == 400 and tokenized["dropped"]["over_length"] > 0
    assert tokenized["truncation"] == "drop"  # the length filter drops, never truncates


# The model's forward raises at the second optimizer step, in this process as the console command runs it.
@pytest.mark.parametrize("error", [ValueError, errors.ConfigError])
def test_an_error_once_training_runs_keeps_its_traceback(
    tokenized_sample, tmp_path, error, monkeypatch, capsys
):
    """An error raised mid-run leaves ``longalign train`` with its traceback (Python prints it as the process
    ends), never as a one-line wrong setting; the user-input class says at which step the run stopped."""
    forward, calls = transformers.LlamaForCausalLM.forward, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error("deep inside the forward at step 2")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "forward", failing)
    arguments = demo_train_arguments(tokenized_sample, tmp_path / "run", "training.max_steps=3")
    with pytest.raises(Exception) as raised:
        main(["train", *arguments])  # in this process, as the console command runs it
    shown = "".join(traceback.format_exception(raised.value))
    assert "deep inside the forward at step 2" in shown
    assert ", in failing\n" in shown  # the frame that raised is kept
    assert "longalign train: error:" not in capsys.readouterr().err  # not reported as a wrong setting
    if error is ValueError:
        assert raised.type is ValueError
    else:  # the user-input class, raised mid-run, says where the run stopped
        assert raised.type is RuntimeError
        assert "RuntimeError: training stopped at step 1: deep inside the forward" in shown


def test_tiled_mlps_and_offloaded_inputs_train_the_steps_of_checkpointing_alone(tokenized_sample, tmp_path):
    """The run file's long-context settings through train.py: the same losses, step after step."""
    checkpointing = ("training.max_steps=3", "training.activation_checkpointing=true")
    train_demo(tokenized_sample, tmp_path / "plain", *checkpointing)
    train_demo(
        tokenized_sample, tmp_path / "long", *checkpointing, "training.tiled_mlp=true",
        "training.mlp_tile_tokens=100", "training.offload_activations=true",
        "training.activation_checkpointing_layers=2",
    )  # fmt: skip
    want, got = step_losses(tmp_path / "plain"), step_losses(tmp_path / "long")
    assert sorted(got) == [1, 2, 3]
    assert got == pytest.approx(want, rel=1e-5)


def test_a_wrong_setting_before_training_is_one_line(tokenized_sample, tmp_path, capsys):
    # In this process, as the console command runs it (tests/test_cli.py runs train.py's own one-line error).
    assert (
        main(["train", *demo_train_arguments(tokenized_sample, tmp_path / "run", "loss.chunk_size=0")]) == 2
    )
    refusal = capsys.readouterr().err
    assert refusal.strip().splitlines() == ["longalign train: error: loss.chunk_size: must be >= 1, got 0"], (
        refusal
    )


def test_the_longalign_skeleton_dry_runs_and_trains_on_raw_chats(tmp_path, capsys):
    """The run file LongAlign / LongWriter users bring (packing and sort_by_length on, greedy packing), as
    written but for its paths and sizes, the demo's tiny random model, and a learning rate that moves it
    within 12 steps: the dry run shows what each key resolved to, and the run sorts, packs and learns."""
    skeleton = ROOT / "tests" / "data" / "longalign_skeleton.toml"
    tiny = tomllib.loads(DEMO.read_text())["model"]["init_from_config"]
    model = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in tiny.items()) + "}"
    command = [
        sys.executable, str(ROOT / "train.py"), "--config", str(skeleton),
        f"data.train_file={json.dumps(str(SAMPLE))}", "data.max_seq_len=2048",
        f"training.output_dir={json.dumps(str(tmp_path / 'run'))}", "training.max_steps=12",
        "training.logging_steps=3", "training.save_strategy='no'", "training.learning_rate=3e-3",
        "model.model_name_or_path=''", f"model.init_from_config={model}", f"model.tokenizer={json.dumps(str(TOKENIZER))}",
    ]  # fmt: skip
    assert main(["train", *command[2:], "--dry-run"]) == 0  # the dry run in this process: no training
    planned = capsys.readouterr().out
    settings = {line.split()[0]: line.split(maxsplit=2)[1:] for line in planned.splitlines()[1:] if line}
    assert settings["packing.strategy"] == ['"greedy"', str(skeleton)]
    assert settings["packing.sort_by_length"] == ["true", f"{skeleton} (as data.sort_by_length)"]
    assert settings["loss.weighting"] == ['"sequence_level"', f"{skeleton} (as loss.normalize_by_tokens)"]
    assert "strategy       greedy" in planned and "not checked" not in planned

    trained = run_process(command, timeout=600, cwd=ROOT)
    assert trained.returncode == 0, trained.stderr[-4000:]
    losses = list(step_losses(tmp_path / "run").values())
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5
    report = json.loads(next((tmp_path / "run" / "data").glob("packed-*/report.json")).read_text())
    assert report["strategy"] == "greedy" and report["sort_by_length"]
