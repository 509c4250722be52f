"""Estimating PiPar iterations and epochs from profiles (pipar.txt §3.3.2, DESIGN §4).

Pure: no I/O, no clock, no torch. Functions of a `ModelProfile`, `DeviceProfile`\\ s and
plans (P_k, N_k). The profiles live in `aiopipe.scheduler.profiles` (re-exported here);
the list schedule that the estimates run, on each plan's stage seconds, is
`aiopipe.scheduler.chain`.

Theory of operation
-------------------
One iteration of device k with plan (P, N) is N micro-batches of B' = floor(B/N) samples
flowing through five stages: forward ``f`` of units 1..P on the device, upload ``u``,
server pass ``s`` (forward, loss and backward of units P+1..Q on device k's replica),
download ``d``, backward ``b`` on the device; then the device steps, and the server steps
replica k after its N-th ``s``. Each resource is serial: each device's compute, uplink and
downlink, and the server's compute, which every device shares. The dependencies are
pipar.txt Table 1 (Eqs. 11-13)::

    f_n   after f_{n-1}                          device compute, f_1..f_N back to back
    u_n   after f_n and u_{n-1}                  uplink; arrives `latency` after it ends
    s_n   after u_n has arrived and s_{n-1}      server, see [Note: server order]
    d_n   after s_n and d_{n-1}                  downlink; arrives `latency` after it ends
    b_1   after f_N and d_1 has arrived;  b_n after d_n has arrived and b_{n-1}
    device step after b_N;  server step of replica k after s_N (on the server)

Stage seconds: f, b and the device step are the `CostTable`'s (server-side) times at B'
multiplied by the device's slowdown; s is forward + backward of units P+1..Q at B' and
the server step is ``step_time(P, Q)``, both unscaled; u and d are a frame's wire time
(bytes x 8 / bandwidth, 0 when unshaped), see `ModelProfile` for frame sizes. A table
that charges accumulated gradients ([Note: accumulated gradients] in costs.py) adds
(N - 1) / N of them to every b and s: the runtime charges them to every backward but an
iteration's first, so there the estimate and the virtual-time runtime differ by less
than one accumulation per iteration (the comparisons with the runtime below are for
tables without).

`estimate_iteration` is an event-driven list schedule of this DAG for the whole fleet,
everyone starting at 0: per device the f/u chain is computed directly, the server is
simulated with a heap of pending requests (O(KN log K) for K devices with N micro-batches),
and the d/b chain follows. For one device it is exactly the longest path through the DAG
(Eqs. 11-13); the virtual-time runtime takes exactly this time (tests/runtime/
test_runtime_overlap.py), and for a fleet that starts together (unshaped links) it equals
the runtime's device step ends too (tests/scheduler/test_scheduler_runtime.py).

[Note: server order] The runtime's session for device k hands the server one request at
a time: it asks for s_n once activation n has arrived *and* its own s_{n-1} is done, and
asks for the replica's step right after s_N. The server's compute queue is FIFO, so
requests are served in the order they were made: ties by device id, then micro-batch (the
step counts as micro-batch N). A device's server work is therefore never faster than when
it is alone, which makes `alone_iteration_end` a lower bound for its end in any fleet.
Note that FIFO list scheduling is not monotone in the fleet: slowing one device's link can
let another device's request go first and shorten the iteration (Graham's anomaly); for
one device the estimate is monotone in every stage time.

[Note: epoch approximation] `estimate_epoch` runs the fleet's iterations in phases.
Device k runs iterations_k = floor(samples_k / (B' N_k)) iterations (the runtime's rule,
[Note: iterations per epoch] in aiopipe/runtime/plan.py). Phase 1 lasts as many
iterations as the device with the fewest has, and every device takes part; phase 2 lasts
until the next fewest, without the devices that are done; and so on. In phase 1 each
device starts when its first download of the device half has arrived (a larger half
starts later: its server requests land later), in the later phases at 0; each phase
chains up to `CHAINED_ITERATIONS` iterations back to back as the runtime runs them
([Note: chained iterations]): devices that collide on the server in the first iteration
drift out of phase in the next ones. A device's phase lasts until both its halves have
stepped in the last chained iteration, plus, for each iteration beyond those, the mean
spacing of its steps over the later half of the chained ones (the start's transient has
settled by then). Device k's epoch is its phases + down_k + up_k, where down_k and up_k
move the device half's parameters and buffers (``state_bytes`` of units 1..P plus one
frame overhead) once each way per aggregation (once per epoch, or per
``aggregation_every`` iterations: `aggregations_per_epoch`; the first download is
already in phase 1). The fleet's epoch is the slowest device's, at least the server's
busy seconds over the epoch (the phases do not carry the server's backlog from one to
the next), plus the server's aggregation of each round (`CostTable.aggregate_time` of
the fleet's size: it starts when the last device's model has arrived, and the next
round's downloads wait for it). tests/scheduler/test_scheduler_runtime.py bounds how far
this is from the virtual-time runtime, for identical devices with one plan and for a
mixed fleet. The chained iterations are there because one synchronized iteration
repeated overestimates identical devices (they drift out of phase), the start at the
first download because starting every device at 0 underestimates mixed split points (a
larger device half starts later). Not modelled: the trace report riding on the
uploaded model. The server's evaluation after an epoch is not part of the epoch's time.

[Note: real clocks] The estimate is exact for the virtual-time runtime charged from the
same table. On the system clock a run is slower than it by what the table cannot know
(bench/planner_accuracy.py measures how much on this machine). Timing each work item
inside its thread shows where the time goes: the hand-over to a compute thread and back
stays small even with other threads busy (and the table charges the runtime's measured
hand-over and messages, costs.py [Note: per-stage costs]); the work itself is what
grows, the devices' forwards and backwards far more than the server's passes. What
inflates it is mostly the interpreter lock that the emulated nodes of one process
share, not caches: a device half's CPU time moves little after its caches are swept or
beside a busy process, but much beside a thread busy in Python or with a shorter switch
interval, which a profile taken alone does not see. (Steps in a run also take well
above the sum of their units' steps timed alone, which is why the profiler times the
whole model's step and passes in sequence, costs.py [Note: units in sequence].) A slowed device's
item is emulated as ``slowdown`` x the CPU time its thread spent
(aiopipe/runtime/compute.py), so a device's inflated CPU time inflates its emulated time
by the same fraction, and estimates of emulated fleets come out low by about that much.
This decides close calls between a compute-bound and a link-bound plan, e.g. vgg5 on
4g+ at P = 2: at N = 32 (one sample per micro-batch) the devices' compute is the
critical path and is estimated low, at N = 16 the uplink is, so the estimate has the
two close, either way round depending on the profile's noise at one sample, where
N = 32 runs slower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from aiopipe.errors import ConfigError
from aiopipe.scheduler.chain import (
    CHAINED_ITERATIONS,
    Stages,
    alone_end,
    chained_schedule,
    cycles,
    schedule_ends,
)
from aiopipe.scheduler.cost_table import CostTable
from aiopipe.scheduler.profiles import DeviceProfile, ModelProfile

__all__ = [
    "DeviceProfile",
    "FleetEstimate",
    "ModelProfile",
    "alone_iteration_end",
    "estimate_epoch",
    "estimate_iteration",
    "estimate_steady_iteration",
]


@dataclass(frozen=True, slots=True)
class FleetEstimate:
    """One synchronized iteration of the fleet, every device starting at 0.

    ``time_s``: until all work is done (the latest of every end below).
    ``device_end_s[k]``: when device k's optimizer step ends (what the runtime's trace
    shows as the end of its iteration). ``replica_end_s[k]``: when the server's step of
    device k's replica ends (usually earlier; later when the server is contended).
    Busy seconds per resource: each device's compute (``compute_busy_s[k]``), uplink and
    downlink wire time (latency is not busy time), and the server's compute.
    """

    time_s: float
    device_end_s: tuple[float, ...]
    replica_end_s: tuple[float, ...]
    compute_busy_s: tuple[float, ...]
    uplink_busy_s: tuple[float, ...]
    downlink_busy_s: tuple[float, ...]
    server_busy_s: float

    def busy_by_track(self) -> dict[str, float]:
        """Busy seconds keyed by the runtime's trace tracks (``"device0/compute"``, ...)."""
        busy = {"server/compute": self.server_busy_s}
        for k, (c, u, d) in enumerate(
            zip(self.compute_busy_s, self.uplink_busy_s, self.downlink_busy_s, strict=True)
        ):
            busy[f"device{k}/compute"] = c
            busy[f"device{k}/uplink"] = u
            busy[f"device{k}/downlink"] = d
        return busy


