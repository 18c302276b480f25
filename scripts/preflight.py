"""Preflight check: every rank reports what it would train with; rank 0 prints one table of them all.

    accelerate launch scripts/preflight.py --config run.toml [section.key=value ...] [--env WANDB_PROJECT,...]
    python scripts/preflight.py --config run.toml          (one rank: the same checks, nothing to compare)

Rows: python and package versions (torch, transformers, accelerate, datasets, longalign, flash-attn), the
attention backend `auto` resolves to for the device and precision, fingerprints of the config, the
tokenizer (vocabulary + chat template) and the packed dataset (row count + hash of cu_seqlens), the
environment variables the run depends on (secret-looking names only as a short hash), an all-reduce
round trip, and each rank's host, device and free memory (which may differ). The model is not loaded.

Exit status: 0 when every rank agrees and every check passes; 1 otherwise, after naming the rank and
what to fix; 2 for a bad config or arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import AutoConfig, AutoTokenizer, TrainingArguments

from longalign.config import Config, ConfigError, load_config
from longalign.preflight import DEFAULT_ENV, compute_dtype, run_preflight
from longalign.trainer import DTYPES, resolve_packs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="the run's TOML file")
    parser.add_argument(
        "--env",
        default="",
        help=f"more environment variables to compare, comma-separated; NAME_* matches a prefix "
        f"(always checked: {', '.join(DEFAULT_ENV)})",
    )
    parser.add_argument("--no-default-env", action="store_true", help="check only the --env names")
    parser.add_argument("overrides", nargs="*", help="section.key=value settings that win over the file")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"preflight: config error: {err}", file=sys.stderr)
        return 2
    extra = [name.strip() for name in args.env.split(",") if name.strip()]
    env_names = list(dict.fromkeys(([] if args.no_default_env else list(DEFAULT_ENV)) + extra))

    # The same arguments train.py builds: they set up the process group, device and precision.
    train_args = TrainingArguments(
        output_dir=cfg.training.output_dir, remove_unused_columns=False, **cfg.training.args
    )
    device = train_args.device
    report = run_preflight(
        cfg,
        load_tokenizer=lambda: AutoTokenizer.from_pretrained(
            cfg.model.tokenizer or cfg.model.model_name_or_path, trust_remote_code=cfg.model.trust_remote_code
        ),
        load_packs=lambda: resolve_packs(cfg.data.train_file, cfg, train_args),
        load_eval_packs=(lambda: resolve_packs(cfg.data.eval_file, cfg, train_args))
        if cfg.data.eval_file
        else None,
        device=device,
        dtype=compute_dtype(model_dtype(cfg), bf16=train_args.bf16, fp16=train_args.fp16),
        env_names=env_names,
        environ=os.environ,
    )
    if train_args.process_index == 0:
        print(report)
    # Leave the process group explicitly: a gloo group still alive at interpreter exit can abort the rank.
    PartialState().destroy_process_group()
    return 0 if report.ok else 1


def model_dtype(cfg: Config) -> torch.dtype:
    """The dtype train.py loads the model in, read from the config files without loading the weights."""
    if cfg.model.torch_dtype != "auto" or cfg.model.init_from_config is not None:
        return DTYPES.get(cfg.model.torch_dtype, torch.float32)
    config = AutoConfig.from_pretrained(
        cfg.model.model_name_or_path, trust_remote_code=cfg.model.trust_remote_code
    )
    return getattr(config, "dtype", None) or torch.float32


if __name__ == "__main__":
    sys.exit(main())
