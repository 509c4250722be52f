"""N that does not divide B is said at once: micro-batches of floor(B/N) samples train
fewer than B per iteration ([Note: iterations per epoch] in aiopipe/runtime/plan.py),
and the server's log says how many of each device's samples an epoch trains."""

from __future__ import annotations

import logging

import pytest

from aiopipe import CostTable, RunConfig, VirtualClock, simulate

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002)


async def test_n_not_dividing_b_is_warned_with_the_samples_left_out(
        caplog: pytest.LogCaptureFixture) -> None:
    config = RunConfig(devices=1, samples_per_device=200, batch_size=50, parallel_batches=4,
                       split_point=2, epochs=1, test_samples=20)
    with caplog.at_level(logging.WARNING, logger="aiopipe.server"):
        result = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert result.epochs[0].samples == 192  # 4 iterations x 4 x 12
    (line,) = [r.getMessage() for r in caplog.records if "does not divide" in r.getMessage()]
    assert "parallel_batches 4 does not divide batch_size 50" in line
    assert "4 micro-batches of 12 = 48 samples, 192 of its 200 per epoch" in line
    assert "N dividing B: 1, 2, 5, 10, 25, 50" in line


async def test_n_dividing_b_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    config = RunConfig(devices=1, samples_per_device=200, batch_size=50, parallel_batches=5,
                       split_point=2, epochs=1, test_samples=20)
    with caplog.at_level(logging.WARNING, logger="aiopipe.server"):
        await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert not [r for r in caplog.records if "does not divide" in r.getMessage()]

