"""Asteroid's hybrid-pipeline-parallel (HPP) planner (§3.3), pure.

A plan cuts the model's units into stages; each stage runs on a group of devices that
split every micro-batch between them (data parallelism within the group, an all-reduce
of the stage's gradients once per round), and the groups form a pipeline (1F1B with
``K_p = 2(P − p) − 1`` forwards of warm-up on stage p of P). A round is ``M``
micro-batches of ``B`` samples.

The estimate of a plan's round time follows the paper:

- **Steps** (Fig. 7): an execution step per stage, a communication step between two
  stages. An execution step's forward and backward times are its slowest member's on
  the samples it was allocated (Eq. 8); a communication step's, the stage's output for
  a micro-batch over the slower of the two groups' links.
- **The dominant step** (Eq. 11): the one whose ``M × (E_f + E_b)``, plus the forward
  and backward times of the steps before it, is largest: its execution phase has no
  bubble. Every step's execution phase ends where the dominant one's does, moved by the
  backward times between them (the trapezoid of Eq. 6).
- **Round time** (Eq. 4): the latest end of a step's waiting, execution and all-reduce
  phases; the all-reduce of a group of ``g`` devices moves ``2 (g − 1) / g`` of its
  stage's weights over its slowest link (Eq. 5).

Within a group, a micro-batch's samples are allocated by Algorithm 1: memory-aware
balancing (shares by capacity, Eq. 9, within each device's memory budget, Eq. 3), then
straggler offloading (a sample at a time from the slowest device to the fastest with
memory to spare, while that makes the slowest faster).

The plan is found by Algorithm 2's dynamic program: the devices sorted by memory,
largest first (early stages hold more activations), ``Q(l, n, p)`` is the best
pipeline of the model's last ``l`` units over the last ``n`` devices in ``p`` stages,
extended by one stage at its head; the best of ``Q(L, N, p)`` over ``p`` wins. Like
the paper's, it keeps one sub-pipeline per state, so it is a heuristic:
`exhaustive_plan` searches every plan of the same shape (tests compare them).
DESIGN §Asteroid records the choices.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property

from aiopipe.errors import ConfigError
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import ModelProfile

#: Builds the stage of units ``first..stop-1`` on the sorted devices ``lo..hi-1`` at
#: ``position`` from the pipeline's end (None: they cannot hold it).
_StageOf = Callable[[int, int, int, int, int], "HppStage | None"]

#: How many sub-pipelines `plan` keeps per state of its dynamic program.
KEEP = 2

__all__ = [
    "KEEP",
    "Device",
    "HppModel",
    "HppPlan",
    "HppStage",
    "adjusted_plan",
    "allocate",
    "exhaustive_plan",
    "plan",
    "round_time",
]


@dataclass(frozen=True, slots=True)
class Device:
    """One device: its compute time against its cost table's (``slowdown``), its memory
    budget (bytes), the rate of its links (bytes/s; a link between two devices runs at
    the slower one's) and its own cost table, measured where it runs (``costs``; None:
    the model's)."""

    slowdown: float
    memory: float
    bandwidth: float
    costs: CostTable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class HppModel:
    """The model as the planner sees it: each unit's compute (the cost table, per batch
    size), its output per sample (what a stage sends on) and its parameters (bytes);
    the optimizer's state per parameter byte (SGD with momentum: 1); per sample, what
    a unit's forward keeps for its backward (``saved``; None: its output, an
    underestimate); the bytes of its frozen parameters, part of its weights, which hold
    no gradient and no optimizer state and are not all-reduced (``frozen``; None: none).
    Sums over unit ranges come from prefix sums (the planner asks for them hundreds of
    thousands of times)."""

    costs: CostTable
    activation: tuple[float, ...]
    weights: tuple[float, ...]
    optimizer: float = 1.0
    saved: tuple[float, ...] | None = None
    frozen: tuple[float, ...] | None = None
    #: the fewest rows a group member may compute (`ModelProfile.min_rows`)
    min_rows: int = 1

    @classmethod
    def of(cls, profile: ModelProfile, *, optimizer: float = 1.0) -> HppModel:
        """The planners' shared profile of a model (`aiopipe.runtime.plan.model_profile`)
        as this planner's: its units' outputs, their state as the weights, and what
        their forwards keep, when measured, their frozen parameters, and the fewest rows
        a pass may train on."""
        saved, frozen = profile.saved_bytes, profile.frozen_bytes
        return cls(profile.costs, tuple(map(float, profile.activation_bytes)),
                   tuple(map(float, profile.state_bytes)), optimizer,
                   tuple(map(float, saved)) if saved is not None else None,
                   tuple(map(float, frozen)) if frozen is not None else None,
                   profile.min_rows)

    @property
    def units(self) -> int:
        """How many units."""
        return len(self.weights)

    @cached_property
    def _sums(self) -> tuple[list[float], list[float]]:
        return (list(itertools.accumulate(self.weights, initial=0.0)),
                list(itertools.accumulate(self.saved or self.activation, initial=0.0)))

    @cached_property
    def _frozen_sums(self) -> list[float]:
        return list(itertools.accumulate(self.frozen or [0.0] * self.units, initial=0.0))

    @cached_property
    def _times(self) -> dict[tuple[int, int], tuple[CostTable, list[float], list[float],
                                                      list[float], list[float]]]:
        # (the table's id, samples) -> the table, each unit's forward and backward
        # seconds, and their prefix sums
        return {}

    def memory(self, first: int, stop: int, samples: int, in_flight: int) -> float:
        """Eq. 3: a member of a stage of units ``first..stop-1`` computing ``samples`` of
        each micro-batch with ``in_flight`` micro-batches' activations held: weights and
        the gradients and the optimizer's state of those that train (not of the frozen
        ones), what the forwards keep (``saved``)."""
        weights, activation = self._sums
        held = in_flight * samples * (activation[stop] - activation[first])
        return ((weights[stop] - weights[first]) * (2.0 + self.optimizer)
                - self._frozen(first, stop) * (1.0 + self.optimizer) + held)

    def stage_weights(self, first: int, stop: int) -> float:
        """The parameter bytes of units ``first..stop-1``."""
        weights = self._sums[0]
        return weights[stop] - weights[first]

    def stage_gradients(self, first: int, stop: int) -> float:
        """The bytes of the gradients of units ``first..stop-1``: their trainable
        parameters' (what a group all-reduces)."""
        return self.stage_weights(first, stop) - self._frozen(first, stop)

    def _frozen(self, first: int, stop: int) -> float:
        frozen = self._frozen_sums
        return frozen[stop] - frozen[first]

    def times(self, first: int, stop: int, samples: int, device: Device) -> tuple[float, float]:
        """Forward and backward seconds of units ``first..stop-1`` on ``samples`` samples
        on ``device`` (0 for none): its own table's, else the model's, times its
        slowdown."""
        if samples <= 0:
            return 0.0, 0.0
        costs = device.costs or self.costs
        known = self._times.get((id(costs), samples))
        if known is None:
            units = range(self.units)
            forward = [costs.forward_time(u, u + 1, samples) for u in units]
            backward = [costs.backward_time(u, u + 1, samples) for u in units]
            known = self._times[id(costs), samples] = (
                costs, forward, backward, list(itertools.accumulate(forward, initial=0.0)),
                list(itertools.accumulate(backward, initial=0.0)))
        _, forward, backward, forward_sums, backward_sums = known
        f, b = forward_sums[stop] - forward_sums[first], backward_sums[stop] - backward_sums[first]
        if not (math.isfinite(f) and math.isfinite(b)):  # a unit that cannot run at this
            f, b = math.fsum(forward[first:stop]), math.fsum(backward[first:stop])  # size
        return f * device.slowdown, b * device.slowdown


@dataclass(frozen=True, slots=True)
class HppStage:
    """Units ``first..stop-1`` on ``devices`` (indices into the fleet), each computing
    ``samples[i]`` of every micro-batch."""

    first: int
    stop: int
    devices: tuple[int, ...]
    samples: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class HppPlan:
    """A plan and its estimated round time (seconds)."""

    stages: tuple[HppStage, ...]
    round_s: float


def allocate(model: HppModel, fleet: Sequence[Device], group: Sequence[int], first: int,
             stop: int, batch: int, in_flight: int) -> tuple[int, ...] | None:
    """Algorithm 1: the samples of a ``batch``-sample micro-batch each member of ``group``
    computes for units ``first..stop-1`` (None: the group cannot hold them, or has more
    members than samples). Every member computes at least one sample (``model.min_rows``:
    two where the model normalises over the batch): a plan uses every device, and a
    member that computes nothing would only add to the all-reduce; the rest are balanced
    by capacity, then offloaded from the straggler."""
    room = [_room(model, fleet[d], first, stop, in_flight) for d in group]
    if min(room) < 0:
        return None  # a member cannot even hold the stage's weights
    if len(group) == 1:
        return (batch,) if room[0] >= batch else None
    capacity = [1.0 / max(sum(model.times(first, stop, batch, fleet[d])), 1e-12)
                for d in group]
    least = model.min_rows
    if len(group) * least > batch or min(room) < least:
        return None  # a member would compute too few rows
    samples = [least] * len(group)  # every member computes (docstring), the rest by capacity
    left = batch - len(group) * least
    while left > 0:  # memory-aware balancing
        open_ = [i for i in range(len(group)) if samples[i] < room[i]]
        if not open_:
            return None
        total = math.fsum(capacity[i] for i in open_)
        given = 0
        for i in open_:
            share = min(int(left * capacity[i] / total), room[i] - samples[i])
            samples[i] += share
            given += share
        if given == 0:  # fewer samples left than devices: the fastest with room
            fastest = max(open_, key=lambda i: capacity[i])
            samples[fastest] += 1
            given = 1
        left -= given

    def time(i: int) -> float:
        return sum(model.times(first, stop, samples[i], fleet[group[i]]))

    times = [time(i) for i in range(len(group))]
    members = range(len(group))
    for _ in range(batch * len(group)):  # straggler offloading: a sample at a time
        slowest = max(members, key=times.__getitem__)
        others = [i for i in members if i != slowest and samples[i] < room[i]]
        if not others or samples[slowest] <= least:  # every member keeps its least
            break
        fastest = min(others, key=times.__getitem__)
        before = times[slowest], times[fastest]
        samples[slowest] -= 1
        samples[fastest] += 1
        times[slowest], times[fastest] = time(slowest), time(fastest)
        if not max(times) < before[0]:  # the straggler is no faster: undo, done
            samples[slowest] += 1
            samples[fastest] -= 1
            times[slowest], times[fastest] = before
            break
    return tuple(samples)


def _room(model: HppModel, device: Device, first: int, stop: int, in_flight: int) -> int:
    """The most samples of a micro-batch ``device`` can hold for units ``first..stop-1``
    (-1: not even the stage's weights)."""
    fixed = model.memory(first, stop, 0, in_flight)
    per_sample = model.memory(first, stop, 1, in_flight) - fixed
    if fixed > device.memory:
        return -1
    if per_sample <= 0:
        return 1 << 30
    return int((device.memory - fixed) / per_sample)


def round_time(model: HppModel, fleet: Sequence[Device], stages: Sequence[HppStage],
             micro_batches: int, batch: int) -> float:
    """The estimated round time of ``stages`` (module docstring: Eqs. 4–6, 8, 11)."""
    return _Estimator(model, fleet, batch).round_time(stages, micro_batches)


class _Estimator:
    """`round_time` with each step's times kept (the planner estimates many plans that
    share stages)."""

    def __init__(self, model: HppModel, fleet: Sequence[Device], batch: int) -> None:
        self.model, self.fleet, self.batch = model, fleet, batch
        self._steps: dict[HppStage, tuple[float, float, float]] = {}

    def execution(self, stage: HppStage) -> tuple[float, float, float]:
        """A stage's forward and backward seconds a micro-batch (its slowest member's,
        Eq. 8) and its all-reduce's (Eq. 5)."""
        known = self._steps.get(stage)
        if known is None:
            model, fleet = self.model, self.fleet
            times = [model.times(stage.first, stage.stop, n, fleet[d])
                     for d, n in zip(stage.devices, stage.samples, strict=True)]
            g = len(stage.devices)
            reduce = 0.0
            if g > 1:
                rate = min(fleet[d].bandwidth for d in stage.devices)
                reduce = (2 * (g - 1) / g * model.stage_gradients(stage.first, stage.stop)
                          / rate)
            known = self._steps[stage] = (max(f for f, _ in times), max(b for _, b in times),
                                          reduce)
        return known

    def communication(self, before: HppStage, after: HppStage) -> float:
        """Seconds a micro-batch's activations (or their gradients) take between two
        stages: over the slower of their links."""
        rate = min(self.fleet[d].bandwidth for d in (*before.devices, *after.devices))
        return self.model.activation[before.stop - 1] * self.batch / rate

    def round_time(self, stages: Sequence[HppStage], micro_batches: int) -> float:
        """Eq. 4 over the steps of ``stages`` (module docstring)."""
        forward: list[float] = []
        backward: list[float] = []
        allreduce: list[float] = []
        for p, stage in enumerate(stages):
            if p:
                seconds = self.communication(stages[p - 1], stage)
                forward.append(seconds)
                backward.append(seconds)
                allreduce.append(0.0)
            f, b, reduce = self.execution(stage)
            forward.append(f)
            backward.append(b)
            allreduce.append(reduce)
        fsum = list(itertools.accumulate(forward, initial=0.0))  # fsum[s]: steps before s
        bsum = list(itertools.accumulate(backward, initial=0.0))
        steps = len(forward)
        dm = max(range(steps), key=lambda s: micro_batches * (forward[s] + backward[s])
                 + fsum[s] + bsum[s])
        end_dm = fsum[dm] + micro_batches * (forward[dm] + backward[dm])
        # earlier steps end later by the backwards between them and the dominant step,
        # later ones earlier (Eq. 6's trapezoid)
        return max(end_dm + (bsum[dm] - bsum[s] if s <= dm else bsum[dm + 1] - bsum[s + 1])
                   + allreduce[s] for s in range(steps))


def _order(fleet: Sequence[Device]) -> list[int]:
    """The devices by memory, largest first (ties: by index)."""
    return sorted(range(len(fleet)), key=lambda d: (-fleet[d].memory, d))


def plan(model: HppModel, fleet: Sequence[Device], micro_batches: int,
         batch: int, *, keep: int = KEEP) -> HppPlan:
    """Algorithm 2 (module docstring): the plan of least estimated round time, keeping
    the ``keep`` best sub-pipelines of each state (the paper keeps one).

    Raises:
        ConfigError: no plan fits the devices' memory (naming the device that is
            shortest of it).
    """
    order = _order(fleet)
    units, n_devices = model.units, len(fleet)

    @cache
    def stage(first: int, stop: int, lo: int, hi: int, position: int) -> HppStage | None:
        group = tuple(order[lo:hi])
        samples = allocate(model, fleet, group, first, stop, batch, 2 * position - 1)
        return None if samples is None else HppStage(first, stop, group, samples)

    estimator = _Estimator(model, fleet, batch)
    best: dict[tuple[int, int, int], list[HppPlan]] = {}
    for p in range(1, min(units, n_devices) + 1):
        for n in range(p, n_devices + 1):
            for last in range(p, units + 1):
                kept: list[HppPlan] = []  # the best so far, fastest first
                for head, sub in _extensions(best, stage, units, n_devices, last, n, p):
                    # a head stage only adds to a pipeline's round, which is at least
                    # its dominant step's: skip what cannot beat the kept ones
                    f, b, _ = estimator.execution(head)
                    bound = max(sub.round_s if sub else 0.0, micro_batches * (f + b))
                    if len(kept) == keep and bound >= kept[-1].round_s:
                        continue
                    stages = (head, *sub.stages) if sub else (head,)
                    candidate = HppPlan(stages, estimator.round_time(stages, micro_batches))
                    at = bisect.bisect_right([c.round_s for c in kept], candidate.round_s)
                    kept.insert(at, candidate)
                    del kept[keep:]
                if kept:
                    best[(last, n, p)] = kept
    whole = [plans[0] for key, plans in best.items()
             if key[0] == units and key[1] == n_devices]
    if not whole:
        raise ConfigError(_no_fit(model, fleet, batch))
    return min(whole, key=lambda c: c.round_s)


def _extensions(best: dict[tuple[int, int, int], list[HppPlan]], stage: _StageOf, units: int,
                n_devices: int, last: int, n: int, p: int
                ) -> Iterator[tuple[HppStage, HppPlan | None]]:
    """The pipelines of the last ``last`` units over the last ``n`` devices in ``p``
    stages: one stage at the head of each best sub-pipeline (Eq. 10), as (head, the
    sub-pipeline; None for a pipeline of one stage)."""
    head_first, head_lo = units - last, n_devices - n
    if p == 1:
        head = stage(head_first, units, head_lo, n_devices, 1)
        if head is not None:
            yield head, None
        return
    for rest_units in range(p - 1, last):
        for rest_devices in range(p - 1, n):
            subs = best.get((rest_units, rest_devices, p - 1))
            if not subs:
                continue
            head = stage(head_first, units - rest_units, head_lo, n_devices - rest_devices, p)
            if head is not None:
                for sub in subs:
                    yield head, sub


def adjusted_plan(model: HppModel, fleet: Sequence[Device], stages: Sequence[HppStage],
                  lost: Iterable[int], micro_batches: int, batch: int) -> HppPlan | None:
    """§3.4's layer-wise lightweight re-planning: ``stages`` without the ``lost`` devices,
    by a small change of the plan rather than the dynamic program. A group that lost a
    member keeps its units on the members left; a stage left without a device gives its
    units to the stages next to it: all to its one neighbour at an end of the pipeline,
    else cut between the two where the estimate is best (the paper splits by FLOPs and
    capacity; the cost table's times are both). Then each cut between two stages moves,
    one at a time, while that improves the estimate (the paper's "minor adjustment to
    the layer partitioning points"; no stage changes its devices). Every group's samples
    are allocated again (Algorithm 1: the places from the pipeline's end, so the memory
    of a micro-batch in flight, may have moved). None when the devices left cannot hold
    the result.
    """
    gone = set(lost)
    layout = [(s.first, s.stop, tuple(d for d in s.devices if d not in gone)) for s in stages]
    estimator = _Estimator(model, fleet, batch)

    def allocated(candidate: Sequence[tuple[int, int, tuple[int, ...]]]) -> HppPlan | None:
        out = []
        for p, (first, stop, group) in enumerate(candidate):
            samples = allocate(model, fleet, group, first, stop, batch,
                               2 * (len(candidate) - p) - 1)
            if samples is None:
                return None
            out.append(HppStage(first, stop, group, samples))
        return HppPlan(tuple(out), estimator.round_time(out, micro_batches))

    while any(not group for _, _, group in layout):
        p = next(i for i, (_, _, group) in enumerate(layout) if not group)
        first, stop, _ = layout[p]
        if len(layout) == 1:
            return None
        if p in (0, len(layout) - 1):  # an end: its one neighbour takes its units
            q = 1 if p == 0 else p - 1
            a, b, group = layout[q]
            layout[q] = (min(a, first), max(b, stop), group)
            del layout[p]
            continue
        before, after = layout[p - 1], layout[p + 1]
        options = [[*layout[:p - 1], (before[0], cut, before[2]), (cut, after[1], after[2]),
                    *layout[p + 2:]] for cut in range(first, stop + 1)]
        found = [(plan_.round_s, i) for i, option in enumerate(options)
                 if (plan_ := allocated(option)) is not None]
        if not found:
            return None
        layout = options[min(found)[1]]
    best = allocated(layout)
    # then move each cut between stages, one at a time, while that helps the estimate
    # (still a small change of the plan: no stage changes its devices)
    improved = best is not None
    while improved and best is not None:
        improved = False
        for p in range(1, len(layout)):
            lo, hi = layout[p - 1][0] + 1, layout[p][1] - 1
            for cut in range(lo, hi + 1):
                if cut == layout[p][0]:
                    continue
                option = [*layout[:p - 1], (layout[p - 1][0], cut, layout[p - 1][2]),
                          (cut, layout[p][1], layout[p][2]), *layout[p + 1:]]
                candidate = allocated(option)
                if candidate is not None and candidate.round_s < best.round_s * (1 - 1e-9):
                    best, layout, improved = candidate, option, True
    return best


def exhaustive_plan(model: HppModel, fleet: Sequence[Device], micro_batches: int,
                    batch: int) -> HppPlan | None:
    """Every plan of `plan`'s shape (the devices by memory in consecutive groups, one
    group per stage of consecutive units), each allocated by Algorithm 1 and estimated:
    the best (None: none fits). For small fleets and models only (tests)."""
    order = _order(fleet)
    units, n_devices = model.units, len(fleet)
    best: HppPlan | None = None
    for p in range(1, min(units, n_devices) + 1):
        for cuts in itertools.combinations(range(1, units), p - 1):
            for splits in itertools.combinations(range(1, n_devices), p - 1):
                bounds = list(itertools.pairwise((0, *cuts, units)))
                groups = list(itertools.pairwise((0, *splits, n_devices)))
                stages = []
                for q, ((first, stop), (lo, hi)) in enumerate(zip(bounds, groups, strict=True)):
                    group = tuple(order[lo:hi])
                    samples = allocate(model, fleet, group, first, stop, batch,
                                       2 * (p - q) - 1)
                    if samples is None:
                        break
                    stages.append(HppStage(first, stop, group, samples))
                else:
                    candidate = HppPlan(tuple(stages),
                                        round_time(model, fleet, stages, micro_batches, batch))
                    if best is None or candidate.round_s < best.round_s:
                        best = candidate
    return best


def _no_fit(model: HppModel, fleet: Sequence[Device], batch: int) -> str:
    """Why no plan fits, naming a device: one that cannot hold even the smallest stage
    (one unit, one sample), else the one with the least memory."""
    smallest = min(model.memory(u, u + 1, 1, 1) for u in range(model.units))
    short = min(range(len(fleet)), key=lambda d: (fleet[d].memory, d))
    if fleet[short].memory < smallest:
        return (f"no Asteroid plan fits: device {short}'s memory budget "
                f"{fleet[short].memory / 2**20:.1f} MiB is below the smallest stage's "
                f"{smallest / 2**20:.1f} MiB (one unit, one sample)")
    return (f"no Asteroid plan fits the devices' memory budgets: the model with a "
            f"micro-batch of {batch} needs {model.memory(0, model.units, batch, 1) / 2**20:.1f} "
            f"MiB on one device, the {len(fleet)} devices hold "
            f"{math.fsum(d.memory for d in fleet) / 2**20:.1f} MiB in all, device {short} "
            f"least ({fleet[short].memory / 2**20:.1f} MiB)")
