"""Weighted next-token loss from final hidden states, chunked: full ``[tokens, vocab]`` logits never exist.

The loss contract between a causal LM and this module (what the trainer, the probe and evaluation rely on,
and what a sharded row must keep)::

    s_local = weighted_loss_sum(model, batch)        # one micro-batch, through the model's own forward

1. **Who computes what.** The model runs its own ``forward`` (wrapped or not: DDP, FSDP, DeepSpeed) with
   ``use_cache=False`` and ``logits_to_keep=0``. While :class:`LossHead` is installed on the unwrapped
   model, the output layer's ``forward`` receives the final hidden states ``[B, T, H]`` and returns the
   micro-batch's weighted loss sum ``S = sum_t w_t * CE_t`` (shape ``[1, 1, 1]``; float32, or float64 for a
   float64 model) in place of logits; the model output's ``logits`` field carries ``S`` out. A family that
   scales or soft-caps its logits after the head (:data:`LOGIT_TRANSFORMS`) gets that transform inside the
   loss, its own held neutral meanwhile; a model that changes ``S`` after the head in any other way is
   refused (:meth:`LossHead.returned_sum`).
2. **Targets.** The batch carries ``labels`` and ``loss_weights`` aligned with the tokens the model sees.
   By default position ``t`` predicts ``labels[t + 1]`` inside its row (labels not shifted, as the
   collator writes them). A batch that holds only a slice of a row, where the next label may sit in
   another slice (sequence parallelism), carries ``shift_labels`` and ``shift_loss_weights`` as well:
   already shifted, so position ``t`` predicts ``shift_labels[t]``; the loss then uses them alone.
3. **Guarantees.** Only target positions are gathered, and their logits are computed ``chunk_size`` rows
   at a time and recomputed in backward, so no ``[tokens, vocab]`` buffer exists. The head's weight is
   used inside the head module's own call, so FSDP and DeepSpeed ZeRO-3 gather it around forward and
   backward as for any layer, and its gradient flows through the normal backward. ``S`` reads only the
   hidden states and targets it is given, so it is exact on a slice of a row.
4. **Reading the head.** The loss reads the output layer through a :data:`HeadReader`: a function that
   turns the head module into ``hidden -> (hidden', weight, bias)`` with logits ``hidden' @ weight^T + bias``,
   called inside the head's own call. :func:`linear_head` reads a ``torch.nn.Linear``; a module that wraps
   the head in another way (adapters: ``longalign.lora.adapted_head``) brings its own reader, so that,
   say, an adapter's gradient comes out of the same backward.

The trainer divides ``S`` by the step's denominator (the sum of ``loss_weights`` over all micro-batches
and ranks of the step). A mixture-of-experts model whose own loss adds a router (load-balancing) loss gets
it per pack from the router logits its forward returns (:func:`loss_sums`, :func:`router_loss_sum`).

Memory: logits are computed in the model's dtype and upcast to float32 per chunk (as transformers' own
loss upcasts); softmax and cross-entropy run in float32 (in float64 for a float64 model, which is how the
tests check identities exactly on any CPU). The loss holds one float32 ``[chunk_size, V]``
buffer at a time (two with a soft-cap; plus the model-dtype product before the upcast when the model is
not float32; 2 GiB at 4096 x 128k), and the head's gradient is summed over chunks in a float32 ``[V, H]``
buffer. ``benchmarks/loss_memory.py`` compares it with transformers' full-logits loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from longalign.errors import ConfigError, ModelError
from longalign.patch.families import logit_transform

# Batch keys the model sees; labels and loss_weights stay out, so the model computes no loss of its own.
MODEL_INPUT_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def _logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logit_scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Float32 logits of one chunk: ``softcap * tanh(scale * (h W^T + b) / softcap)``."""
    logits = nn.functional.linear(hidden, weight, bias)
    logits = logits.to(_loss_dtype(logits.dtype))
    if logit_scale is not None:
        logits *= logit_scale
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the model dtypes of training (bf16, fp16, fp32); float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    target_weights: torch.Tensor,
    logit_scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """sum_t w_t * CE_t over one chunk; the logits are the only ``[rows, V]`` buffer (softmax in place)."""
    logits = _logits(hidden, weight, bias, logit_scale, softcap)
    target_logits = logits.gather(1, targets[:, None]).squeeze(1)
    row_max = logits.amax(1, keepdim=True)
    log_sum_exp = row_max.squeeze(1) + logits.sub_(row_max).exp_().sum(1).log()
    return (target_weights * (log_sum_exp - target_logits)).sum()


