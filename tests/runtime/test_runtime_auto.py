"""split_point="auto" / parallel_batches="auto": the planner picks (P, N) per device from
a cost table, and in virtual time (charged from that same table) the chosen plan is at
least as fast as any fixed plan we try."""

from __future__ import annotations

import pytest
from fleet import vgg5_shaped

from aiopipe import CostTable, RunConfig, VirtualClock, simulate
from aiopipe.testing import joined

# 3 iterations: the virtual times come from the table, so a short epoch compares the plans
# as well as a long one (the planner plans for the epoch it is given); vgg5's stand-in:
# its activations on the links, a tenth of its compute
BASE = RunConfig(mode="pipar", model=vgg5_shaped, devices=2, samples_per_device=150, batch_size=50,
                 epochs=1, split_point="auto", parallel_batches="auto", network="4g",
                 device_slowdown=4.0, test_samples=20, seed=1)

# a table shaped like vgg5's measured one (a fixed cost per call plus a cost per sample
# that shrinks along the units; the aggregation and gradient accumulation costs of a
# measured table too), so that the plans do not depend on this machine and no test here
# waits for a measurement
_SIZES = (1, 2, 5, 10, 25, 50)
_FIXED = (1e-3, 2e-4, 1e-4, 1e-4, 4e-5)
_PER_SAMPLE = (2.5e-4, 1.7e-4, 4.5e-5, 1.5e-5, 3e-7)
_UNITS = list(enumerate(zip(_FIXED, _PER_SAMPLE, strict=True)))
COSTS = CostTable(
    {u: {b: c + t * b for b in _SIZES} for u, (c, t) in _UNITS},
    {u: {b: c + 2 * t * b for b in _SIZES} for u, (c, t) in _UNITS},
    {0: 1e-4, 1: 2e-5, 2: 2e-5, 3: 8e-4, 4: 1e-4},
    (4e-5, 7.5e-4),
    {0: 3e-6, 1: 4e-6, 2: 6e-6, 3: 5e-5, 4: 3e-6},
)


@pytest.fixture
def costs() -> CostTable:
    return COSTS


@pytest.mark.slow
async def test_auto_plan_is_resolved_and_beats_fixed_plans(costs: CostTable) -> None:
    auto = await simulate(BASE, clock=VirtualClock(), cost_table=costs)
    chosen = auto.config
    assert isinstance(chosen.split_point, tuple)
    assert isinstance(chosen.parallel_batches, tuple)
    assert all(50 % n == 0 for n in chosen.parallel_batches)  # N divides B
    assert [p["split_point"] for p in auto.final.plan] == list(chosen.split_point)
    fixed = []
    for p in (1, 2, 3, 4):
        for n in (1, 5):
            run = await simulate(BASE.replace(split_point=p, parallel_batches=n),
                                 clock=VirtualClock(), cost_table=costs)
            fixed.append((run.final.time_s, p, n))
    best_time = min(fixed)[0]
    assert auto.final.time_s <= 1.05 * best_time, (chosen, auto.final.time_s, fixed)


async def test_auto_split_for_sfl_keeps_one_micro_batch(costs: CostTable) -> None:
    result = await simulate(BASE.replace(mode="sfl", parallel_batches=1), clock=VirtualClock(),
                            cost_table=costs)
    assert all(p["parallel_batches"] == 1 for p in result.final.plan)
    assert isinstance(result.config.split_point, tuple)


@pytest.mark.slow
async def test_auto_is_planned_before_a_real_run_too() -> None:
    """Without a cost table the server measures one on this machine to plan with, once
    the devices have joined."""
    from aiopipe.clock import SystemClock
    from aiopipe.runtime.coordinator import Coordinator

    node = await joined(Coordinator(BASE.replace(profile_devices=False), clock=SystemClock()))
    assert node.cost_table is None  # real time is not charged from the table
    assert all(isinstance(p.split_point, int) for p in node.system.plans)
    assert all(1 <= p.split_point < 5 for p in node.system.plans)


async def test_memory_budgets_bound_the_plan_and_an_impossible_one_is_named(
        costs: CostTable) -> None:
    from aiopipe.errors import ConfigError
    from aiopipe.runtime.coordinator import Coordinator
    from aiopipe.scheduler.candidates import device_memory_bytes

    free = await joined(Coordinator(BASE, clock=VirtualClock(), cost_table=costs))
    assert free.system.planning is not None
    need = [device_memory_bytes(free.system.planning, p.split_point, p.parallel_batches, 50)
            for p in free.system.plans]
    # device 1 gets less memory than its free choice needs: it must pick a smaller plan
    budget = (0.0, (need[1] - 1) / 2**20)
    tight = await joined(Coordinator(BASE.replace(device_memory_mb=budget),
                                     clock=VirtualClock(), cost_table=costs))
    p1 = tight.system.plans[1]
    assert device_memory_bytes(tight.system.planning, p1.split_point, p1.parallel_batches,
                               50) < need[1]
    with pytest.raises(ConfigError, match="device 0") as info:
        await joined(Coordinator(BASE.replace(device_memory_mb=0.001), clock=VirtualClock(),
                                 cost_table=costs))
    assert "\n" not in str(info.value)
