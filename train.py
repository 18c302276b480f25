"""Train on packed long-context chat data with exact sequence- or token-level loss weighting.

    accelerate launch train.py --config configs/demo.toml [section.key=value ...]

``[data] train_file`` is a packed directory (``scripts/sort_and_group.py``) used as is, or a pre-tokenized
one (``scripts/pre_tokenize.py``) packed here with ``[packing]`` and cached next to the run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import longalign.patch
from longalign.artifacts import load_stage
from longalign.config import Config, ConfigError, load_config
from longalign.packing import write_packs
from longalign.preflight import check_trainer, preflight_enabled
from longalign.trainer import LongAlignTrainer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(cfg: Config) -> torch.nn.Module:
    """The model of ``[model]`` (pretrained, or random from ``init_from_config``), patched for packed input."""
    mc = cfg.model
    if mc.init_from_config is not None:
        settings = dict(mc.init_from_config)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES.get(mc.torch_dtype, torch.float32))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            mc.model_name_or_path,
            dtype=DTYPES.get(mc.torch_dtype, "auto"),
            trust_remote_code=mc.trust_remote_code,
        )
    return longalign.patch.apply(model, backend=mc.backend)


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
    # packing = false: one sample per row, in shuffled order (a "sorted" batch of one).
    strategy = packing.strategy if packing.packing else "sorted"
    batch_size = packing.batch_size if packing.packing and strategy == "sorted" else 1
    settings = {
        "max_seq_len": cfg.data.max_seq_len,
        "strategy": strategy,
        "batch_size": batch_size,
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
    """Everything ``train.py`` sets up before ``train()``: arguments, tokenizer, model, packs, trainer."""
    args = TrainingArguments(
        output_dir=cfg.training.output_dir, remove_unused_columns=False, **cfg.training.args
    )
    if not cfg.data.train_file:
        raise ConfigError("data.train_file: set it to a packed or pre-tokenized dataset directory")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.model_name_or_path)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="TOML run file")
    parser.add_argument("overrides", nargs="*", help="section.key=value settings that win over the file")
    cli = parser.parse_args(argv)
    try:
        cfg = load_config(cli.config, cli.overrides)
        trainer = build_trainer(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"train.py: {err}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
