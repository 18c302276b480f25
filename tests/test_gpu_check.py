"""benchmarks/gpu_check.py on a machine without a GPU: a one-line stop, and its steps run on CPU at a tiny size
(the training step through the GPU backends' Python layers over the kernel stand-ins, QLoRA's step, the
long-context ladder and its prediction, the reports); the GPU check itself needs CUDA."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import ROOT, TINY
from kernel_standins import SourcesUnavailable, kernels_on_cpu

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_the_check_stops_in_one_line_before_building_anything(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])  # as `python benchmarks/gpu_check.py` runs it
    assert gpu_check().main() == 2
    printed = capsys.readouterr()
    assert printed.err.strip().startswith("gpu_check: no CUDA device, nothing to check here")
    assert len(printed.err.strip().splitlines()) == 1 and printed.out == ""


def test_the_long_context_ladder_trains_each_length_with_the_run_s_trainer(capsys):
    check = gpu_check()
    shape = {**check.LLAMA_31_8B_LAYERS, **TINY, "vocab_size": 4096, "model_type": "llama"}
    shape.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096)
    rows = check.long_context_ladder(
        [1024, 2048], shape, [*check.long_context("layer"), "model.attn_backend='sdpa_segments'"]
    )
    assert [row["tokens"] for row in rows] == [1024, 2048]
    assert all(row["step_seconds"] > 0 and row["peak_bytes"] > 0 for row in rows)
    assert rows[0]["growth_bytes_per_token"] is None and isinstance(rows[1]["growth_bytes_per_token"], float)
    assert rows[1]["predicted_peak_bytes"] is None  # two rungs below are needed
    for row in rows:  # on CPU the step's tensors are counted: the simulation counts the same step
        assert row["simulated_peak_bytes"] == pytest.approx(row["tensor_peak_bytes"], rel=0.02)
    printed = capsys.readouterr().out
    assert "sequence_tiling=layer, offload_activations=true" in printed
    assert printed.splitlines()[-1].split()[0] == "2,048"


def tiny_shape(check) -> dict:
    shape = {**check.LLAMA_31_8B_LAYERS, **TINY, "vocab_size": 4096, "model_type": "llama"}
    shape.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=16384)
    return shape


def test_the_training_step_qlora_and_the_reports_run_at_a_tiny_size(tmp_path):
    check = gpu_check()
    shape, cpu = tiny_shape(check), torch.device("cpu")
    try:
        with kernels_on_cpu("flash_attn", "torch_varlen"):
            ok, steps = check.model_step_agreement(cpu, ["flash_attn", "torch_varlen"], shape, tokens=512)
    except SourcesUnavailable as error:
        pytest.skip(f"flash-attn's Python layer is not available here: {error}")
    assert ok and [row["backend"] for row in steps] == ["flash_attn", "torch_varlen"]
    assert all(0 < row["error"] <= check.STEP_BOUND for row in steps)  # bf16 kernels round apart, a little
    qlora = check.qlora_step(shape, ["model.attn_backend='sdpa_segments'"], length=512)
    assert "error" not in qlora and qlora["step_seconds"] > 0 and qlora["peak_bytes"] > 0
    report = {"device": "cpu", "torch": torch.__version__, "verdict": "all backends agree"}
    report["sections"] = {"training step against sdpa_segments": steps, "QLoRA step": qlora, "throughput": []}
    json_path, markdown_path = check.write_report(report, tmp_path / "report")
    assert json.loads(json_path.read_text())["sections"]["QLoRA step"]["tokens"] == 512
    markdown = markdown_path.read_text()
    assert "## training step against sdpa_segments" in markdown and "| flash_attn | " in markdown
    assert "## throughput\n\n(nothing ran)" in markdown


def test_the_ladder_predicts_each_peak_as_the_probe_s_plan_does():
    """A line through the two rungs below: 5000 B at 1000 tokens, 7000 B at 2000 -> 11000 B at 4000."""
    check = gpu_check()
    rows = [{"tokens": 1000, "peak_bytes": 5000}, {"tokens": 2000, "peak_bytes": 7000}]
    assert check.predicted_peak(rows, 4000) == 11000
    assert check.predicted_peak(rows[:1], 4000) is None
