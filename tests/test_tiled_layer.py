"""The sequence-tiled decoder layer: exact for every family, token-wise tensors one tile at a time.

The fast tests check each family's tiled model against the untiled one in float64 (output and every
gradient, packed samples; with checkpointing, offloaded inputs and LoRA adapters spread over them), that the projections run tile by tile in forward and in backward's recompute,
what a tiled layer keeps for backward, LoRA dropout drawn again identically in the recompute, generation
with a KV cache, and the refusals; then one optimizer step of the real trainer with the layers tiled against
the same step without (Llama; GLM-4 and Qwen3 in the slow tier). The
multi-rank cases (each pack split over 2 ranks; ZeRO-3 with uneven tile counts; flash-attn under sequence
parallelism 2) share the launches of ``test_tiled_mlp.py`` and ``test_attention_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FLOAT64_BOUND, TINY, assert_relatively_close, relative_error, tiny_model
from tiled_mlp_run import TILE_TOKENS, first_mlp, one_step, parse, reference_step
from tiled_mlp_run import model as build
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

import longalign.patch
from longalign.errors import ModelError
from longalign.patch import tiled_layer
from longalign.patch.tiled_mlp import _bounds, tile_count

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
    seen: list[int] = []
    attention = next(m for name, m in tiled.named_modules() if name.endswith("layers.0.self_attn"))
    for module in (attention.q_proj, attention.o_proj, first_mlp(tiled)):
        module.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-2]))

    want, got = loss_and_gradients(dense), loss_and_gradients(tiled)

    assert_relatively_close(got[0], want[0], FLOAT64_BOUND)
    assert_relatively_close(got[1:], want[1:], FLOAT64_BOUND)
    tiles = tile_count(IDS.numel(), TINY["hidden_size"], TILE_TOKENS)
    # forward, (checkpointing's recompute,) backward's recompute; o_proj once more, rebuilding the MLP's input
    runs = 3 if "checkpointing" in switches else 2
    assert len(seen) == (3 * runs + 1) * tiles and max(seen) <= TILE_TOKENS


def test_the_kernel_runs_once_per_key_value_head_and_every_norm_in_tiles(monkeypatch):
    """The attention kernel gets one key/value head and its query heads per call (2 and 1 of TINY's 4 and 2):
    each group's forward runs once, and backward calls the kernel's backward on what that forward kept (its
    output and log-sum-exp), running no forward again; every norm, the final one's included, sees one tile.
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
    # Forward: each layer's groups once; backward: each group's kernel backward, last layer first.
    assert calls == [("forward", 2, 1, 1)] * (groups * layers) + [("backward", 2, 1, 1)] * (groups * layers)
    assert norm_tokens and max(norm_tokens) <= TILE_TOKENS


def test_a_tiled_layer_keeps_for_backward_only_whole_tensors_of_the_residual_and_attention():
    """Untiled, backward needs the norms' outputs and the MLP's ``[tokens, intermediate]`` tensors; tiled, the
    layer keeps its input, RoPE's angles and what attention keeps (q, k, v, its output)."""
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
    assert len(residual_sized(tiled)) == 2 < len(residual_sized(dense))  # the input and attention's output


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

    # The reference: the same tiles in the same order, kept for autograd's own backward.
    def run_kept(tiles, step, inputs, modules, *, residual=False):
        stepped, parts = inputs[1:] if residual else inputs, []
        for a, b in _bounds(inputs[0].shape[1], tiles.count):
            parts.append(list(step(*(x[:, a:b] for x in stepped))))
            if residual:
                parts[-1][0] = inputs[0][:, a:b] + parts[-1][0]
        return tuple(torch.cat(outputs, dim=1) for outputs in zip(*parts, strict=True))

    def run_rebuilt_kept(tiles, step, h, rebuild, sources, modules):
        return torch.cat([step(h[:, a:b])[0] for a, b in _bounds(h.shape[1], tiles.count)], dim=1)

    monkeypatch.setattr(tiled_layer._Tiles, "run", run_kept)
    monkeypatch.setattr(tiled_layer._Tiles, "run_rebuilt", run_rebuilt_kept)
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


def test_a_layer_it_cannot_tile_is_refused_naming_its_class():
    config = Qwen3MoeConfig(
        **{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    )
    with pytest.raises(ModelError, match="longalign cannot tile Qwen3MoeDecoderLayer; it tiles the decoder"):
        longalign.patch.tile_layers(Qwen3MoeForCausalLM(config))
    with pytest.raises(ModelError, match="training.sequence_tiling: Linear has no decoder layers"):
        longalign.patch.tile_layers(torch.nn.Linear(2, 2))


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
