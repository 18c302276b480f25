"""A run from its config: the one TrainingArguments, dtype and tokenizer resolution, and clean exits."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import datasets
import pytest
import torch
from conftest import (
    DEMO,
    FLOAT64_BOUND,
    ROOT,
    SAMPLE,
    TOKENIZER,
    count_packs,
    needs_deepspeed,
    packed_logits_error,
    save_packs,
    tiny_model,
    window_packs,
)

from longalign.artifacts import load_stage, read_report
from longalign.config import load_config
from longalign.errors import ConfigError, InputError
from longalign.run import (
    adapter_record,
    build_trainer,
    check_quantized_base,
    check_sequence_parallel,
    check_vocabulary,
    compare_records,
    load_model,
    model_dtype,
    parameter_summary,
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


def test_the_checkpointed_layers_reach_the_trainer_once_through_its_arguments(tmp_path):
    """The Trainer enables checkpointing when training starts, with every_n_layers from these arguments."""
    on = [f"training.output_dir='{tmp_path}'", "training.activation_checkpointing=true"]
    args = training_arguments(load_config(DEMO, [*on, "training.activation_checkpointing_layers=2"]))
    assert args.activation_checkpointing_kwargs == {"every_n_layers": 2}
    kept = load_config(DEMO, [*on, "training.activation_checkpointing_kwargs={use_reentrant = true}"])
    assert training_arguments(kept).activation_checkpointing_kwargs == {
        "use_reentrant": True,
        "every_n_layers": 1,
    }
    assert training_arguments(load_config(DEMO)).activation_checkpointing_kwargs is None  # checkpointing off


def test_the_model_is_tiled_and_offloaded_as_the_config_says():
    from longalign.patch.offload import _offloaded_forward
    from longalign.patch.tiled_mlp import tiled_forward

    settings = [
        "training.activation_checkpointing=true",
        "training.tiled_mlp=true",
        "training.mlp_tile_tokens=64",
    ]
    model = load_model(load_config(DEMO, [*settings, "training.offload_activations=true"]))
    for layer in model.model.layers:
        assert layer.mlp.forward.func is tiled_forward and layer.mlp.forward.keywords == {"tile_tokens": 64}
        assert layer.forward.func is _offloaded_forward
    layer_settings = [settings[0], "training.sequence_tiling=layer", settings[2]]
    layers = load_model(load_config(DEMO, layer_settings)).model.layers
    for layer in layers:  # the layer's class, tiled; its MLP the class's own
        assert type(layer).untiled.__name__ == type(layer).__name__ and layer.tile_tokens == 64
        assert "forward" not in vars(layer.mlp)
    plain = load_model(load_config(DEMO))
    assert all("forward" not in vars(module) for module in plain.modules())  # the class's own forwards
    assert not any(hasattr(type(layer), "untiled") for layer in plain.model.layers)


def test_model_dtype_is_resolved_once_from_the_config():
    assert model_dtype(load_config(DEMO)) == torch.float32  # a random model: float32
    assert model_dtype(load_config(DEMO, ["model.torch_dtype='bfloat16'"])) == torch.bfloat16


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


def test_sequence_parallel_takes_only_the_exact_weightings():
    cfg = load_config(DEMO, ["training.sequence_parallel_size=2", "loss.weighting='longwriter'"])
    with pytest.raises(ConfigError, match="'longwriter' is a reference counted per pack and micro-batch"):
        check_sequence_parallel(cfg, 2)


def test_sequence_parallel_fits_the_demo_model_in_groups_of_two_and_four():
    assert check_sequence_parallel(load_config(DEMO), 3) == [[0], [1], [2]]  # off: every rank alone
    assert check_sequence_parallel(load_config(DEMO, ["training.sequence_parallel_size=2"]), 4) == [
        [0, 1],
        [2, 3],
    ]
    four = load_config(DEMO, ["training.sequence_parallel_size=4"])
    assert check_sequence_parallel(four, 4) == [[0, 1, 2, 3]]  # 2 KV heads, each on two ranks
    with pytest.raises(ConfigError, match="its 4 attention heads are not a multiple of 8"):
        check_sequence_parallel(load_config(DEMO, ["training.sequence_parallel_size=8"]), 8)


@needs_deepspeed
def test_qlora_under_zero3_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """ZeRO-3 from ``[training] deepspeed`` or from the accelerate config: one line naming the key, the file
    and what to use instead; ZeRO-2 and plain LoRA under ZeRO-3 pass."""
    zero3 = str(ROOT / "configs" / "deepspeed" / "zero3.json")
    cfg = load_config(DEMO, ["lora.load_in_4bit=true", f"training.deepspeed={json.dumps(zero3)}"])
    with pytest.raises(ConfigError) as err:
        check_quantized_base(cfg, training_arguments(cfg))
    assert str(err.value) == (
        f"lora.load_in_4bit: QLoRA cannot run under DeepSpeed ZeRO-3 ([training] deepspeed = {zero3}): ZeRO-3 "
        "shards the weights as they load and the quantized base loads whole onto each rank's device; train "
        "plain LoRA under ZeRO-3, or QLoRA with DDP or ZeRO-2"
    )
    with pytest.raises(ConfigError, match="^lora.load_in_4bit: QLoRA cannot run under DeepSpeed ZeRO-3"):
        build_trainer(cfg)  # the run refuses it first thing: no data, no weights
    plain = load_config(DEMO, ["lora.r=8", f"training.deepspeed={json.dumps(zero3)}"])
    check_quantized_base(plain, training_arguments(plain))
    zero2 = tmp_path / "zero2.json"
    zero2.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": "auto"}))
    stage2 = load_config(DEMO, ["lora.load_in_8bit=true", f"training.deepspeed={json.dumps(str(zero2))}"])
    check_quantized_base(stage2, training_arguments(stage2))

    # What `accelerate launch --config_file configs/accelerate/zero3.yaml` exports to each rank.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", zero3)
    launched = load_config(DEMO, ["lora.load_in_8bit=true"])
    with pytest.raises(
        ConfigError,
        match=rf"^lora.load_in_8bit: QLoRA cannot run under DeepSpeed ZeRO-3 \(the accelerate config, {zero3}\)",
    ):
        check_quantized_base(launched, training_arguments(launched))


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


def test_the_record_holds_the_adapter_settings_and_their_base():
    full = adapter_record(load_config(DEMO))
    assert full["lora.r"] is None and full["lora.base_model"] is None
    record = adapter_record(load_config(DEMO, ["lora.r=8", "lora.trainable=['norms']"]))
    assert (
        record["lora.r"] == 8
        and record["lora.trainable"] == ["norms"]
        and record["lora.load_in_4bit"] is False
    )
    assert json.loads(record["lora.base_model"])["model_type"] == "llama"  # the demo's random base
    assert set(record) == set(full)


def test_a_resume_with_other_adapters_or_none_is_refused(tmp_path):
    saved = {**RECORD, "decides": {**RECORD["decides"], **adapter_record(load_config(DEMO, ["lora.r=8"]))}}
    path = checkpoint(tmp_path, 4, saved)
    for overrides, change in ((["lora.r=4"], "lora.r 8 -> 4"), ([], "lora.r 8 -> None")):
        now = {**RECORD, "decides": {**RECORD["decides"], **adapter_record(load_config(DEMO, overrides))}}
        with pytest.raises(ConfigError, match=change):
            compare_records(path, now, ignore_changes=False)
    same = {**RECORD, "decides": {**RECORD["decides"], **adapter_record(load_config(DEMO, ["lora.r=8"]))}}
    assert compare_records(path, same, ignore_changes=False) == []


def test_ddp_is_told_every_trained_parameter_is_used():
    assert training_arguments(load_config(DEMO, ["lora.r=8"])).ddp_find_unused_parameters is False
    assert training_arguments(load_config(DEMO)).ddp_find_unused_parameters is False  # full fine-tuning too
    for overrides in (["lora.r=8"], []):
        kept = load_config(DEMO, [*overrides, "training.ddp_find_unused_parameters=true"])
        assert training_arguments(kept).ddp_find_unused_parameters is True


def test_a_checkpoint_without_a_record_needs_the_override(tmp_path):
    path = checkpoint(tmp_path, 4)
    with pytest.raises(ConfigError, match="not a complete longalign checkpoint"):
        resume_point(fake_trainer(tmp_path, str(path)), load_config(DEMO))
    forced = load_config(DEMO, ["training.resume_ignore_changes=true"])
    assert resume_point(fake_trainer(tmp_path, str(path)), forced) == str(path)


# --- what the packs must fit ------------------------------------------------------------------------------


def test_packed_rows_must_fit_max_seq_len(tmp_path):
    packs = save_packs(tmp_path / "packs", count_packs([[300, 212], [100]]))
    cfg = load_config(DEMO, ["data.max_seq_len=512", f"data.train_file='{packs}'"])
    args = training_arguments(cfg)
    assert len(resolve_packs("train", cfg, args)) == 2
    small = load_config(DEMO, ["data.max_seq_len=500", f"data.train_file='{packs}'"])
    with pytest.raises(ConfigError, match=r"rows of up to 512 tokens do not fit data.max_seq_len = 500"):
        resolve_packs("train", small, args)


def test_labels_mark_non_targets_with_minus_100(tmp_path):
    rows = count_packs([[4, 3]])
    rows[0]["labels"][0] = -1
    packs = save_packs(tmp_path / "packs", rows)
    cfg = load_config(DEMO, [f"data.train_file='{packs}'"])
    with pytest.raises(InputError, match=r"packs: labels mark non-targets with -1, not -100 as pre-tokenize"):
        resolve_packs("train", cfg, training_arguments(cfg))


def test_ignore_index_is_accepted_as_run_files_write_it_and_nothing_else():
    assert load_config(DEMO, ["loss.ignore_index=-100"]).source("loss.ignore_index") == "default"
    with pytest.raises(
        ConfigError, match=r"loss.ignore_index: only -100 is accepted \(labels mark non-targets"
    ):
        load_config(DEMO, ["loss.ignore_index=-1"])


def test_token_ids_must_fit_the_model_vocabulary(tmp_path):
    rows = count_packs([[4, 3]])
    rows[0]["input_ids"][2] = 4096
    packs = datasets.Dataset.from_list(rows)
    model = tiny_model(vocab_size=4096)
    with pytest.raises(ConfigError, match="token id 4096 is outside the model's vocabulary of 4096"):
        check_vocabulary(model, packs, "packs")
    check_vocabulary(tiny_model(vocab_size=4097), packs, "packs")


# --- raw data in, packs out --------------------------------------------------------------------------------


@pytest.fixture
def chats(tmp_path):
    """Two raw sources: 40 chats of the shipped sample as JSONL, 30 others as Parquet with other columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = SAMPLE.read_text().splitlines()
    long_path = tmp_path / "long.jsonl"
    long_path.write_text("\n".join(lines[:40]) + "\n")
    renamed = [
        {"dialog": [{"speaker": m["role"], "text": m["content"]} for m in json.loads(line)["messages"]]}
        for line in lines[40:70]
    ]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "short.parquet")
    return long_path, tmp_path / "short.parquet"


