"""The sequence-tiled decoder layer: exact, token-wise tensors one tile at a time, each part recomputed once.

The fast tests check tiled models against untiled ones in float64 (output and every gradient, packed
samples; with checkpointing, offloaded inputs and LoRA adapters spread over the families), that the
projections and the MLP run tile by tile, in forward and once in backward (the q/k/v projections once
more), what a tiled layer keeps for backward (its input), LoRA dropout drawn again identically in the
recompute, a mixture of experts' router logits recorded once per layer, generation with a KV cache, and
the refusals; then one optimizer step of the real trainer with the layers tiled against the same step
without (Llama; GLM-4 and Qwen3 in the slow tier). Every family of the registry is tiled in
``test_families.py``. The multi-rank cases (each pack split over 2 ranks; ZeRO-3 with uneven tile counts;
flash-attn under sequence parallelism 2) share the launches of ``test_tiled_mlp.py`` and
``test_attention_kernels.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FLOAT64_BOUND, TINY, assert_relatively_close, relative_error, tiny_model
from tiled_mlp_run import TILE_TOKENS, first_mlp, one_step, parse, reference_step
from tiled_mlp_run import model as build
from tiny_configs import build as build_family
from tiny_configs import tiny_config
from transformers import DynamicCache, Qwen3MoeConfig

import longalign.patch
from longalign.errors import ModelError
from longalign.patch import families, tiled_layer
from longalign.patch.tiled_mlp import _tiles, tile_count

# Three samples in one row: positions restart, so RoPE and attention see the packing.
POSITIONS = torch.tensor([list(range(20)) + list(range(6)) + list(range(11))])
IDS = torch.randint(3, TINY["vocab_size"], POSITIONS.shape, generator=torch.Generator().manual_seed(0))


def tiled_model(kind: str, **overrides) -> torch.nn.Module:
    model = tiny_model(kind, backend="sdpa_segments", **overrides).double()
    return longalign.patch.tile_layers(model, tile_tokens=TILE_TOKENS)


def loss_and_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    out = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
    trained = [param for param in model.parameters() if param.requires_grad]
    return [out.logits, *torch.autograd.grad(out.loss, trained)]


# Every family, with the switches spread over them: activation checkpointing, its inputs offloaded, LoRA
# adapters on every projection (the step tests below run the trainer on some of these).
SWITCHED = [
    "llama",
    "glm+checkpointing+offload",
    "glm4+checkpointing+adapters",  # fused gate_up_proj, partial rotary, q/k/v biases, post norms
    "mistral+adapters",
    "qwen2+checkpointing+adapters",  # q/k/v biases
    "qwen3+checkpointing+offload+adapters",  # per-head q/k norms
]


@pytest.mark.parametrize("variant", SWITCHED)
def test_every_family_s_tiled_layers_give_the_untiled_output_and_gradients(variant):
    family, switches = parse(variant)
    dense, tiled = (build(family, switches | more, 1) for more in ({"offload"} & switches, {"layer"}))
    for model in (dense, tiled):
        if "checkpointing" in switches:
            model.activation_checkpointing_enable()
        model.train()
    seen: dict[str, list[int]] = {"q_proj": [], "o_proj": [], "down_proj": [], "mlp": []}
    attention = next(m for name, m in tiled.named_modules() if name.endswith("layers.0.self_attn"))
    down = first_mlp(tiled).down_proj
    # The projections' products, counted where they run (a tile's second pass hands q_proj's output back).
    weights = {
        id(getattr(module, "base_layer", module).weight): name
        for name, module in (("q_proj", attention.q_proj), ("o_proj", attention.o_proj), ("down_proj", down))
    }
    linear = torch.nn.functional.linear

    def counted(x, weight, *args, **kwargs):
        if id(weight) in weights:
            seen[weights[id(weight)]].append(x.shape[-2])
        return linear(x, weight, *args, **kwargs)

    first_mlp(tiled).register_forward_pre_hook(lambda module, args: seen["mlp"].append(args[0].shape[-2]))

    want = loss_and_gradients(dense)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(torch.nn.functional, "linear", counted)
        got = loss_and_gradients(tiled)

    assert_relatively_close(got[0], want[0], FLOAT64_BOUND)
    assert_relatively_close(got[1:], want[1:], FLOAT64_BOUND)
    tiles = tile_count(IDS.numel(), TINY["hidden_size"], TILE_TOKENS)
    # With checkpointing or without, each tile's projections and MLP run in forward and once in backward, as
    # checkpointing runs them: q/k/v for q, k and v before the kernel's backward, o-projection and MLP in
    # the second pass, whose down projection computes no product (only the residual sum follows it), nor
    # do q/k/v in the first pass differentiated (only RoPE and reshapes follow them). The layer's first call
    # runs one token more to find which children's outputs it reads after the call, and which products'
    # outputs no backward reads: once per pass, and once more with and once without those products where
    # some are found (GLM-4's norm after the MLP reads the down projection's output: none after the call).
    # Qwen3's per-head norm after q_proj reads its output (v_proj's is found: the passes run q_proj).
    found, q_found = family != "glm4", family != "qwen3"
    after = 1 + (3 if found else 1)  # one-token passes after the call
    assert {name: len(tokens) for name, tokens in seen.items()} == {
        "q_proj": 2 * tiles + 2 if q_found else 3 * tiles + 3,
        "o_proj": 2 * tiles + after,
        "down_proj": tiles + after - 1 if found else 2 * tiles + after,
        "mlp": 2 * tiles + after,
    }
    assert max(max(tokens) for tokens in seen.values()) <= TILE_TOKENS
    assert min(seen["mlp"]) == 1  # that token


def test_the_kernel_runs_once_per_key_value_head_and_every_norm_in_tiles(monkeypatch):
    """The attention kernel gets one key/value head and its query heads per call (2 and 1 of TINY's 4 and 2):
    each group's forward runs once per pass (forward, and the layer's recompute), and backward calls the
    kernel's backward on what that forward kept (its output and log-sum-exp); every norm, the final one's
    included, sees one tile.
    Output and gradients as untiled (float64); the trainer's step with these layers is checked below."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from longalign import attention

    calls, norm_tokens = [], []
    kept, norm = attention._KEPT_FUNCTIONS["sdpa_segments"], LlamaRMSNorm.forward

    def recorded_forward(q, k, v, *args):
        calls.append(("forward", q.shape[1], k.shape[1], v.shape[1]))
        return kept.forward(q, k, v, *args)

    def recorded_backward(dout, q, k, v, *args):
        calls.append(("backward", q.shape[1], k.shape[1], v.shape[1]))
        return kept.backward(dout, q, k, v, *args)

    def whole_kernel(*args, **kwargs):
        raise AssertionError("the whole kernel ran: per_kv_head must run each group's own forward")

    def recorded_norm(module, x):
        norm_tokens.append(x.shape[-2])
        return norm(module, x)

    dense = tiny_model("llama", backend="sdpa_segments").double()
    want = loss_and_gradients(dense)
    recorded = kept._replace(forward=recorded_forward, backward=recorded_backward)
    monkeypatch.setitem(attention._KEPT_FUNCTIONS, "sdpa_segments", recorded)
    monkeypatch.setitem(attention._BACKEND_FUNCTIONS, "sdpa_segments", whole_kernel)
    monkeypatch.setattr(LlamaRMSNorm, "forward", recorded_norm)
    got = loss_and_gradients(tiled_model("llama"))

    assert_relatively_close(got, want, FLOAT64_BOUND)
    groups, layers = TINY["num_key_value_heads"], TINY["num_hidden_layers"]
    # Forward: each layer's groups once. Backward, last layer first: the layer's recompute (it keeps its
    # input alone, as checkpointing does) runs each group's forward again, then each group's kernel backward
    # on what that forward kept: never a forward inside the kernel's backward.
    recompute = [("forward", 2, 1, 1)] * groups + [("backward", 2, 1, 1)] * groups
    assert calls == [("forward", 2, 1, 1)] * (groups * layers) + recompute * layers
    assert norm_tokens and max(norm_tokens) <= TILE_TOKENS