# -- stage times ------------------------------------------------------------------------


class UnitTimes:
    """Per-split-point compute sums at one micro-batch size, computed once.

    The sums are formed exactly as `CostTable.forward_time` & co. form them (same terms,
    same order), so estimates built from them equal estimates built from the table.
    """

    __slots__ = ("device_acc", "device_b", "device_f", "device_step", "server_acc", "server_s",
                 "server_step")

    def __init__(self, costs: CostTable, batch: int) -> None:
        q = costs.units
        fwd = [costs.forward_time(u, u + 1, batch) for u in range(q)]
        bwd = [costs.backward_time(u, u + 1, batch) for u in range(q)]
        stp = [costs.step_time(u, u + 1) for u in range(q)]
        acc = [costs.accumulate_time(u, u + 1) for u in range(q)]
        self.device_f = [sum(fwd[:p]) for p in range(q + 1)]
        self.device_b = [sum(bwd[:p]) for p in range(q + 1)]
        self.device_step = [sum(stp[:p]) for p in range(q + 1)]
        self.device_acc = [sum(acc[:p]) for p in range(q + 1)]
        self.server_s = [sum(fwd[p:]) + sum(bwd[p:]) for p in range(q + 1)]
        self.server_step = [sum(stp[p:]) for p in range(q + 1)]
        self.server_acc = [sum(acc[p:]) for p in range(q + 1)]