def raw_config(tmp_path, *overrides):
    return load_config(
        DEMO,
        [f"training.output_dir='{tmp_path / 'run'}'", f"model.tokenizer='{TOKENIZER}'", "data.max_seq_len=2048",
         *overrides],
    )  # fmt: skip


def test_raw_data_is_prepared_once_and_again_when_a_source_changes(tmp_path, chats, monkeypatch):
    import longalign.run as run

    long_path, _ = chats
    cfg = raw_config(tmp_path, f"data.train_file='{long_path}'")
    args = training_arguments(cfg)
    packed = run.prepare("train", cfg, args)
    report = read_report(packed)
    tokenized = read_report(Path(report["input"]))
    assert tokenized["lines_read"] == 40 and report["samples_in"] == tokenized["samples_kept"]
    assert packed.parent == tmp_path / "run" / "data"

    def no_work(*args, **kwargs):
        raise AssertionError("prepared again although nothing changed")

    monkeypatch.setattr(run, "pre_tokenize", no_work)
    monkeypatch.setattr(run, "write_packs", no_work)
    assert run.prepare("train", cfg, args) == packed  # an unchanged rerun reuses both stages
    monkeypatch.undo()
    long_path.write_text(long_path.read_text() + SAMPLE.read_text().splitlines()[99] + "\n")
    again = run.prepare("train", cfg, args)
    assert again != packed and read_report(Path(read_report(again)["input"]))["lines_read"] == 41
    other_packing = raw_config(tmp_path, f"data.train_file='{long_path}'", "packing.strategy='ffd'")
    assert run.prepare("train", other_packing, args) != again


