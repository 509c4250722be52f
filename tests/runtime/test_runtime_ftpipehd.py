"""FTPipeHD's asynchronous pipeline on the stage runtime (``mode = "ftpipehd"``), in
virtual time: three devices, each holding only its stage, streaming an epoch's batches
through 1F1B without a flush, end with exactly the weights of one process applying the
rules in batch order (tests/runtime/async_reference.py), with and without weight
aggregation; every stage keeps at most S − p batches in flight."""

from __future__ import annotations

import pytest
import torch
from async_reference import delayed_sgd

from aiopipe import ConfigError, CostTable, RunConfig, VirtualClock, models, simulate
from aiopipe import data as datasets
from aiopipe.runtime.plan import build_model, device_indices, train_dataset

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002)
CONFIG = RunConfig(mode="ftpipehd", model="vgg5", devices=3, samples_per_device=80,
                   batch_size=8, epochs=2, partition=(1, 3), learning_rate=0.05,
                   momentum=0.9, test_samples=20, seed=3)


def _reference(config: RunConfig) -> dict[str, torch.Tensor]:
    dataset = train_dataset(config)
    model = build_model(config, num_classes=dataset.num_classes, in_shape=dataset.in_shape)
    assert isinstance(config.partition, tuple)
    stages = models.partition(model, list(config.partition))
    batch = config.batch_size
    epochs = []
    for epoch in range(config.epochs):
        order = datasets.epoch_order(device_indices(config, dataset, 0), epoch=epoch,
                                     seed=config.seed)
        epochs.append([dataset.batch(order[b * batch:(b + 1) * batch])
                       for b in range(len(order) // batch)])
    final = delayed_sgd(stages, epochs, lr=config.learning_rate, momentum=config.momentum,
                        every=config.version_aggregation)
    with torch.no_grad():
        for stage, weights in zip(stages, final, strict=True):
            for name, param in stage.named_parameters():
                param.copy_(weights[name])
    return model.state_dict()


@pytest.mark.parametrize("every", [1, 0, 2])
async def test_ftpipehd_computes_what_its_rules_define(every: int) -> None:
    config = CONFIG.replace(version_aggregation=every)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert [e.samples for e in result.epochs] == [80, 80]
    want = _reference(config)
    got = result.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    plan = result.epochs[0].plan
    assert [p["in_flight"] for p in plan] == [3, 2, 1]
    assert [p["batches"] for p in plan] == [10, 10, 10]
    assert [s["peak_live"] for s in result.epochs[0].stages] == [3, 2, 1]


async def test_ftpipehd_learns() -> None:
    """Stale weights and high momentum do not mix (with momentum 0.9 this run does not
    learn: docs/design.md, FTPipeHD); with 0.5 it does."""
    config = CONFIG.replace(samples_per_device=600, batch_size=20, epochs=3,
                            test_samples=300, learning_rate=0.02, momentum=0.5)
    result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    losses = [e.loss for e in result.epochs]
    assert losses == sorted(losses, reverse=True)
    assert result.final.accuracy > 0.3


@pytest.mark.parametrize(("changes", "message"), [
    ({"version_aggregation": -1}, "version_aggregation"),
    ({"mode": "pipeline", "version_aggregation": 2}, "version_aggregation"),
    ({"schedule": "gpipe"}, "schedule"),
    ({"devices": 1, "partition": ()}, "devices"),
])
def test_ftpipehd_config_is_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CONFIG.replace(**changes)
