"""FLOPs of the simulated step (``longalign.flops``, counted in ``longalign.simulate``): the attention count
against the pairs counted one by one, the matrix products against torch's counter on a real CPU step, and
the time and GPU-hours arithmetic."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from conftest import DEMO

from longalign.attention import varlen_attention
from longalign.config import load_config
from longalign.flops import (
    GPU_PEAK_FLOPS,
    StepFlops,
    Throughput,
    causal_pairs,
    format_amount,
    run_gpu_hours,
    run_tokens,
)
from longalign.simulate import (
    Counted,
    Setup,
    _batch,
    _pack,
    _Values,
    build_model,
    kernel_stand_in,
    packed_run_tokens,
    simulate_lengths,
    timed,
)

CHECKPOINTING = ["training.activation_checkpointing=true"]


def pairs_one_by_one(seq_lens: list[int], window: int | None) -> int:
    """(query, key) pairs within a sample with key <= query, and query - key < window."""
    return sum(
        1
        for n in seq_lens
        for query in range(n)
        for key in range(query + 1)
        if window is None or query - key < window
    )


@pytest.mark.parametrize("window", [None, 1, 3, 6])
def test_the_kernel_stand_in_counts_the_causal_pairs_of_each_sample(window):
    """3 samples [5, 7, 1], 4 query heads over 2 key/value heads of size 8: forward 2 x pairs x 4 x (8 + 8),
    backward 2.5 forwards, the pairs counted one by one."""
    seq_lens = [5, 7, 1]
    pairs = pairs_one_by_one(seq_lens, window)
    assert causal_pairs(seq_lens, window) == pairs
    cu_seqlens = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    values = _Values(fake_mode=None)
    values.values[cu_seqlens] = cu_seqlens
    q = torch.zeros(13, 4, 8, requires_grad=True)
    k, v = torch.zeros(13, 2, 8, requires_grad=True), torch.zeros(13, 2, 8, requires_grad=True)
    flops = StepFlops()
    with kernel_stand_in("flash_attn_2", values, flops):
        out = varlen_attention(q, k, v, cu_seqlens, 7, window=window)
        assert flops.totals()["attention"] == 2 * pairs * 4 * 16
        out.sum().backward()
    assert flops.totals() == {"matmul": 0, "attention": 2 * pairs * 4 * 16 * 7 // 2}


def test_the_simulated_matmuls_are_those_torch_counts_on_a_real_step():
    """The demo model (2 layers, checkpointing) on a 256-token pack: the matrix products the fake step
    executes (FlashAttention 2 stood in) equal torch's FlopCounterMode on the real CPU step (sdpa_segments,
    whose CPU kernel torch does not count), to the FLOP; within 5% of 6 x parameters x tokens plus the
    layers' recomputed forward (2 x their parameters x tokens), which it is under by what torch does not
    recompute: it stops at the last tensor backward needs, before each MLP's down projection."""
    from longalign.loss import weighted_loss_sum

    cfg = load_config(DEMO, CHECKPOINTING)
    (row,) = simulate_lengths(cfg, [256], Setup(kernel="flash_attn_2"))
    model, read_head, _ = build_model(cfg, layers=None, fake_mode=contextlib.nullcontext())
    batch = _batch(cfg, _pack(256, model.config.vocab_size, None, Setup()))
    real = StepFlops()
    with real:
        model.train()
        total = weighted_loss_sum(model, batch, chunk_size=cfg.loss.chunk_size, read_head=read_head)
        (total / float(batch["loss_denominator"])).backward()
    assert row["executed_matmul_flops"] == real.totals()["matmul"]
    parameters = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert row["executed_matmul_flops"] == pytest.approx(6 * parameters * 256 + 2 * layers * 256, rel=0.05)


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


def test_a_mixture_of_experts_grouped_products_are_counted():
    """transformers runs the experts as grouped products (``torch._grouped_mm``), which torch's counter
    does not count: counted here, each of the 128 tokens through its 2 experts' gate/up (64 -> 2 x 32) and
    down (32 -> 64) projections, forward and backward (3 x 2 FLOPs a multiply-add), in 2 layers."""
    from torch.utils.flop_counter import FlopCounterMode

    model, tokens = tiny_moe(), torch.randint(0, 64, (1, 128))
    with FlopCounterMode(display=False) as dense_only:
        model(tokens).logits.sum().backward()
    with StepFlops() as flops:
        model(tokens).logits.sum().backward()
    experts = 2 * 3 * 2 * 128 * 2 * (64 * 64 + 32 * 64)
    assert flops.totals()["matmul"] == dense_only.get_total_flops() + experts


