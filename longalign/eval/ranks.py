"""Prompts shared out over the ranks of ``accelerate launch -m longalign eval ...``; rank 0 gets every result.

    results = across_ranks(prompts, lambda mine: generator.generate(mine))
    # 2 ranks: rank 0 works on prompts 0, 2, 4, ..., rank 1 on 1, 3, 5, ...
    # rank 0: the results of all prompts in their order; the other ranks: None

One process (no launcher) works on everything.
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

Item = TypeVar("Item")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks: ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def leave_group_at_exit() -> None:
    """Leave the launch's process group when this process ends, once, after every command it ran.

    A gloo group still joined when the interpreter shuts down is torn down with its worker thread still
    running, and that rank may abort at exit ("terminate called without an active exception") after its
    work was done and written.
    """
    atexit.unregister(_leave_group)
    atexit.register(_leave_group)


def _leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def across_ranks(
    items: Sequence[Item],
    work: Callable[[list[Item]], list[Any]],
    *,
    lockstep: bool = False,
    every_rank: bool = False,
) -> list[Any] | None:
    """``work`` on this rank's share of ``items`` (every world-th one); all results in order on rank 0
    (on every rank with ``every_rank``), else None.

    ``lockstep``: every rank's share is as long, a short one filled up with ``items[0]`` whose results are
    dropped, so that every rank calls a sharded model (ZeRO-3, FSDP) as many times.
    """
    rank, world = rank_and_world()
    mine = list(items[rank::world])
    if lockstep and items:
        per_rank = -(-len(items) // world)
        results = work(mine + [items[0]] * (per_rank - len(mine)))[: len(mine)]
    else:
        results = work(mine)
    if world == 1:
        return results
    gathered: list[list[Any]] | None = [None] * world if rank == 0 or every_rank else None
    if every_rank:
        dist.all_gather_object(gathered, results)
    else:
        dist.gather_object(results, gathered, dst=0)
    if gathered is None:
        return None
    merged: list[Any] = [None] * len(items)
    for r, share in enumerate(gathered):
        merged[r::world] = share
    return merged
