"""One run, one place: from a :class:`~longalign.config.Config` to a trainer, and the run's lifecycle.

Everything that turns a run file into working objects lives here, once::

    cfg = load_config("run.toml", ["training.max_steps=10"])
    args = training_arguments(cfg)          # the one TrainingArguments (process group, device, precision)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg)                 # dtype from model_dtype(cfg), varlen attention patched in
    packs = resolve_packs("train", cfg, args, tokenizer)
    trainer = build_trainer(cfg)            # all of the above (with [lora]'s adapters), as a LongAlignTrainer
    train(cfg)                              # preflight -> resume -> train -> evaluate -> save -> close

``train.py`` (``longalign train``), the preflight (``longalign preflight``) and the memory probe
(``longalign probe``) all start here.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import longalign.patch
from longalign import checkpoints
from longalign.artifacts import REPORT_NAME, load_stage, read_report
from longalign.batching import packs_fingerprint
from longalign.chat_template import open_tokenizer
from longalign.chatglm_layout import CHATGLM, NATIVE
from longalign.config import (
    EXACT_WEIGHTINGS,
    IGNORE_INDEX,
    RESERVED_TRAINING_ARGS,
    Config,
    LoraConfig,
    Source,
    check_config_overrides,
)
from longalign.errors import ConfigError, InputError, LongAlignError
from longalign.fingerprints import digest, tokenizer_digests
from longalign.loss import linear_head
from longalign.packing import write_packs
from longalign.patch import families
from longalign.preflight import (
    DEFAULT_ENV,
    PreflightReport,
    check_trainer,
    compute_dtype,
    parallelism_row,
    preflight_enabled,
    run_preflight,
)
from longalign.redact import is_secret_name, redact
from longalign.sources import fingerprint, kind
from longalign.tokenize import pre_tokenize
from longalign.trainer import CHECKPOINT_RECORD, LongAlignTrainer


def training_arguments(cfg: Config) -> TrainingArguments:
    """The run's ``TrainingArguments``, built here and nowhere else; a value they refuse names its key."""
    settings = {**cfg.training.args, "remove_unused_columns": False}
    # Every trained weight of a causal LM (or every adapter) gets a gradient every step: DDP's search for
    # unused parameters, transformers' default without activation checkpointing, would only cost time.
    settings.setdefault("ddp_find_unused_parameters", False)
    if settings.get("activation_checkpointing") or settings.get("gradient_checkpointing"):
        # The Trainer enables checkpointing when training starts and takes every_n_layers from here.
        kwargs = settings.get("activation_checkpointing_kwargs") or settings.get(
            "gradient_checkpointing_kwargs"
        )
        every = {"every_n_layers": cfg.training.activation_checkpointing_layers}
        settings["activation_checkpointing_kwargs"] = {**(kwargs or {}), **every}
        settings.pop("gradient_checkpointing_kwargs", None)
    try:
        return TrainingArguments(output_dir=cfg.training.output_dir, **settings)
    except (ValueError, TypeError) as err:
        message = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"[training]: {message}") from None


def load_tokenizer(cfg: Config):
    """The run's tokenizer: ``model.tokenizer``, else the model's own."""
    name = cfg.model.tokenizer or cfg.model.model_name_or_path
    if not name:
        raise ConfigError("model.tokenizer: set it (a random model from init_from_config has no tokenizer)")
    return open_tokenizer(name, trust_remote_code=cfg.model.trust_remote_code)


def model_config(cfg: Config):
    """The model's transformers config: built from ``init_from_config``, or read from the checkpoint with
    ``config_overrides`` applied (``checkpoints.override_config``)."""
    mc = cfg.model
    if mc.init_from_config is not None:
        settings = dict(mc.init_from_config)
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    config = checkpoints.model_config(mc.model_name_or_path, trust_remote_code=mc.trust_remote_code)
    if not mc.config_overrides:
        return config
    check_config_overrides(mc.config_overrides, config.model_type)
    return checkpoints.override_config(config, mc.config_overrides, save_format=mc.save_format)


def overrides_note(cfg: Config) -> str | None:
    """What ``model.config_overrides`` change, read from the config files alone; ``None`` without overrides.

    ``max_position_embeddings 1024 -> 4096; rope_parameters {"rope_theta": 10000.0, "rope_type": "default"}
    -> {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}``
    """
    mc = cfg.model
    if not mc.config_overrides:
        return None
    before = checkpoints.model_config(mc.model_name_or_path, trust_remote_code=mc.trust_remote_code)
    after = model_config(cfg)
    return "; ".join(
        f"{key} {json.dumps(checkpoints.config_value(before, key))} -> "
        f"{json.dumps(checkpoints.config_value(after, key))}"
        for key in mc.config_overrides
    )