def test_the_model_flops_of_a_mixture_of_experts_count_the_routed_experts_only():
    """6 x parameters x tokens counts the experts a token is routed to (2 of 8), the router and the rest
    whole, and not the input embedding; a model of 1 built layer scaled to 2 counts as the 2-layer one."""
    from longalign.simulate import _multiplied_parameters

    model = tiny_moe()
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    embedding = model.get_input_embeddings().weight.numel()
    active = total - embedding - experts * 6 // 8
    assert _multiplied_parameters(model, {"parameters": total}, 2, 2) == active
    one_layer = sum(p.numel() for p in model.model.layers[-1].parameters())
    del model.model.layers[-1]
    assert _multiplied_parameters(model, {"parameters": total}, 1, 2) == active
    assert total - one_layer == sum(p.numel() for p in model.parameters())


def test_step_time_tokens_per_second_and_gpu_hours():
    """2 PFLOP executed on an H100 at half its 989.4 TFLOP/s: 4.043 s; 65,536 tokens a step per GPU; a run of
    1B tokens over 2 epochs, at that rate, 2e9 / (65,536 / 4.04 s) / 3600 GPU-hours."""
    counted = Counted(
        peak=0, peak_parts={}, part_peaks={}, host=0, flops={"matmul": 1.5e15, "attention": 0.5e15}
    )
    throughput = Throughput("h100", 0.5)
    tokens = run_tokens({"num_train_epochs": 2}, epoch_tokens=10**9, epoch_packs=None, pack_tokens=1, data_parallel=1,
                        source="--tokens")  # fmt: skip
    row = timed(
        counted, model_flops=1.6e15, tokens=65536, setup=Setup(throughput=throughput, run_tokens=tokens)
    )
    seconds = 2e15 / (GPU_PEAK_FLOPS["h100"] * 0.5)
    assert row["step_seconds"] == pytest.approx(seconds) == pytest.approx(4.0429, abs=1e-4)
    assert row["executed_per_model"] == pytest.approx(1.25)
    assert row["tokens_per_second_per_gpu"] == pytest.approx(65536 / seconds)
    assert row["gpu_hours"] == pytest.approx(2e9 / (65536 / seconds) / 3600)
    assert run_gpu_hours(3600.0, 1.0) == 1.0
    # max_steps: 10 steps x 2 packs a micro-batch x 4 accumulated x 8 data-parallel groups of mean 500 tokens
    args = {"max_steps": 10, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    steps = run_tokens(args, epoch_tokens=1000, epoch_packs=2, pack_tokens=1, data_parallel=8, source="s")
    assert steps.tokens == 10 * 2 * 4 * 8 * 500
    with pytest.raises(ValueError, match="--gpu v100: no peak known"):
        Throughput("v100", 0.4)
    with pytest.raises(ValueError, match="--efficiency 1.5"):
        Throughput("h200", 1.5)


def test_the_run_tokens_come_from_the_packed_datas_report(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"tokens": 12000, "packs": 4}))
    cfg = load_config(DEMO, [f"data.train_file='{tmp_path}'", "training.num_train_epochs=3"])
    tokens = packed_run_tokens(cfg, epoch_tokens=None, gpus=1)
    assert tokens.tokens == 36000 and tokens.source == f"{tmp_path / 'report.json'} x 3 epochs"
    assert packed_run_tokens(cfg, epoch_tokens=500, gpus=1).tokens == 1500
    raw = load_config(DEMO, [f"data.train_file='{tmp_path / 'chats.jsonl'}'"])
    assert packed_run_tokens(raw, epoch_tokens=None, gpus=1) is None


def test_the_cli_prints_the_step_time_and_the_runs_gpu_hours(tmp_path, capsys):
    from longalign.cli import main

    output = tmp_path / "simulated.json"
    argv = ["probe", "--simulate", "--config", str(DEMO), "--lengths", "512", "--kernel", "flash_attn_2",
            "--gpu", "h200", "--efficiency", "0.5", "--tokens", "1000000", "--output", str(output), *CHECKPOINTING]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    (row,) = json.loads(output.read_text())["simulated"]
    epochs = load_config(DEMO, []).training.args["num_train_epochs"]
    assert row["gpu_hours"] == pytest.approx(epochs * 1e6 / row["tokens_per_second_per_gpu"] / 3600)
    assert "512: one H200 at 50% of 989 TFLOP/s: " in printed
    assert f"{format_amount(row['step_seconds'])} s a step" in printed
    assert f"(--tokens x {epochs:g} epochs): {format_amount(row['gpu_hours'])} GPU-hours" in printed
