"""Choosing the system for a fleet (``mode = "auto"``): each candidate's epoch with its
best plan, predicted from the same profiles, and the fastest one that fits.

Pure: functions of a `ModelProfile` and `DeviceProfile`\\ s, like the plan search.

[Note: choosing the system] The star systems differ only in where each device cuts the
model and how many micro-batches it pipelines, so one estimate covers all three:

- fl: every device trains the whole model (P = Q) on its batches of B, between a
  download and an upload of the whole model per round. Device k's epoch is
  down_k + iterations_k x (forward + backward + step of units 1..Q at B) x its slowdown
  + up_k; the fleet's is the slowest device's plus the server's aggregation per round
  (`fl_epoch`). No activation crosses a link and the server computes nothing but the
  average.
- sfl: one split point P for each device, one micro-batch per iteration (N = 1): the
  plan search (`select_plans`) over P with N fixed at 1, and its fleet estimate
  (`estimate_epoch`, [Note: epoch approximation]).
- pipar: the plan search over P and N (pipar.txt §3.3.3).

Each candidate keeps to the devices' memory budgets ([Note: device memory]): fl needs
the whole model's weights, gradients, momentum and a batch's activations; a candidate
no plan of which fits is shown with the reason and not chosen. The fastest candidate
wins; one within `TIE_MARGIN` of it that comes earlier in `STAR_MODES` (fl before sfl
before pipar: fewer moving parts, nothing of the model crossing links per batch) wins
instead, since the estimates are not that exact on real clocks ([Note: real clocks] in
estimate.py); a run checks its choice against measured rounds of the others
([Note: re-choosing the system] in aiopipe/runtime/systems/star/rechoose.py). The bound
that decides a candidate's epoch is its busiest resource over the epoch: a device's
compute, its uplink or downlink, or the server.

The pipeline systems (pipeline, ftpipehd, asteroid) train device 0's data only and
hadfl and fedbuff have no server on the data path: their epochs are not the same work,
so they are not among the candidates (docs/design.md, §Choosing the system).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aiopipe.errors import ConfigError
from aiopipe.scheduler.candidates import device_memory_bytes
from aiopipe.scheduler.estimate import (
    StageCache,
    aggregations_per_epoch,
    estimate_epoch,
    estimate_iteration,
    fleet_stages,
    iterations_per_epoch,
    transfer_times,
)
from aiopipe.scheduler.profiles import DeviceProfile, ModelProfile

__all__ = ["STAR_MODES", "TIE_MARGIN", "SystemEstimate", "choose_system", "estimate_systems",
           "explain", "fl_epoch", "summary"]

#: The systems ``mode = "auto"`` chooses among, simplest first.
STAR_MODES = ("fl", "sfl", "pipar")
#: A simpler system within this fraction of the fastest estimate is chosen instead.
TIE_MARGIN = 0.02


@dataclass(frozen=True, slots=True)
class SystemEstimate:
    """One candidate system's predicted epoch with its plan.

    ``plans[k]``: device k's (P, N) (fl: (Q, 1)); ``epoch_s``: None when no plan fits,
    ``refusal`` then says why; ``busy_s``: each resource's busy seconds over the epoch
    ("device0 compute", "device0 uplink", "device0 downlink", "server"); ``bound``: the
    busiest of them.
    """

    mode: str
    plans: tuple[tuple[int, int], ...] = ()
    epoch_s: float | None = None
    busy_s: tuple[tuple[str, float], ...] = ()
    refusal: str = ""

    @property
    def bound(self) -> str:
        """The busiest resource over the epoch ("" when the candidate does not fit)."""
        return max(self.busy_s, key=lambda item: item[1])[0] if self.busy_s else ""

    def plan_text(self) -> str:
        """The plans as "P2N4 x2, P3N1" (equal plans of devices in a row counted)."""
        words: list[str] = []
        previous, count = None, 0
        for plan in (*self.plans, None):
            if plan == previous:
                count += 1
                continue
            if previous is not None:
                word = f"P{previous[0]}N{previous[1]}"
                words.append(word if count == 1 else f"{word} x{count}")
            previous, count = plan, 1
        return ", ".join(words)


def fl_epoch(model: ModelProfile, devices: Sequence[DeviceProfile], batch_size: int, *,
             aggregation_every: int = 0) -> tuple[float, dict[str, float]]:
    """FL's epoch ([Note: choosing the system]) and each resource's busy seconds in it.

    Raises:
        ConfigError: a device holds fewer samples than one batch.
    """
    q, cache = model.units, StageCache(model)
    rounds_max, busy, ends = 1, {}, []
    for k, device in enumerate(devices):
        iterations = iterations_per_epoch(device, 1, batch_size)
        if iterations < 1:
            raise ConfigError(f"device {k} holds {device.samples} samples, fewer than one "
                              f"batch ({batch_size})")
        own = cache.times(batch_size, device.costs)
        work = iterations * (own.device_f[q] + own.device_b[q] + own.device_step[q]
                             ) * device.slowdown
        rounds = aggregations_per_epoch(iterations, aggregation_every)
        rounds_max = max(rounds_max, rounds)
        down, up = transfer_times(model, device, q, rounds)
        ends.append(down + work + up)
        busy[f"device{k} compute"] = work
        busy[f"device{k} downlink"] = rounds * device.downlink.wire_time(
            model.model_frame_bytes(q))
        busy[f"device{k} uplink"] = rounds * device.uplink.wire_time(model.model_frame_bytes(q))
    aggregation = rounds_max * model.costs.aggregate_time(len(devices))
    busy["server"] = aggregation
    return max(ends) + aggregation, busy


def estimate_systems(model: ModelProfile, devices: Sequence[DeviceProfile], batch_size: int, *,
                     modes: Sequence[str] = STAR_MODES,
                     memory_budget_bytes: Sequence[int | None] | None = None,
                     aggregation_every: int = 0) -> list[SystemEstimate]:
    """Each of ``modes``' (a subset of `STAR_MODES`) predicted epoch with its best plan,
    in ``modes``' order ([Note: choosing the system]).

    Raises:
        ConfigError: a mode that is not a star system's.
    """
    from aiopipe.scheduler.select import select_plans  # (select imports the estimates)

    budgets = list(memory_budget_bytes or [None] * len(devices))
    out = []
    for mode in modes:
        if mode not in STAR_MODES:
            raise ConfigError(f"mode auto chooses among {', '.join(STAR_MODES)}, not {mode!r}")
        try:
            if mode == "fl":
                _fits_whole_model(model, batch_size, budgets)
                epoch, busy = fl_epoch(model, devices, batch_size,
                                       aggregation_every=aggregation_every)
                plans = tuple((model.units, 1) for _ in devices)
            else:
                plans = tuple(select_plans(
                    model, devices, batch_size,
                    parallel_batches=[1] if mode == "sfl" else _divisors(batch_size),
                    memory_budget_bytes=budgets, aggregation_every=aggregation_every))
                epoch = estimate_epoch(model, devices, plans, batch_size,
                                       aggregation_every=aggregation_every)
                busy = _split_busy(model, devices, plans, batch_size, aggregation_every)
        except ConfigError as exc:
            out.append(SystemEstimate(mode, refusal=str(exc)))
            continue
        out.append(SystemEstimate(mode, plans, epoch, tuple(busy.items())))
    return out


def choose_system(estimates: Sequence[SystemEstimate]) -> SystemEstimate:
    """The fastest estimate that fits; a simpler one (earlier in `STAR_MODES`) within
    `TIE_MARGIN` of it instead.

    Raises:
        ConfigError: no candidate fits (the message gives each one's reason).
    """
    fitting = [e for e in estimates if e.epoch_s is not None]
    if not fitting:
        raise ConfigError("mode auto: no system fits the fleet: " + "; ".join(
            f"{e.mode}: {e.refusal}" for e in estimates))
    best = min(e.epoch_s for e in fitting if e.epoch_s is not None)
    return min((e for e in fitting if e.epoch_s is not None
                and e.epoch_s <= best * (1 + TIE_MARGIN)),
               key=lambda e: STAR_MODES.index(e.mode))


def explain(estimates: Sequence[SystemEstimate], chosen: SystemEstimate | None = None) -> str:
    """The candidates as a table: predicted epoch, plan, the bound that decided it (its
    busy seconds), the chosen one marked."""
    lines = [f"{'':2}{'system':8}{'epoch s':>9}  {'bound (busy s)':28}plan"]
    for e in estimates:
        mark = "->" if chosen is not None and e.mode == chosen.mode else ""
        if e.epoch_s is None:
            lines.append(f"{mark:2}{e.mode:8}{'-':>9}  does not fit: {e.refusal}")
            continue
        busy = dict(e.busy_s)[e.bound]
        lines.append(f"{mark:2}{e.mode:8}{e.epoch_s:9.2f}  "
                     f"{f'{e.bound} ({busy:.2f})':28}{e.plan_text()}")
    return "\n".join(lines)


def summary(estimates: Sequence[SystemEstimate], chosen: SystemEstimate) -> str:
    """One line: the choice, its predicted epoch and bound, and the others' epochs."""
    others = ", ".join(f"{e.mode} {e.epoch_s:.2f} s" if e.epoch_s is not None
                       else f"{e.mode} does not fit" for e in estimates if e is not chosen)
    assert chosen.epoch_s is not None
    return (f"auto chose {chosen.mode} ({chosen.plan_text()}): predicted {chosen.epoch_s:.2f} s "
            f"per epoch, bound by {chosen.bound}; {others or 'no other candidate'}")


def _fits_whole_model(model: ModelProfile, batch_size: int,
                      budgets: Sequence[int | None]) -> None:
    need = device_memory_bytes(model, model.units, 1, batch_size)
    for k, budget in enumerate(budgets):
        if budget is not None and need > budget:
            raise ConfigError(f"device {k}'s memory budget ({budget / 2**20:.1f} MiB) is "
                              f"below the whole model's need ({need / 2**20:.1f} MiB)")


def _divisors(batch_size: int) -> list[int]:
    return [n for n in range(1, batch_size + 1) if batch_size % n == 0]


def _split_busy(model: ModelProfile, devices: Sequence[DeviceProfile],
                plans: Sequence[tuple[int, int]], batch_size: int,
                aggregation_every: int) -> dict[str, float]:
    """Busy seconds per resource over a split plan's epoch: one iteration's busy time
    (`estimate_iteration`) times each device's iterations, plus its model transfers."""
    one = estimate_iteration(model, devices, plans, batch_size)
    stages = fleet_stages(model, devices, plans, batch_size)
    busy: dict[str, float] = {}
    server = 0.0
    for k, (device, (p, n)) in enumerate(zip(devices, plans, strict=True)):
        iterations = iterations_per_epoch(device, n, batch_size)
        rounds = aggregations_per_epoch(iterations, aggregation_every)
        half = model.model_frame_bytes(p)
        busy[f"device{k} compute"] = iterations * one.compute_busy_s[k]
        busy[f"device{k} uplink"] = (iterations * one.uplink_busy_s[k]
                                     + rounds * device.uplink.wire_time(half))
        busy[f"device{k} downlink"] = (iterations * one.downlink_busy_s[k]
                                       + rounds * device.downlink.wire_time(half))
        server += iterations * (stages[k].n * stages[k].s + stages[k].server_step)
    rounds = max(aggregations_per_epoch(iterations_per_epoch(d, n, batch_size),
                                        aggregation_every)
                 for d, (_, n) in zip(devices, plans, strict=True))
    busy["server"] = server + rounds * model.costs.aggregate_time(len(devices))
    return busy

