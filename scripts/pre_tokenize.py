"""Chat data -> tokenized sample dataset with assistant-only labels: ``longalign pre-tokenize``.

    python scripts/pre_tokenize.py --input data/sample.jsonl --tokenizer data/tokenizer \
        --output out/tokenized --max-seq-len 8192
"""

import sys

from longalign.cli import script

if __name__ == "__main__":
    sys.exit(script("pre-tokenize"))