def test_a_mix_takes_what_each_source_says_and_accounts_for_both(tmp_path, chats):
    from longalign.run import prepare

    long_path, short_path = chats
    sources = (
        f'data.sources=[{{path="{long_path}"}}, {{path="{short_path}", fraction=0.5, '
        f'columns={{messages="dialog", role="speaker", content="text"}}}}]'
    )
    taken = {}
    for seed in (1, 2):
        cfg = raw_config(tmp_path, sources, f"packing.seed={seed}")
        packed = prepare("train", cfg, training_arguments(cfg))
        report = read_report(packed)
        long_mix, short_mix = report["mix"]
        assert long_mix["taken"] == long_mix["available"] and long_mix["rule"] == "all"
        assert short_mix["taken"] == round(short_mix["available"] / 2) and short_mix["rule"] == "fraction 0.5"
        tokenized = read_report(Path(report["input"]))
        assert [s["lines_read"] for s in tokenized["sources"]] == [40, 30]
        by_source = {0: [], 1: []}
        for row in load_stage(packed):
            for line, source in zip(row["lines"], row["sources"], strict=True):
                by_source[source].append(line)
        assert len(by_source[0]) == long_mix["taken"] and len(by_source[1]) == short_mix["taken"]
        taken[seed] = sorted(by_source[1])
    assert taken[1] != taken[2]  # another seed, other short samples; the same counts


