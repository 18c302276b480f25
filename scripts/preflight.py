"""Preflight: every rank reports what it would train with, rank 0 compares: ``longalign preflight``.

    accelerate launch scripts/preflight.py --config run.toml \
        [section.key=value ...] [--env WANDB_PROJECT,...]
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("preflight"))
