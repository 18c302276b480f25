"""Tokenized samples -> packs with cu_seqlens, report.json and packing.png: ``longalign pack``.

    python scripts/sort_and_group.py --input out/tokenized --output out/packed \
        --max-seq-len 8192
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("pack"))
