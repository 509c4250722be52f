"""Testing your own model and plan against faults before real devices run them, with
`aiopipe.testing` only: a whole fleet in this process, in virtual time.

    python -m pytest examples/test_my_fleet.py      # needs pytest and pytest-asyncio

Here: PiPar over three devices with a model of our own; device 2's process is killed in
the middle of the first round and started again at once. The round it was in goes on
without it and counts none of its samples; it trains again from the next round; no
sample is counted twice. Then the same run undisturbed, for what a fault must not change.
"""

from __future__ import annotations

import math

import pytest
from torch import nn

from aiopipe import RunConfig
from aiopipe.testing import open_fleet


def my_model() -> nn.Sequential:
    """Our model, as split units (top-level children) for 3x32x32 inputs, 10 classes."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 10)),
    )


def my_config() -> RunConfig:
    """3 devices x 40 samples, B = 10: 4 iterations an epoch, 2 rounds of 2."""
    return RunConfig(mode="pipar", model=my_model(), devices=3, samples_per_device=40,
                     batch_size=10, epochs=2, split_point=1, parallel_batches=2,
                     aggregation_every=2, test_samples=20)


@pytest.mark.asyncio
async def test_a_device_killed_mid_round_loses_that_round_only() -> None:
    async with open_fleet(my_config()) as fleet:
        training = fleet.train()
        # mid-round: device 2 has sent activations in round 0
        await fleet.until(lambda: fleet.activations_in(2, 0) > 0)
        fleet.kill(2)           # as SIGKILL would
        fleet.start_device(2)   # a new process with the same id
        result = await training
    first, second = result.epochs
    assert first.device_samples == (40, 40, 20)   # round 0 of device 2 counted nothing
    assert first.devices_lost == (2,)
    assert second.device_samples == (40, 40, 40)
    assert second.devices_lost == ()
    for epoch in result.epochs:
        assert epoch.samples == sum(epoch.device_samples)
        assert math.isfinite(epoch.loss)


@pytest.mark.asyncio
async def test_undisturbed_every_sample_counts_once() -> None:
    async with open_fleet(my_config()) as fleet:
        result = await fleet.train()
    assert [e.device_samples for e in result.epochs] == [(40, 40, 40)] * 2
    assert all(e.devices_lost == () for e in result.epochs)
