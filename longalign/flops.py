"""FLOPs of a training step, and the time and GPU-hours they take on a named GPU.

The simulated step (``longalign.simulate``) counts what it executes with :class:`StepFlops`: matrix products
by torch's ``FlopCounterMode`` (it reads shapes only, so fake tensors count as real ones), attention by the
kernel stand-in from the kernel calls' shapes and the samples of their ``cu_seqlens`` (:func:`attention_flops`).
A recompute counts again, since it runs again. The model's FLOPs (:func:`model_flops`) are the step's
arithmetic without any recompute: what a model-FLOPs utilization is measured against.

For a 2-sample pack of lengths [3, 2], no window, one head of size 1 (q·k and p·v each 2 FLOPs a pair)::

    causal pairs   q0:k0 | q1:k0 k1 | q2:k0 k1 k2      q3:k3 | q4:k3 k4     6 + 3 = 9
    forward        2 x 9 x 1 x (1 + 1) = 36 FLOPs
    backward       2.5 x 36 = 90 FLOPs (the kernel recomputes q·k, then 4 products: dv, dp, dq, dk)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# Dense (no 2:4 sparsity) BF16 tensor-core peaks, FLOP/s per GPU, from NVIDIA's datasheets, SXM parts:
# A100 80GB 312 TFLOPS ("NVIDIA A100 Tensor Core GPU" datasheet: 624 with sparsity); H100 and H200 989.4
# TFLOPS (their datasheets list 1,979 with sparsity); B200 2.25 PFLOPS (HGX B200 at 1,000 W: 4.5 with
# sparsity).
GPU_PEAK_FLOPS = {"a100": 312e12, "h100": 989.4e12, "h200": 989.4e12, "b200": 2.25e15}

# The share of the peak a step's executed FLOPs run at, unless told (--efficiency): Llama 3's 405B model
# trained at 131,072-token sequences (context parallelism 16) ran at 380 TFLOPS per H100, a model-FLOPs
# utilization of 38% ("The Llama 3 Herd of Models", Meta 2024, Table 4). Taken as the executed rate: that
# run recomputed little, so its model and executed FLOPs were close.
DEFAULT_EFFICIENCY = 0.38

# FlashAttention's backward recomputes q·k and runs four products (dv, dp, dq, dk) for the forward's two:
# 2.5 forwards, as FlashAttention-2's paper (Dao 2023) counts it.
BACKWARD_PER_FORWARD = 2.5


def causal_pairs(seq_lens: Sequence[int], window: int | None = None) -> int:
    """Query-key pairs causal attention computes within each sample: each query sees itself and the keys
    before it, at most ``window`` of them all told (a sliding window, as ``varlen_attention`` takes it).

    >>> causal_pairs([3, 2]), causal_pairs([4], window=2)
    (9, 7)
    """
    pairs = 0
    for n in seq_lens:
        w = n if window is None else min(window, n)
        pairs += w * (w + 1) // 2 + (n - w) * w
    return pairs


def attention_flops(
    seq_lens: Sequence[int], *, heads: int, qk_dim: int, v_dim: int, window: int | None, causal: bool = True
) -> int:
    """Forward FLOPs of one attention kernel call: q·k and p·v for every pair it computes, on every query head.

    >>> attention_flops([3, 2], heads=1, qk_dim=1, v_dim=1, window=None)
    36
    """
    pairs = causal_pairs(seq_lens, window) if causal else sum(n * n for n in seq_lens)
    return 2 * pairs * heads * (qk_dim + v_dim)


def model_flops(
    *,
    parameters: int,
    tokens: float,
    pairs: float,
    layers: int,
    heads: int,
    qk_dim: int,
    v_dim: int,
) -> float:
    """The step's model FLOPs: 6 per parameter and token (forward 2, backward 4) and attention's pairs
    (forward and backward as 3 forwards), nothing recomputed. ``parameters`` without the input embedding
    (a lookup multiplies nothing).

    >>> model_flops(parameters=10, tokens=5, pairs=9, layers=1, heads=1, qk_dim=1, v_dim=1)
    408.0
    """
    return 6.0 * parameters * tokens + 3.0 * layers * 2 * pairs * heads * (qk_dim + v_dim)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What executed FLOPs take on one GPU at an efficiency: a step's seconds and its tokens per second."""

    gpu: str
    efficiency: float

    def __post_init__(self) -> None:
        from longalign.errors import ConfigError

        if self.gpu not in GPU_PEAK_FLOPS:
            raise ConfigError(f"--gpu {self.gpu}: no peak known; one of {', '.join(GPU_PEAK_FLOPS)}")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"--efficiency {self.efficiency}: a share of the peak, above 0 and at most 1")

    @property
    def flops_per_second(self) -> float:
        return GPU_PEAK_FLOPS[self.gpu] * self.efficiency

    def step_seconds(self, executed_flops: float) -> float:
        """Seconds of a step that executes ``executed_flops``.

        >>> Throughput("h100", 0.5).step_seconds(989.4e12)
        2.0
        """
        return executed_flops / self.flops_per_second