def model_dtype(cfg: Config) -> torch.dtype:
    """The dtype the model is loaded in: ``model.torch_dtype``, where ``auto`` is the checkpoint's own.

    A random model (``init_from_config``) and a checkpoint whose config names no dtype load in float32.
    Read from the config files alone, so the preflight can tell without loading weights.
    """
    mc = cfg.model
    if mc.torch_dtype != "auto":
        return getattr(torch, mc.torch_dtype)
    if mc.init_from_config is not None:
        return torch.float32
    dtype = getattr(model_config(cfg), "dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def load_model(cfg: Config, device: torch.device | None = None) -> torch.nn.Module:
    """The model of ``[model]`` (pretrained, or random from ``init_from_config``), patched for packed input.

    With ``[lora] load_in_4bit`` or ``load_in_8bit`` a pretrained model loads quantized onto ``device``.
    ``[training] sequence_tiling`` tiles its MLPs or whole layers and ``offload_activations`` moves the inputs that
    checkpointing keeps to host memory (``longalign.patch``).
    """
    mc = cfg.model
    dtype = model_dtype(cfg)
    quantized = cfg.lora is not None and (cfg.lora.load_in_4bit or cfg.lora.load_in_8bit)
    if mc.init_from_config is not None:
        if quantized:
            raise ConfigError(
                "lora.load_in_4bit/load_in_8bit: a checkpoint is quantized as it loads; save the random model "
                "and set model.model_name_or_path to it instead of init_from_config"
            )
        model = AutoModelForCausalLM.from_config(model_config(cfg), dtype=dtype)
    else:
        extra = {}
        if quantized:
            from longalign.lora import quantization

            extra = quantization(cfg.lora, dtype=dtype, device=device or torch.device("cpu"))
        model = checkpoints.load_model(
            mc.model_name_or_path,
            config=model_config(cfg),
            dtype=dtype,
            trust_remote_code=mc.trust_remote_code,
            **extra,
        )
    training = cfg.training
    model = longalign.patch.apply(
        model, backend=mc.attn_backend, sequence_parallel_size=training.sequence_parallel_size
    )
    # After the run's TrainingArguments: under ZeRO-3 the tiled MLPs (or layers) become leaf modules.
    if training.sequence_tiling == "mlp":
        longalign.patch.tile_mlp(model, tile_tokens=training.mlp_tile_tokens)
    elif training.sequence_tiling == "layer":
        longalign.patch.tile_layers(
            model, tile_tokens=training.mlp_tile_tokens, keep_attention=training.keep_attention
        )
    if training.offload_activations:
        longalign.patch.offload_checkpointed_inputs(model)
    return model


def check_family(cfg: Config, config=None) -> families.Decision:
    """The model family's decision (``longalign.patch.families``) for the run's model and attention backend,
    from its config alone; raises ``UnsupportedModelError`` in one line when it cannot train on packed
    samples exactly, or when ``training.sequence_tiling`` cannot tile it. Called before any data is prepared."""
    decision = families.decide(
        config if config is not None else model_config(cfg), backend=cfg.model.attn_backend
    )
    if not decision.exact:
        raise longalign.patch.UnsupportedModelError(decision.message())
    mode = cfg.training.sequence_tiling
    problem = decision.tiling_problem(mode)
    if problem is not None:
        instead = (
            "sequence_tiling = 'mlp' tiles the MLP alone" if mode == "layer" else "set sequence_tiling = ''"
        )
        raise longalign.patch.UnsupportedModelError(
            f"training.sequence_tiling = {mode!r} cannot tile {decision.architecture} (model type "
            f"{decision.model_type!r}): {problem}; {instead}"
        )
    return decision


def check_sequence_parallel(
    cfg: Config, world_size: int, *, parallelism: Any = None, environ: Mapping[str, str] = os.environ
) -> list[list[int]]:
    """The ranks that share each pack, or a refusal of ``training.sequence_parallel_size`` in one line
    naming every reason it cannot run.

        sequence_parallel_size 2 on 4 ranks  ->  [[0, 1], [2, 3]]      (1: every rank alone)

    Checked before any work, from the run file, the launch and the model's config: the world size splits
    into groups of N ranks, the model's heads split over N ranks (``longalign.patch.
    sequence_parallel_problems``), nothing else splits the model or the sequence (accelerate's
    ``parallelism``, from ``TrainingArguments.parallelism_config`` or the launcher's
    ``PARALLELISM_CONFIG_*`` variables: tensor, context or its own sequence parallelism), and DeepSpeed
    is installed.
    """
    size = cfg.training.sequence_parallel_size
    groups = [list(range(start, min(start + size, world_size))) for start in range(0, world_size, size)]
    if size == 1:
        return groups
    found = []
    if world_size % size:
        found.append(
            f"the world size {world_size} is not a multiple of it (each pack is split over {size} consecutive ranks)"
        )
    config = model_config(cfg)
    found += [
        f"{config.model_type} model: {problem}"
        for problem in longalign.patch.sequence_parallel_problems(config, size)
    ]
    for axis in ("tp", "cp", "sp"):
        other = getattr(parallelism, f"{axis}_size", None) or int(
            environ.get(f"PARALLELISM_CONFIG_{axis.upper()}_SIZE", "1")
        )
        if other > 1:
            found.append(
                f"accelerate's parallelism config sets {axis}_size = {other}, which would split the model or the "
                "sequence a second time; leave accelerate's tensor, context and sequence parallelism off"
            )
    if cfg.loss.weighting not in EXACT_WEIGHTINGS:
        found.append(
            f"loss.weighting = {cfg.loss.weighting!r} is a reference counted per pack and micro-batch, which a "
            "split pack cannot reproduce; use sequence_level or token_level"
        )
    if importlib.util.find_spec("deepspeed") is None:
        found.append("it runs on DeepSpeed, which is not installed: pip install 'longalign[sp]'")
    if found:
        raise ConfigError(f"training.sequence_parallel_size = {size} cannot run: {'; '.join(found)}")
    return groups


def check_quantized_base(
    cfg: Config, args: TrainingArguments, environ: Mapping[str, str] = os.environ
) -> None:
    """Refuse ``[lora] load_in_4bit`` / ``load_in_8bit`` under DeepSpeed ZeRO-3 in one line, before any work.

    bitsandbytes quantizes the base as it loads onto each rank's device (a device map), while ZeRO-3 shards
    every weight over the ranks as it loads: transformers refuses a device map under ZeRO-3. The stage is the
    one the run's DeepSpeed plugin was built with, from ``[training] deepspeed`` or the accelerate config.
    """
    lora = cfg.lora
    plugin = getattr(args, "deepspeed_plugin", None)
    if lora is None or not (lora.load_in_4bit or lora.load_in_8bit) or plugin is None:
        return
    if plugin.zero_stage != 3:
        return
    key = "lora.load_in_4bit" if lora.load_in_4bit else "lora.load_in_8bit"
    if args.deepspeed:
        where = f"[training] deepspeed = {args.deepspeed if isinstance(args.deepspeed, str) else '{...}'}"
    else:
        where = f"the accelerate config, {environ.get('ACCELERATE_DEEPSPEED_CONFIG_FILE') or 'zero_stage: 3'}"
    raise ConfigError(
        f"{key}: QLoRA cannot run under DeepSpeed ZeRO-3 ({where}): ZeRO-3 shards the weights as they load and "
        "the quantized base loads whole onto each rank's device; train plain LoRA under ZeRO-3, or QLoRA with "
        "DDP or ZeRO-2"
    )


def resolve_packs(which: str, cfg: Config, args: TrainingArguments, tokenizer=None):
    """The packs of the training (``which="train"``) or eval data, prepared on first use (see :func:`prepare`).

    Either way the rows must fit ``data.max_seq_len`` and mark non-targets with -100.
    """
    path = prepare(which, cfg, args, tokenizer)
    return check_packs(load_stage(path), str(path), cfg)


def prepare(which: str, cfg: Config, args: TrainingArguments, tokenizer=None) -> Path:
    """The packed directory of the ``train`` or ``eval`` data, preparing and caching what is missing.

    A packed directory is used as is; a pre-tokenized one is packed with ``[packing]``; raw sources (chat
    files, directories, datasets, Hub ids, or the ``[[data.sources]]`` of a mix) are pre-tokenized with
    the run's tokenizer, mixed and packed. Each step's output is cached in ``data.cache_dir`` under a
    fingerprint of everything that decides its content (the sources' files, the tokenizer and its
    template, max_seq_len and truncation; then the length filters, the mix, the packing settings and the
    seed), so an unchanged rerun reuses it and any change prepares it again. The local main process
    prepares while the others wait.
    """
    sources = cfg.data.train_sources() if which == "train" else [Source(cfg.data.eval_file)]
    if not sources or not sources[0].path:
        raise ConfigError("data.train_file: set it (or [[data.sources]]) to the training data")
    stages = [_stage_kind(source) for source in sources]
    mixing = len(sources) > 1 or any(source.rule is not None for source in sources)
    if stages[0] == "packed" and not mixing:
        for key in ("min_seq_len", "max_seq_len_filter"):
            if cfg.source(f"data.{key}") != "default":
                raise ConfigError(
                    f"data.{key}: filters samples when packing, but {sources[0].path} is packed already"
                )
        return Path(sources[0].path)
    if any(stage is not None for stage in stages) and mixing:
        raise ConfigError(
            "data.sources: a mix takes raw chat sources, not pre-tokenized or packed directories"
        )
    cache_root = Path(cfg.data.cache_dir or Path(args.output_dir) / "data")
    with args.main_process_first(desc=f"preparing the {which} data"):
        if stages[0] == "tokenized":
            tokenized = Path(sources[0].path)
        else:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
            settings = {
                "max_seq_len": cfg.data.max_seq_len,
                "truncation": cfg.data.raw_truncation,
                "num_proc": cfg.data.num_proc,
            }
            key = digest([[fingerprint(s) for s in sources], tokenizer_digests(tokenizer), settings])
            tokenized = cache_root / f"tokenized-{key}"
            if not tokenized.exists():
                # Nodes on shared storage may prepare at once: the first complete copy wins.
                pre_tokenize(sources, tokenizer, tokenized, **settings, replace=False)
        packing = cfg.packing
        settings = {
            "max_seq_len": cfg.data.max_seq_len,
            "strategy": packing.strategy,
            "batch_size": packing.batch_size if packing.strategy == "sorted" else 1,
            # Only greedy packs differently when sorted first; the others sort anyway.
            "sort_by_length": packing.sort_by_length and packing.strategy == "greedy",
            "seed": packing.seed,
            "drop_long": packing.drop_long,
            "min_sample_len": cfg.data.min_seq_len,
            "max_sample_len": cfg.data.max_seq_len_filter,
        }
        mix = sources if mixing else None
        state = [(tokenized / name).read_text() for name in ("state.json", "report.json")]
        key = digest([state, settings, [dataclasses.asdict(s) for s in mix or []]])
        packed = cache_root / f"packed-{key}"
        if not packed.exists():
            write_packs(tokenized, packed, **settings, mix=mix, replace=False)
    return packed


def _stage_kind(source: Source) -> str | None:
    """``"packed"`` or ``"tokenized"`` for a longalign stage directory (by its columns), else ``None``."""
    if kind(source.path) != "dataset" or (Path(source.path) / "dataset_dict.json").exists():
        return None
    columns = load_stage(source.path).column_names
    if "cu_seqlens" in columns:
        return "packed"
    return "tokenized" if {"input_ids", "length"} <= set(columns) else None


def check_packs(packs, path: str, cfg: Config):
    """``packs`` if they fit ``data.max_seq_len`` and their labels mark non-targets with -100.

    Every sample must fit, and every row too, except the batches of the ``sorted`` strategy, which hold
    ``batch_size`` samples of up to ``max_seq_len`` tokens each.
    """
    budget = cfg.data.max_seq_len
    longest_sample = pc.max(pc.list_flatten(packs.data.column("seq_lens"))).as_py() or 0
    longest_row = pc.max(pc.list_value_length(packs.data.column("input_ids"))).as_py() or 0
    report = Path(path) / REPORT_NAME
    sorted_batches = report.exists() and read_report(path).get("strategy") == "sorted"
    if longest_sample > budget or (longest_row > budget and not sorted_batches):
        what = (
            f"samples of up to {longest_sample}"
            if longest_sample > budget
            else f"pack rows of up to {longest_row}"
        )
        raise ConfigError(
            f"{path}: {what} tokens do not fit data.max_seq_len = {budget}; pack again with the smaller "
            "budget, or raise data.max_seq_len"
        )
    labels = pc.list_flatten(packs.data.column("labels"))
    negative = pc.unique(pc.filter(labels, pc.less(labels, 0))).to_pylist()
    if any(value != IGNORE_INDEX for value in negative):
        raise InputError(
            f"{path}: labels mark non-targets with {', '.join(map(str, sorted(negative)))}, not "
            f"{IGNORE_INDEX} as pre-tokenize writes them"
        )
    return packs


def check_vocabulary(model: torch.nn.Module | int, packs, path: str) -> None:
    """Every token id of ``packs`` must have a row in the model's input embedding (or vocabulary size)."""
    largest = pc.max(pc.list_flatten(packs.data.column("input_ids"))).as_py()
    size = model if isinstance(model, int) else model.get_input_embeddings().num_embeddings
    if largest is not None and largest >= size:
        raise ConfigError(
            f"{path}: token id {largest} is outside the model's vocabulary of {size} "
            "(was the data tokenized with another tokenizer, or is the model's vocab_size too small?)"
        )


def check_positions(config, packs, path: str, cfg: Config) -> None:
    """Every sample of ``packs`` must fit the model's window (``max_position_embeddings`` of ``config``).

    Positions restart with each sample, so it is the longest sample, not the pack, that must fit: a pack of
    4096 tokens holding samples of up to 1024 trains on a 1024-token window as it is. The refusal names
    the override that would make the window long enough.
    """
    window = getattr(config.get_text_config(), "max_position_embeddings", None)
    longest = pc.max(pc.list_flatten(packs.data.column("seq_lens"))).as_py()
    if window is None or longest is None or longest <= window:
        return
    mc = cfg.model
    factor = 2 ** math.ceil(math.log2(longest / window))
    yarn = f'rope_parameters = {{ rope_type = "yarn", factor = {factor:.1f} }}'
    pretrained = mc.init_from_config is None
    layout = (
        pretrained
        and checkpoints.find_checkpoint(mc.model_name_or_path, trust_remote_code=mc.trust_remote_code).layout
    )
    if not pretrained:
        fix = f"raise max_position_embeddings in model.init_from_config to {longest} or more"
    elif layout == CHATGLM and mc.save_format != NATIVE:  # it holds plain RoPE only
        fix = (
            f"extend it with model.config_overrides = {{ max_position_embeddings = {window * factor}, rope_theta "
            f'= ... }} (a larger base), or {yarn} with model.save_format = "native", or leave the longer samples '
            f"out (data.max_seq_len_filter = {window})"
        )
    else:
        fix = (
            f"extend it with model.config_overrides = {{ max_position_embeddings = {window * factor}, {yarn} }}, "
            f"or leave the longer samples out (data.max_seq_len_filter = {window})"
        )
    raise ConfigError(
        f"{path}: samples of up to {longest} tokens are longer than the model's max_position_embeddings = "
        f"{window} (positions restart with each sample: each sample must fit); {fix}"
    )


def run_record(cfg: Config, args: TrainingArguments, packs) -> dict[str, Any]:
    """What a checkpoint records of its run: ``decides`` must match on resume, ``kept`` is restored as saved.

    ``decides``: the pack order and the loss (the data, the sampler's seed and split, the weighting);
    ``kept``: what the restored optimizer and scheduler carry over from the checkpoint whatever the run
    file now says.
    """
    return {
        "decides": {
            "data": packs_fingerprint(packs),
            "data.max_seq_len": cfg.data.max_seq_len,
            "packing.seed": cfg.packing.seed,
            "loss.weighting": cfg.loss.weighting,
            "training.per_device_train_batch_size": args.per_device_train_batch_size,
            "training.gradient_accumulation_steps": args.gradient_accumulation_steps,
            "training.seed": args.seed,
            "world size": args.world_size,
            # Recorded only when on, so that checkpoints from before the setting existed still resume.
            **(
                {"training.sequence_parallel_size": cfg.training.sequence_parallel_size}
                if cfg.training.sequence_parallel_size > 1
                else {}
            ),
            **adapter_record(cfg),
        },
        "kept": {
            f"training.{name}": getattr(args, name)
            for name in ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "optim")
        },
    }


