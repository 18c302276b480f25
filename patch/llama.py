"""Llama 3 (``LlamaForCausalLM``; Llama 2 based checkpoints load the same class).

``LlamaModel`` hands ``position_ids`` to the rotary embedding and every keyword argument of the batch
through each decoder layer to the attention function, so the generic checks cover it. Llama 3.1's
``rope_type="llama3"`` rescales frequencies once, independent of the batch, and is safe to pack.
"""

from .generic import Family

LLAMA = Family(label="Llama 3", architectures=("LlamaForCausalLM",))
