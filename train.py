"""Train on packed long-context chat data with exact sequence- or token-level loss weighting.

    accelerate launch train.py --config configs/demo.toml [section.key=value ...]

``[data] train_file`` is a packed directory (``scripts/sort_and_group.py``) used as is, or a pre-tokenized
one (``scripts/pre_tokenize.py``) packed here with ``[packing]`` and cached next to the run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accelerate import PartialState
from transformers.trainer_utils import get_last_checkpoint

from longalign.config import ConfigError, load_config
from longalign.preflight import check_trainer, preflight_enabled
from longalign.trainer import build_trainer


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
    try:
        return run(trainer, cfg)
    finally:
        # Leave the process group explicitly: a gloo group still alive at interpreter exit can abort a rank.
        PartialState().destroy_process_group()


def run(trainer, cfg) -> int:
    """Preflight (when on), train, evaluate, save; the exit status."""
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
