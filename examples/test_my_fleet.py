"""Testing your own model and plan against faults before real devices run them, with
`aiopipe.testing` only: a whole fleet in this process, in virtual time.

    python -m pytest examples/test_my_fleet.py      # needs pytest and pytest-asyncio

Here: PiPar over three devices with a model of our own.

- Device 2's process is killed in the middle of the first round (at its first
  iteration) and started again at once. The round it was in goes on without it and
  counts none of its samples; it trains again from the next round; no sample is counted
  twice (`assert_exact_accounting` checks each device's count against what its plan
  trains, less the round it lost).
- Device 1's uplink stalls for 3 seconds mid-round (what it sends arrives late, in
  order), and device 0's link runs at a tenth of its bandwidth: the run takes longer,
  but loses nothing and ends with the same weights as an undisturbed run
  (`assert_same_weights`).
- The same run undisturbed, for what a fault must not change.
"""

from __future__ import annotations

import math

import pytest
from torch import nn

from aiopipe import RunConfig
from aiopipe.testing import (
    assert_exact_accounting,
    assert_same_weights,
    open_fleet,
    run_undisturbed,
)


def my_model() -> nn.Sequential:
    """Our model, as split units (top-level children) for 3x32x32 inputs, 10 classes."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4)),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 10)),
    )


def my_config() -> RunConfig:
    """3 devices x 40 samples, B = 10: 4 iterations an epoch, 2 rounds of 2; 4G links."""
    return RunConfig(mode="pipar", model=my_model(), devices=3, samples_per_device=40,
                     batch_size=10, epochs=2, split_point=1, parallel_batches=2,
                     aggregation_every=2, test_samples=20, network="4g")


@pytest.mark.asyncio
async def test_a_device_killed_mid_round_loses_that_round_only() -> None:
    async with open_fleet(my_config()) as fleet:
        training = fleet.train()
        await fleet.at_iteration(2, 1)  # device 2 in its first iteration: round 1
        fleet.kill(2)                   # as SIGKILL would
        fleet.start_device(2)           # a new process with the same id
        result = await training
    first, second = result.epochs
    assert first.device_samples == (40, 40, 20)   # round 1 of device 2 counted nothing
    assert first.devices_lost == (2,)
    assert second.devices_lost == ()
    assert_exact_accounting(result, lost={2: [(1, 1)]})  # device 2: (epoch 1, round 1)
    assert all(math.isfinite(epoch.loss) for epoch in result.epochs)


@pytest.mark.asyncio
async def test_a_stalled_and_a_slow_link_cost_time_only() -> None:
    undisturbed = await run_undisturbed(my_config())
    async with open_fleet(my_config()) as fleet:
        fleet.slow(0, 10.0)             # device 0: a tenth of 4G, both ways, for good
        training = fleet.train()
        await fleet.at_iteration(1, 2)  # device 1 mid-round 1
        fleet.stall(1, 3.0, direction="up")  # held 3 s, then delivered in order
        result = await training
    assert_exact_accounting(result)                 # nothing lost or counted twice
    assert_same_weights(result, undisturbed)        # bit for bit
    stalled, slow = (r.time_s - u.time_s for r, u in zip(result.epochs, undisturbed.epochs,
                                                          strict=True))
    assert stalled > 2.5  # most of the stall: the others trained on meanwhile
    assert slow > 0       # the slow link alone


@pytest.mark.asyncio
async def test_undisturbed_every_sample_counts_once() -> None:
    async with open_fleet(my_config()) as fleet:
        result = await fleet.train()
    assert [e.device_samples for e in result.epochs] == [(40, 40, 40)] * 2
    assert_exact_accounting(result)