class StageCache:
    """`UnitTimes` per micro-batch size for one model (and for each device's own table):
    what planning calls share."""

    __slots__ = ("_model", "_own", "_times")

    def __init__(self, model: ModelProfile) -> None:
        self._model = model
        self._times: dict[int, UnitTimes] = {}
        #: by id: a device's own table (kept alive here) and its sums per batch size
        self._own: dict[int, tuple[CostTable, dict[int, UnitTimes]]] = {}

    def times(self, batch: int, costs: CostTable | None = None) -> UnitTimes:
        """The sums at micro-batch size ``batch`` of the model's table, or of ``costs``."""
        if costs is None or costs is self._model.costs:
            table, cache = self._model.costs, self._times
        else:
            table, cache = self._own.setdefault(id(costs), (costs, {}))
        found = cache.get(batch)
        if found is None:
            found = cache[batch] = UnitTimes(table, batch)
        return found

    def stages(
        self, device: DeviceProfile, split_point: int, parallel: int, batch_size: int
    ) -> Stages:
        """Stage seconds of ``device`` with plan (P, N) at batch size B."""
        model, p = self._model, split_point
        micro = batch_size // parallel
        t = self.times(micro)
        own = t if device.costs is None else self.times(micro, device.costs)
        slow = device.slowdown
        # [Note: accumulated gradients] (costs.py): N - 1 of the N backwards add into
        # the gradients; spread evenly over the micro-batches
        shared = (parallel - 1) / parallel
        return Stages(
            n=parallel,
            f=own.device_f[p] * slow,
            b=(own.device_b[p] + own.device_acc[p] * shared) * slow,
            device_step=own.device_step[p] * slow,
            u=device.uplink.wire_time(model.activation_frame_bytes(p, micro)),
            up_latency=device.uplink.latency_s,
            s=t.server_s[p] + t.server_acc[p] * shared,
            server_step=t.server_step[p],
            d=device.downlink.wire_time(model.gradient_frame_bytes(p, micro)),
            down_latency=device.downlink.latency_s,
        )


def fleet_stages(model: ModelProfile, devices: Sequence[DeviceProfile],
                 plans: Sequence[tuple[int, int]], batch_size: int) -> list[Stages]:
    """Stage seconds of every device's plan (plans already checked)."""
    cache = StageCache(model)
    return [cache.stages(dev, p, n, batch_size)
            for dev, (p, n) in zip(devices, plans, strict=True)]


# -- public estimates ------------------------------------------------------------------


