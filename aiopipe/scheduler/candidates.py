"""The plan search's candidates and objective: which (P, N) each device may take, and
the fleet epoch of a choice of them.

A `Candidate` is one plan of one device with what the search needs of it, computed once
(its stage seconds, iterations, transfers and two bounds on its epoch). `Objective` is the
fleet estimate of `aiopipe.scheduler.estimate` over a choice of candidates, counting the
micro-batches its schedules simulate: the search's budget. Pure: functions of profiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from aiopipe.errors import ConfigError
from aiopipe.scheduler.chain import Stages, alone_end, alone_floor
from aiopipe.scheduler.estimate import (
    StageCache,
    aggregations_per_epoch,
    fleet_epoch,
    iterations_per_epoch,
    transfer_times,
)
from aiopipe.scheduler.profiles import DeviceProfile, ModelProfile

__all__ = ["Candidate", "Objective", "device_memory_bytes", "parallel_shortlist",
           "plan_candidates"]


class Candidate(NamedTuple):  # a tuple: built once per candidate, 10^4 - 10^5 times
    """One plan (P, N) of one device, with what the search needs of it."""

    plan: tuple[int, int]
    stages: Stages
    iterations: int
    transfer: tuple[float, float]
    start: float  # the first download: when its first iteration starts
    alone_epoch: float
    floor_epoch: float  # no fleet estimate of the device's epoch is lower
    server_load: float  # server seconds per epoch


# -- candidates --------------------------------------------------------------------------


def parallel_shortlist(
    model: ModelProfile,
    device: DeviceProfile,
    split_point: int,
    batch_size: int,
    cache: StageCache | None = None,
) -> list[int]:
    """The N candidates for one device and split point ([Note: N shortlist]).

    [Note: N shortlist] PiPar Eq. 14 fills the device's idle time between f and b of one
    micro-batch with the forwards of the next ones:
    N_eq = 1 + ceil((t(u) + t(s) + t(d)) / min(t(f), t(b))), with the stage times of the
    whole batch (N = 1, latencies included in t(u) and t(d); t(s) = t(f^s) + t(b^s)).
    The shortlist is {1, N_eq - 1, N_eq, N_eq + 1} plus every power of two <= B, clipped
    to 1..B. When min(t(f), t(b)) is 0, N_eq = B.
    """
    st = (cache or StageCache(model)).stages(device, split_point, 1, batch_size)
    gap = st.u + st.up_latency + st.s + st.d + st.down_latency
    fill = min(st.f, st.b)
    eq = batch_size if fill <= 0 else 1 + math.ceil(min(gap / fill, float(batch_size)))
    values = {1, eq - 1, eq, eq + 1}
    power = 1
    while power <= batch_size:
        values.add(power)
        power *= 2
    return sorted(v for v in values if 1 <= v <= batch_size)


def device_memory_bytes(
    model: ModelProfile, split_point: int, parallel: int, batch_size: int
) -> int:
    """Bytes a device needs for plan (P, N) ([Note: device memory]).

    [Note: device memory] 3 x the device half's parameter and buffer bytes (weights,
    gradients, momentum; buffers are counted thrice too, a small overestimate) plus the
    activations kept for backward: N x B' x the per-sample output bytes of units 1..P.
    Inputs, temporaries and the allocator's slack are not counted.
    """
    micro = batch_size // parallel
    return 3 * sum(model.state_bytes[:split_point]) + parallel * micro * sum(
        model.activation_bytes[:split_point]
    )


def _check_inputs(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    batch_size: int,
    split_points: Sequence[int] | None,
    parallel_batches: Sequence[int] | None,
    memory_budget_bytes: Sequence[int | None] | None,
) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an int >= 1, got {batch_size!r}")
    if not devices:
        raise ConfigError("the fleet has no devices")
    q = model.units
    if split_points is not None and (not split_points or any(not 1 <= p < q for p in split_points)):
        raise ConfigError(
            f"split points {list(split_points)} must be a non-empty list within 1..{q - 1}"
        )
    if parallel_batches is not None and (
        not parallel_batches or any(not 1 <= n <= batch_size for n in parallel_batches)
    ):
        raise ConfigError(
            f"parallel batches {list(parallel_batches)} must be a non-empty "
            f"list within 1..{batch_size} (the batch size)"
        )
    if memory_budget_bytes is not None and len(memory_budget_bytes) != len(devices):
        raise ConfigError(f"{len(memory_budget_bytes)} memory budgets for {len(devices)} devices")


def plan_candidates(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    batch_size: int,
    split_points: Sequence[int] | None,
    parallel_batches: Sequence[int] | None,
    memory_budget_bytes: Sequence[int | None] | None,
    aggregation_every: int = 0,
) -> list[list[Candidate]]:
    """Each device's candidates, as `aiopipe.scheduler.select.select_plans` describes
    its arguments. Devices with equal profiles and no memory budget share one list: the
    search takes devices that share a list as identical.

    Raises:
        ConfigError: as `aiopipe.scheduler.select.select_plans`.
    """
    _check_inputs(model, devices, batch_size, split_points, parallel_batches, memory_budget_bytes)
    points = sorted(set(split_points)) if split_points is not None else list(range(1, model.units))
    fixed_n = sorted(set(parallel_batches)) if parallel_batches is not None else None
    cache = StageCache(model)
    by_profile: dict[DeviceProfile, list[Candidate]] = {}
    result = []
    for k, device in enumerate(devices):
        budget = memory_budget_bytes[k] if memory_budget_bytes is not None else None
        if device not in by_profile:
            by_profile[device] = _device_candidates(
                model, device, batch_size, points, fixed_n, cache, aggregation_every
            )
        every = by_profile[device]
        if not every:
            raise ConfigError(
                f"device {k} holds {device.samples} samples, fewer than one "
                "iteration of any candidate plan"
            )
        if budget is None:
            result.append(every)
            continue
        needs = [device_memory_bytes(model, *c.plan, batch_size) for c in every]
        fitting = [c for c, need in zip(every, needs, strict=True) if need <= budget]
        if not fitting:
            raise ConfigError(
                f"device {k} has a memory budget of {budget} bytes; every "
                f"candidate plan needs more, the smallest {min(needs)} bytes"
            )
        result.append(fitting)
    return result


def _device_candidates(
    model: ModelProfile,
    device: DeviceProfile,
    batch_size: int,
    points: Sequence[int],
    fixed_n: Sequence[int] | None,
    cache: StageCache,
    aggregation_every: int,
) -> list[Candidate]:
    found = []
    for p in points:
        shortlist = (
            fixed_n
            if fixed_n is not None
            else parallel_shortlist(model, device, p, batch_size, cache)
        )
        start = transfer_times(model, device, p)[0]  # one download of this half
        for n in shortlist:
            iterations = iterations_per_epoch(device, n, batch_size)
            if iterations < 1:
                continue
            transfer = transfer_times(
                model, device, p, aggregations_per_epoch(iterations, aggregation_every)
            )
            st = cache.stages(device, p, n, batch_size)
            found.append(
                Candidate(
                    plan=(p, n),
                    stages=st,
                    iterations=iterations,
                    transfer=transfer,
                    start=start,
                    alone_epoch=transfer[0] + iterations * alone_end(st) + transfer[1],
                    floor_epoch=transfer[0] + iterations * alone_floor(st) + transfer[1],
                    server_load=iterations * (n * st.s + st.server_step),
                )
            )
    return found


# -- the fleet objective -----------------------------------------------------------------


class Objective:
    """The fleet epoch of a choice of candidates (`fleet_epoch`, as `estimate_epoch`
    gives it), counting the work spent: ``work``, the micro-batches its schedules have
    simulated."""

    def __init__(self, model: ModelProfile, candidates: list[list[Candidate]],
                 aggregation_every: int) -> None:
        self.model = model
        self.candidates = candidates
        self.aggregation_every = aggregation_every
        self.work = 0

    def __call__(self, choice: Sequence[int]) -> tuple[float, list[float]]:
        chosen = [cs[i] for cs, i in zip(self.candidates, choice, strict=True)]
        return self._epoch(chosen, [c.stages for c in chosen])

    def at_speeds(self, choice: Sequence[int], speeds: tuple[float, float]) -> float:
        """The fleet estimate of ``choice`` with the server's compute seconds times
        ``speeds[0]`` and the devices' times ``speeds[1]`` (links as they are; [Note:
        speed band])."""
        server, device = speeds
        chosen = [cs[i] for cs, i in zip(self.candidates, choice, strict=True)]
        fleet = [c.stages._replace(f=c.stages.f * device, b=c.stages.b * device,
                                   device_step=c.stages.device_step * device,
                                   s=c.stages.s * server,
                                   server_step=c.stages.server_step * server)
                 for c in chosen]
        return self._epoch(chosen, fleet)[0]

    def _epoch(self, chosen: Sequence[Candidate], fleet: Sequence[Stages]
               ) -> tuple[float, list[float]]:
        value, per_device, work = fleet_epoch(
            self.model, fleet, [c.iterations for c in chosen],
            [c.transfer for c in chosen], [c.start for c in chosen], self.aggregation_every,
        )
        self.work += work
        return value, per_device
