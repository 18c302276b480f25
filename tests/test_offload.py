"""Checkpointed layer inputs in host memory: the same step, and only the checkpointed layers' inputs moved.

On a machine without an accelerator the hooks run as on a GPU machine, with nothing to pin or copy: the
path is the one a GPU run takes, minus the copies.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT64_BOUND, TINY, relative_error, tiny_model
from tiled_mlp_run import one_step, reference_step
from torch.autograd.graph import save_on_cpu

import longalign.patch
import longalign.patch.offload
from longalign.errors import ModelError

no_accelerator = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="a machine without an accelerator"
)


@pytest.mark.parametrize(
    "variant", ["llama+checkpointing", "glm4+checkpointing+adapters", "qwen3+checkpointing+tiled"]
)
def test_a_step_with_offloaded_inputs_is_the_step_without(variant):
    offloaded, kept = one_step(variant + "+offload"), reference_step(variant)
    assert relative_error(offloaded["update"], kept["update"]) < FLOAT64_BOUND
    assert offloaded["loss"] == pytest.approx(kept["loss"], rel=1e-12)


class CountingHooks(save_on_cpu):
    """torch's hooks, counting what passes through them."""

    packed: list[tuple[int, ...]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        pack = self.pack_hook

        def counted(tensor):
            CountingHooks.packed.append(tuple(tensor.shape))
            return pack(tensor)

        self.pack_hook = counted


@pytest.mark.parametrize("every_n_layers, moved", [(1, 4), (2, 2)])
def test_only_the_inputs_of_checkpointed_layers_pass_through_host_memory(monkeypatch, every_n_layers, moved):
    monkeypatch.setattr(longalign.patch.offload, "save_on_cpu", CountingHooks)
    monkeypatch.setattr(CountingHooks, "packed", [])
    model = tiny_model("llama", backend="sdpa_segments", num_hidden_layers=4).double()
    longalign.patch.offload_checkpointed_inputs(model)
    model.activation_checkpointing_enable(every_n_layers=every_n_layers)  # after: as the Trainer does
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (1, 11))
    model(input_ids=ids, labels=ids).loss.backward()
    # One hidden-state input per checkpointed layer; what a layer saves inside is recomputed, not moved.
    assert CountingHooks.packed == [(1, 11, TINY["hidden_size"])] * moved
    with torch.no_grad():
        model(input_ids=ids)  # no backward to wait for: nothing moves
    model.eval()
    model(input_ids=ids).logits.sum().backward()  # not training: the layers are not checkpointed
    assert len(CountingHooks.packed) == moved


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ModelError, match="training.offload_activations: Linear has no decoder layers"):
        longalign.patch.offload_checkpointed_inputs(torch.nn.Linear(2, 2))


@no_accelerator
def test_transformers_own_offload_cannot_run_without_an_accelerator():
    """Why longalign installs the hooks itself: transformers pins host memory that no allocator provides here."""
    model = tiny_model("llama", backend="sdpa_segments")
    model.activation_checkpointing_enable(offload=True)
    model.train()
    ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    with pytest.raises(RuntimeError, match="pin_memory=True requires a CUDA or other accelerator backend"):
        model(input_ids=ids, labels=ids)