def _check_plans(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    plans: Sequence[tuple[int, int]],
    batch_size: int,
) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch size must be an int >= 1, got {batch_size!r}")
    if not devices:
        raise ConfigError("the fleet has no devices")
    if len(plans) != len(devices):
        raise ConfigError(f"{len(plans)} plans for {len(devices)} devices")
    q = model.units
    for k, (p, n) in enumerate(plans):
        if not (isinstance(p, int) and isinstance(n, int)):
            raise ConfigError(f"device {k}: plan ({p!r}, {n!r}) must be two ints")
        if not 1 <= p < q:
            raise ConfigError(f"device {k}: split point {p} outside 1..{q - 1}")
        if not 1 <= n <= batch_size:
            raise ConfigError(
                f"device {k}: {n} micro-batches outside 1..{batch_size} (the batch size)"
            )


def iterations_per_epoch(device: DeviceProfile, parallel: int, batch_size: int) -> int:
    """floor(samples / (B' N)): the runtime's rule (plan.py [Note: iterations per epoch])."""
    return device.samples // ((batch_size // parallel) * parallel)


def estimate_iteration(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    plans: Sequence[tuple[int, int]],
    batch_size: int,
) -> FleetEstimate:
    """Estimate one synchronized iteration of the fleet; ``plans[k] = (P_k, N_k)``.

    Raises:
        ConfigError: no devices, as many plans as devices not given, a split point outside
            1..Q-1, N outside 1..batch_size, or a batch size < 1.
    """
    _check_plans(model, devices, plans, batch_size)
    fleet = fleet_stages(model, devices, plans, batch_size)
    device_end, replica_end = schedule_ends(fleet, model.server_lanes)
    return FleetEstimate(
        time_s=max(cycles(device_end, replica_end)),
        device_end_s=tuple(device_end),
        replica_end_s=tuple(replica_end),
        compute_busy_s=tuple(st.n * (st.f + st.b) + st.device_step for st in fleet),
        uplink_busy_s=tuple(st.n * st.u for st in fleet),
        downlink_busy_s=tuple(st.n * st.d for st in fleet),
        server_busy_s=sum(st.n * st.s + st.server_step for st in fleet),
    )


def alone_iteration_end(
    model: ModelProfile, device: DeviceProfile, plan: tuple[int, int], batch_size: int
) -> float:
    """One device's iteration with an otherwise idle server (closed form, O(1)).

    A lower bound for the device's end in any fleet ([Note: server order]).

    Raises:
        ConfigError: as `estimate_iteration`.
    """
    _check_plans(model, [device], [plan], batch_size)
    return alone_end(StageCache(model).stages(device, plan[0], plan[1], batch_size))


def aggregations_per_epoch(iterations: int, aggregation_every: int) -> int:
    """Rounds a device with ``iterations`` per epoch takes part in: one per
    ``aggregation_every`` iterations (0: one per epoch)."""
    return math.ceil(iterations / aggregation_every) if aggregation_every > 0 else 1


def transfer_times(
    model: ModelProfile, device: DeviceProfile, split_point: int, rounds: int = 1
) -> tuple[float, float]:
    """Seconds to send the device half down and back up, ``rounds`` times each (with
    latency): once per aggregation."""
    nbytes = model.model_frame_bytes(split_point)
    return (rounds * device.downlink.transfer_time(nbytes),
            rounds * device.uplink.transfer_time(nbytes))


def steady_spacing(ends: Sequence[float]) -> float:
    """Mean spacing of a device's step ends over the later half of its chained iterations
    (the start's transient has settled by then); 0 for a single iteration."""
    rounds = len(ends)
    half = rounds // 2
    return (ends[-1] - ends[half - 1]) / (rounds - half) if rounds > 1 else 0.0


def estimate_steady_iteration(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    plans: Sequence[tuple[int, int]],
    batch_size: int,
) -> float:
    """The fleet's iteration once its iterations run back to back: per device the mean
    spacing of its steps over `CHAINED_ITERATIONS` chained iterations, after the start's
    transient ([Note: chained iterations]); the slowest device's.

    This is what a run's iterations after its first take (one device step to the
    next), and what `estimate_epoch` charges per iteration beyond the chained ones.
    `estimate_iteration` is a different figure: one iteration that every device starts
    at 0, so that they all collide on the server at once.

    Raises:
        ConfigError: as `estimate_iteration`.
    """
    _check_plans(model, devices, plans, batch_size)
    fleet = fleet_stages(model, devices, plans, batch_size)
    device_ends, _ = chained_schedule(fleet, CHAINED_ITERATIONS, lanes=model.server_lanes)
    return max(steady_spacing(ends) for ends in device_ends)