def adapter_record(cfg: Config) -> dict[str, Any]:
    """The ``[lora]`` settings and the base model under the adapters; all ``None`` for full fine-tuning.

    A resume loads only the adapters from the checkpoint and rebuilds the frozen base from the config,
    so the base and every adapter setting must match, as the data must.
    """
    if cfg.lora is not None:
        settings = dataclasses.asdict(cfg.lora)
    else:
        settings = dict.fromkeys(field.name for field in dataclasses.fields(LoraConfig))
    record = {f"lora.{key}": value for key, value in settings.items()}
    base = cfg.model.model_name_or_path or json.dumps(cfg.model.init_from_config, sort_keys=True)
    record["lora.base_model"] = base if cfg.lora is not None else None
    # Recorded only when set, so that checkpoints from before the setting existed still resume.
    if cfg.lora is not None and cfg.model.config_overrides:
        record["lora.base_config_overrides"] = cfg.model.config_overrides
    return record


def saved_random_base(cfg: Config, args: TrainingArguments) -> Config:
    """``cfg``, or for QLoRA on a random base (``init_from_config``) ``cfg`` pointing at that base, saved.

    bitsandbytes quantizes a checkpoint as it loads, so the random model is built in ``torch_dtype`` from the
    seed, written to ``output_dir/base_model`` (where the adapters name their base for merging) and loaded
    back quantized. The other ranks wait for the saving one.
    """
    lora = cfg.lora
    if cfg.model.init_from_config is None or lora is None or not (lora.load_in_4bit or lora.load_in_8bit):
        return cfg
    from longalign.lora import BASE_MODEL_DIR, save_base  # the lora extra, needed by [lora] runs alone

    with args.main_process_first(local=args.save_on_each_node, desc="saving the random base"):
        if args.should_save:
            model = AutoModelForCausalLM.from_config(model_config(cfg), dtype=model_dtype(cfg))
            save_base(model, args.output_dir)
    saved = str((Path(args.output_dir) / BASE_MODEL_DIR).resolve())
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, model_name_or_path=saved, init_from_config=None)
    )


