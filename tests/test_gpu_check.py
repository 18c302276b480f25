"""benchmarks/gpu_check.py on a machine without a GPU: a one-line stop, and its long-context ladder's code
run on CPU at a tiny size (the GPU check itself needs CUDA)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import ROOT, TINY, run_process

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_without_cuda_the_check_stops_in_one_line_before_building_anything():
    result = run_process([sys.executable, str(SCRIPT)], timeout=300)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gpu_check: no CUDA device, nothing to check here")
    assert result.stdout == ""


def test_the_long_context_ladder_trains_each_length_with_the_run_s_trainer(capsys):
    check = gpu_check()
    shape = {**check.LLAMA_31_8B_LAYERS, **TINY, "vocab_size": 4096, "model_type": "llama"}
    shape.update(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096)
    rows = check.long_context_ladder(
        [1024, 2048], shape, [*check.LONG_CONTEXT, "model.attn_backend='sdpa_segments'"]
    )
    assert [row["tokens"] for row in rows] == [1024, 2048]
    assert all(row["step_seconds"] > 0 and row["peak_bytes"] > 0 for row in rows)
    assert rows[0]["growth_bytes_per_token"] is None and isinstance(rows[1]["growth_bytes_per_token"], float)
    printed = capsys.readouterr().out
    assert "tiled_mlp=true, offload_activations=true" in printed
    assert printed.splitlines()[-1].split()[0] == "2,048"
