"""Model patches: route packed cu_seqlens to varlen attention.

One call before training::

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = longalign.patch.apply(model)            # backend="auto" | "flash_attn" | ... | "sdpa_segments"
    model(input_ids=..., position_ids=..., cu_seq_lens_q=..., cu_seq_lens_k=..., max_length_q=..., max_length_k=...)
    model(input_ids=ids, attention_mask=cu_seqlens)  # LongAlign's call: 1D int32 boundaries (cu_seqlens_mask)

``apply`` checks the architecture once (``UnsupportedModelError`` lists what is supported), registers the
varlen attention with transformers under a ``longalign_varlen*`` name, selects it, and turns the KV cache
off: with a cache, transformers' own attention lets packed samples see each other. Call it before wrapping
the model (PEFT, FSDP); gradient checkpointing may be enabled before or after.

``apply(model, sequence_parallel_size=N)`` with N > 1 splits every pack over groups of N ranks: the
varlen attention runs inside DeepSpeed's Ulysses layer (``sequence_parallel``), and each rank's batches
must be its slices of the pack (``longalign.batching.PackCollator``); ``with whole_rows(model):`` it
attends without splitting for a while (scoring during training).

What longalign knows of model families is in ``families``: ``families.decide(config)`` says, before any
data is prepared, whether a model trains on packed samples exactly, and why not; ``apply`` holds the model
it patches to the same decision.

Three more patches trade time for memory at long context, all exact: ``tile_mlp(model)`` runs every
layer's MLP (dense or a mixture of experts) over the tokens in tiles (``tiled_mlp``), ``tile_layers(model)`` every token-wise part of
every decoder layer (``tiled_layer``), and ``offload_checkpointed_inputs(model)`` keeps
the inputs that activation checkpointing saves in host memory (``offload``).
"""

from __future__ import annotations

if __name__ != "longalign.patch":
    # The directory is installed as longalign.patch (pyproject's package-dir). Loaded under another name
    # (`import patch` from the repository root) it would be a second module with its own registry.
    raise ImportError(f"import longalign.patch, not {__name__}: patch/ is installed as longalign.patch")

import torch

from longalign.errors import ModelError

from . import cu_seqlens_mask, families, linear_attention, llama4
from .interface import ATTENTION_NAMES, register, varlen_attention_forward
from .offload import offload_checkpointed_inputs
from .sequence_parallel import sequence_parallel_problems, whole_rows, wrap
from .tiled_layer import tile_layers
from .tiled_mlp import tile_mlp

__all__ = [
    "ATTENTION_NAMES",
    "UnsupportedModelError",
    "apply",
    "check_model",
    "offload_checkpointed_inputs",
    "sequence_parallel_problems",
    "tile_layers",
    "tile_mlp",
    "varlen_attention_forward",
    "whole_rows",
]


class UnsupportedModelError(ModelError):
    """The model cannot train on packed samples; the message says why and what is supported."""


def apply(
    model: torch.nn.Module, *, backend: str = "auto", sequence_parallel_size: int = 1
) -> torch.nn.Module:
    """Make ``model`` attend within packed samples: check it, select varlen attention, disable the cache.

    With ``sequence_parallel_size`` N > 1 the varlen attention is wrapped in DeepSpeed's Ulysses layer
    over groups of N consecutive ranks (needs DeepSpeed and a process group).
    """
    check_model(model, backend=backend)
    llama4.install(model)  # Llama 4's NoPE layers: their query temperature from positions within samples
    if sequence_parallel_size > 1:
        found = sequence_parallel_problems(model.config, sequence_parallel_size)
        if found:
            raise UnsupportedModelError(
                f"{type(model).__name__} cannot split its attention over {sequence_parallel_size} ranks: "
                + "; ".join(found)
            )
        name = wrap(model, sequence_parallel_size, backend)
    else:
        name = register(backend)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:  # transformers only warns when it cannot switch
        raise UnsupportedModelError(
            f"{type(model).__name__} kept attention {model.config._attn_implementation!r}"
        )
    model.config.use_cache = False
    cu_seqlens_mask.install(model)
    linear_attention.install(model)  # Qwen3-Next/3.5, Kimi-Linear: convolution and state restart per sample
    return model


def check_model(model: torch.nn.Module, *, backend: str = "auto") -> str:
    """The family ``model`` is patched as (a label such as ``"GLM-4"``, or ``"generic"``); raises
    ``UnsupportedModelError`` in one line when it cannot train on packed samples exactly (``families``)."""
    remote = families.remote_code_problem(model)
    if remote:
        raise UnsupportedModelError(remote)
    if not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a transformers model; call longalign.patch.apply on the model before "
            "wrapping it (PEFT, FSDP, DeepSpeed)"
        )
    decision = families.decide_model(model, backend=backend)
    if not decision.exact:
        raise UnsupportedModelError(decision.message())
    return families.NAMED.get(type(model).__name__, "generic")