def adapt(model: torch.nn.Module, cfg: Config, args: TrainingArguments) -> torch.nn.Module:
    """``model`` with ``[lora]``'s adapters (see ``longalign.lora``).

    A random base (``init_from_config``) is saved in ``output_dir/base_model`` for merging; the adapters
    name it as their base.
    """
    from longalign.lora import BASE_MODEL_DIR, add_adapters, save_base

    base = cfg.model.model_name_or_path
    if cfg.model.init_from_config is not None:
        base = str((Path(args.output_dir) / BASE_MODEL_DIR).resolve())
        quantized = cfg.lora.load_in_4bit or cfg.lora.load_in_8bit  # saved before it loaded quantized
        if args.should_save and not quantized:
            save_base(model, args.output_dir)
    return add_adapters(model, cfg.lora, base_model=base)


def parameter_summary(model: torch.nn.Module) -> str:
    """``parameters: 20,971,520 trainable of 8,051,232,768 (0.26%)``, counting 4-bit weights as peft does."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
    else:
        sizes = parameter_sizes(model)
        trainable, total = sizes["trainable_parameters"], sizes["parameters"]
    return f"parameters: {trainable:,} trainable of {total:,} ({trainable / max(total, 1):.2%})"


def parameter_sizes(model: torch.nn.Module) -> dict[str, int]:
    """The model's parameters and the bytes they take in their dtypes, all of them and the trainable ones.

    ``{"parameters": 8030261248, "parameter_bytes": 16060522496, "trainable_parameters": ..., "trainable_bytes":
    ...}``. Under ZeRO-3 a parameter holds an empty shard; DeepSpeed keeps its full size in ``ds_numel``.
    """
    sizes = dict.fromkeys(("parameters", "parameter_bytes", "trainable_parameters", "trainable_bytes"), 0)
    for param in model.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        size = numel * param.element_size()
        sizes["parameters"] += numel
        sizes["parameter_bytes"] += size
        if param.requires_grad:
            sizes["trainable_parameters"] += numel
            sizes["trainable_bytes"] += size
    return sizes


def build_trainer(cfg: Config) -> LongAlignTrainer:
    """Everything a run sets up before ``train()``: arguments, tokenizer, model, packs, eval tasks, trainer."""
    args = training_arguments(cfg)
    check_sequence_parallel(cfg, args.world_size, parallelism=args.parallelism_config)
    check_quantized_base(cfg, args)
    check_family(cfg)
    tokenizer = load_tokenizer(cfg)
    # The data first: a problem with it shows before the weights are loaded.
    train_packs = resolve_packs("train", cfg, args, tokenizer)
    eval_packs = resolve_packs("eval", cfg, args, tokenizer) if cfg.data.eval_file else None
    config = model_config(cfg)
    check_positions(config, train_packs, "the training data", cfg)
    if eval_packs is not None:
        check_positions(config, eval_packs, "the eval data", cfg)
    tasks = eval_tasks(cfg, tokenizer, config)
    transformers.set_seed(args.seed)
    model = load_model(saved_random_base(cfg, args), args.device)
    check_vocabulary(model, train_packs, "the training data")
    if eval_packs is not None:
        check_vocabulary(model, eval_packs, "the eval data")
    read_head = linear_head
    if cfg.lora is not None:
        from longalign.lora import adapted_head

        model, read_head = adapt(model, cfg, args), adapted_head
    trainer = LongAlignTrainer(
        model=model,
        args=args,
        train_dataset=train_packs,
        eval_dataset=eval_packs,
        processing_class=tokenizer,
        weighting=cfg.loss.weighting,
        longwriter_divisor=cfg.loss.longwriter_divisor,
        max_seq_len=cfg.data.max_seq_len,
        loss_chunk_size=cfg.loss.chunk_size,
        read_head=read_head,
        pack_seed=cfg.packing.seed,
        pad_packs_to=cfg.data.max_seq_len if cfg.packing.pad_to_max else None,
        sequence_parallel_size=cfg.training.sequence_parallel_size,
        run_record=json.loads(json.dumps(run_record(cfg, args, train_packs), default=str)),
        save_layout=final_saver(cfg),
        save_with_model=adapter_files(cfg),
    )
    if tasks:
        from longalign.eval.in_training import EvalTasksCallback

        trainer.add_callback(EvalTasksCallback(trainer, tasks, on_start=cfg.eval_tasks.on_start))
    return trainer


def eval_tasks(cfg: Config, tokenizer, config) -> list:
    """The tasks of ``[eval_tasks]`` with their prompts (``longalign.eval.in_training``); none without it.

    ``config`` is the model's (``model_config``): no prompt may be longer than its window.
    """
    if cfg.eval_tasks is None:
        return []
    from longalign.eval.in_training import build_tasks

    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return build_tasks(cfg.eval_tasks, tokenizer, context_limit=limit)


def adapter_files(cfg: Config) -> dict[str, Any]:
    """Files a ``[lora]`` run writes next to every adapter it saves: the base's ``config_overrides``, which
    merging and eval apply to the base (``checkpoints.adapter_base_config``). A full model carries them in
    its own config."""
    mc = cfg.model
    if cfg.lora is None or not mc.config_overrides:
        return {}
    return {checkpoints.OVERRIDES_RECORD: checkpoints.overrides_record(mc.config_overrides, mc.save_format)}


def final_saver(cfg: Config):
    """How the run writes its final model or adapter in the layout it loaded (``None``: as transformers does)."""
    mc = cfg.model
    if not mc.model_name_or_path:
        return None
    if cfg.lora is not None:
        from longalign.lora import adapter_saver

        return adapter_saver(mc.model_name_or_path, mc.save_format, trust_remote_code=mc.trust_remote_code)
    return checkpoints.layout_saver(
        mc.model_name_or_path, mc.save_format, trust_remote_code=mc.trust_remote_code
    )


def train(cfg: Config) -> int:
    """The whole run: build, preflight (when on), resume, train, evaluate, save; the exit status."""
    trainer = build_trainer(cfg)
    try:
        return _lifecycle(trainer, cfg)
    except BaseException as err:
        # The failed step's frames still hold the DDP wrapper as a local; let release() be its last owner.
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        release(trainer)
        close()


def _lifecycle(trainer: LongAlignTrainer, cfg: Config) -> int:
    if preflight_enabled(cfg.training.preflight, trainer.args.world_size):
        # Every rank takes part; all stop here if any disagrees.
        report = check_trainer(trainer, cfg, overrides_note=lambda: overrides_note(cfg))
        if trainer.is_world_process_zero():
            print(report, flush=True)
        if not report.ok:
            return 1
    if trainer.is_world_process_zero():
        mc = cfg.model
        note = mc.model_name_or_path and checkpoints.layout_note(
            mc.model_name_or_path, trust_remote_code=mc.trust_remote_code, save_format=mc.save_format
        )
        if note:
            print(f"model: {note}", flush=True)
        if mc.config_overrides:
            print(f"model config_overrides: {overrides_note(cfg)}", flush=True)
        print(parameter_summary(trainer.model), flush=True)
    resume = resume_point(trainer, cfg)
    try:
        trainer.train(resume_from_checkpoint=resume)
        if trainer.eval_dataset is not None:
            trainer.evaluate()
        trainer.save_model()
        trainer.save_state()
    except (LongAlignError, OSError) as err:
        # Once training runs, nothing is a setting the user typed: the CLI shows this with its traceback.
        raise RuntimeError(f"training stopped at step {trainer.state.global_step}: {err}") from err
    return 0


def resume_point(trainer: LongAlignTrainer, cfg: Config) -> str | None:
    """The checkpoint to resume from (``None``: a fresh run), after checking that resuming is sound.

    ``resume_from_checkpoint = "last"`` takes the newest complete checkpoint of ``output_dir``. A resume
    whose data, packing or loss settings differ from the checkpoint's is refused, naming what changed,
    unless ``training.resume_ignore_changes``; settings the checkpoint's optimizer and scheduler keep are
    stated. A fresh run into an ``output_dir`` that holds checkpoints is refused: the checkpoint limit
    would delete them.
    """
    output_dir = Path(trainer.args.output_dir)
    checkpoints = sorted(output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"), key=_step_of)
    complete = [path for path in checkpoints if (path / CHECKPOINT_RECORD).is_file()]
    resume = trainer.args.resume_from_checkpoint
    if resume is None:
        if checkpoints:
            raise ConfigError(
                f"training.output_dir: {output_dir} holds checkpoints of an earlier run ({checkpoints[-1].name}); "
                "resume it with training.resume_from_checkpoint='last', or choose another output_dir"
            )
        return None
    if resume == "last":
        if not complete:
            if checkpoints:
                raise ConfigError(
                    f"training.resume_from_checkpoint: no complete checkpoint in {output_dir} "
                    f"({', '.join(p.name for p in checkpoints)}: saves that did not finish); remove them to start afresh"
                )
            return None
        resume = str(complete[-1])
    notes = compare_records(Path(resume), trainer.run_record, cfg.training.resume_ignore_changes)
    if trainer.is_world_process_zero():
        for note in notes:
            print(f"resume: {note}", flush=True)
    return resume


def compare_records(checkpoint: Path, now: dict[str, Any], ignore_changes: bool) -> list[str]:
    """Notes on resuming ``checkpoint`` with the run record ``now``; raises if what decides the run changed."""
    try:
        saved = json.loads((checkpoint / CHECKPOINT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if not ignore_changes:
            raise ConfigError(
                f"training.resume_from_checkpoint: {checkpoint} is not a complete longalign checkpoint "
                f"(no {CHECKPOINT_RECORD}); set training.resume_ignore_changes=true to resume from it anyway"
            ) from None
        return [f"{checkpoint} has no {CHECKPOINT_RECORD}; resuming without checking the run's settings"]
    keys = list(dict.fromkeys([*now["decides"], *saved["decides"]]))  # a setting either side lacks differs
    changed = [
        f"{key} {saved['decides'].get(key)!r} -> {now['decides'].get(key)!r}"
        for key in keys
        if saved["decides"].get(key) != now["decides"].get(key)
    ]
    notes = []
    if changed and not ignore_changes:
        raise ConfigError(
            f"training.resume_from_checkpoint: {checkpoint.name} was saved with other settings ({'; '.join(changed)}), "
            "so the pack order or the loss would change; restore them, or set training.resume_ignore_changes=true"
        )
    if changed:
        notes.append(f"resuming although these changed: {'; '.join(changed)}")
    notes += [
        f"{key} is {value!r} in the run file, but the restored optimizer and scheduler keep the checkpoint's "
        f"{saved['kept'].get(key)!r}"
        for key, value in now["kept"].items()
        if saved.get("kept", {}).get(key) != value
    ]
    return notes


def _step_of(path: Path) -> int:
    step = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
    return int(step) if step.isdigit() else -1


def dry_run(cfg: Config) -> dict[str, Any]:
    """Everything but the training, as far as this machine can check it, with no download.

    Returns ``{"settings": [(key, value, source), ...], "config_overrides": note or None, "data": {"train":
    {...}, "eval": {...}}, "eval_tasks": [...], "needs_gpu": [...], "not_checked": [...]}``: each data entry
    has the packed directory and the pre-tokenize and pack reports (those that exist); the note says what
    ``model.config_overrides`` change (:func:`overrides_note`); ``eval_tasks`` what one evaluation of each
    task of ``[eval_tasks]`` costs, its prompts built. No model weights are loaded; the checks of the data's
    token ids (vocabulary) and sample lengths (window) read the model's config alone. What cannot be
    checked here is listed, one line each, instead of
    failing: settings that need a GPU on a machine without one (``needs_gpu``), and a tokenizer or model
    config that is neither a local directory nor in the Hugging Face cache, or data files that are not
    on this machine (``not_checked``). A machine where people plan GPU jobs has neither GPU nor data.
    """
    args, needs_gpu = dry_run_arguments(cfg)
    check_quantized_base(cfg, args)
    not_checked: list[str] = []
    try:
        tokenizer = _local_tokenizer(cfg, not_checked)
        config = _local_model_config(cfg, not_checked)
        family = check_family(cfg, config) if config is not None else None
        text_config = config.get_text_config() if config is not None else None
        data = {}
        for which in ("train", "eval") if cfg.data.eval_file else ("train",):
            sources = cfg.data.train_sources() if which == "train" else [Source(cfg.data.eval_file)]
            missing = [source.path for source in sources if _missing(source.path)]
            if missing:
                not_checked.append(
                    f"{which} data: {', '.join(missing)} not found here; not prepared or checked"
                )
                continue
            if tokenizer is None and any(_stage_kind(source) is None for source in sources):
                not_checked.append(
                    f"{which} data: raw chats, and pre-tokenizing needs the tokenizer; not prepared"
                )
                continue
            path = prepare(which, cfg, args, tokenizer)
            packs = check_packs(load_stage(path), str(path), cfg)
            if config is not None:
                check_vocabulary(config.get_text_config().vocab_size, packs, f"the {which} data")
                check_positions(config, packs, f"the {which} data", cfg)
            reports = {"pack": read_report(path) if (path / REPORT_NAME).exists() else None}
            tokenized = Path(reports["pack"]["input"]) if reports["pack"] else None
            reports["pre_tokenize"] = (
                read_report(tokenized) if tokenized and (tokenized / REPORT_NAME).exists() else None
            )
            data[which] = {"path": str(path), **reports}
        tasks = []
        if cfg.eval_tasks is not None and tokenizer is None:
            not_checked.append("eval_tasks: the prompts are built with the tokenizer; not built")
        elif cfg.eval_tasks is not None:
            from longalign.eval.in_training import build_tasks, plan

            limit = getattr(text_config, "max_position_embeddings", None)
            tasks = plan(build_tasks(cfg.eval_tasks, tokenizer, context_limit=limit), args.world_size)
        return {
            "settings": resolved_settings(cfg),
            "config_overrides": overrides_note(_local_model(cfg)) if config is not None else None,
            "model_family": None
            if family is None
            else {
                "model_type": family.model_type,
                "architecture": family.architecture,
                "packs_exactly_with": family.features.described(),
            },
            "data": data,
            "eval_tasks": tasks,
            "needs_gpu": needs_gpu,
            "not_checked": not_checked,
        }
    finally:
        close()


# TrainingArguments switches that need a CUDA device: always, or unless the run trains on the CPU (bf16).
_GPU_TRAINING_ARGS = {
    "bf16": False,
    "bf16_full_eval": False,
    "fp16": True,
    "fp16_full_eval": True,
    "tf32": True,
}


def gpu_settings(cfg: Config) -> list[str]:
    """The settings of ``cfg`` that need a CUDA GPU, as ``key = value`` (precision, tf32, kernels)."""
    args = cfg.training.args
    found = [
        f"training.{name} = true"
        for name, always in _GPU_TRAINING_ARGS.items()
        if args.get(name) is True and (always or not args.get("use_cpu"))
    ]
    if cfg.model.attn_backend in ("flash_attn", "flash_attn_cute", "torch_varlen"):
        found.append(f'model.attn_backend = "{cfg.model.attn_backend}"')
    return found


def dry_run_arguments(cfg: Config) -> tuple[TrainingArguments, list[str]]:
    """The run's ``TrainingArguments`` as this machine can build them, and the settings it cannot check.

    Without a CUDA device the switches that need one are turned off to check everything else (transformers
    refuses bf16 and tf32 without a GPU), and every GPU-only setting is returned to be listed; with one,
    nothing is left out.
    """
    if torch.cuda.is_available():
        return training_arguments(cfg), []
    needs_gpu = gpu_settings(cfg)
    off = {name: False for name in _GPU_TRAINING_ARGS if f"training.{name} = true" in needs_gpu}
    view = dataclasses.replace(cfg.training, args={**cfg.training.args, **off})
    return training_arguments(dataclasses.replace(cfg, training=view)), needs_gpu


def _local_tokenizer(cfg: Config, not_checked: list[str]):
    """The run's tokenizer from a local directory or the cache; ``None`` (and a line in ``not_checked``) if absent."""
    name = cfg.model.tokenizer or cfg.model.model_name_or_path
    if not name:
        return load_tokenizer(cfg)  # says what to set
    where = checkpoints.local_dir(name)
    if where is None:
        not_checked.append(f"tokenizer {name}: not a local directory nor in the Hugging Face cache")
        return None
    return load_tokenizer(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer=str(where)))
    )


