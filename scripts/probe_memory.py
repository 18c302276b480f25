"""Length-ladder memory probe, the longest pack this run fits: ``longalign probe``.

    python scripts/probe_memory.py --config run.toml --lengths 4k,8k,16k,32k,64k \
        [section.key=value ...]
    accelerate launch scripts/probe_memory.py --config run.toml --lengths 16k,32k,64k
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("probe"))
