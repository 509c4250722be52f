"""A synchronous pipeline across devices (``mode = "pipeline"``).

Placement: a chain of S stages on S devices, stage p on device p; stage 0 holds the data
(device 0's own), the last stage computes the loss; the coordinator runs no stage and
stays off the data path: activations and gradients go device to device, over links the
devices authenticate with the pair keys the coordinator hands out (`Plan.peer_keys`).
The units are cut at ``partition`` (S - 1 cut points, or "auto": a balanced partition of
the cost table, `aiopipe.scheduler.partition`).

Each iteration is ``parallel_batches`` micro-batches of ``batch_size // N`` samples
under ``schedule`` ("1f1b": K_p = min(2(S - p) - 1, N) forwards on stage p before one
forward, one backward, Asteroid §3.2; or "gpipe": all forwards, then all backwards);
every stage steps once the iteration's backwards are done (gradients accumulated over
the micro-batches: the same step as unsplit training on the whole batch). A round is
an epoch: each device gets its stage's weights, runs the epoch's iterations with its
neighbours, and returns its trained stage; the coordinator puts the stages side by side
into the global model, which it evaluates.

``mode = "ftpipehd"`` runs the same chain asynchronously (FTPipeHD §III-C; the rules are
aiopipe/scheduler/async_pipeline.py): a round is an epoch run as one iteration whose
micro-batches are the epoch's whole batches, under 1F1B with ``k_p = S − p`` forwards of
warm-up and no flush until the epoch ends; each stage applies each batch's update as
its backward ends, with weight stashing, vertical sync and weight aggregation
(`aiopipe.runtime.async_weights.AsyncStageWork`). The epoch's end is the one flush: the
stages' latest weights make the global model that is evaluated. Its "auto" cuts come from
FTPipeHD's planner (`aiopipe.scheduler.ftpipehd`) with the declared ``device_slowdown``
as capacities and each device's uplink as the link to the next stage, and are planned
again between epochs from the capacities the epoch measured (`Pipeline.after_round`).

Faults: a synchronous pipeline cannot go on without one of its stages, so a device lost
mid-round ends the run with a `TrainingError` naming it; its optimizer state lives on
the devices, so it cannot resume from a checkpoint: none is written. FTPipeHD plays the
round again without the lost device (`Pipeline._recover`), and since the coordinator
holds every stage's weights and momentum between rounds, its checkpoints hold the whole
state: a restarted server resumes exactly where its last round ended.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.auth import pair_key
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, RoundStalledError, TrainingError
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Hello,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.async_weights import MOMENTUM, split_momentum
from aiopipe.runtime.plan import (
    DevicePlan,
    check_trainable,
    measure_planning_costs,
    unit_output_shapes,
)
from aiopipe.runtime.systems.base import Rounds, Setup
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.ftpipehd import Partition, ftpipehd_partition, pipeline_time
from aiopipe.scheduler.partition import balanced_partition
from aiopipe.scheduler.placement import chain
from aiopipe.scheduler.schedule import (
    Schedule,
    check_schedule,
    gpipe,
    one_f_one_b,
    with_transfers,
)

__all__ = ["MAX_REPLAYS", "Pipeline"]

#: FTPipeHD: how many times in a row a round may be played again with the same devices
#: (a fault that no re-partition removes) before the run ends.
MAX_REPLAYS = 3

log = logging.getLogger("aiopipe.server")


class Pipeline:
    """The synchronous multi-device pipeline (module docstring)."""

    wants_profiles = False  # "auto" cuts are balanced on the coordinator's table

    def __init__(self, setup: Setup) -> None:
        config = setup.config
        self.setup, self.config = setup, config
        self.model = setup.model
        #: FTPipeHD resumes from its checkpoints (the module docstring), with the cuts
        #: its planner had chosen
        self.resumable = config.mode == "ftpipehd"
        self.planned_keys: tuple[str, ...] = (
            ("partition",) if self.resumable and config.partition == "auto" else ())
        self.units = models.unit_count(self.model)
        self.stages = config.devices
        #: the device of each stage (FTPipeHD's worker list: it shrinks when devices are
        #: lost, `_enlist`)
        self.workers = list(range(self.stages))
        self.asynchronous = config.mode == "ftpipehd"
        n = 1 if self.asynchronous else config.parallel_batches
        if not isinstance(n, int):
            raise ConfigError("config key 'parallel_batches': mode pipeline takes one "
                              "integer (micro-batches per iteration)")
        self.parallel_batches = n  # ftpipehd: the round's batches, once `prepare` knows
        #: ftpipehd: a round's batches (an iteration is a batch); 0: the epoch's
        self.round_iterations = 0
        self.micro_batch_size = config.batch_size // n
        if self.stages > self.units:
            raise ConfigError(f"config key 'devices': {self.stages} stages, but "
                              f"{config.model if isinstance(config.model, str) else 'the model'}"
                              f" has only {self.units} units")
        cuts = config.partition
        #: FTPipeHD's planner (mode ftpipehd; built when first needed): "auto" cuts, and
        #: new ones after a device is lost
        self._planner: _Planner | None = None
        #: FTPipeHD re-partitions between rounds from measured capacities ("auto" cuts)
        self.replanning = self.asynchronous and cuts == "auto"
        #: the capacity each device last measured (FTPipeHD; 1 until measured)
        self.capacity: dict[int, float] = {}
        #: whether the round under way was played again after a fault
        self.recovered = False
        #: the round last played again, (epoch, first batch), and how many times in a
        #: row with the same devices
        self._replayed: tuple[int, int] | None = None
        self._replays = 0
        if cuts == "auto":
            slowdowns = [config.device_slowdown_of(p) for p in range(self.stages)]
            if self.asynchronous:  # FTPipeHD's planner: capacities and links (§III-D)
                cuts = self.planner().cuts(slowdowns, self.workers).cuts
            else:
                costs = setup.cost_table or measure_planning_costs(
                    config, self.model, setup.in_shape, setup.test_set)
                cuts = tuple(balanced_partition(costs, self.stages, self.micro_batch_size,
                                                slowdowns))
        assert isinstance(cuts, tuple)
        self.config = config
        self._place(cuts)
        self.iterations_per_epoch = 0  # `prepare` knows: device 0's announced samples
        check_trainable(self.model, setup.in_shape,
                        [DevicePlan(0, self.units, n, self.micro_batch_size, 0)], config)
        self.activation_shapes = unit_output_shapes(self.model, setup.in_shape)
        self.schedule: Schedule = self._schedule(n)
        self._secret = setup.run_secret
        #: the worker list and cuts before the last change (`_enlist`)
        self._before: tuple[list[int], list[int]] = (list(self.workers), list(cuts))
        #: each parameter's momentum buffer (FTPipeHD with momentum: the stages' SGD
        #: state travels with their weights, aiopipe.runtime.async_weights)
        self.momentum: dict[str, torch.Tensor] = {}
        if self.asynchronous and config.momentum:
            self.momentum = {name: torch.zeros_like(param.detach())
                             for name, param in self.model.named_parameters()}

    def planner(self) -> _Planner:
        """FTPipeHD's planner for this run (built from the cost table, or by profiling,
        when first asked)."""
        if self._planner is None:
            setup = self.setup
            costs = setup.cost_table or measure_planning_costs(
                self.config, self.model, setup.in_shape, setup.test_set)
            self._planner = _Planner.of(self.config, costs, self.model, setup.in_shape,
                                        self.micro_batch_size)
        return self._planner

    def _place(self, cuts: tuple[int, ...]) -> None:
        """Stage p of the chain on device p, cut at ``cuts``.

        Raises:
            ConfigError: the cuts do not fit the model.
        """
        try:
            self.placement = chain(cuts, self.units, [f"device{w}" for w in self.workers])
        except ConfigError as exc:
            raise ConfigError(f"config key 'partition': {exc} for a model of {self.units} "
                              "units") from None
        if len(self.workers) == self.config.devices:  # (after a loss the plan tells)
            self.config = self.config.replace(partition=cuts)
        self.pipeline = self.placement.pipelines[0]
        #: (first, stop) units of each stage
        self.bounds = [(s.first_unit, s.stop_unit) for s in self.pipeline.stages]

    def _schedule(self, n: int) -> Schedule:
        if self.asynchronous:  # k_p = S − p batches in flight: PipeDream's 1F1B
            warmup = [min(self.stages - p, n) for p in range(self.stages)]
            schedule = with_transfers(one_f_one_b(self.stages, n, warmup))
        else:
            schedule = with_transfers(one_f_one_b(self.stages, n)
                                      if self.config.schedule == "1f1b"
                                      else gpipe(self.stages, n))
        check_schedule(schedule)
        return schedule

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Device 0 holds the data: its samples make the epoch.

        Raises:
            ConfigError: fewer than one iteration's samples.
        """
        if self.asynchronous:  # rounds of global_replication_every whole batches
            batches = samples[0] // self.micro_batch_size
            if batches < 1:
                raise ConfigError(f"device 0 holds {samples[0]} samples, fewer than one "
                                  f"batch ({self.micro_batch_size})")
            every = self.config.global_replication_every
            self.iterations_per_epoch = batches
            self.round_iterations = min(every, batches) if every else batches
            self._round_of(self.round_iterations)
            return
        per_iteration = self.micro_batch_size * self.parallel_batches
        self.iterations_per_epoch = samples[0] // per_iteration
        if self.iterations_per_epoch < 1:
            raise ConfigError(f"device 0 holds {samples[0]} samples, fewer than one "
                              f"iteration ({per_iteration})")

    # -- what devices are told -----------------------------------------------------------

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per stage: its device, units (first, stop), micro-batches and schedule."""
        if self.asynchronous:
            return [{"stage": p, "device": self.workers[p], "units": [a, b],
                     "batches": self.round_iterations,
                     "schedule": "async 1f1b", "in_flight": self.stages - p}
                    for p, (a, b) in enumerate(self.bounds)]
        return [{"stage": p, "device": p, "units": [a, b],
                 "parallel_batches": self.parallel_batches, "schedule": self.config.schedule}
                for p, (a, b) in enumerate(self.bounds)]

    def iterations(self, device_id: int) -> int:
        """Every stage runs the data holder's iterations."""
        return self.iterations_per_epoch

    def refuse_hello(self, hello: Hello) -> str:
        """A device must listen for its peers."""
        if not hello.address:
            return (f"mode pipeline links devices directly: start device {hello.device_id} "
                    "with an address its peers can reach (python -m aiopipe.device "
                    "--listen HOST:PORT)")
        return ""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """The keys of device ``device_id``'s pairs with the members of its neighbouring
        stages (FTPipeHD: with every other device, whose stage may come next to its own
        after a device is lost)."""
        me = f"device{device_id}"
        nodes = ([f"device{k}" for k in range(self.config.devices) if k != device_id]
                 if self.asynchronous else
                 [node for _, node in self.pipeline.neighbours(me)])
        return {node: pair_key(self._secret, me, node).hex() for node in nodes}

    def frame_limit(self) -> int:
        """The whole model's state (a stage's share is less), a round report's slices
        and a round's action list."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size()
                          for t in [*state.values(), *self.momentum.values()])
        n = self.parallel_batches
        # (ftpipehd: a round is one iteration of n batches)
        slices = (1 if self.asynchronous else self.iterations_per_epoch) * (4 * n + 2) + 16
        actions = 16 * (6 * n + 2)
        return int(state_bytes + HEADER_SLACK_BYTES + 256 * len(state) + 128 * slices
                   + actions)

    def round_start(self, rounds: Rounds, p: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Stage p's `RoundStart`: its units' weights, actions and neighbours."""
        a, b = self.bounds[p]
        peers = {node: {"stage": q, "address": rounds.address_of(self.workers[q])}
                 for q, node in self.pipeline.neighbours(f"device{self.workers[p]}")}
        if self.asynchronous:  # one iteration of ``iterations`` whole batches
            return RoundStart(round_no, epoch, first, 1, state, p, self.stages, a, b,
                              iterations, self.micro_batch_size, round_no,
                              " ".join(map(str, self.schedule.actions[p])), peers)
        return RoundStart(round_no, epoch, first, iterations, state, p, self.stages, a, b,
                          self.parallel_batches, self.micro_batch_size,
                          epoch * self.iterations_per_epoch + first,
                          " ".join(map(str, self.schedule.actions[p])), peers)

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every stage's device trains the round together; their stages make the model.
        FTPipeHD goes on without a lost device: the round is played again by the devices
        still there, re-partitioned (`_recover`).

        Raises:
            TrainingError: a stage's device is missing or was lost (a synchronous
                pipeline), or device 0, which holds the data, is (FTPipeHD).
        """
        if not self.asynchronous:
            missing = sorted(set(range(self.stages)) - set(participants))
            if missing:
                raise TrainingError(f"device {missing[0]} (stage {missing[0]}) is gone: a "
                                    "synchronous pipeline cannot go on without a stage")
            return await self._play_round(rounds, round_no, epoch, first, work)
        self.recovered = False
        self._round_of(work[0])
        if self._enlist(participants):
            rounds.record_change(self._recovery(round_no, epoch, "at its start"))
        while True:
            try:
                return await self._play_round(rounds, round_no, epoch, first, work)
            except _StageLost as lost:
                round_no = await self._recover(rounds, lost, round_no, epoch, first)

    async def _play_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                          work: Sequence[int]) -> dict[int, RoundResult]:
        """One attempt at the round with the current worker list; results by device.

        Raises:
            _StageLost: a stage's device was lost (FTPipeHD).
            TrainingError: a stage's device was lost (a synchronous pipeline).
        """
        states = await rounds.compute.call(self._stage_states)
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:  # the first stage lost ends them all
                played = {w: tasks.create_task(self._play(
                    rounds, w, self.round_start(rounds, p, round_no, epoch, first, work[w],
                                                states[p])))
                    for p, w in enumerate(self.workers)}
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {w: task.result() for w, task in played.items()}
        await rounds.compute.run("agg", partial(self._merge, done),
                                 cost=0.0 if rounds.cost_table else None, epoch=epoch)
        return done

    async def _play(self, rounds: Rounds, device: int, start: RoundStart) -> RoundResult:
        """Stage ``start.stage``'s part of the round, on ``device``.

        Raises:
            _StageLost: its device was lost (FTPipeHD).
            TrainingError: its device was lost (a synchronous pipeline).
        """
        try:
            result = await rounds.play(device, start, None)
        except RoundStalledError as exc:  # (FTPipeHD's devices say so; see `_recover`)
            raise _StageLost(device, start.stage, rounds.clock.now(), str(exc)) from None
        if result is None:
            if self.asynchronous:
                raise _StageLost(device, start.stage, rounds.clock.now())
            raise TrainingError(f"device {device} (stage {start.stage}) was lost in round "
                                f"{start.round + 1}: a synchronous pipeline cannot go on "
                                "without a stage")
        return result

    def _round_of(self, batches: int) -> None:
        """FTPipeHD: the coming round has ``batches`` batches (the epoch's last may have
        fewer)."""
        if batches != self.parallel_batches:
            self.parallel_batches = batches
            self.schedule = self._schedule(batches)

    def _enlist(self, alive: Sequence[int]) -> bool:
        """FTPipeHD's worker list is the devices alive, in id order (§III-F: a lost one's
        successors move up one place; one that came back takes its place again); when it
        changed, the model is re-partitioned among them by the planner, with the
        capacities they measured (1 where none was). Whether it changed.

        Raises:
            TrainingError: device 0 (the data) is gone.
        """
        workers = sorted(set(alive) & set(range(self.config.devices)))
        if 0 not in workers:
            raise TrainingError("device 0 is gone: it holds the data (FTPipeHD's central "
                                "node), so the run cannot go on without it")
        if workers == self.workers:
            return False
        self._before = (list(self.workers), [b for _, b in self.bounds[:-1]])
        capacities = [self.capacity.get(w, 1.0) for w in workers]
        cuts = self.planner().cuts(capacities, workers).cuts
        self.workers, self.stages = workers, len(workers)
        self._place(cuts)
        self.schedule = self._schedule(self.parallel_batches)
        return True

    def _recovery(self, round_no: int, epoch: int, when: str, **more: Any) -> dict[str, Any]:
        """The record of a change of the worker list (see `_enlist`)."""
        workers, cuts = self._before
        after = [b for _, b in self.bounds[:-1]]
        log.warning("round %d (%s): the pipeline runs on devices %s (was %s), cuts %s "
                    "(were %s)", round_no + 1, when, self.workers, workers, after, cuts)
        return {"round": round_no, "epoch": epoch, "kind": "recovery",
                "workers": list(self.workers), "workers_before": workers, "before": cuts,
                "after": after, **more}

    async def _recover(self, rounds: Rounds, lost: _StageLost, round_no: int,
                       epoch: int, first: int) -> int:
        """FTPipeHD's recovery (§III-F, with the choice of DESIGN §FTPipeHD): the round
        is played again from its start, every stage from the weights and momentum the
        coordinator sent it, by the devices still there (re-partitioned when they
        changed); the round number of the new attempt.

        Raises:
            TrainingError: device 0 is gone.
        """
        if lost.stalled:
            log.warning("round %d: %s; playing the round again", round_no + 1, lost.stalled)
        else:
            log.warning("round %d: device %d (stage %d) was lost; playing the round again "
                        "without it", round_no + 1, lost.device, lost.stage)
        self.recovered = True
        self._before = (list(self.workers), [b for _, b in self.bounds[:-1]])
        if lost.stalled:
            # a neighbour's link may break a moment before the coordinator's own link to
            # a dead device does: give that a heartbeat interval (at most 1 s) to show
            await rounds.clock.sleep(min(1.0, self.config.heartbeat_interval))
        changed = self._enlist(await rounds.settled_alive())
        key = (epoch, first)
        self._replays = self._replays + 1 if key == self._replayed and not changed else 0
        self._replayed = key
        if self._replays >= MAX_REPLAYS:
            raise TrainingError(
                f"the round of batches {first + 1}..{first + self.parallel_batches} of epoch "
                f"{epoch + 1} stopped {MAX_REPLAYS + 1} times with the same devices; the "
                f"last time: {lost}")
        again = rounds.new_round()
        gone = sorted(set(self._before[0]) - set(self.workers))
        rounds.record_change(self._recovery(
            round_no, epoch, "devices lost" if gone else "stalled", lost=gone,
            stopped=lost.stalled or str(lost), noticed_at=lost.at,
            resumed_at=rounds.clock.now(), replayed_as=again,
            batches=[first, first + self.parallel_batches]))
        return again

    def _stage_states(self) -> list[dict[str, Any]]:
        stages = models.partition(self.model, [b for _, b in self.bounds[:-1]])
        states = []
        for stage in stages:
            state = {k: v.detach().clone() for k, v in stage.state_dict().items()}
            if self.momentum:
                state.update({MOMENTUM + name: self.momentum[name].clone()
                              for name, _ in stage.named_parameters()})
            states.append(state_to_wire(state))
        return states

    def _merge(self, results: Mapping[int, RoundResult]) -> None:
        """The stages side by side are the whole model (compute thread)."""
        state, momentum = split_momentum(models.merge_states(
            *(state_from_wire(results[w].tensors) for w in self.workers)))
        self.model.load_state_dict(state)
        self.momentum.update({name: buf.clone() for name, buf in momentum.items()})

    def refused_updates(self) -> list[int]:
        """A pipeline's stages are put side by side, not aggregated: none."""
        return []

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """The samples that went through the whole pipeline (device 0's: it holds the
        data, and its stage is the first)."""
        return device_samples[0] if device_samples else 0

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int]) -> list[dict[str, Any]]:
        """Per stage: its device, units, compute busy and idle seconds, and the most
        micro-batches whose activations it held at once."""
        return [{"stage": p, "device": w, "units": [a, b],
                 "busy_s": busy.get(f"device{w}/compute", 0.0),
                 "idle_s": elapsed - busy.get(f"device{w}/compute", 0.0),
                 "peak_live": peaks.get(w, 0)}
                for p, (w, (a, b)) in enumerate(zip(self.workers, self.bounds, strict=True))]

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """FTPipeHD with "auto" cuts re-partitions between rounds (§III-D): each stage's
        capacity is the compute time its device spent on the round over the planner's
        time for its units, and the cuts that the planner gives for those capacities are
        taken when they promise at least 5% less time per batch. The next round hands
        each device its new units' weights (from the global model). A round that was
        played again after a fault measured nothing reliable: its record is the
        recovery's. A synchronous pipeline keeps its partition."""
        if self.recovered or not self.replanning:
            return None
        planner = self.planner()
        measured = [math.fsum(s.duration for s in slices if s.track == f"device{w}/compute"
                              and s.name in ("f", "b", "s")) for w in self.workers]
        capacities = planner.capacities(self.bounds, measured, self.parallel_batches)
        self.capacity.update(zip(self.workers, capacities, strict=True))
        cuts = tuple(b for _, b in self.bounds[:-1])
        current = planner.time(cuts, capacities, self.workers)
        chosen = planner.cuts(capacities, self.workers)
        if chosen.cuts == cuts or not chosen.time_s < 0.95 * current:
            return None
        before = list(cuts)
        self._place(chosen.cuts)
        log.info("re-partitioned after round %d (epoch %d): cuts %s -> %s for capacities "
                 "%s (estimated %.3g -> %.3g s a batch)", round_no + 1, epoch + 1, before,
                 list(chosen.cuts), [round(c, 2) for c in capacities], current,
                 chosen.time_s)
        return {"round": round_no, "epoch": epoch, "before": before,
                "after": list(chosen.cuts), "capacities": capacities,
                "estimated_s": [current, chosen.time_s]}

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """FTPipeHD: the global model and every parameter's momentum; a synchronous
        pipeline: nothing (it cannot resume: the module docstring)."""
        if not self.resumable:
            return {}
        tensors = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        tensors.update({MOMENTUM + k: v.clone() for k, v in self.momentum.items()})
        return tensors

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """FTPipeHD: load a checkpoint's model, momentum and cuts ("auto": the ones the
        planner had chosen).

        Raises:
            ConfigError: a synchronous pipeline (see the module docstring).
        """
        if not self.resumable:
            raise ConfigError("mode pipeline cannot resume from a checkpoint: its optimizer "
                              "state lives on the devices")
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        self.momentum.update({k[len(MOMENTUM):]: v.clone() for k, v in tensors.items()
                              if k.startswith(MOMENTUM)})
        if self.planned_keys:
            self._place(tuple(int(c) for c in config["partition"]))