def _local_model_config(cfg: Config, not_checked: list[str]):
    """The model's config (overrides applied), read locally; ``None`` (and a line in ``not_checked``) if absent."""
    if cfg.model.init_from_config is None and checkpoints.local_dir(cfg.model.model_name_or_path) is None:
        not_checked.append(
            f"model {cfg.model.model_name_or_path}: its config.json is not a local file nor in the Hugging Face "
            "cache, so the data's token ids and sample lengths were not checked against its vocabulary and "
            "window" + (", nor its config_overrides" if cfg.model.config_overrides else "")
        )
        return None
    return model_config(_local_model(cfg))


def _local_model(cfg: Config) -> Config:
    """``cfg`` naming its checkpoint by the local directory that holds it (a Hub id in the cache)."""
    if cfg.model.init_from_config is not None:
        return cfg
    where = str(checkpoints.local_dir(cfg.model.model_name_or_path))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model_name_or_path=where))


def _missing(path: str) -> bool:
    """Whether a data source names a local path that is not on this machine."""
    try:
        kind(path)
    except InputError:
        return not Path(path).exists()
    return False


def resolved_settings(cfg: Config) -> list[tuple[str, Any, str]]:
    """``(section.key, value, where it came from)`` for every setting; secrets redacted."""
    rows = []
    for section, table in cfg.to_dict().items():
        for key, value in table.items():
            name = f"{section}.{key}"
            shown = redact(name, value) if is_secret_name(name) else value
            rows.append((name, shown, cfg.source(name)))
    rows += [(f"training.{key}", value, "longalign") for key, (value, _) in RESERVED_TRAINING_ARGS.items()]
    return rows


