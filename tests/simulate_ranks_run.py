"""One rank of a sequence-parallel group of 2, in this process alone, on torch's fake process group: the real
CPU step counted as the probe counts it, and the simulated step, at each length; prints both as JSON.

    python tests/simulate_ranks_run.py OUT_DIR LENGTH,... [section.key=value ...]

Every collective of the fake group returns at once (DeepSpeed's all-to-alls leave their buffers as they
are, DDP's reduction is a no-op hook), so the step computes on garbage but allocates what rank 0 of a real
group allocates; tests/test_simulate.py compares the two. What is compared is the rank's own share, the
peak of what the step allocates beyond weights, gradients and optimizer states (activations, the
all-to-all buffers, the kernels' buffers): DDP's gradients live in its buckets here (gradient views of
them), which exist before the step and which the counter does not count when the reducer writes into
them; the simulation adds DDP's buckets to the GPU's peak on its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import counted_real_steps  # noqa: E402

from longalign.simulate import Setup, simulate_lengths  # noqa: E402

_wrap = torch.nn.parallel.DistributedDataParallel.__init__


def _no_reduction(self, *args, **kwargs):
    _wrap(self, *args, **{**kwargs, "gradient_as_bucket_view": True})
    self.register_comm_hook(None, noop_hook)  # the fake group's futures hold no tensor for DDP's own hook


def main() -> None:
    out, lengths, overrides = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.nn.parallel.DistributedDataParallel.__init__ = _no_reduction
    real, cfg = counted_real_steps(out, lengths, overrides, key="activations_peak_bytes")
    rows = simulate_lengths(cfg, lengths, Setup(gpus=2))
    print(
        json.dumps(
            {"real": real, "simulated": {row["length"]: row["counted_activations_peak"] for row in rows}}
        )
    )


if __name__ == "__main__":
    main()
