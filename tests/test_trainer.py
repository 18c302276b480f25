"""LongAlignTrainer: packing-independent evaluation, the router loss of one pack (the step invariance lives in
test_invariance.py)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from conftest import FLOAT32_BOUND, assert_relatively_close, pack_row, tiny_model, tiny_moe
from invariance_run import GradientCapture, packs, samples
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


def test_router_loss_of_one_pack_is_the_familys_own_loss(tmp_path):
    """One pack of one sample, token-level, one micro-batch: the step's loss and gradient are the model's own
    ``model(input_ids, labels=...).loss`` (cross-entropy mean + 0.5 x load-balancing loss), and the logs
    carry the router loss apart."""
    ids, labels = samples()[2]  # 17 tokens, 5 of them prompt
    reference = tiny_moe()
    own = reference(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), use_cache=False)
    own.loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters()}

    capture = GradientCapture()
    args = TrainingArguments(
        output_dir=tmp_path,
        max_steps=1,
        logging_steps=1,
        max_grad_norm=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        remove_unused_columns=False,
        disable_tqdm=True,
    )
    trainer = LongAlignTrainer(
        model=tiny_moe(),
        args=args,
        weighting="token_level",
        train_dataset=datasets.Dataset.from_list([pack_row([(ids, labels)])]),
        callbacks=[capture],
    )
    trainer.train()
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    # transformers sums the router statistics in float32 (its load_balancing_loss_func): a float32 bound.
    assert_relatively_close(capture.grads, want, FLOAT32_BOUND)
    assert logged["loss"] == pytest.approx(own.loss.item(), rel=FLOAT32_BOUND)
    assert logged["router_loss"] == pytest.approx(own.aux_loss.item(), rel=FLOAT32_BOUND)
