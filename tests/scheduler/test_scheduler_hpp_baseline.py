"""Asteroid's hybrid baseline (aiopipe.scheduler.hpp_baseline): equal groups in the
declared order, equal rows, cuts that balance compute, memory budgets ignored by the
ranking (only a plan that cannot fit is passed over), and the ``by_speed`` variant."""

from __future__ import annotations

import itertools

import pytest
from test_scheduler_asteroid import FAST, MB, _model

from aiopipe.errors import ConfigError
from aiopipe.scheduler.asteroid import Device, HppModel, HppPlan, HppStage, plan, round_time
from aiopipe.scheduler.hpp_baseline import (
    PLANNERS,
    equal_groups_plan,
    equal_groups_plans,
    over_budget,
)

#: units of uneven compute, the last one's weights heavy (a classifier)
FORWARD = [0.004, 0.003, 0.002, 0.002, 0.001, 0.001]


def _shape(found: HppPlan) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(s.first, s.stop, s.devices) for s in found.stages]


def _fleet(slowdowns: list[float], memory: float = 100 * MB,
           rate: float = 1.25e7) -> list[Device]:
    return [Device(s, memory, rate) for s in slowdowns]


def _stage_compute(model: HppModel, stage: HppStage, device: Device) -> float:
    return sum(model.times(stage.first, stage.stop, max(stage.samples), device))


def test_groups_are_equal_and_in_declared_order_and_rows_equal() -> None:
    model = _model(FORWARD, weights=[1e4] * 5 + [4e6])
    fleet = _fleet([4.0, 1.0, 2.0, 1.0, 4.0])  # the slowest first: order is not speed
    plans = equal_groups_plans(model, fleet, 4, 16)
    assert sorted(len(p.stages) for p in plans) == [1, 2, 3, 4, 5]
    for found in plans:
        sizes = [len(s.devices) for s in found.stages]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)  # the larger groups first
        assert [d for s in found.stages for d in s.devices] == [0, 1, 2, 3, 4]
        for stage in found.stages:
            assert max(stage.samples) - min(stage.samples) <= 1  # blind to speed
            assert sum(stage.samples) == 16
        assert found.round_s == pytest.approx(round_time(model, fleet, found.stages, 4, 16))


@pytest.mark.parametrize("stages", [2, 3])
def test_the_cuts_balance_compute_on_a_device_of_the_mean_speed(stages: int) -> None:
    """Every other cut of the same groups leaves some stage more compute than the
    largest of the baseline's (the min-max partition)."""
    model = _model(FORWARD)
    fleet = _fleet([1.0, 1.0, 3.0, 3.0, 2.0, 2.0])
    mean = Device(2.0, 100 * MB, FAST)
    found = next(p for p in equal_groups_plans(model, fleet, 4, 12) if len(p.stages) == stages)
    worst = max(_stage_compute(model, s, mean) for s in found.stages)
    for cuts in itertools.combinations(range(1, model.units), stages - 1):
        bounds = list(itertools.pairwise((0, *cuts, model.units)))
        other = max(_stage_compute(model, HppStage(a, b, s.devices, s.samples), mean)
                    for (a, b), s in zip(bounds, found.stages, strict=True))
        assert other >= worst - 1e-12


def test_the_ranking_ignores_memory_budgets() -> None:
    """The same plans, in the same order, whatever the budgets: where Asteroid's planner
    gives a device short of memory fewer rows, the baseline's first choice keeps its
    equal share and would overflow it."""
    model = _model(FORWARD, activation=[2e5] * 6, weights=[1e4] * 5 + [4e6])
    roomy = _fleet([1.0, 1.0, 2.0, 2.0])
    tight = [roomy[0], Device(1.0, 15 * MB, 1.25e7), *roomy[2:]]
    assert [p.stages for p in equal_groups_plans(model, tight, 4, 16)] == [
        p.stages for p in equal_groups_plans(model, roomy, 4, 16)]

    def rows_of(found: HppPlan, device: int) -> int:
        return next(n for s in found.stages for d, n in zip(s.devices, s.samples, strict=True)
                    if d == device)

    assert rows_of(plan(model, tight, 4, 16), 1) < rows_of(plan(model, roomy, 4, 16), 1)
    first = equal_groups_plans(model, tight, 4, 16)[0]
    assert rows_of(first, 1) == 4
    assert set(over_budget(model, tight, first.stages, 4)) == {1}
    assert not over_budget(model, tight, plan(model, tight, 4, 16).stages, 4)


def test_a_plan_that_would_run_out_of_memory_is_passed_over_for_the_next() -> None:
    model = _model(FORWARD, activation=[2e5] * 6, weights=[1e4] * 5 + [4e6])
    roomy = _fleet([1.0, 1.0, 2.0, 2.0])
    first = equal_groups_plans(model, roomy, 4, 16)[0]
    assert equal_groups_plan(model, roomy, 4, 16) == first
    # device 0 one byte short of what the first choice gives it
    needed = model.memory(first.stages[0].first, first.stages[0].stop,
                          first.stages[0].samples[0], min(2 * len(first.stages) - 1, 4))
    tight = [Device(1.0, needed - 1, 1.25e7), *roomy[1:]]
    assert over_budget(model, tight, first.stages, 4) == {0: needed}
    chosen = equal_groups_plan(model, tight, 4, 16)
    assert chosen != first
    assert not over_budget(model, tight, chosen.stages, 4)
    assert chosen in equal_groups_plans(model, tight, 4, 16)
    nothing = _fleet([1.0, 1.0, 2.0, 2.0], memory=1.0)
    with pytest.raises(ConfigError, match=r"no equal-groups plan fits.*device"):
        equal_groups_plan(model, nothing, 4, 16)


def test_by_speed_gives_a_slower_member_fewer_rows() -> None:
    model = _model(FORWARD)
    fleet = _fleet([1.0, 3.0, 1.0, 3.0])
    for found in equal_groups_plans(model, fleet, 4, 16, by_speed=True):
        assert [d for s in found.stages for d in s.devices] == [0, 1, 2, 3]
        for stage in found.stages:
            rows = dict(zip(stage.devices, stage.samples, strict=True))
            if 0 in rows and 1 in rows:
                assert rows[1] < rows[0]
    blind = equal_groups_plans(model, fleet, 4, 16)
    assert all(max(s.samples) - min(s.samples) <= 1 for p in blind for s in p.stages)


def test_the_planners_by_name() -> None:
    model = _model(FORWARD)
    fleet = _fleet([1.0, 2.0, 2.0, 4.0])
    assert PLANNERS["asteroid"](model, fleet, 4, 16) == plan(model, fleet, 4, 16)
    assert PLANNERS["equal-groups"](model, fleet, 4, 16) == equal_groups_plan(
        model, fleet, 4, 16)
    assert PLANNERS["equal-groups-by-speed"](model, fleet, 4, 16) == equal_groups_plan(
        model, fleet, 4, 16, by_speed=True)
