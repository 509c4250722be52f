"""A server measured apart (e.g. on a GPU) in virtual time: its own stages are charged
from its own table, the devices' from theirs, and the planner plans each side with its
own."""

from __future__ import annotations

import math

import pytest
from fleet import COSTS

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.plan import declared_devices

CONFIG = RunConfig(mode="pipar", model="vgg5", devices=2, samples_per_device=40,
                   batch_size=10, epochs=1, split_point=2, parallel_batches=2,
                   test_samples=0, network="lan")


async def test_the_server_s_stages_are_charged_from_its_own_table() -> None:
    same = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    fast = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS,
                          server_cost_table=COSTS.scaled(0.1))
    before, after = same.epochs[0].busy_s, fast.epochs[0].busy_s
    assert math.isclose(after["server"], 0.1 * before["server"], rel_tol=0.05)
    assert math.isclose(after["device"], before["device"], rel_tol=1e-9)
    assert fast.epochs[0].time_s < same.epochs[0].time_s


async def test_the_planner_plans_the_server_with_its_table_and_devices_with_theirs(
        ) -> None:
    """Devices 20x slower than the server's table: with the server's table 100x faster
    the planner puts the least it can on the devices; with one table for both, a
    device with the same table as the server keeps more."""
    config = CONFIG.replace(split_point="auto", parallel_batches="auto",
                            device_slowdown=1.0)
    slow_server = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    fast_server = await simulate(config, clock=VirtualClock(), cost_table=COSTS,
                                 server_cost_table=COSTS.scaled(0.01))
    points = [[p["split_point"] for p in r.epochs[0].plan] for r in (slow_server, fast_server)]
    assert points[1] == [1, 1]
    assert min(points[0]) >= min(points[1])


def test_declared_devices_carry_their_own_table_when_given() -> None:
    devices = declared_devices(CONFIG, [40, 40], costs=COSTS)
    assert all(d.costs is COSTS for d in devices)
    assert all(d.costs is None for d in declared_devices(CONFIG, [40, 40]))


def test_a_server_table_of_another_model_or_without_devices_tables_is_refused() -> None:
    other = CostTable.uniform(3, forward=0.01, backward=0.02)
    with pytest.raises(ConfigError, match="server_cost_table has 3 units, the model 5"):
        Coordinator(CONFIG, clock=VirtualClock(), cost_table=COSTS, server_cost_table=other)
    with pytest.raises(ConfigError, match="needs cost_table"):
        Coordinator(CONFIG, clock=VirtualClock(), server_cost_table=COSTS)
