"""GLM (``GlmForCausalLM``, e.g. GLM-4-9B ``-hf``) and GLM-4 (``Glm4ForCausalLM``, GLM-4-0414).

Both rotate only part of each head (``partial_rotary_factor``, interleaved pairs) and compute the angle from
``position_ids``, so positions restart per sample as long as the collator restarts them::

    position_ids  0 1 2 | 0 1     head_dim 128: dims 0..63 rotated by position, 64..127 untouched

``GlmModel`` and ``Glm4Model`` pass the batch's keyword arguments down to attention like Llama does.

The original GLM-4-9B checkpoints are laid out for remote code (model type ``chatglm``) that computes
attention in its own module; we never run or patch it. ``longalign.checkpoints`` reads them as
``GlmForCausalLM`` instead.
"""

from .generic import Family

GLM = Family(label="GLM", architectures=("GlmForCausalLM",))
GLM4 = Family(label="GLM-4", architectures=("Glm4ForCausalLM",))

REMOTE_CODE_HINTS = {
    "chatglm": (
        "For GLM-4-9B load the same checkpoint with longalign.checkpoints.load_model (GlmForCausalLM, its code "
        "not run), or convert it once with `longalign convert`. ChatGLM2/3 have no native class."
    ),
}
