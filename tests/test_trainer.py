"""LongAlignTrainer: packing-independent evaluation (the step invariance lives in test_invariance.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_model
from invariance_run import packs
from transformers import TrainingArguments

from longalign.trainer import LongAlignTrainer


@pytest.mark.parametrize("weighting", ["sequence_level", "token_level"])
def test_eval_loss_does_not_depend_on_packing(weighting, tmp_path):
    losses = []
    args = TrainingArguments(
        output_dir=tmp_path, use_cpu=True, report_to="none", per_device_eval_batch_size=2
    )
    for per_pack in (1, 3, 8):
        trainer = LongAlignTrainer(
            model=tiny_model(backend="sdpa_segments").double(),  # float64: packing changes rounding only
            args=args,
            weighting=weighting,
            eval_dataset=packs(per_pack),
        )
        metrics = trainer.evaluate()
        assert metrics["eval_samples"] == 8
        losses.append(metrics["eval_loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-10) == pytest.approx(losses[2], rel=1e-10)
    assert np.isfinite(losses[0]) and losses[0] > 0
