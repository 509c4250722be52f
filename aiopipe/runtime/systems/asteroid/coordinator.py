"""Asteroid's hybrid pipeline (``mode = "asteroid"``, Asteroid §3.2).

Placement: S stages, each run by a group of devices; every micro-batch of
``batch_size // parallel_batches`` samples is split between a stage's members by rows
(member d computes rows ``rows[d]`` of each), so a group is data-parallel within the
stage and the groups form a pipeline. The first stage's members hold the data: each reads
its share of every micro-batch from its own (the others' data is not used). The
coordinator runs no stage and stays off the data path: activations and gradients go
device to device, cut and joined by rows (`aiopipe.runtime.groups`).

The plan: ``partition`` (S - 1 cut points) and ``stage_groups`` (each stage's device
ids), with each group's rows allocated by Asteroid's Algorithm 1 (memory-aware
balancing, then straggler offloading) within each device's ``device_memory_mb``; or
both "auto": Asteroid's planner (`aiopipe.scheduler.asteroid.plan`, Algorithm 2) chooses
stages, groups and rows for the fleet's compute, memory budgets and uplinks (``planner``:
or a hybrid baseline's rules, `aiopipe.scheduler.hpp_baseline`). A device's
compute is its own cost table, measured where it runs, and its uplink the rate it was
measured at, on real clocks (``profile_devices``, [Note: device profiles] in
aiopipe.runtime.profiling: the coordinator plans once before devices join, from the
declared fleet, to refuse what cannot fit, and again from the profiles); else, and in
virtual time, the coordinator's table times its ``device_slowdown``.

Each iteration runs 1F1B (``K_p = min(2(S - p) - 1, N)`` warm-up forwards on stage p) or
GPipe over N micro-batches; the members of a group then all-reduce the gradients they
accumulated (REDUCE, [Note: direct all-reduce] in aiopipe.runtime.groups) and step, so
the step is unsplit training's on the whole batch. A round is an epoch; the coordinator
puts the stages side by side (each stage's weights from its first member: they are
identical; floating-point buffers, batch norm's statistics, averaged over the members).

Faults (Asteroid's replay, §3.4): a device lost mid-round (its connection, or a
neighbour's link to it, given up: heartbeats and ``device_timeout``) stops the round;
the devices still there wait (`RoundStalled`), and the coordinator re-plans over them and
plays the round again from the latest stage backup point every stage survived
([Note: stage backups] in aiopipe.runtime.systems.ftpipehd.chain: a stage's state kept by
its members, and a
single-device stage's sent to its backup node every ``chain_replication_every``
batches), else from its start; the epoch keeps its number of batches (the first stage's
devices go round their own data again if they now hold less of it). ``rescheduling``
"lightweight" (the default) adjusts the plan (§3.4's layer-wise re-planning,
`aiopipe.scheduler.asteroid.adjusted_plan`; when that is estimated much slower than the
devices left should be, `FALLBACK`, the planner's plan if better), and a device that
holds the same stage as in the attempt given up on (same process) is sent no weights:
it starts again from the state it kept of that attempt's start ([Note: kept weights] in
aiopipe/runtime/holdings.py), or of the backup point when it answered with its own
snapshot there; the others get their stage's weights from the coordinator's copy of
the round's start (or of the backup point, with its momentum). "heavy" runs the planner
from scratch over the devices left and sends every stage's weights again (the paper's
straw-man). A replay's weight versions (and those of every round after a re-plan) are
``REPLAY_VERSIONS`` above the attempt's before, so the devices drop what an attempt
given up on still sends. Not resumable from a checkpoint.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, RemoteProtocolError, TrainingError
from aiopipe.protocol import Replica, RoundResult, RoundStart, state_from_wire
from aiopipe.runtime.momentum import MOMENTUM, backs_up_momentum, split_momentum
from aiopipe.runtime.plan import (
    DevicePlan,
    cached_planning_costs,
    check_trainable,
    model_profile,
    unit_crossings,
)
from aiopipe.runtime.plan_text import log_plan
from aiopipe.runtime.systems.asteroid.device import AsteroidDevice
from aiopipe.runtime.systems.asteroid.options import AsteroidOptions
from aiopipe.runtime.systems.asteroid.replay import (
    CarriedResults,
    declared_device,
    measured_device,
    merged_stage,
)
from aiopipe.runtime.systems.base import Rounds, Setup, planning_batch_sizes
from aiopipe.runtime.systems.ftpipehd.chain import gather_from, replica_check
from aiopipe.runtime.systems.pipeline.coordinator import (
    MAX_REPLAYS,
    REPLAY_VERSIONS,
    Pipeline,
    StageLost,
    play_or_lost,
)
from aiopipe.scheduler.asteroid import (
    HppModel,
    HppPlan,
    HppStage,
    adjusted_plan,
    allocate,
    round_time,
)
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.hpp_baseline import PLANNERS
from aiopipe.scheduler.placement import Pipeline as StagePipeline
from aiopipe.scheduler.placement import Placement, Stage
from aiopipe.scheduler.schedule import Schedule, check_schedule, with_reductions
from aiopipe.wording import plural

__all__ = ["Asteroid"]

log = logging.getLogger("aiopipe.server")

#: A lightweight re-plan whose estimated iteration is more than this many times what the
#: devices left should take (the plan's estimate before, scaled by the compute lost)
#: is checked against the planner's, and the better taken.
FALLBACK = 1.25


class Asteroid(Pipeline):
    """Asteroid's hybrid pipeline (module docstring); a synchronous pipeline whose stages
    are groups."""

    recovers_lost_devices = True  # the plan adjusted, the round replayed without it
    device_half = AsteroidDevice
    links_devices = True

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """B' = B/N, and B'/2, B'/4 and B'/8 too: a group splits each micro-batch, and
        times are not linear in the samples (its Fig. 6)."""
        sizes = set(Pipeline.micro_batch_sizes(config))
        return sorted(sizes | {max(1, size // d) for size in sizes for d in (2, 4, 8)})

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """Asteroid's backups go to devices: a replica unasked is a late answer to a
        request of a round that has ended (let go).

        Raises:
            RemoteProtocolError: it is of a later round.
        """
        if start is not None and replica.round <= start.round:
            return
        raise RemoteProtocolError(f"a replica of stage {replica.stage} that nobody "
                                  "asked for")

    def __init__(self, setup: Setup) -> None:  # (Pipeline's, for groups)
        config = setup.config
        self.setup, self.config = setup, config
        self.model = setup.model
        self.units = models.unit_count(self.model)
        n = self._micro_batches()
        self.parallel_batches = n
        self.micro_batch_size = config.batch_size // n
        self._secret = setup.run_secret
        self.crossings = unit_crossings(self.model, setup.data.inputs)
        costs = setup.cost_table or cached_planning_costs(
            config, self.model, setup.data.inputs, setup.test_set,
            sizes=planning_batch_sizes(config))
        self._hpp = HppModel.of(model_profile(self.model, setup.data.inputs, costs))
        self._fleet = [declared_device(config, k) for k in range(config.devices)]
        #: real clocks plan from what the devices measure of themselves ([Note: device
        #: profiles] in aiopipe.runtime.profiling): `prepare` plans again with it
        self.wants_profiles = setup.cost_table is None and config.profile_devices
        self._auto = config.options_as(AsteroidOptions).stage_groups == "auto"
        self._place(self._planned() if self._auto else self._given())
        check_trainable(self.model, setup.data.inputs,
                        [DevicePlan(0, self.units, n, self.micro_batch_size, 0)], config)
        self.schedule = self._schedule(n)
        self.iterations_per_epoch = 0  # `prepare` knows: the first stage's data
        self._samples: list[int] = []  # what each device announced
        self._replays = 0  # re-plans in the run (each lifts the versions: module doc)
        #: per device, its session and stage when the round under way began (a replay
        #: that leaves both sends it no weights: [Note: kept weights])
        self._held: dict[int, tuple[int, tuple[int, int, int, int]]] = {}
        self._keep = False  # the round is being played again, lightweight
        #: the weights a device that keeps its stage must return (the session checks)
        self._returns: dict[int, Mapping[str, Any]] = {}
        #: the devices that can start a replay from what they kept (all of them when it
        #: starts where the given-up attempt did; from a backup point, those that held
        #: their own stage's snapshot there)
        self._restorable: set[int] = set()
        #: each parameter's momentum at the backup point a replay starts from (sent with
        #: the weights then); empty otherwise
        self.momentum: dict[str, torch.Tensor] = {}

    @property
    def _options(self) -> AsteroidOptions:
        return self.config.options_as(AsteroidOptions)

    def _planned(self) -> list[HppStage]:
        """The planner (``planner``: Asteroid's or a baseline's) on the table and fleet.

        Raises:
            ConfigError: no plan fits the devices' memory.
        """
        found = PLANNERS[self._options.planner](self._hpp, self._fleet,
                                                self.parallel_batches, self.micro_batch_size)
        return list(found.stages)

    def _given(self) -> list[HppStage]:
        """The configured stages and groups, each group's rows by Algorithm 1.

        Raises:
            ConfigError: a group cannot hold its stage (memory), or the cuts do not fit.
        """
        options = self.config.options_as(AsteroidOptions)
        groups, cuts = options.stage_groups, options.partition
        assert isinstance(groups, tuple), "resolved by the planner"
        bounds = [0, *(int(c) for c in cuts), self.units]
        if bounds[-2] >= self.units:
            raise ConfigError(f"config key 'partition': cut points {list(cuts)} "
                              f"do not fit a model of {self.units} units")
        stages = []
        for p, group in enumerate(groups):
            first, stop = bounds[p], bounds[p + 1]
            rows = allocate(self._hpp, self._fleet, group, first, stop, self.micro_batch_size,
                            self._in_flight(p, len(groups)))
            if rows is None:
                raise ConfigError(f"config key 'stage_groups': devices {list(group)} cannot "
                                  f"hold stage {p} (units {first}..{stop - 1}) within "
                                  f"device_memory_mb, or it has more devices than the "
                                  f"{self.micro_batch_size} samples of a micro-batch")
            stages.append(HppStage(first, stop, tuple(group), rows))
        return stages

    def _in_flight(self, p: int, stages: int) -> int:
        """The most micro-batches stage p of ``stages`` holds at once: K_p under 1F1B,
        all N under GPipe."""
        n = self.parallel_batches
        return n if self._options.schedule == "gpipe" else min(2 * (stages - p) - 1, n)

    def _place(self, stages: Sequence[HppStage]) -> None:  # type: ignore[override]
        """The stages on their groups, each member's rows of a micro-batch."""
        self.hpp_stages = list(stages)
        self.groups: list[tuple[int, ...]] = []
        self.rows: dict[int, tuple[int, int]] = {}
        for stage in stages:
            start = 0
            for d, samples in zip(stage.devices, stage.samples, strict=True):
                self.rows[d] = (start, start + samples)
                start += samples
            self.groups.append(tuple(stage.devices))
        self.stages = len(stages)
        self.workers = [d for group in self.groups for d in group]
        self.bounds = [(s.first, s.stop) for s in stages]
        self.placement = Placement(self.units, (StagePipeline(tuple(
            Stage(s.first, s.stop, tuple(f"device{d}" for d in s.devices)) for s in stages)),))
        self.pipeline = self.placement.pipelines[0]
        if len(self.workers) == self.config.devices:  # (after a loss, the plan tells)
            self.config = self.config.replace(options={
                "partition": tuple(s.stop for s in stages[:-1]),
                "stage_groups": tuple(self.groups)})

    def _schedule(self, n: int) -> Schedule:
        """The pipeline's schedule, each group's REDUCE right before its STEP."""
        grouped = with_reductions(super()._schedule(n), [
            p for p, group in enumerate(self.groups) if len(group) > 1])
        check_schedule(grouped)
        return grouped

    def stage_of(self, device_id: int) -> int:
        """The stage ``device_id`` is a member of."""
        return next(p for p, group in enumerate(self.groups) if device_id in group)

    def estimate_s(self) -> float:
        """The planner's estimate of an iteration's time for this plan (Eqs. 4-6, 11)."""
        return round_time(self._hpp, self._fleet, self.hpp_stages, self.parallel_batches,
                          self.micro_batch_size)

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Plan again from ``devices``, what the devices measured of themselves (their
        own cost tables and uplinks; None: as declared). The first stage's members hold
        the data: each iteration takes ``N`` times its rows from each; the epoch has as
        many as the one that runs out first holds.

        Raises:
            ConfigError: no plan fits the measured devices, or a member holds fewer than
                one iteration's samples.
        """
        self._samples = list(samples)
        n = self.parallel_batches
        if devices is not None:
            self._fleet = [measured_device(self.config, k, profile)
                           for k, profile in enumerate(devices)]
            self._place(self._planned() if self._auto else self._given())
            self.schedule = self._schedule(n)
        fits = {d: samples[d] // ((self.rows[d][1] - self.rows[d][0]) * n)
                for d in self.groups[0]}
        self.iterations_per_epoch = min(fits.values())
        if self.iterations_per_epoch < 1:
            d = min(fits, key=fits.__getitem__)
            raise ConfigError(f"device {d} holds {samples[d]} samples, fewer than one "
                              f"iteration of its rows ({(self.rows[d][1] - self.rows[d][0]) * n})")

    # -- what devices are told -----------------------------------------------------------

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per device: its stage, units (first, stop), rows of each micro-batch,
        micro-batches and schedule; the first also the plan's estimated iteration time."""
        entries = [{"stage": p, "device": d, "units": list(self.bounds[p]),
                    "rows": list(self.rows[d]), "parallel_batches": self.parallel_batches,
                    "schedule": self._options.schedule}
                   for p, group in enumerate(self.groups) for d in group]
        entries[0]["estimate_s"] = self.estimate_s()
        return entries

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """The keys of the device's pairs with every other device (a re-plan after a
        loss may put any of them in its group or next to it)."""
        return self._pair_keys(device_id, [f"device{k}" for k in range(self.config.devices)
                                           if k != device_id])

    def _member_peers(self, rounds: Rounds, device: int) -> dict[str, dict[str, Any]]:
        """A member's peers: its group's other members and the neighbouring stages',
        each with its stage, address and rows; with stage backups, the first and the
        last stage are neighbours too (the last backs up to the first)."""
        p, last = self.stage_of(device), self.stages - 1
        near = {q for q in (p - 1, p, p + 1) if 0 <= q <= last}
        if self._options.chain_replication_every and p in (0, last):
            near.add(last - p)
        return {f"device{d}": {"stage": q, "address": rounds.address_of(d),
                               "rows": list(self.rows[d])}
                for q in sorted(near) for d in self.groups[q] if d != device}

    def member_start(self, rounds: Rounds, device: int, round_no: int, epoch: int,
                     first: int, iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Member ``device``'s `RoundStart`: its stage's weights and actions, its rows,
        its peers."""
        p = self.stage_of(device)
        a, b = self.bounds[p]
        return RoundStart(round_no, epoch, first, iterations, state, p, self.stages, a, b,
                          self.parallel_batches, self.micro_batch_size,
                          epoch * self.iterations_per_epoch + first
                          + self._replays * REPLAY_VERSIONS,
                          " ".join(map(str, self.schedule.actions[p])),
                          self._member_peers(rounds, device), self.rows[device])

    def _starts(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                work: Sequence[int], states: Sequence[Mapping[str, Any]]
                ) -> dict[int, RoundStart]:
        """Each member's `RoundStart`; in a lightweight replay, without weights for a
        member that holds its stage from the attempt given up on, in the same session
        (it starts again from that attempt's start, which it kept)."""
        starts, held = {}, {}
        self._returns.clear()
        for d in self.workers:
            p = self.stage_of(d)
            state = states[p]
            held[d] = (rounds.session_of(d), (p, self.stages, *self.bounds[p]))
            weights = {k: v for k, v in state.items() if not k.startswith(MOMENTUM)}
            if len(weights) < len(state):  # (momentum goes out, not back)
                self._returns[d] = weights
            if self._keep and self._held.get(d) == held[d] and d in self._restorable:
                self._returns[d], state = weights, {}
            starts[d] = self.member_start(rounds, d, round_no, epoch, first, work[d], state)
        self._held = held
        return starts

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every member trains the round; their stages make the model. A device missing
        at the start, or lost meanwhile: re-planned over the devices still there, and the
        round played again from its start (module docstring).

        Raises:
            TrainingError: the devices left cannot hold the model, or the round stopped
                `MAX_REPLAYS` + 1 times with the same devices.
        """
        alive, tries = sorted(participants), 0
        self._keep = False
        if set(self.workers) != set(alive):
            self._replan(rounds, round_no, epoch, alive, "at its start")
        start, carried = 0, CarriedResults()  # where the attempt starts; what came before
        while True:
            try:
                done = await self._play_round(
                    rounds, round_no, epoch, start,
                    [self.iterations_per_epoch - start] * len(work))
                self.momentum = {}
                return carried.added_to(done, self.groups)
            except StageLost as lost:
                self._keep = self._options.rescheduling == "lightweight"
                log.warning("round %d: %s; playing the round again", round_no + 1, lost)
                # a neighbour's link may break a moment before the coordinator's own link
                # to a dead device does: give that a heartbeat interval (at most 1 s)
                await rounds.clock.sleep(min(1.0, self.config.heartbeat_interval))
                alive = sorted(await rounds.settled_alive())
                tries = tries + 1 if set(alive) == set(self.workers) else 0
                if tries > MAX_REPLAYS:
                    raise TrainingError(f"round {round_no + 1} stopped {tries} times with "
                                        f"the same devices; the last time: {lost}") from None
                point = await self._backup_point(rounds, round_no, start, alive)
                self._restorable = set(range(self.config.devices))
                if point is not None:
                    self._restorable = {d for p, (d, _) in point[1].items()
                                        if d in self.groups[p]}
                    start = carried.add(point, start, self)
                again = rounds.new_round()
                self._replan(rounds, round_no, epoch, alive, "devices lost", lost=lost,
                             replayed_as=again, start=start)
                round_no = again

    def _replan(self, rounds: Rounds, round_no: int, epoch: int, alive: Sequence[int],
                when: str, *, lost: StageLost | None = None, replayed_as: int = -1,
                start: int = 0) -> None:
        """Plan again over ``alive`` from scratch (the planner) and record it.

        Raises:
            TrainingError: they cannot hold the model.
        """
        before = self.plan_entries()
        workers = sorted(alive)
        self._replays += 1  # versions above the last attempt's (module docstring)
        how, planning_s = "", 0.0
        if workers != sorted(self.workers):
            started = time.perf_counter()
            how, stages = self._replanned(workers)
            planning_s = time.perf_counter() - started
            self._place(stages)
            self.schedule = self._schedule(self.parallel_batches)
            self._check_first_stage(workers)
        log_plan(log, logging.WARNING, f"round {round_no + 1} ({when}): the plan runs on "
                 f"devices {workers}", self.plan_entries(), units=self.units,
                 batch_size=self.config.batch_size)
        change = {"round": round_no, "epoch": epoch, "kind": "recovery",
                  "rescheduling": how, "planning_s": planning_s,
                  "workers": workers, "lost": sorted(
                      {int(e["device"]) for e in before} - set(workers)),
                  "before": [[e["device"], e["stage"], e["units"], e["rows"]] for e in before],
                  "after": [[e["device"], e["stage"], e["units"], e["rows"]]
                            for e in self.plan_entries()]}
        if lost is None:
            rounds.record_change(change)
        else:
            rounds.record_change({**change, "stopped": str(lost), "replayed_as": replayed_as,
                                  "from_iteration": start},
                                 recovery=(lost.at, rounds.clock.now()))

    async def _backup_point(self, rounds: Rounds, round_no: int, start: int,
                            alive: Sequence[int]
                            ) -> tuple[int, dict[int, tuple[int, Replica]]] | None:
        """The latest backup point of the given-up attempt (round ``round_no``, from
        iteration ``start``, on the current plan) at which every stage survived
        ([Note: stage backups] in aiopipe.runtime.systems.ftpipehd.chain): each stage asked of
        its members
        alive, then of its backup node; that state loaded here (the weights into the
        model, the momentum kept to send). (batches, by stage: its holder and replica),
        or None when none survived whole (or there are no backups)."""
        every = self._options.chain_replication_every
        if not every:
            return None
        holders = []
        for p, group in enumerate(self.groups):
            backup = self.groups[(p + 1) % self.stages][0]
            holders.append([*group, backup] if len(group) == 1 and self.stages > 1
                           else list(group))
        sound = replica_check(self.model, self.bounds, round_no, self.micro_batch_size,
                              momentum=backs_up_momentum(self.config), what="backup")
        points = [b for b in range(self.iterations_per_epoch - 1, start, -1) if b % every == 0]
        found = await gather_from(rounds, round_no, points, holders, alive, sound)
        if found is None:
            return None
        batches, replicas = found
        self.momentum = await rounds.compute.call(
            partial(self._load_point, [replicas[p][1] for p in range(self.stages)]))
        log.warning("round %d: every stage's state after %s of the epoch survived "
                    "in the stage backups: playing the round again from there",
                    round_no + 1, plural(batches, "batch"))
        return found

    def _load_point(self, replicas: Sequence[Replica]) -> dict[str, torch.Tensor]:
        """The stages' backups side by side as the model; their momentum, by parameter
        (compute thread)."""
        weights, momentum = split_momentum(models.merge_states(
            *(state_from_wire(r.tensors) for r in replicas)))
        self._absorb(weights)
        return momentum

    def frame_limit(self) -> int:
        """The whole model's state, with momentum when stage backups may send it."""
        backups = self._options.chain_replication_every and backs_up_momentum(self.config)
        return self._frame_limit(self.iterations_per_epoch, extra_tensors=list(
            self.model.parameters()) if backups else ())

    def _replanned(self, workers: Sequence[int]) -> tuple[str, list[HppStage]]:
        """The plan over ``workers``: with only devices lost and ``rescheduling``
        "lightweight", the current plan adjusted (`adjusted_plan`), else (or when that
        cannot hold the model) the planner's from scratch; and which it was.

        Raises:
            TrainingError: ``workers`` cannot hold the model.
        """
        n, micro = self.parallel_batches, self.micro_batch_size
        if self._options.rescheduling == "lightweight" and set(workers) <= set(self.workers):
            adjusted = adjusted_plan(self._hpp, self._fleet, self.hpp_stages,
                                     set(self.workers) - set(workers), n, micro)
            if adjusted is not None:
                expected = (self.estimate_s() * self._capacity(self.workers)
                            / self._capacity(workers))
                if adjusted.round_s <= FALLBACK * expected:
                    return "lightweight", list(adjusted.stages)
                planned = self._from_scratch(workers)
                log.warning("the adjusted plan's iteration (%.3g s) is %.1fx what the devices "
                            "left should take (%.3g s); the planner's: %.3g s", adjusted.round_s,
                            adjusted.round_s / expected, expected, planned.round_s)
                if planned.round_s < adjusted.round_s:
                    return "lightweight+planner", list(planned.stages)
                return "lightweight", list(adjusted.stages)
        return "heavy", list(self._from_scratch(workers).stages)

    def _from_scratch(self, workers: Sequence[int]) -> HppPlan:
        """The planner's plan over ``workers`` (devices by their ids).

        Raises:
            TrainingError: they cannot hold the model.
        """
        try:
            found = PLANNERS[self._options.planner](self._hpp, [self._fleet[d] for d in workers],
                                                    self.parallel_batches, self.micro_batch_size)
        except ConfigError as exc:
            raise TrainingError(f"devices {list(workers)} cannot go on: {exc}") from None
        return HppPlan(tuple(HppStage(s.first, s.stop, tuple(workers[i] for i in s.devices),
                                      s.samples) for s in found.stages), found.round_s)

    def _capacity(self, devices: Sequence[int]) -> float:
        """What ``devices`` compute together: the sum of each one's micro-batches of the
        whole model per second."""
        return math.fsum(1.0 / max(sum(self._hpp.times(0, self.units, self.micro_batch_size,
                                                       self._fleet[d])), 1e-12)
                         for d in devices)

    def _check_first_stage(self, workers: Sequence[int]) -> None:
        """An epoch keeps its batches after a re-plan (the first stage's members go round
        their data again: aiopipe.runtime.holdings); each must hold one iteration's rows.

        Raises:
            TrainingError: one does not.
        """
        n = self.parallel_batches
        for d in self.groups[0]:
            rows = (self.rows[d][1] - self.rows[d][0]) * n
            if self._samples[d] < rows:
                raise TrainingError(f"devices {list(workers)} cannot go on: device {d} "
                                    f"holds {self._samples[d]} samples, fewer than one "
                                    f"iteration of its rows ({rows})")

    async def _play(self, rounds: Rounds, device: int, start: RoundStart) -> RoundResult:
        """Member ``device``'s part of the round.

        Raises:
            StageLost: it was lost, or said its round stopped.
        """
        return await play_or_lost(rounds, device, start, self._returns.pop(device, None))

    def _merge(self, results: Mapping[int, RoundResult]) -> None:
        """Each stage's weights from its first member (its members' are the same);
        floating-point buffers averaged over the members (compute thread)."""
        self._absorb(models.merge_states(*(
            merged_stage([state_from_wire(results[d].tensors) for d in group], self.model)
            for group in self.groups)))

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """The samples that went through the whole pipeline: the first stage's members'."""
        return sum(device_samples[d] for d in self.groups[0] if d < len(device_samples))

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int], memory: Mapping[int, int]
                      ) -> list[dict[str, Any]]:
        """Per member: its stage, device, units, rows, compute busy and idle seconds, the
        most micro-batches whose activations it held at once, and what its training held
        at most, measured, against the planner's Eq. 3 and the device's budget (MiB;
        budget 0: none)."""
        figures = []
        for p, group in enumerate(self.groups):
            for d in group:
                track = f"device{d}/compute"
                planned = self._hpp.memory(*self.bounds[p], self.rows[d][1] - self.rows[d][0],
                                           self._in_flight(p, self.stages))
                figures.append({
                    "stage": p, "device": d, "units": list(self.bounds[p]),
                    "rows": list(self.rows[d]), "busy_s": busy.get(track, 0.0),
                    "idle_s": elapsed - busy.get(track, 0.0), "peak_live": peaks.get(d, 0),
                    "peak_memory_mb": memory.get(d, 0) / 2**20,
                    "planned_memory_mb": planned / 2**20,
                    "budget_mb": (self.config.device_memory_bytes_of(d) or 0) / 2**20})
        return figures

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Refused (see the module docstring).

        Raises:
            ConfigError: always.
        """
        raise ConfigError("mode asteroid cannot resume from a checkpoint yet: its "
                          "optimizer state lives on the devices")