def _chunk_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    target_weights: torch.Tensor,
    logit_scale: float | None,
    softcap: float | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    grad_bias: torch.Tensor | None,
) -> None:
    """Recompute one chunk's logits and add its gradients into ``grad_*`` (the ones that are not None)."""
    logits = _logits(hidden, weight, bias, logit_scale, softcap)
    # softcap * tanh(u / softcap) has slope 1 - (logits / softcap)^2; taken before the softmax overwrites.
    softcap_slope = (logits / softcap).square_().neg_().add_(1) if softcap is not None else None
    grad = logits.sub_(logits.amax(1, keepdim=True)).exp_()
    grad /= grad.sum(1, keepdim=True)  # softmax, in place
    grad[torch.arange(len(grad), device=grad.device), targets] -= 1
    grad *= target_weights[:, None]
    if softcap_slope is not None:
        grad *= softcap_slope
    if logit_scale is not None:
        grad *= logit_scale
    if grad_bias is not None:
        grad_bias += grad.sum(0)
    grad = grad.to(weight.dtype)
    if grad_hidden is not None:
        torch.mm(grad, weight, out=grad_hidden)
    if grad_weight is not None:
        if weight.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad.t(), hidden)  # in place: no [V, H] temporary
        else:
            grad_weight += grad.t() @ hidden  # product in the model dtype, summed over chunks in fp32


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t w_t * CE(head(h_t), y_t) over rows of ``hidden`` that are all targets, chunk by chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        target_weights: torch.Tensor,
        logit_scale: float | None,
        softcap: float | None,
        chunk_size: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=_loss_dtype(hidden.dtype), device=hidden.device)
        for rows in _chunks(len(targets), chunk_size):
            total += _chunk_loss(
                hidden[rows], weight, bias, targets[rows], target_weights[rows], logit_scale, softcap
            )
        ctx.save_for_backward(hidden, weight, bias, targets, target_weights)
        ctx.logit_scale, ctx.softcap, ctx.chunk_size = logit_scale, softcap, chunk_size
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, target_weights = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=_loss_dtype(weight.dtype)) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=_loss_dtype(bias.dtype)) if need_bias else None
        target_weights = target_weights * grad_total
        for rows in _chunks(len(targets), ctx.chunk_size):
            _chunk_backward(
                hidden[rows],
                weight,
                bias,
                targets[rows],
                target_weights[rows],
                ctx.logit_scale,
                ctx.softcap,
                grad_hidden[rows] if grad_hidden is not None else None,
                grad_weight,
                grad_bias,
            )
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunks(length: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, length, chunk_size)]


