"""A [lora] run's adapter folded into its base, a full model: ``longalign merge``.

python scripts/merge_adapter.py --adapter out/run --output out/merged [--base MODEL] [--dtype bfloat16]
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("merge"))
