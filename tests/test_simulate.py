"""The simulated step (``longalign probe --simulate``) against real CPU steps counted the same way, and its
pieces: the kernels' stand-ins, the one-line refusals and verdicts."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import DEMO, ROOT, counted_real_steps, needs_deepspeed, run_process

from longalign.config import load_config
from longalign.probe import parse_size
from longalign.run import model_config
from longalign.simulate import (
    Setup,
    SimulationError,
    _first_repeated_layer,
    _kernel_buffers,
    format_simulation,
    kernel_for,
    simulate_lengths,
    simulated_config,
    text_model_note,
)

LENGTHS = [512, 1024, 2048]
CHECKPOINTING = ["training.activation_checkpointing=true"]
VARIANTS = {
    "checkpointing": CHECKPOINTING,
    "tiled MLP": [*CHECKPOINTING, "training.tiled_mlp=true", "training.mlp_tile_tokens=1024"],
    "offloaded inputs": [*CHECKPOINTING, "training.offload_activations=true"],
    "tiled layer": [*CHECKPOINTING, "training.sequence_tiling='layer'", "training.mlp_tile_tokens=1024"],
    "LoRA": [*CHECKPOINTING, "lora.r=8"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_simulated_peak_is_the_counted_peak_of_a_real_step(tmp_path, variant):
    """At three lengths, the fake step's peak within 2% of the real CPU step's counted peak (it is equal)."""
    real, cfg = counted_real_steps(tmp_path, LENGTHS, VARIANTS[variant])
    simulated = {row["length"]: row["peak"] for row in simulate_lengths(cfg, LENGTHS, Setup())}
    for length in LENGTHS:
        assert simulated[length] == pytest.approx(real[length], rel=0.02), (length, simulated, real)


@pytest.mark.integration
@needs_deepspeed
def test_the_simulated_rank_of_a_sequence_parallel_group_is_the_counted_real_rank(tmp_path):
    """Rank 0 of a group of 2 (DeepSpeed's Ulysses all-to-alls, DDP), real and simulated, on a fake group:
    the peak of what the step allocates beyond weights, gradients and optimizer states."""
    overrides = [*VARIANTS["offloaded inputs"], "training.sequence_parallel_size=2"]
    command = [
        sys.executable,
        str(ROOT / "tests" / "simulate_ranks_run.py"),
        str(tmp_path),
        ",".join(map(str, LENGTHS)),
    ]
    result = run_process([*command, *overrides], timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    for length in LENGTHS:
        real, simulated = measured["real"][str(length)], measured["simulated"][str(length)]
        assert simulated == pytest.approx(real, rel=0.02), (length, measured)


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.sequence_tiling='layer'"],
        ["training.sequence_tiling='mlp'", "training.offload_activations=true"],
    ],
    ids=["tiled layer", "tiled MLP, offload"],
)
def test_running_only_the_distinct_tiles_counts_what_running_every_tile_counts(monkeypatch, overrides):
    """7 tiles of 1000 tokens (6 of 143, one of 142), FlashAttention 2's stand-in: every part at the peak, each
    part's own peak and the host memory equal in bytes, and the executed FLOPs (each tile run counted for
    the tiles it stands for) equal, with 3 tiles of each loop run instead of 7."""
    from longalign.patch import tiled_layer, tiled_mlp

    one_layer = "model.init_from_config.num_hidden_layers=1"
    cfg = load_config(DEMO, [*CHECKPOINTING, one_layer, "training.mlp_tile_tokens=150", *overrides])
    ran: list[int] = []  # tiles run per loop
    original = tiled_mlp._tiles

    def tiles(tokens: int, count: int) -> list[tuple[int, int, int]]:
        run = original(tokens, count)
        ran.append(len(run))
        return run

    for module in (tiled_mlp, tiled_layer):
        monkeypatch.setattr(module, "_tiles", tiles)
    counted = {}
    for every_tile in (False, True):
        ran.clear()
        (row,) = simulate_lengths(cfg, [1000], Setup(kernel="flash_attn_2", every_tile=every_tile))
        counted[every_tile] = ({k: v for k, v in row.items() if k != "seconds"}, sum(ran))
    (distinct, ran_distinct), (every, ran_every) = counted[False], counted[True]
    assert distinct == every
    assert distinct["executed_matmul_flops"] > 0 and distinct["executed_attention_flops"] > 0
    assert ran_distinct * 7 == ran_every * 3


# GLM-4.5's shape, small: a dense first layer (first_k_dense_replace), routed and shared experts in the rest,
# their activations larger than the loss's; bf16, as grouped_mm takes it.
GLM45_SHAPED = [
    "model.init_from_config={model_type='glm4_moe', vocab_size=256, hidden_size=64, intermediate_size=64, "
    "moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=4, n_shared_experts=1, "
    "first_k_dense_replace=1, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2}",
    "model.torch_dtype='bfloat16'",
    "loss.chunk_size=256",
]


def test_layers_unlike_the_rest_are_counted_and_the_rest_extrapolated():
    """4 layers of GLM-4.5's shape, the first dense: counted with 2 and 3 layers and extrapolated to 4,
    every part equal to counting all 4 (through the dense layer alone, the line multiplied the difference
    between the two kinds of layer)."""
    cfg = load_config(DEMO, [*CHECKPOINTING, *GLM45_SHAPED])
    assert _first_repeated_layer(model_config(simulated_config(cfg))) == 1
    rows = [simulate_lengths(cfg, [1024], Setup(full_depth=full))[0] for full in (False, True)]
    extrapolated, counted = ({k: v for k, v in row.items() if k != "seconds"} for row in rows)
    assert extrapolated == counted


def test_a_multimodal_model_is_simulated_as_its_text_model():
    """Gemma 3's multimodal config: the step of its text config's gemma3_text model, byte for byte, said
    in one line."""
    text = (
        "{model_type='gemma3_text', vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
        "num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64}"
    )
    vision = (
        "{model_type='siglip_vision_model', hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
        "num_attention_heads=2, image_size=28, patch_size=14}"
    )
    multimodal = load_config(
        DEMO,
        [
            *CHECKPOINTING,
            f"model.init_from_config={{model_type='gemma3', text_config={text}, vision_config={vision}, "
            "mm_tokens_per_image=4}",
        ],
    )
    text_only = load_config(DEMO, [*CHECKPOINTING, f"model.init_from_config={text}"])
    assert text_model_note(multimodal) == (
        "the gemma3 model is simulated as its text model: its text config as a gemma3_text model, what a "
        "text-only fine-tune trains; the weights outside it (a vision tower, its projector) are not counted"
    )
    assert text_model_note(text_only) is None
    rows = [simulate_lengths(cfg, [1024], Setup())[0] for cfg in (multimodal, text_only)]
    simulated, text_model = ({k: v for k, v in row.items() if k != "seconds"} for row in rows)
    assert simulated == text_model


def test_the_kernel_stand_ins_allocate_what_the_kernels_sources_allocate():
    """FA2's mha_varlen_bwd at Llama-3.1-8B's heads (32 query, 8 key/value of 128) for 1000 tokens in 3
    samples: softmax_d, dq_accum (float32, 128 padding rows per sample) and dk/dv expanded to 32 heads."""
    q, k = torch.empty(1000, 32, 128, dtype=torch.bfloat16), torch.empty(1000, 8, 128, dtype=torch.bfloat16)
    sizes = [tuple(t.shape) + (t.dtype,) for t in _kernel_buffers("flash_attn_2", q, k, samples=3)]
    assert sizes == [
        (32, 1384, torch.float32),
        (1384, 32, 128, torch.float32),
        (1000, 32, 128, torch.bfloat16),
        (1000, 32, 128, torch.bfloat16),
    ]
    # FA3 (sm90, causal, head size 128): kBlockM 64, kBlockN 128; dk/dv accumulated per key/value head.
    sizes = [tuple(t.shape) for t in _kernel_buffers("flash_attn_3", q, k, samples=3)]
    assert sizes == [(32, 1216), (32, 1216), (32, 1216 * 128), (8, 1408, 128), (8, 1408, 128)]


def test_what_cannot_be_simulated_is_one_line_naming_it(tmp_path):
    cfg = load_config(DEMO, ["model.attn_backend='flash_attn_cute'"])
    with pytest.raises(SimulationError, match="FlashAttention 4 .* has no stand-in"):
        kernel_for(cfg)
    with pytest.raises(SimulationError, match="--kernel flash_attn_5: no stand-in"):
        kernel_for(cfg, "flash_attn_5")
    assert kernel_for(load_config(DEMO, [])) == "sdpa_segments"  # a CPU run: the kernel it runs
    assert (
        kernel_for(load_config(DEMO, ["training.use_cpu=false", "model.attn_backend='auto'"]))
        == "flash_attn_2"
    )
    run_file = ROOT / "configs" / "llama3_8b_768k_1gpu.toml"
    missing = load_config(run_file, [f"model.model_name_or_path='{tmp_path / 'nowhere'}'"])
    with pytest.raises(SimulationError, match="its config cannot be read here"):
        simulate_lengths(missing, [1024], Setup())


def test_the_verdict_says_by_how_much_in_one_line():
    row = {"length": 1048576, "peak": parse_size("82GiB"), "host_per_node": parse_size("1TiB")}
    setup = Setup(gpu_memory=parse_size("80GiB"), host_memory=parse_size("2TiB"))
    text = format_simulation([{**row, "tokens_per_gpu": 1048576, "weights": 0, "gradients": 0,
                               "optimizer states": 0, "engine": 0, "activations": row["peak"],
                               "activation_bytes_per_token_per_hidden": 20.5}], setup)  # fmt: skip
    assert text.splitlines()[-1] == (
        "1m: peak 82.00 GiB per GPU does not fit 80.00 GiB (2.00 GiB over); host 1.00 TiB per node fits 2.00 TiB "
        "(1.00 TiB left)"
    )


def test_a_model_counted_on_two_layers_executes_the_flops_of_all_its_layers():
    """gpt-oss's layers alternate a sliding window of 64 tokens with full attention: counted on its first two
    layers (window, full) and extrapolated to 6, the step executes the FLOPs of the 6 layers counted one
    by one (the attention of each layer left at its own window, not the last counted layer's)."""
    kinds = ["sliding_attention", "full_attention"] * 3
    model = (
        "model.init_from_config={model_type='gpt_oss', vocab_size=4096, hidden_size=64, intermediate_size=64, "
        "num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, "
        f"num_experts_per_tok=2, sliding_window=64, layer_types={kinds}, bos_token_id=4088, "
        "eos_token_id=4092, pad_token_id=4093}"
    )
    cfg = load_config(DEMO, [*CHECKPOINTING, model, "model.torch_dtype='bfloat16'"])
    rows = {
        full_depth: simulate_lengths(cfg, [1500], Setup(kernel="flash_attn_2", full_depth=full_depth))[0]
        for full_depth in (False, True)
    }
    for key in ("executed_matmul_flops", "executed_attention_flops", "model_flops"):
        assert rows[False][key] == pytest.approx(rows[True][key], rel=1e-6), key
    assert rows[True]["executed_attention_flops"] > 0
