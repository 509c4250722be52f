"""FTPipeHD's dynamic partition (aiopipe/scheduler/ftpipehd.py, paper §III-D): the dynamic
program equals brute force over every partition, capacities follow Eqs. 1–2, and on a
fleet with one device 10x slower it beats PipeDream's homogeneous partition."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from aiopipe import ConfigError, CostTable
from aiopipe.scheduler.ftpipehd import (
    Partition,
    capacities,
    ftpipehd_partition,
    pipeline_time,
)

GOLDEN = Path(__file__).parent / "golden"


def _brute_force(times: list[float], sizes: list[float], stages: int,
                 cap: list[float], bw: list[float]) -> float:
    return min(pipeline_time(times, sizes, cuts, capacities=cap, bandwidths=bw)
               for cuts in itertools.combinations(range(1, len(times)), stages - 1))


@pytest.mark.parametrize("seed", range(40))
def test_the_dynamic_program_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    q = rng.randint(1, 8)
    stages = rng.randint(1, min(q, 4))
    times = [rng.uniform(0.001, 0.05) for _ in range(q)]
    sizes = [rng.choice([1e3, 1e5, 1e6]) for _ in range(q)]
    cap = [1.0, *(rng.choice([1.0, 1.5, 4.0, 10.0]) for _ in range(stages - 1))]
    bw = [rng.choice([math.inf, 1e7, 1e8]) for _ in range(stages - 1)]
    plan = ftpipehd_partition(times, sizes, stages, capacities=cap, bandwidths=bw)
    assert len(plan.cuts) == stages - 1
    assert plan.time_s == pytest.approx(_brute_force(times, sizes, stages, cap, bw))
    assert pipeline_time(times, sizes, plan.cuts, capacities=cap,
                         bandwidths=bw) == pytest.approx(plan.time_s)


def test_capacities_are_reported_time_over_the_central_profile() -> None:
    profile = [1.0, 2.0, 3.0, 4.0]
    bounds = [(0, 1), (1, 3), (3, 4)]
    assert capacities(profile, bounds, [1.0, 10.0, 8.0]) == [1.0, 2.0, 2.0]
    with pytest.raises(ConfigError, match="capacity"):
        capacities(profile, bounds, [1.0, 0.0, 8.0])
    with pytest.raises(ConfigError, match="measured times"):
        capacities(profile, bounds, [1.0])


def test_a_slow_device_gets_less_of_the_model() -> None:
    """12 equal units on 4 devices, the last 10x slower, transfers free: PipeDream's
    homogeneous partition gives it 3 units (30 s a batch); FTPipeHD's gives it one."""
    times, sizes = [1.0] * 12, [0.0] * 12
    truth = [1.0, 1.0, 1.0, 10.0]
    homogeneous = ftpipehd_partition(times, sizes, 4)
    assert homogeneous == Partition((3, 6, 9), 3.0)
    assert pipeline_time(times, sizes, homogeneous.cuts, capacities=truth) == 30.0
    dynamic = ftpipehd_partition(times, sizes, 4, capacities=truth)
    assert dynamic.bounds(12)[-1] == (11, 12)
    assert dynamic.time_s == 10.0  # the slow device's one unit; the others take 11 in 3
    assert 30.0 / dynamic.time_s == 3.0


def test_vgg5_with_one_device_10x_slower() -> None:
    """Measured vgg5 costs (B = 32), devices 1, 1, 1, 10, compute only: the dynamic
    partition's batch time is 1.8x shorter than the homogeneous one's."""
    costs = CostTable.from_mapping(json.loads((GOLDEN / "vgg5_costs.json").read_text()))
    times = [costs.forward_time(u, u + 1, 32) + costs.backward_time(u, u + 1, 32)
             for u in range(costs.units)]
    sizes = [0.0] * costs.units
    truth = [1.0, 1.0, 1.0, 10.0]
    homogeneous = ftpipehd_partition(times, sizes, 4)
    dynamic = ftpipehd_partition(times, sizes, 4, capacities=truth)
    before = pipeline_time(times, sizes, homogeneous.cuts, capacities=truth)
    assert before / dynamic.time_s == pytest.approx(1.80, abs=0.01)


def test_a_slow_link_moves_the_cut_to_a_smaller_activation() -> None:
    times = [1.0, 1.0, 1.0, 1.0]
    sizes = [1.0, 100.0, 1.0, 100.0]
    assert ftpipehd_partition(times, sizes, 2).cuts == (2,)  # balanced: 2 units each
    slow = ftpipehd_partition(times, sizes, 2, bandwidths=[1.0])
    # after unit 1 the link would carry 100 bytes both ways (200 s): cut where 1 does
    assert slow == Partition((1,), 3.0)
    assert pipeline_time(times, sizes, (2,), bandwidths=[1.0]) == 200.0


@pytest.mark.parametrize(("stages", "kwargs", "message"), [
    (5, {}, "cannot cut"),
    (0, {}, "cannot cut"),
    (2, {"capacities": [1.0]}, "capacities"),
    (2, {"bandwidths": [0.0]}, "must be > 0"),
])
def test_bad_arguments_are_refused(stages: int, kwargs: dict[str, list[float]],
                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ftpipehd_partition([1.0] * 4, [1.0] * 4, stages, **kwargs)  # type: ignore[arg-type]
