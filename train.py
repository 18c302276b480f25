"""Train on packed long-context chat data with exact loss weighting: ``longalign train``.

accelerate launch train.py --config configs/demo.toml [section.key=value ...]
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("train"))