def weighted_token_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    lm_head_bias: torch.Tensor | None = None,
    logit_scale: float | None = None,
    final_logit_softcap: float | None = None,
    chunk_size: int = 4096,
    ignore_index: int = -100,
    shifted: bool = False,
) -> torch.Tensor:
    """Sum over targets of ``w * cross_entropy`` (float32 scalar), shifting inside each row.

    ``hidden`` is ``[..., T, H]`` and ``labels`` / ``loss_weights`` are ``[..., T]`` (``[T]``, ``[1, T]``
    or a padded ``[B, T]``); ``hidden[..., t, :]`` predicts ``labels[..., t + 1]`` with weight
    ``loss_weights[..., t + 1]``. Positions whose label is ``ignore_index`` or whose weight is 0 are
    skipped before any logits are computed; with no targets at all the result is exactly 0 and the
    gradient is zero. ``chunk_size`` counts target tokens per logits chunk::

        labels        -   a1  a2 | -   b1        (one row, two samples)
        loss_weights  0  .5  .5  | 0   1
        hidden        h0  h1  h2 | h3  h4
        result = .5 * CE(h0 -> a1) + .5 * CE(h1 -> a2) + 1 * CE(h3 -> b1)     (h2, h4 predict nothing)

    ``shifted=True`` takes ``labels`` / ``loss_weights`` as already shifted: ``hidden[..., t, :]``
    predicts ``labels[..., t]`` (the form a slice of a row needs).
    """
    if chunk_size < 1:
        raise ConfigError(f"chunk_size: must be >= 1, got {chunk_size}")
    if hidden.shape[:-1] != labels.shape or labels.shape != loss_weights.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} + (H,), "
            f"and loss_weights {tuple(loss_weights.shape)} must match labels"
        )
    if shifted:
        next_labels, next_weights = labels.reshape(-1), loss_weights.reshape(-1)
        is_target = (next_labels != ignore_index) & (next_weights != 0)
    else:
        row_length = labels.shape[-1]
        next_labels = labels.reshape(-1)[1:]
        next_weights = loss_weights.reshape(-1)[1:]
        position = torch.arange(1, labels.numel(), device=labels.device)
        # Position p predicts label p + 1 unless p + 1 starts the next row of a [B, T] batch.
        is_target = (next_labels != ignore_index) & (next_weights != 0) & (position % row_length != 0)
    rows = is_target.nonzero().squeeze(1)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1])[rows],
        lm_head_weight,
        lm_head_bias,
        next_labels[rows],
        next_weights[rows].to(_loss_dtype(hidden.dtype)),
        logit_scale,
        final_logit_softcap,
        chunk_size,
    )


@dataclass(frozen=True)
class LMHead:
    """What the chunked loss needs of a model's output layer: logits = softcap(scale * (h W^T + b))."""

    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None
    logit_scale: float | None  # multiplies the logits; None = 1
    final_logit_softcap: float | None  # softcap * tanh(logits / softcap); None = no cap


# What each kind is held at while the loss runs inside the head: the forward then leaves S as it is.
_NEUTRAL = {"multiply": 1.0, "divide": 1.0, "softcap": None}


LinearInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # hidden, weight, bias
# The loss's view of an output layer: head module -> (hidden -> LinearInputs), logits = hidden' @ weight^T + bias.
# Raises ModelError for a head it cannot read.
HeadReader = Callable[[nn.Module], Callable[[torch.Tensor], LinearInputs]]


def linear_head(head: nn.Module) -> Callable[[torch.Tensor], LinearInputs]:
    """The :data:`HeadReader` of a plain ``torch.nn.Linear`` output layer: ``hidden -> (hidden, W, b)``.

    Raises ``ModelError`` naming any other layer (quantized, custom, or wrapped without a reader).
    """
    if type(head) is not nn.Linear:
        raise ModelError(
            f"output layer is {type(head).__name__}; the chunked loss reads a torch.nn.Linear (or a head "
            "whose wrapper brings its reader, as LoRA adapters do)"
        )
    return lambda hidden: (hidden, head.weight, head.bias)


def _read(model: nn.Module, head: nn.Module, read_head: HeadReader) -> Callable[[torch.Tensor], LinearInputs]:
    try:
        return read_head(head)
    except ModelError as err:
        raise ModelError(f"{type(model).__name__}: {err}") from None


def lm_head_spec(model: nn.Module, read_head: HeadReader = linear_head) -> LMHead:
    """The output layer of a transformers causal LM, with the logit scale or soft-cap its family applies.

    The scale and soft-cap are read where the family's forward reads them (:data:`LOGIT_TRANSFORMS`):
    Granite 3.x (``logits_scaling`` 16) gives ``logit_scale`` 1/16, Gemma 2 ``final_logit_softcap`` 30.
    Raises ``ModelError`` naming the module class or the field when the output layer or the value is
    one this loss does not reproduce. For a head with a LoRA adapter, ``weight`` is its frozen base (its
    ``read_head`` adds the adapter).
    """
    head = model.get_output_embeddings()
    _read(model, head, read_head)
    scale, softcap = None, None
    found = logit_transform(model)
    if found is not None:
        transform, holder, name = found
        value = getattr(holder, name, None)
        if value is not None:
            if not isinstance(value, int | float) or (transform.kind != "multiply" and value == 0):
                raise ModelError(_unsupported_field(model, transform.field, value))
            if transform.kind == "softcap":
                softcap = float(value)
            else:
                scale = float(value) if transform.kind == "multiply" else 1 / float(value)
    return LMHead(
        weight=head.weight,
        bias=head.bias,
        logit_scale=None if scale == 1.0 else scale,
        final_logit_softcap=softcap,
    )