class _StageLost(Exception):
    """FTPipeHD: the device of a stage was lost mid-round, or said its round stopped
    (``stalled``: why), noticed at ``at``."""

    def __init__(self, device: int, stage: int, at: float, stalled: str = "") -> None:
        super().__init__(stalled or f"device {device} (stage {stage}) was lost")
        self.device, self.stage, self.at, self.stalled = device, stage, at, stalled


@dataclass(frozen=True, slots=True)
class _Planner:
    """FTPipeHD's planner for one run: each unit's time per batch (the cost table's),
    its output per batch, and each device's uplink (bytes/s): a stage's link to the
    next is its device's uplink."""

    times: tuple[float, ...]
    sizes: tuple[float, ...]
    uplinks: tuple[float, ...]

    @classmethod
    def of(cls, config: RunConfig, costs: CostTable, model: torch.nn.Sequential,
           in_shape: tuple[int, ...], batch: int) -> _Planner:
        """The planner of ``config``'s run."""
        units = models.unit_count(model)
        times = tuple(costs.forward_time(u, u + 1, batch) + costs.backward_time(u, u + 1, batch)
                      for u in range(units))
        shapes = unit_output_shapes(model, in_shape)
        sizes = tuple(4.0 * math.prod(shapes[u]) * batch for u in range(units))
        rates = [config.device_network(k).up.bandwidth_bps for k in range(config.devices)]
        return cls(times, sizes, tuple(r / 8 if r is not None else math.inf for r in rates))

    def _links(self, workers: Sequence[int]) -> list[float]:
        return [self.uplinks[w] for w in workers[:-1]]

    def cuts(self, capacities: Sequence[float], workers: Sequence[int]) -> Partition:
        """The best partition for ``capacities`` of the devices ``workers``, in order."""
        return ftpipehd_partition(self.times, self.sizes, len(capacities),
                                  capacities=capacities, bandwidths=self._links(workers))

    def time(self, cuts: tuple[int, ...], capacities: Sequence[float],
             workers: Sequence[int]) -> float:
        """The estimated time per batch of ``cuts`` under ``capacities``."""
        return pipeline_time(self.times, self.sizes, cuts, capacities=capacities,
                             bandwidths=self._links(workers))

    def capacities(self, bounds: Sequence[tuple[int, int]], measured: Sequence[float],
                   batches: int) -> list[float]:
        """Each stage's capacity from the compute seconds it measured over ``batches``
        batches (a stage that measured nothing keeps 1)."""
        result = []
        for (first, stop), seconds in zip(bounds, measured, strict=True):
            reference = math.fsum(self.times[first:stop]) * batches
            result.append(seconds / reference if seconds > 0 and reference > 0 else 1.0)
        return result
