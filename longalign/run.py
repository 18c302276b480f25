"""One run, one place: from a :class:`~longalign.config.Config` to a trainer, and the run's lifecycle.

Everything that turns a run file into working objects lives here, once::

    cfg = load_config("run.toml", ["training.max_steps=10"])
    args = training_arguments(cfg)          # the one TrainingArguments (process group, device, precision)
    tokenizer = load_tokenizer(cfg)
    model = load_model(cfg)                 # dtype from model_dtype(cfg), varlen attention patched in
    packs = resolve_packs(cfg.data.train_file, cfg, args)
    trainer = build_trainer(cfg)            # all of the above, as a LongAlignTrainer
    train(cfg)                              # preflight -> resume -> train -> evaluate -> save -> close

``train.py`` (``longalign train``), the preflight (``longalign preflight``) and the memory probe
(``longalign probe``) all start here.
"""

from __future__ import annotations

import gc
import hashlib
import json
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from accelerate import PartialState
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import longalign.patch
from longalign.artifacts import load_stage
from longalign.config import Config, ConfigError
from longalign.packing import write_packs
from longalign.preflight import (
    DEFAULT_ENV,
    PreflightReport,
    check_trainer,
    compute_dtype,
    preflight_enabled,
    run_preflight,
)
from longalign.trainer import LongAlignTrainer


def training_arguments(cfg: Config) -> TrainingArguments:
    """The run's ``TrainingArguments``, built here and nowhere else; a value they refuse names its key."""
    settings = {**cfg.training.args, "remove_unused_columns": False}
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
    return AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)


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
    config = AutoConfig.from_pretrained(mc.model_name_or_path, trust_remote_code=mc.trust_remote_code)
    dtype = getattr(config, "dtype", None)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def load_model(cfg: Config) -> torch.nn.Module:
    """The model of ``[model]`` (pretrained, or random from ``init_from_config``), patched for packed input."""
    mc = cfg.model
    dtype = model_dtype(cfg)
    if mc.init_from_config is not None:
        settings = dict(mc.init_from_config)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            mc.model_name_or_path, dtype=dtype, trust_remote_code=mc.trust_remote_code
        )
    return longalign.patch.apply(model, backend=mc.attn_backend)


def resolve_packs(path: str, cfg: Config, args: TrainingArguments):
    """Packs at ``path``: a packed directory as is, or a tokenized one packed once and cached."""
    dataset = load_stage(path)
    if "cu_seqlens" in dataset.column_names:
        return dataset
    if "length" not in dataset.column_names:
        raise ConfigError(
            f"{path}: neither a packed nor a pre-tokenized dataset (columns {dataset.column_names})"
        )
    packing = cfg.packing
    settings = {
        "max_seq_len": cfg.data.max_seq_len,
        "strategy": packing.strategy,
        "batch_size": packing.batch_size if packing.strategy == "sorted" else 1,
        "seed": packing.seed,
        "drop_long": packing.drop_long,
    }
    source = Path(path)
    key = hashlib.sha256(
        json.dumps(
            [settings, (source / "state.json").read_text(), (source / "report.json").read_text()]
        ).encode()
    ).hexdigest()[:12]
    cache_root = Path(cfg.data.packed_cache_dir or Path(args.output_dir) / "packed")
    cache = cache_root / f"{source.resolve().name}-{key}"
    with args.main_process_first(desc=f"packing {path}"):
        if not cache.exists():
            write_packs(source, cache, **settings)
    return load_stage(cache)


def build_trainer(cfg: Config) -> LongAlignTrainer:
    """Everything a run sets up before ``train()``: arguments, tokenizer, model, packs, trainer."""
    if not cfg.data.train_file:
        raise ConfigError("data.train_file: set it to a packed or pre-tokenized dataset directory")
    args = training_arguments(cfg)
    tokenizer = load_tokenizer(cfg)
    transformers.set_seed(args.seed)
    model = load_model(cfg)
    train_packs = resolve_packs(cfg.data.train_file, cfg, args)
    eval_packs = resolve_packs(cfg.data.eval_file, cfg, args) if cfg.data.eval_file else None
    return LongAlignTrainer(
        model=model,
        args=args,
        train_dataset=train_packs,
        eval_dataset=eval_packs,
        processing_class=tokenizer,
        weighting=cfg.loss.weighting,
        max_seq_len=cfg.data.max_seq_len,
        loss_chunk_size=cfg.loss.chunk_size,
        ignore_index=cfg.loss.ignore_index,
        pack_seed=cfg.packing.seed,
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
        report = check_trainer(trainer, cfg)  # every rank takes part; all stop here if any disagrees
        if trainer.is_world_process_zero():
            print(report, flush=True)
        if not report.ok:
            return 1
    resume = trainer.args.resume_from_checkpoint
    if resume == "last":
        resume = get_last_checkpoint(trainer.args.output_dir)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.eval_dataset is not None:
        trainer.evaluate()
    trainer.save_model()
    trainer.save_state()
    return 0


def preflight(cfg: Config, env_names: Sequence[str] = DEFAULT_ENV) -> PreflightReport:
    """The preflight without a model: every rank checks what it would train with; ranks must agree."""
    args = training_arguments(cfg)
    try:
        return run_preflight(
            cfg,
            load_tokenizer=lambda: load_tokenizer(cfg),
            load_packs=lambda: resolve_packs(cfg.data.train_file, cfg, args),
            load_eval_packs=(lambda: resolve_packs(cfg.data.eval_file, cfg, args))
            if cfg.data.eval_file
            else None,
            device=args.device,
            dtype=compute_dtype(model_dtype(cfg), bf16=args.bf16, fp16=args.fp16),
            env_names=env_names,
        )
    finally:
        close()


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
