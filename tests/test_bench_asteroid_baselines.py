"""bench/asteroid_baselines.py's fleets and figures: the paper's environments, budgets
that bind (a Nano holds the whole model on half a micro-batch, a TX2 or NX twice that),
each run's config, Eq. 3 per member against its budget."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

from aiopipe.runtime.systems.asteroid.options import AsteroidOptions
from aiopipe.scheduler.asteroid import HppModel
from aiopipe.scheduler.costs import CostTable

baselines = load_bench("asteroid_baselines")
MIB = 2.0**20


def _hpp() -> HppModel:
    table = CostTable.uniform(3, forward=1e-3, backward=2e-3)
    return HppModel(table, (1000.0, 500.0, 10.0), (1e4, 2e4, 4e5))


def test_budgets_bind_by_kind() -> None:
    hpp = _hpp()
    budgets = baselines.budgets_of("C", hpp)
    nano = hpp.memory(0, 3, 8, 1) / MIB
    assert budgets == pytest.approx((2 * nano,) * 3 + (nano,) * 3, abs=0.01)
    assert hpp.memory(0, 3, 16, 1) / MIB > budgets[-1]


def test_each_run_s_config() -> None:
    base = baselines.fleet_config("D", "vgg5", 10.0, 100.0, 640, (8.0, 4.0, 4.0, 4.0))
    assert base.device_slowdown == pytest.approx((13.0, 36.0, 36.0, 36.0))
    runs = {name: baselines.run_config(base, name) for name in baselines.RUNS}
    assert runs["asteroid"].options_as(AsteroidOptions).planner == "asteroid"
    assert runs["equal-groups"].options_as(AsteroidOptions).planner == "equal-groups"
    assert runs["data parallel"].options_as(AsteroidOptions).stage_groups == ((0, 1, 2, 3),)
    assert runs["pipeline parallel"].mode == "pipeline"


def test_eq3_per_member_against_its_budget() -> None:
    hpp = _hpp()
    stages = [{"stage": 0, "device": 0, "units": [0, 2], "rows": [0, 16]},
              {"stage": 1, "device": 1, "units": [2, 3]}]  # (a pipeline's: all rows)
    rows = baselines.memory_rows(hpp, stages, (1.0, 2.0, 0.0, 0.0))
    assert rows[0] == (pytest.approx(hpp.memory(0, 2, 16, 3) / MIB), 1.0)
    assert rows[1] == (pytest.approx(hpp.memory(2, 3, 16, 1) / MIB), 2.0)


@pytest.mark.slow
def test_a_fleet_s_runs_side_by_side() -> None:
    """Every run on fleet D (vgg5, a uniform table, two batches a device): each has a
    throughput or says why it was refused, and the report has a line for each."""
    from aiopipe import models
    from aiopipe.runtime.plan import model_profile

    model = models.build("vgg5", num_classes=10, in_shape=(3, 32, 32))
    costs = CostTable.uniform(5, forward=1e-3, backward=2e-3, batch=16)
    hpp = HppModel.of(model_profile(model, (3, 32, 32), costs))
    result = baselines.bench_fleet("D", "vgg5", 10.0, 100.0, 128, False, costs, hpp)
    assert set(result["runs"]) == set(baselines.RUNS)
    for row in result["runs"].values():
        assert "refused" in row or row["samples_per_s"] > 0
    assert result["runs"]["asteroid"]["samples_per_s"] > 0
    assert baselines._worst(result["runs"]["asteroid"]) <= 1
    lines = baselines.report(result)
    assert sum(line.startswith("| ") for line in lines) == 1 + len(baselines.RUNS)
    assert len(baselines.summary([result])) == 3