def test_dry_run_prints_settings_with_sources_and_the_packing(tmp_path, chats, capsys):
    from longalign.cli import main

    long_path, _ = chats
    argv = ["train", "--config", str(DEMO), f"data.train_file='{long_path}'", f"model.tokenizer='{TOKENIZER}'",
            f"training.output_dir='{tmp_path / 'run'}'", "data.packing=false", "data.sort_by_length=true",
            "--dry-run"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    strategy = next(line for line in out.splitlines() if line.strip().startswith("packing.strategy"))
    assert '"sorted"' in strategy
    assert strategy.endswith("command line (as data.packing) + command line (as data.sort_by_length)")
    assert "lines read     40" in out and "strategy       sorted" in out
    assert out.rstrip().endswith("dry run: no model weights loaded, nothing trained")
    assert not (tmp_path / "run" / "checkpoint-1").exists()


@pytest.fixture
def planning_machine(tmp_path, monkeypatch):
    """No GPU, no network (a connection attempt fails the test), an empty Hugging Face cache, no data."""
    import socket

    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("the dry run tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # the run files' relative data paths lead nowhere
    return tmp_path


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_run_file_dry_runs_on_a_planning_machine(planning_machine, path, capsys):
    """Exit 0 on a CPU-only machine without network, cache or data, naming each thing it could not check."""
    from longalign.cli import main

    assert main(["train", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    train = ", ".join(source.path for source in cfg.data.train_sources())  # train_file or [[data.sources]]
    expected = [f"not checked: train data: {train} not found here; not prepared or checked"]
    if cfg.model.init_from_config is None:
        name = cfg.model.model_name_or_path
        expected += [
            f"not checked: tokenizer {cfg.model.tokenizer or name}: not a local directory nor in the Hugging Face cache",
            f"not checked: model {name}: its config.json is not a local file nor in the Hugging Face cache",
        ]
    if cfg.training.args.get("bf16"):
        expected.append("needs a GPU, not checked here (none on this machine): training.bf16 = true")
    if cfg.model.config_overrides:
        expected.append("window, nor its config_overrides")
    for line in expected:
        assert line in out, line
    assert out.rstrip().endswith("dry run: no model weights loaded, nothing trained")


# Llama-3.1-8B-Instruct's config.json, as the Hub has it (the weights are not needed for a dry run).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip


@pytest.mark.parametrize(
    "name, window, factor",
    [("llama3_8b_1m_sp8.toml", 1048576, 8.0), ("llama3_8b_512k_1gpu.toml", 524288, 4.0)],
)
def test_the_long_context_run_files_extend_llama_31_with_yarn(planning_machine, name, window, factor, capsys):
    """With the checkpoint's config.json in the cache, the dry run applies the run file's overrides to it."""
    from longalign.cli import main

    snapshot = planning_machine / "hub" / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_31_8B))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    argv = ["train", "--config", str(ROOT / "configs" / name), f"model.tokenizer='{TOKENIZER}'", "--dry-run"]
    assert main(argv) == 0
    note = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("model config_overrides")
    )
    assert note == (
        f"model config_overrides: max_position_embeddings 131072 -> {window}; rope_parameters "
        '{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, '
        f'"rope_type": "llama3", "rope_theta": 500000.0}} -> {{"rope_type": "yarn", "factor": {factor}, '
        '"original_max_position_embeddings": 131072, "rope_theta": 500000.0}'
    )


def test_gpu_settings_are_listed_not_refused_without_a_gpu(planning_machine):
    from longalign.run import dry_run_arguments, gpu_settings

    cfg = load_config(DEMO, ["training.bf16=true", "training.tf32=true", "model.attn_backend='flash_attn'",
                             "lora.load_in_4bit=true", "training.use_cpu=false"])  # fmt: skip
    args, needs_gpu = dry_run_arguments(cfg)
    assert needs_gpu == [
        "training.bf16 = true",
        "training.tf32 = true",
        'model.attn_backend = "flash_attn"',
    ]  # QLoRA is not among them: bitsandbytes quantizes on CPU too
    assert not args.bf16 and not args.tf32 and args.learning_rate == 3e-3  # the rest is checked as written
    assert gpu_settings(load_config(DEMO, ["training.bf16=true"])) == []  # use_cpu: bf16 runs on the CPU
    with pytest.raises(ConfigError, match="support bf16/gpu"):
        training_arguments(cfg)  # the run itself still refuses what this machine cannot do


def test_a_dry_run_reads_a_cached_model_and_tokenizer_without_the_network(planning_machine, chats, capsys):
    """A Hub id found in the Hugging Face cache is checked offline: its vocabulary against the data."""
    import shutil

    from longalign.cli import main

    repo = planning_machine / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(TOKENIZER, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    long_path, _ = chats
    run = planning_machine / "run.toml"
    run.write_text(
        f"[data]\ntrain_file = '{long_path}'\nmax_seq_len = 2048\n[training]\nuse_cpu = true\n"
        f"output_dir = '{planning_machine / 'out'}'\n[model]\nmodel_name_or_path = 'org/tiny'\n"
    )
    for vocab_size, status in ((4096, 0), (4000, 2)):  # the shipped tokenizer has 4096 entries
        tiny_model(vocab_size=vocab_size, max_position_embeddings=2048).config.save_pretrained(snapshot)
        assert main(["train", "--config", str(run), "--dry-run"]) == status
        out, err = capsys.readouterr()
        assert "not checked" not in out
    assert err.strip().endswith("is outside the model's vocabulary of 4000 (was the data tokenized with another "
                                "tokenizer, or is the model's vocab_size too small?)")  # fmt: skip


def test_parameter_summary_counts_zero3_shards_at_their_full_size():
    model = torch.nn.Linear(4, 3)  # 12 + 3 parameters
    for param in model.parameters():  # as ZeRO-3 leaves them: an empty shard, the full size in ds_numel
        param.ds_numel = param.numel()
        param.data = torch.empty(0)
    model.bias.requires_grad_(False)
    assert parameter_summary(model) == "parameters: 12 trainable of 15 (80.00%)"


# --- RoPE past the checkpoint's window: config_overrides -------------------------------------------------

SHIPPED_TOKENIZER = dict(vocab_size=4096, bos_token_id=4088, eos_token_id=4092, pad_token_id=4093)
YARN = '{ max_position_embeddings = 4096, rope_parameters = { rope_type = "yarn", factor = 4.0 } }'
TRAINED_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "rope_theta": 500000.0,
    "original_max_position_embeddings": 1024,
}


def window_run(tmp_path: Path, overrides: str | None, *extra: str):
    """The config of two steps on ``window_packs`` from a tiny Llama checkpoint with a 1024-token window."""
    base = tmp_path / "base"
    if not base.exists():
        tiny_model(**SHIPPED_TOKENIZER, max_position_embeddings=1024, rope_theta=500000.0).save_pretrained(
            base
        )
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        f"[data]\ntrain_file = '{window_packs(tmp_path / 'packs', vocab_size=4088)}'\nmax_seq_len = 4096\n"
        f"[training]\noutput_dir = '{tmp_path / 'run'}'\nmax_steps = 2\nlearning_rate = 1e-2\nuse_cpu = true\n"
        "save_steps = 1\nlogging_steps = 1\nreport_to = 'none'\ndisable_tqdm = true\n"
        f"[model]\nmodel_name_or_path = '{base}'\ntokenizer = '{TOKENIZER}'\ntorch_dtype = 'float32'\n"
        "attn_backend = 'sdpa_segments'\n" + (f"config_overrides = {overrides}\n" if overrides else "")
    )
    return load_config(run_file, list(extra))


