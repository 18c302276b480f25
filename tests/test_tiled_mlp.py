"""The sequence-tiled MLP: exact, one tile of ``[tile, intermediate]`` tensors at a time, on every engine.

The fast tests check each family's MLP tile by tile against the dense one in float64 (outputs and every
gradient), a mixture of experts with its router logits (recorded once, in token order, and trained through
the tiles), what the tiled MLP keeps for backward, LoRA dropout redrawn identically when backward
recomputes the tiles, and the refusals (every family of transformers is tiled in ``test_families.py``); then one optimizer step of the real trainer with the MLPs tiled
against the same step without (Llama, GLM-4 and Qwen3; activation checkpointing on and off; full
fine-tuning and LoRA). The launched ones run the same comparison with each pack split over 2 ranks
(DDP, sequence parallelism 2) and under ZeRO-3 with one rank holding about a quarter of the other's
tokens, and so fewer tiles (``tiled_mlp_run.py``); a case of tiled decoder layers rides along in each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import (
    FLOAT32_BOUND,
    FLOAT64_BOUND,
    TINY,
    assert_relatively_close,
    launch,
    needs_deepspeed,
    needs_launcher,
    relative_error,
    tiny_model,
)
from sequence_parallel_run import outcome
from tiled_mlp_run import TILE_TOKENS, one_step, reference_step
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import longalign.patch
from longalign.errors import ModelError
from longalign.patch.tiled_mlp import tile_count, tiled_forward

HERE = Path(__file__).resolve().parent
TILEABLE = ["llama", "glm", "glm4", "mistral", "qwen2", "qwen3"]


def mlp_of(kind: str) -> torch.nn.Module:
    """The first layer's MLP of the family's tiny model, in float64."""
    return tiny_model(kind).double().model.layers[0].mlp


def projections(mlp: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in mlp.children() if isinstance(module, torch.nn.Linear)]


def test_a_tile_holds_about_hidden_size_tokens_by_default():
    assert tile_count(65536, 4096) == 16  # Llama-3-8B, 64k tokens: 16 tiles of 4096 tokens
    assert tile_count(65537, 4096) == 17
    assert tile_count(4096, 4096) == 1 and tile_count(1, 4096) == 1  # short packs are not split
    assert tile_count(65536, 4096, tile_tokens=1024) == 64


@pytest.mark.parametrize("kind", TILEABLE)
def test_every_family_s_mlp_gives_the_dense_output_and_gradients(kind):
    mlp, tokens = mlp_of(kind), 37
    x = torch.randn(1, tokens, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn_like(x)
    seen: list[int] = []
    for module in projections(mlp):  # every call of a projection, in forward and in backward's recompute
        module.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-2]))

    dense = mlp(x)
    want = torch.autograd.grad(dense, [x, *mlp.parameters()], grad_out)
    seen.clear()
    tiled = tiled_forward(mlp, x, tile_tokens=TILE_TOKENS)
    got = torch.autograd.grad(tiled, [x, *mlp.parameters()], grad_out)

    assert_relatively_close(tiled, dense, FLOAT64_BOUND)
    assert_relatively_close(list(got), list(want), FLOAT64_BOUND)
    calls = len(projections(mlp)) * tile_count(tokens, TINY["hidden_size"], TILE_TOKENS)
    assert len(seen) == 2 * calls and max(seen) <= TILE_TOKENS  # forward, then the recompute: tile by tile


def test_the_tiled_mlp_keeps_only_its_input_for_backward():
    """Untiled, backward needs gate, up and their product, ``[tokens, intermediate]`` each; tiled, only x."""
    mlp, x = mlp_of("llama"), torch.randn(1, 40, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)

    def saved_shapes(run) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run()
        return shapes

    intermediate = TINY["intermediate_size"]
    assert (1, 40, intermediate) in saved_shapes(lambda: mlp(x))
    assert saved_shapes(lambda: tiled_forward(mlp, x, tile_tokens=TILE_TOKENS)) == [
        (1, 40, TINY["hidden_size"])
    ]


def test_adapter_dropout_draws_the_forward_s_masks_again_in_backward():
    """LoRA dropout on the MLP's projections: the recompute must see the masks the forward drew."""
    from longalign.config import LoraConfig
    from longalign.lora import add_adapters

    settings = LoraConfig(r=4, alpha=8.0, dropout=0.5, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = add_adapters(tiny_model("llama", backend="sdpa_segments").double(), settings, base_model="tiny")
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    trained = [param for param in mlp.parameters() if param.requires_grad]
    x = torch.randn(1, 30, TINY["hidden_size"], dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn_like(x)

    torch.manual_seed(5)  # the reference: the same tiles in the same order, with autograd's own backward
    tiles = [mlp(tile) for tile in x.tensor_split(tile_count(30, TINY["hidden_size"], TILE_TOKENS), dim=1)]
    want = torch.autograd.grad(torch.cat(tiles, dim=1), [x, *trained], grad_out)
    torch.manual_seed(5)
    tiled = tiled_forward(mlp, x, tile_tokens=TILE_TOKENS)
    after_forward = torch.get_rng_state()
    got = torch.autograd.grad(tiled, [x, *trained], grad_out)

    assert_relatively_close(tiled, torch.cat(tiles, dim=1), FLOAT64_BOUND)
    assert_relatively_close(list(got), list(want), FLOAT64_BOUND)
    assert torch.equal(
        torch.get_rng_state(), after_forward
    )  # the recompute leaves the random stream as it was


def moe_model() -> torch.nn.Module:
    """A tiny Qwen3-MoE in float64 (4 experts, top 2) whose experts run eagerly (no float64 grouped_mm on CPU)."""
    config = Qwen3MoeConfig(
        **{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).double().train()
    model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_a_mixture_of_experts_tiles_with_its_router_logits_once_in_order_and_trained(checkpointing):
    """Qwen3-MoE: each layer's router logits reach ``outputs.router_logits`` once, the tiles' in token
    order (not again from backward's recompute, nor from activation checkpointing's), and the gradient of a
    loss on them reaches the router through the tiles."""
    dense = moe_model()
    tiled = longalign.patch.tile_mlp(moe_model(), tile_tokens=TILE_TOKENS)
    calls: list[int] = []
    tiled.model.layers[0].mlp.gate.register_forward_pre_hook(
        lambda module, args: calls.append(args[0].shape[0])
    )
    ids = torch.randint(0, TINY["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(1))

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor]]:
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        out = model(input_ids=ids, use_cache=False, output_router_logits=True)
        weights = torch.Generator().manual_seed(2)
        loss = out.logits.square().mean() + sum(
            (logits * torch.randn(logits.shape, generator=weights, dtype=torch.float64)).sum()
            for logits in out.router_logits
        )
        loss.backward()
        return out.logits, out.router_logits, [param.grad for param in model.parameters()]

    (want_logits, want_routers, want_grads), (got_logits, got_routers, got_grads) = step(dense), step(tiled)
    assert len(got_routers) == len(want_routers) == TINY["num_hidden_layers"]
    assert [tuple(logits.shape) for logits in got_routers] == [(38, 4)] * TINY["num_hidden_layers"]
    assert_relatively_close([got_logits, *got_routers], [want_logits, *want_routers], FLOAT64_BOUND)
    assert_relatively_close(got_grads, want_grads, FLOAT64_BOUND)
    assert tiled.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    tiles = tile_count(38, TINY["hidden_size"], TILE_TOKENS)
    runs = 3 if checkpointing else 2  # forward, backward's recompute, and checkpointing's
    assert len(calls) == runs * tiles and max(calls) <= TILE_TOKENS


def test_a_decoder_layer_without_a_token_wise_mlp_is_refused_naming_it():
    """An MLP whose forward takes more than the hidden states (here the positions) is not token-wise."""

    class PositionalMLP(torch.nn.Module):
        def __init__(self, mlp: torch.nn.Module):
            super().__init__()
            self.inner = mlp

        def forward(self, hidden_states, position_ids):
            return self.inner(hidden_states)

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp = PositionalMLP(layer.mlp)
    with pytest.raises(ModelError, match="LlamaForCausalLM: its LlamaDecoderLayer has no token-wise MLP"):
        longalign.patch.tile_mlp(model)
    with pytest.raises(ModelError, match="Linear: it has no decoder layers"):
        longalign.patch.tile_mlp(torch.nn.Linear(2, 2))


def test_sequence_tiling_mlp_is_refused_before_any_data_for_a_family_without_one():
    from tiny_configs import tiny_config

    from longalign.config import load_config
    from longalign.run import check_family

    cfg = load_config(None, ["model.model_name_or_path=m", "training.sequence_tiling=mlp"])
    with pytest.raises(longalign.patch.UnsupportedModelError) as refused:
        check_family(cfg, tiny_config("moshi"))
    message = str(refused.value)
    assert "\n" not in message and "MoshiDecoderLayer has no token-wise MLP" in message
    assert check_family(load_config(None, ["model.model_name_or_path=m"]), tiny_config("moshi")).exact


def test_parameters_that_zero3_partitions_inside_the_mlp_are_a_one_line_error():
    """An MLP tiled after DeepSpeed started is not a leaf: its projections would gather one by one."""
    mlp = mlp_of("llama")
    mlp.gate_proj.weight.data = torch.empty(0, dtype=torch.float64)  # how ZeRO-3 holds a partitioned weight
    mlp.gate_proj.weight.ds_numel = TINY["intermediate_size"] * TINY["hidden_size"]
    x = torch.randn(1, 4, TINY["hidden_size"], dtype=torch.float64)
    with pytest.raises(ModelError, match="LlamaMLP's parameters are partitioned by ZeRO-3 inside it"):
        tiled_forward(mlp, x)


# --- one optimizer step of the trainer ------------------------------------------------------------------

# Llama in the fast tier; GLM-4 (fused gate_up_proj) and Qwen3 in the slow one (their MLPs are checked
# tile by tile above in the fast tier too).
STEPS = [
    pytest.param(f"{family}{switches}", marks=[pytest.mark.integration] if family != "llama" else [])
    for family in ("llama", "glm4", "qwen3")
    for switches in ("", "+checkpointing", "+adapters", "+checkpointing+adapters")
]


@pytest.mark.parametrize("variant", STEPS)
def test_a_step_with_tiled_mlps_is_the_step_without(variant):
    tiled, dense = one_step(variant + "+tiled"), reference_step(variant)
    assert relative_error(tiled["update"], dense["update"]) < FLOAT64_BOUND
    assert tiled["loss"] == pytest.approx(dense["loss"], rel=1e-12)
    assert max(tiled["mlp_tokens"][0]) > TILE_TOKENS  # the MLP did run in several tiles
    if "adapters" in variant:
        assert any("mlp.down_proj.lora_A" in name for name in tiled["update"])  # adapters on the MLP trained


# Every two-rank case in one launch: DDP with each pack split over both ranks (sequence parallelism 2), each
# rank tiling its half; then ZeRO-3 with one pack per rank, 51 tokens (7 tiles) on one and 14 (2) on the other.
# The tiled decoder layer (tests/test_tiled_layer.py) rides along: one case of each.
SPLIT = [
    "llama+split",
    "llama+tiled+split",
    "llama+tiled+checkpointing+adapters+split",
    "llama+layer+checkpointing+adapters+split",
]
UNEVEN = [
    "llama+uneven",
    "llama+tiled+uneven",
    "llama+tiled+checkpointing+adapters+uneven",
    "llama+layer+checkpointing+adapters+uneven",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """``tiled_mlp_run.py`` on 2 CPU ranks, launched once: the results of every case, by ``ENGINE/VARIANT``."""
    out = tmp_path_factory.mktemp("tiled") / "results.pt"
    cases = [*(f"ddp/{variant}" for variant in SPLIT), *(f"zero3/{variant}" for variant in UNEVEN)]
    result = launch(HERE / "tiled_mlp_run.py", str(out), *cases, env={"PYTHONPATH": str(HERE)}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def whole(variant: str) -> str:
    """The one-process reference of a variant: packs whole, MLPs and layers untiled."""
    return variant.replace("+tiled", "").replace("+layer", "").replace("+split", "")


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_split_packs_with_tiled_mlps_give_the_step_of_the_whole_packs(two_ranks):
    """DDP over 2 ranks, each pack split over both (sequence parallelism 2): each rank tiles its half."""
    for variant in SPLIT:
        got, want = outcome(two_ranks, f"ddp/{variant}"), reference_step(whole(variant))
        assert relative_error(got["update"], want["update"]) < FLOAT64_BOUND, variant
        assert got["loss"] == pytest.approx(want["loss"], rel=FLOAT32_BOUND)
    halves = outcome(two_ranks, "ddp/llama+tiled+split")["mlp_tokens"]
    assert halves == [[18, 17], [18, 17]]  # every rank: its half of the packs of 36 and of 34 tokens
    tiles = outcome(two_ranks, "ddp/llama+layer+checkpointing+adapters+split")["mlp_tokens"]
    assert [max(calls) for calls in tiles] == [6, 6]  # tiled layers: 3 tiles of each half


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_zero3_ranks_with_different_tile_counts_do_not_wait_on_each_other(two_ranks):
    """ZeRO-3 on 2 ranks, one pack each: 51 tokens (7 tiles) on one, 14 (2 tiles) on the other."""
    tokens = sorted(calls[0] for calls in outcome(two_ranks, "zero3/llama+tiled+uneven")["mlp_tokens"])
    assert [tile_count(n, TINY["hidden_size"], TILE_TOKENS) for n in tokens] == [2, 7]
    # Tiled layers, checkpointed: each rank's MLP ran its tiles in forward and once in backward's recompute,
    # and on one token at the layer's first call: once to find which of its projections it reads after
    # attention, three times to find and check the products whose outputs no backward reads.
    layer_tiles = outcome(two_ranks, "zero3/llama+layer+checkpointing+adapters+uneven")["mlp_tokens"]
    assert sorted(len(calls) for calls in layer_tiles) == [2 * 2 + 4, 2 * 7 + 4]
    tiled, dense = outcome(two_ranks, "zero3/llama+tiled+uneven"), outcome(two_ranks, "zero3/llama+uneven")
    # ZeRO-3 partitions float32 parameters at most: the tiles' summed weight gradients round as float32 does.
    assert relative_error(tiled["update"], dense["update"]) < FLOAT32_BOUND
    # Against one process without ZeRO, in float64: float32 and ZeRO-3 move the update, tiled or not.
    for variant in UNEVEN:
        want = reference_step(whole(variant))
        assert relative_error(two_ranks[f"zero3/{variant}"]["update"], want["update"]) < FLOAT32_BOUND, (
            variant
        )