@pytest.mark.parametrize("offloaded", [False, True], ids=["on the device", "offloaded"])
def test_kept_attention_runs_no_attention_forward_in_backward(offloaded):
    """``keep_attention``: each layer keeps its attention output and log-sum-exps from forward (offloaded with
    its input, as ``offload_checkpointed_inputs`` moves what the layer saves), and its backward hands them to
    the kernel's backward: the kernel's forward runs once per group and layer, all in forward. Output and
    gradients as untiled (float64)."""
    from conftest import kept_kernel_calls
    from torch.autograd.graph import saved_tensors_hooks

    want = loss_and_gradients(tiny_model("llama", backend="sdpa_segments").double())
    model = longalign.patch.tile_layers(
        tiny_model("llama", backend="sdpa_segments").double(), tile_tokens=TILE_TOKENS, keep_attention=True
    )
    saved: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor.clone()  # what the offload does: a copy, brought back in backward

    hooks = (
        saved_tensors_hooks(pack, torch.clone) if offloaded else saved_tensors_hooks(lambda t: t, lambda t: t)
    )
    with kept_kernel_calls("sdpa_segments") as calls, hooks:
        out = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
        in_forward = list(saved)
        trained = [param for param in model.parameters() if param.requires_grad]
        got = [out.logits, *torch.autograd.grad(out.loss, trained)]

    assert_relatively_close(got, want, FLOAT64_BOUND)
    groups, layers = TINY["num_key_value_heads"], TINY["num_hidden_layers"]
    assert calls == ["forward"] * (groups * layers) + ["backward"] * (groups * layers)
    if offloaded:  # in forward, each layer's attention output and one log-sum-exp per group went out
        heads, tokens = TINY["num_attention_heads"], POSITIONS.shape[1]
        output, lse = (tokens, heads, TINY["hidden_size"] // heads), (heads // groups, tokens)
        assert sum(shape == output for shape in in_forward) == layers
        assert sum(shape == lse for shape in in_forward) == layers * groups


def test_kept_attention_needs_the_tiled_layer_and_offloaded_inputs():
    from longalign.config import ConfigError, TrainingConfig

    for settings in (
        {},
        {"sequence_tiling": "layer"},
        {"sequence_tiling": "mlp", "offload_activations": True},
    ):
        with pytest.raises(ConfigError, match="training.keep_attention") as err:
            TrainingConfig(keep_attention=True, args={"activation_checkpointing": True}, **settings)
        assert "\n" not in str(err.value)
    TrainingConfig(
        keep_attention=True,
        sequence_tiling="layer",
        offload_activations=True,
        args={"activation_checkpointing": True},
    )


def test_a_tiled_layer_keeps_its_input_alone_for_backward():
    """Untiled, backward needs the norms' outputs and the MLP's ``[tokens, intermediate]`` tensors; tiled, the
    layer keeps its input and recomputes the rest (q, k, v and the attention output included)."""
    tokens, hidden = 40, TINY["hidden_size"]
    x = torch.randn(1, tokens, hidden, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(tokens)[None]

    def saved(model: torch.nn.Module) -> list[torch.Tensor]:
        layer, kept = model.model.layers[0], []
        angles = model.model.rotary_emb(x, positions)

        def pack(tensor):
            kept.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(x, position_ids=positions, position_embeddings=angles)
        return kept

    def residual_sized(kept):  # distinct [1, tokens, hidden] tensors (q x heads is hidden here too)
        return {t.data_ptr() for t in kept if t.shape == (1, tokens, hidden)}

    dense, tiled = saved(tiny_model("llama", backend="sdpa_segments").double()), saved(tiled_model("llama"))
    intermediate = TINY["intermediate_size"]
    assert any(intermediate in t.shape for t in dense) and not any(intermediate in t.shape for t in tiled)
    assert len(tiled) == 1 and tiled[0] is x and len(residual_sized(dense)) > 1


def test_adapter_dropout_draws_the_forward_s_masks_again_in_backward(monkeypatch):
    """LoRA dropout on every projection: the recompute of each tile must see the masks the forward drew."""
    from longalign.config import LoraConfig
    from longalign.lora import add_adapters

    settings = LoraConfig(r=4, alpha=8.0, dropout=0.5)
    model = add_adapters(tiled_model("qwen3"), settings, base_model="tiny")
    model.train()
    trained = [param for param in model.parameters() if param.requires_grad]

    def run() -> list[torch.Tensor]:
        torch.manual_seed(5)
        out = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
        after_forward = torch.get_rng_state()
        grads = torch.autograd.grad(out.loss, trained)
        assert torch.equal(torch.get_rng_state(), after_forward)  # the recompute leaves the stream as it was
        return [out.logits, *grads]

    got = run()

    # The reference: the same tiles and attention call in the same order, kept for autograd's own backward.
    def kept(call, x, *tensors):
        parts, cached, outputs = [], {}, []
        for index, start, stop in _tiles(call.length, call.count):
            tile_qkv, cached[index] = call.before(x[:, start:stop], start, stop)
            parts.append(tile_qkv)
        attended = call.kernel(*(torch.cat(tiles, dim=-2) for tiles in zip(*parts, strict=True)))
        for index, start, stop in _tiles(call.length, call.count):
            outputs.append(
                call.after(x[:, start:stop], start, stop, cached[index], attended[:, start:stop])[0]
            )
        return (torch.cat(outputs, dim=1),)

    monkeypatch.setattr(tiled_layer._TiledLayer, "apply", kept)
    assert_relatively_close(got, run(), FLOAT64_BOUND)


def test_generation_with_a_kv_cache_runs_the_layer_s_own_forward():
    """A cache is written whole by the layer's own code; transformers' sdpa attention reads it."""
    dense, tiled = tiny_model("glm4").double().eval(), tiny_model("glm4").double().eval()
    longalign.patch.tile_layers(tiled, tile_tokens=TILE_TOKENS)
    ids = IDS[:, :12]
    with torch.no_grad():
        for model in (dense, tiled):
            cache = DynamicCache(config=model.config)
            model.logits = [model(input_ids=ids[:, :9], cache=cache, use_cache=True).logits]
            model.logits.append(model(input_ids=ids[:, 9:], cache=cache, use_cache=True).logits)
        assert_relatively_close(tiled.logits, dense.logits, FLOAT64_BOUND)
        assert_relatively_close(tiled(input_ids=ids).logits, dense(input_ids=ids).logits, FLOAT64_BOUND)


def test_a_layer_it_cannot_tile_is_refused_in_one_line_by_the_decision_and_at_load():
    """AltUp carries a stack of hidden states per token: the decision refuses it before any data, and
    ``tile_layers`` with the same reason. Linear-attention layers tile, their token mixer run whole."""
    from conftest import DEMO

    from longalign.config import load_config
    from longalign.run import check_family

    config = tiny_config("gemma3n_text")
    reason = families.decide(config).layer_tiling
    assert reason is not None and "stack of hidden states per token (AltUp)" in reason
    run = load_config(DEMO, ["training.sequence_tiling=layer"])
    with pytest.raises(
        longalign.patch.UnsupportedModelError,
        match="sequence_tiling = 'layer' cannot tile Gemma3nForCausalLM",
    ):
        check_family(run, config)  # the dry run's and the training run's check, before any data
    assert check_family(run, tiny_config("llama")).layer_tiling is None
    assert check_family(run, tiny_config("qwen3_next")).layer_tiling is None
    with pytest.raises(
        ModelError, match="longalign cannot tile Gemma3nTextDecoderLayer: its layers carry"
    ) as err:
        longalign.patch.tile_layers(build_family(config))
    assert reason in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ModelError, match="training.sequence_tiling: Linear has no decoder layers"):
        longalign.patch.tile_layers(torch.nn.Linear(2, 2))


def test_a_mixture_of_experts_records_its_router_logits_once_per_layer_in_token_order():
    """Qwen3-MoE with its router loss: each layer's router logits, joined over the tiles, are the untiled
    ones (once per layer, not once per tile or recompute), and the loss's gradients through them too."""
    config = Qwen3MoeConfig(
        **{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    torch.manual_seed(0)
    dense = longalign.patch.apply(build_family(config), backend="sdpa_segments")
    tiled = longalign.patch.tile_layers(copy.deepcopy(dense), tile_tokens=TILE_TOKENS)
    logits = []
    for model in (dense, tiled):
        out = model(input_ids=IDS, position_ids=POSITIONS, labels=IDS)
        trained = [param for param in model.parameters() if param.requires_grad]
        logits.append([*out.router_logits, out.aux_loss, *torch.autograd.grad(out.loss, trained)])
    assert len(logits[1]) == len(logits[0]) and logits[0][0].shape == (IDS.numel(), 4)
    assert_relatively_close(logits[1], logits[0], FLOAT64_BOUND)


def test_parameters_that_zero3_partitions_inside_the_layer_are_a_one_line_error():
    """A layer tiled after DeepSpeed started is not a leaf: its modules would gather one by one."""
    model = tiled_model("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight
    weight.data = torch.empty(0, dtype=torch.float64)  # how ZeRO-3 holds a partitioned weight
    weight.ds_numel = 32 * 32
    with pytest.raises(
        ModelError, match="LlamaDecoderLayer's parameters are partitioned by ZeRO-3 inside it"
    ):
        model(input_ids=IDS)


# --- one optimizer step of the trainer ------------------------------------------------------------------

# Llama in the fast tier, GLM-4 and Qwen3 in the slow one; the untiled references are shared with
# test_tiled_mlp.py and test_offload.py (``reference_step``).
STEPS = [
    pytest.param(variant, marks=[pytest.mark.integration] if not variant.startswith("llama") else [])
    for variant in (
        "llama",
        "llama+checkpointing+offload+adapters",
        "glm4+checkpointing+adapters",
        "qwen3+checkpointing+adapters",
    )
]


@pytest.mark.parametrize("variant", STEPS)
def test_a_step_with_tiled_layers_is_the_step_without(variant):
    tiled, dense = one_step(variant + "+layer"), reference_step(variant.replace("+offload", ""))
    assert relative_error(tiled["update"], dense["update"]) < FLOAT64_BOUND
    assert tiled["loss"] == pytest.approx(dense["loss"], rel=1e-12)
    assert max(tiled["mlp_tokens"][0]) <= TILE_TOKENS  # the MLP ran in tiles of the layer
    if "adapters" in variant:
        assert any("self_attn.q_proj.lora_A" in name for name in tiled["update"])  # adapters trained


class _Sums(torch.nn.Module):
    """Three products: one only a residual sum follows, one a norm reads, and optionally a choice made on
    the residual sum's values (which keeps no tensor that needs a gradient)."""

    def __init__(self, choose: bool) -> None:
        super().__init__()
        self.free, self.normed, self.choose = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), choose

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summed = x + self.free(x)
        out = summed + torch.nn.functional.rms_norm(self.normed(x), (4,))
        return out + torch.where(summed > 0, x, 0.0) if self.choose else out


@pytest.mark.parametrize("choose", [False, True], ids=["sums", "a choice on the values"])
def test_a_product_is_valueless_only_where_backward_reads_none_of_its_output(choose):
    """The residual sum's product computes nothing, the normed one runs; when a choice is made on the sum's
    values, the graph shows nothing but the check (the same gradients with the product's output zeros) does,
    and every product runs. Where taken, the gradients are the module's own."""
    torch.manual_seed(0)
    block = _Sums(choose).double()
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    inputs = [x, *block.parameters()]

    def run():
        return [block(x)], inputs

    taken = tiled_layer._valueless_linears(block, run)
    assert taken == (frozenset() if choose else frozenset({"free"}))
    grad = torch.randn(2, 3, 4, dtype=torch.float64)
    want = torch.autograd.grad(block(x), inputs, grad)
    with tiled_layer._valueless(block, taken):
        got = torch.autograd.grad(block(x), inputs, grad)
    assert_relatively_close(list(got), list(want), FLOAT64_BOUND)
