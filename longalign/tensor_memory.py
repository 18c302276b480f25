"""Tensor memory, counted: the bytes of every tensor storage a step holds, by part, now and at the peak.

The CPU probe (``longalign.probe_step``) counts a real step with it, and the simulation
(``longalign.simulate``) counts the same step on fake tensors, so that the two are the same measurement::

    with LiveTensors() as live:
        live.track(model.parameters(), "weights")        # what existed before the step, by part
        a = torch.empty(1024)                            # live.device 4096 (part "activations")
        b = a[:10]                                       # a view: still 4096
        del a, b                                         # 0; live.peak stays 4096 above the weights

A storage counts once (views and in-place results share it) from the operation that made it until it is
freed, like CUDA's ``max_memory_allocated`` and without an allocator's caching. Storages moved to host
memory (:meth:`LiveTensors.to_host`, the offload's copies) count as ``host`` instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

PARTS = ("weights", "gradients", "optimizer states", "activations")
HOST = "host"


class LiveTensors(TorchDispatchMode):
    """Bytes of tensor storage alive while the mode is on, by part, and at most.

    A storage an operation makes counts as ``activations`` (everything a step allocates: activations, their
    gradients, temporaries, the kernels' buffers); :meth:`track` files existing tensors under a part, and
    :meth:`watch_gradients` files each gradient under ``gradients`` as autograd accumulates it.
    ``peak_parts`` is the split of the device bytes at the moment of the peak, ``part_peaks`` each part's
    own peak.
    """

    def __init__(self) -> None:
        super().__init__()
        self.device = self.host = self.peak = self.host_peak = 0
        self.parts = dict.fromkeys(PARTS, 0)
        self.peak_parts = dict(self.parts)
        self.part_peaks = dict(self.parts)  # each part's own peak
        self._sizes: dict[int, list] = {}  # id(storage) -> [bytes, part or HOST]
        self._hooks: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.account_outputs(out, (args, kwargs))
        return out

    def account_outputs(self, outputs, inputs) -> None:
        """Count the storages an operation made; an output that is one of its inputs' storages was not made
        by it: counted already, or made before counting began and never tracked (DDP's gradient buckets,
        which the reducer writes each gradient into) and so not part of what the step allocates."""
        given = {id(t.untyped_storage()) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        for leaf in tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                if id(storage) in given and id(storage) not in self._sizes:
                    continue
                self._account(storage, "activations")

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return super().__exit__(*exc)

    def track(self, tensors: Iterable[torch.Tensor | None], part: str) -> None:
        """Count ``tensors`` (made before the mode, or already counted) under ``part`` from now on."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._account(tensor.untyped_storage(), part, retag=True)

    def watch_gradients(self, parameters: Iterable[torch.Tensor]) -> None:
        """File each trained parameter's ``.grad`` under ``gradients`` once autograd has accumulated it."""
        for param in parameters:
            if param.requires_grad:
                hook = param.register_post_accumulate_grad_hook(lambda p: self.track([p.grad], "gradients"))
                self._hooks.append(hook)

    def to_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory from now on."""
        self._account(tensor.untyped_storage(), HOST, retag=True)

    def _account(self, storage: torch.UntypedStorage, part: str, *, retag: bool = False) -> None:
        key, size = id(storage), storage.nbytes()
        known = self._sizes.get(key)
        if known is None:
            self._sizes[key] = [size, part]
            self._add(size, part)
            weakref.finalize(storage, self._free, key)
            return
        if known[0] != size:  # an operation that wrote into it may have resized it
            self._add(size - known[0], known[1])
            known[0] = size
        if retag and known[1] != part:
            self._add(-size, known[1])
            known[1] = part
            self._add(size, part)

    def _free(self, key: int) -> None:
        size, part = self._sizes.pop(key)
        self._add(-size, part)

    def _add(self, size: int, part: str) -> None:
        if part == HOST:
            self.host += size
            self.host_peak = max(self.host_peak, self.host)
            return
        self.device += size
        self.parts[part] += size
        self.part_peaks[part] = max(self.part_peaks[part], self.parts[part])
        if self.device > self.peak:
            self.peak = self.device
            self.peak_parts = dict(self.parts)


class CopiesToHost(torch.autograd.graph.saved_tensors_hooks):
    """What the offload's hooks do on a GPU, anywhere: the saved tensor is copied out at the forward, into a
    storage counted as host memory, and back at the backward (``longalign.patch.offload``)."""

    def __init__(self, live: LiveTensors) -> None:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            host = tensor.clone()
            live.to_host(host)
            return host

        super().__init__(pack, torch.clone)