def _unsupported_field(model: nn.Module, name: str, value: Any) -> str:
    return (
        f"{type(model).__name__}: {name!r} = {value!r} transforms the logits in a way the chunked loss "
        "does not apply"
    )


class LossHead:
    """The output layer of ``model`` made to return the micro-batch's weighted loss sum (see the contract).

    A context manager around one forward call of the (possibly wrapped) model::

        with LossHead(inner_model, batch, chunk_size=4096) as head:
            outputs = model(**inputs, use_cache=False, logits_to_keep=0)
        s = head.returned_sum(outputs.logits)

    On entry the head is checked (:func:`lm_head_spec`), its ``forward`` is replaced on the instance, and
    the family's own transform after the head (:data:`LOGIT_TRANSFORMS`) is held neutral (scale 1,
    soft-cap off), since the loss applies it inside; on exit all of it is back, whatever happened in
    between.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Mapping[str, Any],
        *,
        chunk_size: int,
        read_head: HeadReader = linear_head,
    ) -> None:
        self.spec = lm_head_spec(model, read_head)
        self.model = model
        self.head = model.get_output_embeddings()
        self.as_linear = _read(model, self.head, read_head)
        self.shifted = "shift_labels" in batch
        prefix = "shift_" if self.shifted else ""
        self.labels, self.weights = batch[prefix + "labels"], batch[prefix + "loss_weights"]
        self.chunk_size = chunk_size
        self.returned: torch.Tensor | None = None  # S as the head returned it, last call
        self._held: tuple[Any, str, Any] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head computes while installed: ``S`` as ``[1, 1, 1]`` from ``hidden [B, T, H]``."""
        hidden, weight, bias = self.as_linear(hidden)
        total = weighted_token_loss(
            hidden,
            weight,
            self.labels,
            self.weights,
            lm_head_bias=bias,
            logit_scale=self.spec.logit_scale,
            final_logit_softcap=self.spec.final_logit_softcap,
            chunk_size=self.chunk_size,
            shifted=self.shifted,
        )
        self.returned = total.detach()
        return total.reshape(1, 1, 1)

    def returned_sum(self, logits: torch.Tensor) -> torch.Tensor:
        """``S`` as the model's output carries it (``outputs.logits``), checked to be what the head returned.

        Backward must run through this tensor, not through the head's own: sharding backends (FSDP,
        ZeRO-3) hook the head's output to gather its weight for backward. Raises ``ModelError`` when the
        model changed it after the head (a transform this module does not know), so no transform is
        ever silently applied on top of the loss. A cast to float32 is the one change let through.
        """
        if self.returned is None or not _same_value(logits, self.returned):
            raise ModelError(
                f"{type(self.model).__name__} transforms the LM head's output in a way longalign does not "
                "apply (its logits are not the loss sum the head returned); the chunked loss cannot train it"
            )
        return logits.reshape(())

    def __enter__(self) -> LossHead:
        self.head.forward = self.forward
        found = logit_transform(self.model)
        if found is not None and getattr(found[1], found[2], None) is not None:
            transform, holder, name = found
            self._held = (holder, name, getattr(holder, name))
            setattr(holder, name, _NEUTRAL[transform.kind])
        return self

    def __exit__(self, *exc: object) -> None:
        del self.head.forward
        if self._held is not None:
            holder, name, value = self._held
            setattr(holder, name, value)
            self._held = None


def _same_value(logits: torch.Tensor, returned: torch.Tensor) -> bool:
    """``logits`` holds exactly ``returned`` (NaN matching NaN), or its float32 cast; fake tensors pass."""
    if logits.numel() != 1 or logits.dtype not in (returned.dtype, torch.float32):
        return False
    if is_fake(logits):  # a memory simulation's tensors carry no values
        return True
    expected = returned.to(logits.dtype).reshape(())
    return bool(torch.allclose(logits.detach().reshape(()), expected, rtol=0, atol=0, equal_nan=True))


