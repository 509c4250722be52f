"""Asteroid's hybrid-parallel baseline, pure: a plan of the shape Asteroid's runtime runs
(stages, each on a group of devices that split every micro-batch by rows) chosen by the
rules of the hybrid planners the paper compares against, not by Asteroid's.

The paper (`../shared/papers/asteroid.txt`) names Dapple and PipeDream as hybrid pipeline
parallelism (HPP: "devices into groups for inter-group PP and intra-group DP", §2.3) and
says why they lose (§5.3): they are "designed for homogeneous accelerator clusters in
datacenter, which results in unbalanced and suboptimal workload partition and device
grouping for both inter-stage and intra-stage", and they "do not consider device memory
budget in their parallelism planning algorithms, leading to OOM errors". Its ablation's
naive planner (§5.4) likewise "treated all devices as homogeneous and overlooked memory
and bandwidth constraints". HetPipe is hybrid *data* parallelism (pipelines as virtual
workers, synchronised by a parameter server): not a plan this runtime runs, so not
built; ``by_speed`` (below) is the closest HPP plan that, like HetPipe, knows each
device's speed.

The rules (`equal_groups_plans`), for each stage count S from 1 to the units or devices:

1. **Equal groups**: the devices in their declared order, cut into S consecutive groups
   of equal size; where S does not divide the N devices, the first ``N mod S`` groups
   have one more (as equal as they can be). Not sorted by speed or memory: the devices
   are interchangeable to these planners.
2. **Rows**: a group splits every micro-batch equally (its first ``B mod g`` members one
   row more). ``by_speed``: by Algorithm 1's shares of capacity and straggler
   offloading, with no memory limit (`aiopipe.scheduler.asteroid.allocate`).
3. **Cuts by compute**: the cuts that make the largest stage's compute least (a min-max
   dynamic program over the units): a stage's compute is its units' forward and
   backward on its largest share of rows, on a device of the fleet's mean slowdown
   (``by_speed``: its slowest member's time on its own rows). Links and memory play no
   part.
4. **The stage count**: the S whose plan Asteroid's own estimate (Eq. 4,
   `aiopipe.scheduler.asteroid.round_time`) finds fastest on a homogeneous fleet: every
   device at the mean slowdown and the mean link rate, with the model's cost table
   (``by_speed``: on the fleet as it is). Memory plays no part.

So the ranking is the same for any memory budgets. `equal_groups_plan` runs the first
plan of the ranking that fits every member's budget (Eq. 3, with the micro-batches 1F1B
keeps in flight): what a user of such a planner does after an out-of-memory error, run
its next configuration. `over_budget` names the members a plan overflows: the paper's
"X". DESIGN §Asteroid's baselines records the choices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from aiopipe.errors import ConfigError
from aiopipe.scheduler.asteroid import (
    Device,
    HppModel,
    HppPlan,
    HppStage,
    allocate,
    plan,
    round_time,
)

__all__ = ["PLANNERS", "Planner", "equal_groups_plan", "equal_groups_plans", "over_budget"]

#: A planner of Asteroid's plans: (model, fleet, micro-batches, micro-batch size) -> plan.
Planner = Callable[[HppModel, Sequence[Device], int, int], HppPlan]

#: A memory budget that binds nothing (bytes).
_UNLIMITED = float(1 << 60)


def equal_groups_plans(model: HppModel, fleet: Sequence[Device], micro_batches: int,
                       batch: int, *, by_speed: bool = False) -> list[HppPlan]:
    """The baseline's plans, one per stage count, best first by its own ranking (module
    docstring, rules 1-4); each with Asteroid's estimate of its round on ``fleet`` as it
    is (``round_s``). Memory budgets are ignored."""
    n, units = len(fleet), model.units
    mean = Device(math.fsum(d.slowdown for d in fleet) / n, _UNLIMITED,
                  math.fsum(d.bandwidth for d in fleet) / n)
    homogeneous = [mean] * n
    unlimited = [replace(d, memory=_UNLIMITED) for d in fleet]
    ranked: list[tuple[float, HppPlan]] = []
    for stages in range(1, min(units, n) + 1):
        groups = _equal_groups(n, stages)
        if max(map(len, groups)) * model.min_rows > batch:
            continue  # a member would compute too few rows (`HppModel.min_rows`)
        rows_of = (partial(_speed_rows, model, unlimited, batch) if by_speed
                   else partial(_rows_alike, batch))
        compute = partial(_slowest, model, fleet, groups, rows_of) if by_speed else partial(
            _alike, model, mean, batch, groups)
        chosen = [HppStage(first, stop, groups[p], rows_of(groups[p], first, stop))
                  for p, (first, stop) in enumerate(_balanced_cuts(units, stages, compute))]
        estimate = round_time(model, fleet, chosen, micro_batches, batch)
        rank = estimate if by_speed else round_time(model, homogeneous, chosen,
                                                    micro_batches, batch)
        ranked.append((rank, HppPlan(tuple(chosen), estimate)))
    ranked.sort(key=lambda pair: pair[0])
    return [found for _, found in ranked]


def equal_groups_plan(model: HppModel, fleet: Sequence[Device], micro_batches: int,
                      batch: int, *, by_speed: bool = False) -> HppPlan:
    """The first of `equal_groups_plans` whose members all fit their memory budgets.

    Raises:
        ConfigError: none fits (naming the first plan's most overflowed member).
    """
    plans = equal_groups_plans(model, fleet, micro_batches, batch, by_speed=by_speed)
    for found in plans:
        if not over_budget(model, fleet, found.stages, micro_batches):
            return found
    if not plans:
        raise ConfigError(f"no equal-groups plan: every group would have more devices "
                          f"than the {batch} samples of a micro-batch allow "
                          f"({model.min_rows} each at least)")
    device, needed = max(over_budget(model, fleet, plans[0].stages, micro_batches).items(),
                         key=lambda item: item[1] - fleet[item[0]].memory)
    raise ConfigError(f"no equal-groups plan fits the devices' memory budgets: the "
                      f"baseline's first choice ({len(plans[0].stages)} stages) needs "
                      f"{needed / 2**20:.1f} MiB on device {device}, whose budget is "
                      f"{fleet[device].memory / 2**20:.1f} MiB")


def over_budget(model: HppModel, fleet: Sequence[Device], stages: Sequence[HppStage],
                micro_batches: int) -> dict[int, float]:
    """The members of ``stages`` whose Eq. 3 (their rows, with the ``min(2(S - p) - 1,
    N)`` micro-batches 1F1B keeps in flight on stage p) exceeds their budget: device ->
    bytes needed."""
    over = {}
    for p, stage in enumerate(stages):
        in_flight = min(2 * (len(stages) - p) - 1, micro_batches)
        for d, rows in zip(stage.devices, stage.samples, strict=True):
            needed = model.memory(stage.first, stage.stop, rows, in_flight)
            if needed > fleet[d].memory:
                over[d] = needed
    return over


def _equal_groups(devices: int, stages: int) -> list[tuple[int, ...]]:
    """Devices 0..devices-1 in order, in ``stages`` consecutive groups as equal as can be
    (the first ``devices mod stages`` one larger)."""
    size, extra = divmod(devices, stages)
    groups, start = [], 0
    for p in range(stages):
        stop = start + size + (p < extra)
        groups.append(tuple(range(start, stop)))
        start = stop
    return groups


def _equal_rows(batch: int, members: int) -> tuple[int, ...]:
    """A micro-batch of ``batch`` rows split equally (the first ``batch mod members``
    members one more)."""
    size, extra = divmod(batch, members)
    return tuple(size + (i < extra) for i in range(members))


def _rows_alike(batch: int, group: tuple[int, ...], first: int, stop: int) -> tuple[int, ...]:
    """Rule 2: a group's rows, equal (whatever its units)."""
    return _equal_rows(batch, len(group))


def _speed_rows(model: HppModel, unlimited: Sequence[Device], batch: int,
                group: tuple[int, ...], first: int, stop: int) -> tuple[int, ...]:
    """Rule 2, ``by_speed``: a group's rows by Algorithm 1 without memory limits."""
    found = allocate(model, unlimited, group, first, stop, batch, 1)
    assert found is not None, "unlimited memory and no more members than rows"
    return found


def _alike(model: HppModel, mean: Device, batch: int, groups: Sequence[tuple[int, ...]],
           first: int, stop: int, p: int) -> float:
    """Rule 3: stage p's compute on a device of the mean slowdown, on its largest share."""
    return sum(model.times(first, stop, _equal_rows(batch, len(groups[p]))[0], mean))


def _slowest(model: HppModel, fleet: Sequence[Device], groups: Sequence[tuple[int, ...]],
             rows_of: Callable[[tuple[int, ...], int, int], tuple[int, ...]],
             first: int, stop: int, p: int) -> float:
    """Rule 3, ``by_speed``: stage p's compute, its slowest member's on its own rows."""
    group = groups[p]
    rows = rows_of(group, first, stop)
    return max(sum(model.times(first, stop, r, fleet[d])) for d, r in
               zip(group, rows, strict=True))


def _balanced_cuts(units: int, stages: int, compute: Callable[[int, int, int], float]
                   ) -> list[tuple[int, int]]:
    """The ``stages`` consecutive unit ranges (first, stop) whose largest
    ``compute(first, stop, p)`` is least (ties: the earliest cuts)."""
    # best[p][stop]: the least largest compute of stages 0..p over units 0..stop-1
    best = [[math.inf] * (units + 1) for _ in range(stages)]
    cut = [[0] * (units + 1) for _ in range(stages)]
    for stop in range(1, units + 1):
        best[0][stop] = compute(0, stop, 0)
    for p in range(1, stages):
        for stop in range(p + 1, units + 1):
            for first in range(p, stop):
                worst = max(best[p - 1][first], compute(first, stop, p))
                if worst < best[p][stop]:
                    best[p][stop], cut[p][stop] = worst, first
    bounds, stop = [], units
    for p in range(stages - 1, 0, -1):
        first = cut[p][stop]
        bounds.append((first, stop))
        stop = first
    bounds.append((0, stop))
    return bounds[::-1]


#: The planners ``[asteroid] planner`` names: Asteroid's Algorithm 2, the equal-groups
#: baseline, and the baseline with rows and cuts by each device's speed.
PLANNERS: dict[str, Planner] = {
    "asteroid": plan,
    "equal-groups": equal_groups_plan,
    "equal-groups-by-speed": partial(equal_groups_plan, by_speed=True),
}
