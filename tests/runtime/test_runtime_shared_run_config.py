"""The devices of an in-process simulation share one parsed `RunConfig` for one run
(each parsed its own from its plan: 1.7 KB a device, 170 MB for 100,000)."""

from __future__ import annotations

import pytest

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.runtime import plan as plan_module
from aiopipe.runtime.plan import shared_run_config
from aiopipe.scheduler.costs import CostTable


def test_equal_runs_are_one_object_and_other_runs_another() -> None:
    run = RunConfig(mode="fl", devices=3, samples_per_device=20).to_mapping()
    first, again = shared_run_config(dict(run)), shared_run_config(dict(run))
    assert first is again
    assert first == RunConfig.from_mapping(run)
    other = shared_run_config({**run, "seed": 7})
    assert other is not first
    assert other.seed == 7


async def test_a_simulation_s_devices_hold_one_run_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[int] = []
    real = RunConfig.from_mapping

    def counting(values: object) -> RunConfig:
        parsed.append(1)
        return real(values)  # type: ignore[arg-type]

    plan_module._RUN_CONFIGS.clear()
    monkeypatch.setattr(plan_module.RunConfig, "from_mapping", counting)
    config = RunConfig(mode="fl", devices=6, samples_per_device=10, batch_size=10, epochs=1,
                       test_samples=10, devices_per_round=2)
    costs = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)
    result = await simulate(config, clock=VirtualClock(), cost_table=costs)
    assert len(result.epochs) == 1
    assert len(parsed) == 1  # once for six devices