@dataclass(frozen=True)
class RouterLoss:
    """What the load-balancing loss of a mixture-of-experts model needs, read where its forward reads it."""

    coefficient: float  # the causal LM's router_aux_loss_coef: the loss adds coefficient x aux
    num_experts: int  # E
    top_k: int  # experts each token is routed to


def router_loss_spec(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model``'s own loss adds, or None when it adds none.

    A transformers MoE causal LM adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits,
    num_experts, num_experts_per_tok)`` to its loss when its config has ``output_router_logits`` on (Mixtral,
    Qwen2/3-MoE, OLMoE, gpt-oss, Granite-MoE, Jamba, DBRX, ...); the three values are attributes its
    ``__init__`` copies from the config, and are read there. Families whose forward adds no router term
    (DeepSeek-V3, GLM-4.5, Llama 4 in transformers 5.24 and 5.25) have no ``router_aux_loss_coef`` attribute and get
    none here either. ``model`` may be in a PEFT wrapper.
    """
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(causal_lm.config.get_text_config(), "output_router_logits", False):
        return None
    coefficient = getattr(causal_lm, "router_aux_loss_coef", None)
    if coefficient is None:
        return None
    values = {name: getattr(causal_lm, name, None) for name in ("num_experts", "num_experts_per_tok")}
    missing = [name for name, value in values.items() if not isinstance(value, int)]
    if missing or not isinstance(coefficient, int | float):
        unread = ", ".join(missing) or "router_aux_loss_coef"
        raise ModelError(
            f"{type(causal_lm).__name__}: output_router_logits is on, but its {unread} is not a number the "
            "router loss can read; set output_router_logits = false to train without it"
        )
    return RouterLoss(float(coefficient), values["num_experts"], values["num_experts_per_tok"])


def router_loss_sum(
    router_logits: tuple[torch.Tensor, ...],
    pack_ids: torch.Tensor,
    num_packs: int,
    spec: RouterLoss,
    *,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """sum_p aux_p over the packs of a micro-batch: each pack's load-balancing loss as if it ran alone.

    ``router_logits`` holds one ``[tokens, E]`` tensor per MoE layer (the model's ``router_logits``) for
    the batch's tokens in order; ``pack_ids [..., tokens]`` says which pack each token is in, 0 ..
    ``num_packs`` - 1, or -1 for filler, which counts nowhere. For pack p with real tokens R_p over L
    layers, with ``probs = softmax(router_logits)`` and each token's top-k experts among them::

        f_pe  = (slots (t, l), t in R_p, whose top-k includes e) / (|R_p| L)
        P_pe  = (sum over t in R_p and the L layers of probs[t, e]) / (|R_p| L)
        aux_p = E * sum_e f_pe * P_pe            (transformers' load_balancing_loss_func on pack p alone)

        pack_ids [0 0 0 1 1 -1], E = 4, top-2: aux_0 from the first 3 tokens, aux_1 from the next 2

    Under sequence parallelism a rank holds a slice of each pack. ``all_reduce`` sums the routing counts
    and token totals over the group (they carry no gradient), and each rank returns the part of the sum
    its own tokens' probabilities make, ``E * sum_e f_pe * (its share of P_pe)``: the ranks' results, and
    their gradients, add up to the whole pack's. The result is float32 (float64 for a float64 model).
    """
    ids = pack_ids.reshape(-1)
    real = ids >= 0
    ids = ids[real]
    experts, tokens = spec.num_experts, len(real)
    dtype = _loss_dtype(router_logits[0].dtype)
    device = router_logits[0].device
    counts = torch.zeros(num_packs * experts, dtype=torch.float64, device=device)
    probs_sum = torch.zeros(num_packs, experts, dtype=dtype, device=device)
    for layer in router_logits:
        if layer.shape[-1] != experts or layer.numel() != tokens * experts:
            raise ModelError(
                f"router logits of shape {tuple(layer.shape)} are not [{tokens} tokens, {experts} experts]: "
                "this family routes in a way the router loss does not follow; set output_router_logits = false"
            )
        # softmax in the logits' dtype and top-k of that, as transformers does
        probs = torch.softmax(layer.reshape(tokens, experts), dim=-1)[real]
        chosen = probs.topk(spec.top_k, dim=-1).indices
        slots = (ids[:, None] * experts + chosen).reshape(-1)
        counts.index_add_(0, slots, torch.ones(len(slots), dtype=torch.float64, device=device))
        probs_sum = probs_sum.index_add(0, ids, probs.to(dtype))
    totals = torch.cat([counts, torch.bincount(ids, minlength=num_packs).double() * len(router_logits)])
    if all_reduce is not None and num_packs:  # a group's ranks hold the same packs: all skip, or none
        all_reduce(totals)
    counts, slots = totals.split([num_packs * experts, num_packs])
    slots = slots.clamp(min=1)[:, None]
    fractions = (counts.view(num_packs, experts) / slots).to(dtype)
    return experts * (fractions * probs_sum / slots.to(dtype)).sum()


@dataclass(frozen=True)
class LossSums:
    """One micro-batch's parts of the step's objective, before the step's denominators divide them."""

    tokens: torch.Tensor  # S = sum_t w_t * CE_t
    router: torch.Tensor | None  # sum_p aux_p over the batch's packs (this rank's part); None: no router loss
    router_coefficient: float  # what the objective multiplies the router loss by; 0 without one


def loss_sums(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    chunk_size: int = 4096,
    read_head: HeadReader = linear_head,
    sequence_parallel_group: Any = None,
) -> LossSums:
    """``S`` (see :func:`weighted_loss_sum`) and, for an MoE model whose own loss adds one, the router loss.

    The router loss is :func:`router_loss_sum` over the batch's ``pack_ids`` (``PackCollator``).
    A batch that holds a slice of its packs (``shift_labels``: sequence parallelism) needs the
    ``sequence_parallel_group`` its slices are spread over, to sum the routing counts.
    """
    spec = router_loss_spec(_unwrapped(model))
    if spec is not None and "pack_ids" not in batch:
        raise ValueError("the router loss is per pack: the batch needs the pack_ids PackCollator writes")
    if spec is not None and "shift_labels" in batch and sequence_parallel_group is None:
        raise ValueError(
            "a batch that is a slice of its packs needs the sequence-parallel group for the router loss"
        )
    outputs, tokens = _forward(model, batch, chunk_size, read_head)
    if spec is None:
        return LossSums(tokens, None, 0.0)
    router_logits = getattr(outputs, "router_logits", None)
    if not router_logits:
        raise ModelError(
            f"{type(_unwrapped(model)).__name__}: output_router_logits is on, but no router_logits came out"
        )
    all_reduce = None
    if sequence_parallel_group is not None:
        all_reduce = functools.partial(torch.distributed.all_reduce, group=sequence_parallel_group)
    router = router_loss_sum(
        router_logits, batch["pack_ids"], batch["num_packs"], spec, all_reduce=all_reduce
    )
    return LossSums(tokens, router, spec.coefficient)


def weighted_loss_sum(
    model: nn.Module, batch: Mapping[str, Any], *, chunk_size: int = 4096, read_head: HeadReader = linear_head
) -> torch.Tensor:
    """One micro-batch's ``S = sum_t w_t * CE_t`` (float32 scalar) through the model's own forward.

    ``model`` may be wrapped (DDP, FSDP, DeepSpeed: anything exposing ``.module``); the LM head is found on
    the model inside, and read with ``read_head``. Every position of the batch reaches the head
    (``logits_to_keep=0``); labels mark non-targets with -100. A router loss is not part of ``S``
    (:func:`loss_sums` adds it).
    """
    return _forward(model, batch, chunk_size, read_head)[1]


def _unwrapped(model: nn.Module) -> nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _forward(
    model: nn.Module, batch: Mapping[str, Any], chunk_size: int, read_head: HeadReader
) -> tuple[Any, torch.Tensor]:
    """The model's outputs, and ``S`` as they carry it."""
    inputs = {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
    with LossHead(_unwrapped(model), batch, chunk_size=chunk_size, read_head=read_head) as head:
        outputs = model(**inputs, use_cache=False, logits_to_keep=0)
    return outputs, head.returned_sum(outputs.logits)