@pytest.mark.integration
def test_a_checkpoint_trains_past_its_window_with_yarn_and_is_saved_with_it(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from longalign.eval.models import load_model as load_for_eval
    from longalign.run import build_trainer, close, release

    trainer = build_trainer(window_run(tmp_path, YARN))
    trainer.train()
    trainer.save_model()
    for saved in (tmp_path / "run", tmp_path / "run" / "checkpoint-2"):
        config = json.loads((saved / "config.json").read_text())
        assert config["rope_parameters"] == TRAINED_YARN and config["max_position_embeddings"] == 4096
        assert load_for_eval(str(saved)).config.rope_parameters == TRAINED_YARN  # what longalign eval scores
    row = load_stage(tmp_path / "packs")[1]  # samples of 3000 and 1096 tokens
    training_model = trainer.model.double().eval()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run", dtype=torch.float64).eval()
    assert packed_logits_error(training_model, reloaded, row) < FLOAT64_BOUND
    without = LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64).eval()
    without.load_state_dict(reloaded.state_dict())  # the trained weights on the 1024-token RoPE
    assert packed_logits_error(training_model, without, row) > 1e-3  # YaRN made the difference
    release(trainer)
    close()


@pytest.mark.integration
def test_adapters_trained_past_the_window_merge_and_evaluate_on_the_yarn_base(tmp_path):
    from longalign.eval.models import load_model as load_for_eval
    from longalign.lora import merge_adapter
    from longalign.run import build_trainer, close, release

    trainer = build_trainer(
        window_run(tmp_path, YARN, "lora.r=4", "lora.target_modules=['q_proj', 'v_proj']")
    )
    trainer.train()
    trainer.save_model()
    release(trainer)
    close()
    record = {
        "config_overrides": {
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
        },
        "save_format": "auto",
    }
    for saved in (tmp_path / "run", tmp_path / "run" / "checkpoint-2"):
        assert json.loads((saved / "config_overrides.json").read_text()) == record
        assert load_for_eval(str(saved)).config.rope_parameters == TRAINED_YARN
    merge_adapter(tmp_path / "run", tmp_path / "merged")
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged["rope_parameters"] == TRAINED_YARN and merged["max_position_embeddings"] == 4096


