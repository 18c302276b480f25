"""How a benchmark starts a Python program on CPU ranks: one process, or ``accelerate launch`` of gloo ranks.

subprocess.run(command(["-m", "longalign", "probe", ...], ranks=2), env=environment(ranks=2), ...)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def command(args: list[str], *, ranks: int) -> list[str]:
    """``python ARGS`` for one rank; ``accelerate launch`` of ``ranks`` CPU processes running ARGS otherwise."""
    if ranks == 1:
        return [sys.executable, *args]
    return [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu",
        "--num_processes", str(ranks), "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "--main_process_port", "0", *args,
    ]  # fmt: skip


def environment(*, ranks: int, threads: int) -> dict[str, str]:
    """This process's environment with ``threads`` threads per rank, and CPU ranks for the launcher."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if ranks > 1:
        env["ACCELERATE_USE_CPU"] = "1"
    return env
