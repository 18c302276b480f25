"""Two eval commands in one launch, one after the other on the same ranks (tests/test_eval_ranks.py):

    accelerate launch --multi_gpu --num_processes 2 tests/eval_ranks_run.py eval needle ... -- eval ruler ...

Exits with the first command's status that is not 0.
"""

import sys

from longalign.cli import main

if __name__ == "__main__":
    words = sys.argv[1:]
    cut = words.index("--")
    sys.exit(main(words[:cut]) or main(words[cut + 1 :]))
