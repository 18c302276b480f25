"""``python -m longalign SUBCOMMAND ...`` (and ``accelerate launch -m longalign train ...``)."""

import sys

from longalign.cli import main

sys.exit(main())
