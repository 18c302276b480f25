"""Sequence parallelism: DeepSpeed's Ulysses layer around the varlen attention, for packs split over ranks.

A group of N consecutive ranks shares one pack. Each rank holds T / N of its tokens (the collator's
slice) and runs embeddings, MLPs, norms and the loss on them alone. Around every attention call the
Ulysses layer trades token slices for heads (all-to-all), so the varlen attention sees the whole pack,
with its whole ``cu_seq_lens_q``, for H / N of the heads, and trades back afterwards::

    N = 2, one pack of T tokens    entering attention         inside attention              leaving
    rank 0                         tokens [0, T/2), H heads   all T tokens, heads [0, H/2)  tokens [0, T/2)
    rank 1                         tokens [T/2, T), H heads   all T tokens, heads [H/2, H)  tokens [T/2, T)

DeepSpeed is the engine (``deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF``): the
exchange and its gradient, and gathering ``position_ids`` over the group, are its own. It wraps an
attention registered with transformers under a name of its own (``ATTENTION_NAMES[backend] +
"_ulysses"``), so models of the same process that do not split packs keep the plain varlen attention.
DeepSpeed builds its groups once per process; a second model with the same attention shape reuses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from longalign.errors import ConfigError

from .interface import ATTENTION_NAMES, is_ulysses, register

SUFFIX = "_ulysses"
# Layer types whose token mixing is attention (what the Ulysses layer splits); any other layer type
# (linear attention, state-space mixers) would see only one rank's slice of the pack.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Config fields of multi-head latent attention (DeepSeek-V2/V3): query/key and value heads of different
# sizes, which the Ulysses layer's reshapes by one head size do not follow.
_LATENT_ATTENTION_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim")

# name -> the attention shape it was wrapped for; DeepSpeed's groups and the wrapper live as long as the process.
_WRAPPED: dict[str, dict[str, int]] = {}


def sequence_parallel_problems(config: Any, size: int) -> list[str]:
    """Why a model of this config cannot split its attention over ``size`` ranks; empty when it can.

    >>> from transformers import LlamaConfig
    >>> sequence_parallel_problems(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 3)
    ['its 4 attention heads are not a multiple of 3', 'its 2 key/value heads neither divide by 3 nor divide 3']
    """
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    found = []
    if heads % size:
        found.append(f"its {heads} attention heads are not a multiple of {size}")
    if kv_heads % size and size % kv_heads:
        found.append(f"its {kv_heads} key/value heads neither divide by {size} nor divide {size}")
    if any(getattr(text, field, None) for field in _LATENT_ATTENTION_FIELDS):
        found.append(
            "it uses multi-head latent attention (value heads of another size than query/key heads), which "
            "the Ulysses layer does not split"
        )
    others = sorted(set(getattr(text, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    if others:
        found.append(
            f"it has {', '.join(others)} layers, which mix tokens outside attention and would see only one "
            "rank's slice of the pack"
        )
    return found


def wrap(model: torch.nn.Module, size: int, backend: str) -> str:
    """Register the varlen attention for ``backend`` under DeepSpeed's Ulysses layer; the name to select.

    Needs a process group (``accelerate launch``) whose world size is a multiple of ``size``.
    """
    import torch.distributed as dist

    name = ATTENTION_NAMES[backend] + SUFFIX
    shape = _attention_shape(model.config, size)
    if name in _WRAPPED:
        if _WRAPPED[name] != shape:
            raise ConfigError(
                f"this process already splits attention {name!r} as {_WRAPPED[name]}, not as {shape}; DeepSpeed "
                "sets sequence parallelism up once per process"
            )
        return name
    if _WRAPPED or is_ulysses(ALL_ATTENTION_FUNCTIONS.get(name)):
        raise ConfigError(
            f"sequence parallelism is already set up in this process for another attention ({', '.join(_WRAPPED) or 'outside longalign'}); "
            "DeepSpeed sets it up once per process"
        )
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    except ImportError as err:
        raise ConfigError(
            f"sequence parallelism runs on DeepSpeed, which does not import ({err}): pip install 'longalign[sp]'"
        ) from None
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("sequence parallelism needs a process group: start the run with accelerate launch")

    if not deepspeed.comm.is_initialized():  # accelerate's DeepSpeed launches have done it already
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    register(backend, name=name)
    model.set_attn_implementation(name)  # DeepSpeed checks that the model selects what it wraps
    # One varlen row per micro-batch (the collator concatenates packs), of whatever length the pack has.
    UlyssesSPAttentionHF.register_with_transformers(
        model,
        core_attn_implementation=name,
        sequence_parallel_size=size,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    _WRAPPED[name] = shape
    return name


def group_of_this_rank() -> Any:
    """The process group of the ranks that share this rank's packs, as :func:`wrap` had DeepSpeed build it.

    For sums over the slices of a pack that no gradient flows through (the router loss's counts).
    """
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


@contextmanager
def whole_rows(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, a model that splits packs over ranks attends as one that does not.

    Its attention runs without DeepSpeed's Ulysses layer, so every rank can run whole rows of its own
    (teacher-forced scoring during training: ``longalign.eval.in_training``) and gets what the unsplit
    model computes, exactly; the exchange would otherwise take each rank's row for a slice of one row
    shared by the group. A model that does not split packs is left as it is.
    """
    config = model.config
    name = config._attn_implementation
    if not (isinstance(name, str) and name.endswith(SUFFIX)):
        yield
        return
    plain = name.removesuffix(SUFFIX)
    backend = next(b for b, n in ATTENTION_NAMES.items() if n == plain)
    if plain not in ALL_ATTENTION_FUNCTIONS:
        register(backend)
    config._attn_implementation = plain
    try:
        yield
    finally:
        config._attn_implementation = name


def _attention_shape(config: Any, size: int) -> dict[str, int]:
    """What the Ulysses layer is built for: group size, heads, key/value heads, head size, layers."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    return {
        "size": size,
        "heads": heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "layers": text.num_hidden_layers,
    }