def preflight(cfg: Config, env_names: Sequence[str] = DEFAULT_ENV) -> PreflightReport:
    """The preflight without a model: every rank checks what it would train with; ranks must agree."""
    args = training_arguments(cfg)
    check_sequence_parallel(cfg, args.world_size, parallelism=args.parallelism_config)
    check_quantized_base(cfg, args)
    check_family(cfg)
    try:
        accelerator = trainer_accelerator(args)
        return run_preflight(
            cfg,
            load_tokenizer=lambda: load_tokenizer(cfg),
            load_packs=lambda: resolve_packs("train", cfg, args),
            load_eval_packs=(lambda: resolve_packs("eval", cfg, args)) if cfg.data.eval_file else None,
            device=args.device,
            dtype=compute_dtype(model_dtype(cfg), bf16=args.bf16, fp16=args.fp16),
            batch_size=args.per_device_train_batch_size,
            env_names=env_names,
            parallelism=lambda: parallelism_row(
                accelerator, args, sequence_parallel_size=cfg.training.sequence_parallel_size
            ),
            overrides_note=lambda: overrides_note(cfg),
        )
    finally:
        close()


def trainer_accelerator(args: TrainingArguments) -> Accelerator:
    """The ``Accelerator`` the trainer would create from ``args``: the same engine, plugins and DDP settings.

    For the preflight without a model; ``transformers.Trainer`` builds its own from the same arguments.
    """
    fsdp = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args) if args.fsdp_plugin_args else None
    ddp = DistributedDataParallelKwargs(find_unused_parameters=bool(args.ddp_find_unused_parameters))
    return Accelerator(
        mixed_precision=args.mixed_precision,
        deepspeed_plugin=args.deepspeed_plugin,
        fsdp_plugin=fsdp,
        kwargs_handlers=[ddp],
    )


def release(trainer: LongAlignTrainer) -> None:
    """Free the trainer's DDP wrapper while the process group is still alive.

    The wrapper's C++ reducer holds the gloo group. Freed last, after the group was destroyed, the reducer
    joins gloo's worker thread while holding the GIL, and that thread may still need the GIL to drop the
    last collective's buffers: the rank never exits. Freed here, the reducer is not the group's last owner.
    """
    trainer.model_wrapped = trainer.model
    trainer.accelerator.free_memory()  # the accelerator's references too, then gc.collect()


def close() -> None:
    """Leave the process group, once nothing that holds it is left (see :func:`release`)."""
    gc.collect()
    PartialState().destroy_process_group()
