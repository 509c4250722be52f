"""Accumulated gradients ([Note: accumulated gradients] in aiopipe/scheduler/costs.py):
every backward but an iteration's first adds into the gradients, which the table
measures apart and the runtime's virtual time and the planner's estimate charge."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fleet import COSTS

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.errors import ConfigError
from aiopipe.scheduler.costs import measure_costs
from aiopipe.scheduler.estimate import DeviceProfile, ModelProfile, fleet_stages
from aiopipe.transport import LinkSpec

#: vgg5 has 5 units: the device's is unit 0 at P = 1, the server's units 1..4
ACCUMULATE = {0: 0.003, 1: 0.001, 2: 0.002, 3: 0.0, 4: 0.004}


def test_the_table_keeps_its_accumulation_cost() -> None:
    costs = dataclasses.replace(COSTS, accumulate=ACCUMULATE)
    assert costs.accumulate_time(1, 5) == pytest.approx(0.007)
    assert COSTS.accumulate_time(0, 5) == 0.0  # not measured: none
    assert costs.scaled(2.0).accumulate_time(0, 5) == pytest.approx(0.02)
    assert CostTable.from_mapping(costs.to_mapping()) == costs
    older = {k: v for k, v in costs.to_mapping().items() if k != "accumulate"}
    assert CostTable.from_mapping(older).accumulate == {}  # tables saved before it
    for bad in ({"0": -1.0}, {"0": float("nan")}, {"9": 0.1}):
        with pytest.raises(ConfigError, match="accumulate times"):
            CostTable.from_mapping({**older, "accumulate": bad})


def test_profiling_measures_it_by_the_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.ReLU(),
                                torch.nn.Linear(1000, 2))
    costs = measure_costs(model, (1000,), [2], repeats=3, warmup=1, clock="cpu")
    assert costs.accumulate[1] == 0.0  # no parameters
    assert costs.accumulate[0] > 10 * costs.accumulate[2] > 0


async def test_virtual_time_charges_every_backward_but_an_iterations_first() -> None:
    n, iterations = 4, 2
    config = RunConfig(mode="pipar", model="vgg5", devices=1, samples_per_device=20,
                       batch_size=10, epochs=1, split_point=1, parallel_batches=n,
                       test_samples=0, network="lan")
    plain = (await simulate(config, clock=VirtualClock(), cost_table=COSTS)).final
    costs = dataclasses.replace(COSTS, accumulate=ACCUMULATE)
    charged = (await simulate(config, clock=VirtualClock(), cost_table=costs)).final
    added = iterations * (n - 1)
    assert charged.busy_s["device"] - plain.busy_s["device"] == pytest.approx(added * 0.003)
    assert charged.busy_s["server"] - plain.busy_s["server"] == pytest.approx(added * 0.007)


def test_the_estimate_spreads_it_over_the_micro_batches() -> None:
    costs = dataclasses.replace(COSTS, accumulate=ACCUMULATE)
    model = ModelProfile(costs, (100,) * 5, (0,) * 5)
    plain = ModelProfile(COSTS, (100,) * 5, (0,) * 5)
    dev = DeviceProfile(3.0, LinkSpec(None), LinkSpec(None), 40)
    for n in (1, 2, 5):
        with_it, = fleet_stages(model, [dev], [(1, n)], 10)
        without, = fleet_stages(plain, [dev], [(1, n)], 10)
        share = (n - 1) / n
        assert with_it.b - without.b == pytest.approx(3.0 * 0.003 * share)
        assert with_it.s - without.s == pytest.approx(0.007 * share)
        assert with_it.f == without.f
        assert with_it.server_step == without.server_step


def test_the_live_profile_counts_it_where_the_round_paid_it() -> None:
    """A round that ran exactly as the table says, accumulation included, reads as a
    server and a device at the table's speed (the re-planner's view, replan.py)."""
    from aiopipe.metrics.trace import Slice
    from aiopipe.runtime.plan import DevicePlan
    from aiopipe.runtime.systems.star.replan import live_profiles

    costs = dataclasses.replace(COSTS, accumulate=ACCUMULATE)
    profile = ModelProfile(costs, (100,) * 5, (0,) * 5)
    plan = DevicePlan(0, 1, 2, 10, 2)  # P = 1, N = 2, B' = 10, 2 iterations
    f = costs.forward_time(0, 1, 10)
    b = costs.backward_time(0, 1, 10)
    s = costs.forward_time(1, 5, 10) + costs.backward_time(1, 5, 10)
    slices = []
    for n in (0, 1, 0, 1):  # two iterations of two micro-batches
        extra = n > 0  # the second micro-batch of each iteration adds into the gradients
        slices += [Slice("device0/compute", "f", 0, f),
                   Slice("device0/compute", "b", 0, b + extra * costs.accumulate_time(0, 1)),
                   Slice("server/compute", "s", 0, s + extra * costs.accumulate_time(1, 5))]
    before = DeviceProfile(2.0, LinkSpec(None), LinkSpec(None), 40)
    live, (device,) = live_profiles(slices, [plan], [4], profile, [before])
    assert live.costs.forward_time(1, 5, 10) == pytest.approx(costs.forward_time(1, 5, 10))
    assert device.slowdown == pytest.approx(1.0)