def test_samples_past_the_window_are_refused_before_the_weights_load_naming_the_override(tmp_path, capsys):
    from longalign.cli import main
    from longalign.run import build_trainer

    cfg = window_run(tmp_path, None)
    with pytest.raises(ConfigError) as err:
        build_trainer(cfg)
    assert str(err.value) == (
        "the training data: samples of up to 4096 tokens are longer than the model's max_position_embeddings = "
        "1024 (positions restart with each sample: each sample must fit); extend it with model.config_overrides = "
        '{ max_position_embeddings = 4096, rope_parameters = { rope_type = "yarn", factor = 4.0 } }, or leave the '
        "longer samples out (data.max_seq_len_filter = 1024)"
    )
    assert not (tmp_path / "run").exists()  # refused before anything ran
    run_file = str(tmp_path / "run.toml")
    assert (
        main(["train", "--config", run_file, "--dry-run"]) == 2
    )  # the dry run reads the config and refuses too
    assert capsys.readouterr().err.strip().endswith("(data.max_seq_len_filter = 1024)")
    assert main(["train", "--config", run_file, "--dry-run", f"model.config_overrides={YARN}"]) == 0
    out = capsys.readouterr().out
    assert (
        'model config_overrides: max_position_embeddings 1024 -> 4096; rope_parameters {"rope_theta": 500000.0, '
        '"rope_type": "default"} -> {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, '
        '"original_max_position_embeddings": 1024}'
    ) in out


def test_a_misspelt_override_is_one_line_naming_it(tmp_path, capsys):
    from longalign.cli import main

    window_run(tmp_path, "{ max_position_embedings = 4096 }")
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "longalign train: error: model.config_overrides.max_position_embedings: not a field of LlamaConfig; "
        "did you mean 'max_position_embeddings'?"
    )


def test_the_preflight_shows_what_the_overrides_change(tmp_path):
    from longalign.run import preflight

    report = preflight(window_run(tmp_path, YARN))
    row = next(line for line in str(report).splitlines() if line.startswith("config overrides"))
    assert row.split()[2] == "ok"
    assert row.endswith(
        'max_position_embeddings 1024 -> 4096; rope_parameters {"rope_theta": 500000.0, "rope_type": "default"} -> '
        '{"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0, "original_max_position_embeddings": 1024}'
    )