def run_gpu_hours(run_tokens: float, tokens_per_second_per_gpu: float) -> float:
    """GPU-hours of ``run_tokens`` at a rate per GPU.

    >>> run_gpu_hours(7.2e9, 1e5)
    20.0
    """
    return run_tokens / tokens_per_second_per_gpu / 3600


@dataclasses.dataclass(frozen=True)
class RunTokens:
    """The tokens a whole run trains on, and where the count came from (said in the report)."""

    tokens: float
    source: str


def run_tokens(
    args: Mapping[str, Any],
    *,
    epoch_tokens: int,
    epoch_packs: int | None,
    pack_tokens: int,
    data_parallel: int,
    source: str,
) -> RunTokens:
    """The run's tokens from one epoch's: ``num_train_epochs`` of them (Trainer's default 3), or with
    ``max_steps`` that many optimizer steps of ``per_device_train_batch_size x gradient_accumulation_steps x
    data_parallel`` packs of the epoch's mean pack (``pack_tokens`` where the packs are not counted).

    >>> run_tokens({"max_steps": 10}, epoch_tokens=1000, epoch_packs=4, pack_tokens=300, data_parallel=2,
    ...            source="s").tokens
    5000.0
    """
    steps = int(args.get("max_steps", -1) or -1)
    if steps > 0:
        packs = steps * args.get("per_device_train_batch_size", 1)
        packs *= args.get("gradient_accumulation_steps", 1) * data_parallel
        mean = epoch_tokens / epoch_packs if epoch_packs else pack_tokens
        return RunTokens(float(packs * mean), f"{source}; max_steps {steps} x {packs // steps} packs a step")
    epochs = float(args.get("num_train_epochs", 3.0))
    return RunTokens(epochs * epoch_tokens, f"{source} x {epochs:g} epochs")


class StepFlops:
    """What one step executes, counted as it runs: matrix products (torch's ``FlopCounterMode``) and
    attention (added by the kernel's stand-in, :meth:`add_attention`), as ``{"matmul": n, "attention": n}``.

    The simulation runs a tiled loop's distinct tiles only (``tiled_mlp.distinct_tiles_only``); within
    :meth:`weighing_tiles` each tile that ran counts once more for every tile of its size it stood for,
    so the count is that of every tile (``tests/test_simulate.py`` checks both are equal).
    """

    def __init__(self) -> None:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        # A mixture of experts' grouped products (transformers' default experts), which torch does not count
        grouped = {torch.ops.aten._grouped_mm: grouped_mm_flops}
        self.mode = FlopCounterMode(display=False, custom_mapping=grouped)
        # The total alone: its module tracker, which attributes FLOPs to modules, hooks the backward of every
        # module's inputs and fails on the tiled loops' recomputed ones (requiring grad, without a grad_fn).
        self.mode.mod_tracker = _GlobalOnly()
        self.attention = 0
        self.skipped = {"matmul": 0, "attention": 0}  # FLOPs of the tiles that stood in for others

    def add_attention(self, flops: int) -> None:
        self.attention += flops

    def totals(self) -> dict[str, int]:
        return {
            "matmul": self.mode.get_total_flops() + self.skipped["matmul"],
            "attention": self.attention + self.skipped["attention"],
        }

    def __enter__(self) -> StepFlops:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    @contextlib.contextmanager
    def weighing_tiles(self) -> Iterator[None]:
        """Within the block, the tiled loops (the MLP's, the layer's) count each tile they run as the tiles
        it stands for."""
        from longalign.patch import tiled_layer, tiled_mlp

        modules = (tiled_mlp, tiled_layer)
        originals = [module._tiles for module in modules]
        for module, original in zip(modules, originals, strict=True):
            module._tiles = self._weighed(original)
        try:
            yield
        finally:
            for module, original in zip(modules, originals, strict=True):
                module._tiles = original

    def _weighed(self, tiles_of):
        def tiles(tokens: int, count: int):
            run = tiles_of(tokens, count)
            return self._tile_by_tile(run, _stand_ins(run, tokens, count))

        return tiles

    def _tile_by_tile(
        self, run: list[tuple[int, int, int]], weights: list[int]
    ) -> Iterator[tuple[int, int, int]]:
        for tile, weight in zip(run, weights, strict=True):
            before = self.totals()
            try:
                yield tile
            finally:  # when the loop asks for the next tile: what this one ran, counted weight - 1 more times
                after = self.totals()
                for key in self.skipped:
                    self.skipped[key] += (weight - 1) * (after[key] - before[key])


def grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm(a, b, offs)``: each row of ``a`` times the ``b`` of its group, 2 per
    multiply-add. ``a`` ``[rows, k]`` by ``b`` ``[groups, k, n]`` (the experts' forward), ``[k, rows]`` by
    ``[rows, n]`` into ``[groups, k, n]`` (their weights' gradient, ``k`` here the contracted rows),
    ``[groups, m, k]`` by ``[k, n]``, or batched ``[groups, m, k]`` by ``[groups, k, n]``.

    >>> grouped_mm_flops((10, 4), (3, 4, 5)), grouped_mm_flops((4, 10), (10, 5)), grouped_mm_flops((3, 2, 4), (3, 4, 5))
    (400, 400, 240)
    """
    rows, inner, columns = a_shape[-2], a_shape[-1], b_shape[-1]
    groups = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * groups * rows * inner * columns


class _GlobalOnly:
    """A module tracker for ``FlopCounterMode`` that attributes every FLOP to the step as a whole."""

    parents = ("Global",)

    def __enter__(self) -> _GlobalOnly:
        return self

    def __exit__(self, *exc) -> None:
        return None


def _stand_ins(run: list[tuple[int, int, int]], tokens: int, count: int) -> list[int]:
    """For each tile run, how many tiles it counts for: itself and those skipped after it, which must be
    of its size (tiles cut as ``torch.tensor_split`` cuts them).

    >>> _stand_ins([(0, 0, 3), (1, 3, 6), (4, 12, 14)], 14, 5)
    [1, 3, 1]
    """
    size, longer = divmod(tokens, count)
    sizes = [size + (i < longer) for i in range(count)]
    indices = [index for index, _, _ in run] + [count]
    weights = []
    for (index, start, stop), following in zip(run, indices[1:], strict=False):
        if any(sizes[i] != stop - start for i in range(index + 1, following)):
            # A tile of another size would count other FLOPs: the loops' skipping no longer is what this knows.
            raise RuntimeError(
                f"a tiled loop of {tokens} tokens in {count} tiles skipped a tile of another size"
            )
        weights.append(following - index)
    return weights


def format_amount(value: float) -> str:
    """A figure such as hours or seconds: to the unit from 100 on, else to three digits.

    >>> format_amount(1234.5), format_amount(12.34), format_amount(0.25)
    ('1,234', '12.3', '0.25')
    """
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def format_tokens(tokens: float) -> str:
    """A token count in millions or billions.

    >>> format_tokens(2e6), format_tokens(1.234e10), format_tokens(5000)
    ('2.00M', '12.3B', '5,000')
    """
    for size, unit in ((1e9, "B"), (1e6, "M")):
        if tokens >= size:
            return f"{tokens / size:.3g}{unit}" if tokens >= 10 * size else f"{tokens / size:.2f}{unit}"
    return f"{tokens:,.0f}"


def format_flops(flops: float, digits: int = 2) -> str:
    """FLOPs in the unit of their thousands.

    >>> format_flops(2.5e15), format_flops(3.1e12)
    ('2.50 PFLOP', '3.10 TFLOP')
    """
    units = ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP", "EFLOP"]
    power = min(int(math.log10(flops) // 3), len(units) - 1) if flops >= 1 else 0
    return f"{flops / 1000**power:.{digits}f} {units[power]}"