def device_epochs(
    fleet: Sequence[Stages], iterations: Sequence[int], transfers: Sequence[tuple[float, float]],
    starts: Sequence[float], lanes: int = 1,
) -> tuple[list[float], int, float]:
    """Each device's epoch by phases ([Note: epoch approximation]), the number of
    micro-batches the schedules simulated (what a search spends), and the server's busy
    seconds over the epoch, over its ``lanes`` (a floor for the fleet's epoch: the phases
    do not carry the server's backlog from one to the next).

    ``transfers[k]``: device k's download and upload seconds over the epoch;
    ``starts[k]``: when it starts its first iteration (its first download, part of
    ``transfers[k][0]``)."""
    spent = [0.0] * len(fleet)
    work = done = 0
    server = sum(i * (st.n * st.s + st.server_step) for st, i in zip(fleet, iterations,
                                                                     strict=True)) / lanes
    for count in sorted(set(iterations)):
        active = [k for k, i in enumerate(iterations) if i >= count]
        phase = [fleet[k] for k in active]
        length = count - done
        rounds = min(length, CHAINED_ITERATIONS)
        device_ends, replica_ends = chained_schedule(
            phase, rounds, [starts[k] for k in active] if done == 0 else None, lanes=lanes)
        for k, dev, rep in zip(active, device_ends, replica_ends, strict=True):
            last = dev[-1] if dev[-1] > rep[-1] else rep[-1]
            if math.isinf(last):  # a plan that cannot run (inf - inf is no period)
                spent[k] = math.inf
                continue
            spent[k] += last + (length - rounds) * steady_spacing(dev)
        work += rounds * sum(st.n for st in phase)
        done = count
    return [t + down - start + up for t, (down, up), start in zip(spent, transfers, starts,
                                                                  strict=True)], work, server


class FleetEpoch(NamedTuple):
    """`fleet_epoch`'s answer: the fleet's epoch, each device's, and the micro-batches
    the schedules simulated."""

    time_s: float
    per_device: list[float]
    work: int


def fleet_epoch(
    model: ModelProfile, fleet: Sequence[Stages], iterations: Sequence[int],
    transfers: Sequence[tuple[float, float]], starts: Sequence[float], aggregation_every: int,
) -> FleetEpoch:
    """The fleet's epoch ([Note: epoch approximation]): the slowest device's epoch
    (`device_epochs`, same arguments), at least the server's busy seconds over the epoch,
    plus the server's aggregation of each round. The one place both `estimate_epoch` and
    the plan search form it."""
    per_device, work, server = device_epochs(fleet, iterations, transfers, starts,
                                             model.server_lanes)
    rounds = aggregations_per_epoch(max(iterations), aggregation_every)
    aggregation = rounds * model.costs.aggregate_time(len(fleet))
    return FleetEpoch(max(*per_device, server) + aggregation, per_device, work)


def estimate_epoch(
    model: ModelProfile,
    devices: Sequence[DeviceProfile],
    plans: Sequence[tuple[int, int]],
    batch_size: int,
    *,
    aggregation_every: int = 0,
) -> float:
    """Estimate one epoch of the fleet in seconds ([Note: epoch approximation]);
    ``aggregation_every`` > 0 moves the device halves once per that many iterations.

    Raises:
        ConfigError: as `estimate_iteration`, or a device holds fewer samples than one
            iteration of its plan (B' x N), which the runtime refuses too.
    """
    _check_plans(model, devices, plans, batch_size)
    iterations = [
        iterations_per_epoch(dev, n, batch_size) for dev, (_, n) in zip(devices, plans, strict=True)
    ]
    for k, i in enumerate(iterations):
        if i < 1:
            p, n = plans[k]
            raise ConfigError(
                f"device {k} holds {devices[k].samples} samples, fewer than "
                f"one iteration of plan P={p}, N={n} "
                f"({(batch_size // n) * n})"
            )
    fleet = fleet_stages(model, devices, plans, batch_size)
    transfers = [
        transfer_times(model, dev, p, aggregations_per_epoch(i, aggregation_every))
        for dev, (p, _), i in zip(devices, plans, iterations, strict=True)
    ]
    starts = [transfer_times(model, dev, p)[0] for dev, (p, _) in zip(devices, plans, strict=True)]
    return fleet_epoch(model, fleet, iterations, transfers, starts, aggregation_every).time_s
