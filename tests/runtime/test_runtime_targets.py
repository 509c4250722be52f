"""Targets of any shape (issue 44, item 2): the loss gets the model's output and the
target as they are, a class per token is scored per token, a float target trains with
MSE, and the accuracy is the run's metric (a classifier's by default, a user's, or none).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from regression_data import dataset as regression
from regression_data import within
from torch import nn

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.data import DataKind, kind_of
from aiopipe.runtime.factories import accuracy, cross_entropy, make_loss, make_metric, scored
from aiopipe.scheduler.costs import CostTable


def test_cross_entropy_scores_the_last_dimension_per_sample_or_per_token() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5), torch.randint(5, (6,))
    assert torch.equal(cross_entropy(logits, labels), nn.functional.cross_entropy(logits, labels))
    tokens, targets = torch.randn(2, 3, 5), torch.randint(5, (2, 3))
    want = nn.functional.cross_entropy(tokens.transpose(1, 2), targets)  # torch's layout
    assert torch.allclose(cross_entropy(tokens, targets), want)


def test_accuracy_counts_right_samples_or_the_fraction_of_right_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert accuracy(logits, torch.tensor([1, 1, 1])).item() == 2
    tokens = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])
    assert accuracy(tokens, torch.tensor([[1, 1], [1, 1]])).item() == 1.5  # 1/2 + 2/2


def test_the_run_names_its_loss_and_metric() -> None:
    assert make_loss(RunConfig(loss="mse")) is nn.functional.mse_loss
    assert make_metric(RunConfig(metric="none")) is None
    assert make_metric(RunConfig()) is accuracy
    assert make_metric(RunConfig(metric="regression_data:metric")) is within


def test_a_metric_out_of_range_is_refused_with_what_it_must_be() -> None:
    out, target = torch.zeros(4, 1), torch.zeros(4, 1)
    assert scored(out, target, torch.tensor(0.5), within) == (2.0, 4.0)
    with pytest.raises(ValueError, match=r"per-sample scores in \[0, 1\] summed, at most "
                                         r"its 4 rows; got 5\.0"):
        scored(out, target, torch.tensor(0.5), lambda o, t: 5)


def test_a_datasets_kind_says_its_inputs_target_and_classes() -> None:
    assert kind_of(regression("train", 0)) == DataKind((("float32", (8,)),),
                                                       ("float32", (1,)), 0)


COSTS = CostTable.uniform(2, forward=0.001, backward=0.002, step=0.0005, batch=10)


@pytest.mark.parametrize("mode", ["fl", "pipar"])
async def test_a_regression_trains_with_mse_and_reports_the_users_metric(mode: str) -> None:
    config = RunConfig(mode=mode, dataset="regression_data:dataset",
                       model="regression_data:model", loss="mse",
                       metric="regression_data:metric", devices=2, samples_per_device=200,
                       batch_size=20, epochs=4, learning_rate=0.05, momentum=0.9,
                       test_samples=100, split_point=1, parallel_batches=2)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    losses = [e.loss for e in result.epochs]
    assert losses[-1] < losses[0] / 4, losses  # MSE of a learnable linear target
    assert 0.0 <= result.epochs[0].train_accuracy < result.epochs[-1].train_accuracy <= 1.0
    assert result.final.accuracy > 0.5  # the test set within 0.25, by the user's metric


async def test_without_a_metric_only_the_loss_is_reported(tmp_path: Path) -> None:
    """``metric = "none"``: NaN accuracies in the result, null in ``metrics.jsonl``."""
    config = RunConfig(mode="fl", dataset="regression_data:dataset",
                       model="regression_data:model", loss="mse", metric="none", devices=1,
                       samples_per_device=100, batch_size=20, epochs=1, test_samples=100,
                       out_dir=str(tmp_path / "run"))
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert math.isfinite(result.final.loss)
    assert math.isnan(result.final.train_accuracy)
    assert math.isnan(result.final.accuracy)
    [written] = [json.loads(line) for line in
                 (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(written["loss"])
    assert written["accuracy"] is None
    assert written["train_accuracy"] is None
