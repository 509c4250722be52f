"""FTPipeHD's asynchronous pipeline across heterogeneous devices (``mode = "ftpipehd"``).

The synchronous pipeline's chain (`aiopipe.runtime.systems.pipeline`), run as FTPipeHD
§III-C says (the rules are aiopipe/scheduler/async_pipeline.py): a round is
``global_replication_every`` whole batches run as one iteration under 1F1B with
``k_p = S − p`` forwards of warm-up and no flush until the round ends; each stage
applies each batch's update as its backward ends, with weight stashing, vertical sync
and weight aggregation (`async_weights.AsyncStageWork`, on the device). A round's end
is a flush and FTPipeHD's global replication: every stage returns its weights and their
momentum, so the coordinator holds the whole state between rounds (and checkpoints it:
a restarted server resumes).

The partition (§III-D): "auto" cuts come from FTPipeHD's planner
(`aiopipe.scheduler.ftpipehd`) with the declared ``device_slowdown`` as capacities and
each device's uplink as the link to the next stage, and are planned again after every
round from the capacities the round measured (`FTPipeHD.after_round`).

Faults (§III-F, `FTPipeHD._recover`): a round that cannot finish (a device lost, a
neighbour's link broken, no gradient within ``device_timeout``: `RoundStalled`) is played
again from its start by the devices alive, re-partitioned among them when they changed;
no batch is applied twice or skipped. Device 0 holds the data: without it the run ends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, RemoteProtocolError
from aiopipe.metrics.trace import Slice
from aiopipe.models.crossing import Crossing, crossing_bytes
from aiopipe.protocol import Replica, RoundResult, RoundStart, state_from_wire
from aiopipe.runtime.momentum import MOMENTUM, trainable_parameters
from aiopipe.runtime.plan import cached_planning_costs, unit_crossings
from aiopipe.runtime.plan_text import change_lines, log_lines
from aiopipe.runtime.systems.base import Rounds, Setup, planning_batch_sizes
from aiopipe.runtime.systems.ftpipehd.chain import KEPT, gather, replica_check
from aiopipe.runtime.systems.ftpipehd.device import FTPipeHDDevice
from aiopipe.runtime.systems.ftpipehd.options import FTPipeHDOptions
from aiopipe.runtime.systems.pipeline.coordinator import (
    MAX_REPLAYS,
    Pipeline,
    StageLost,
    play_or_lost,
)
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.ftpipehd import Partition, ftpipehd_partition, pipeline_time
from aiopipe.scheduler.schedule import Schedule, check_schedule, one_f_one_b, with_transfers

__all__ = ["MAX_REPLAYS", "FTPipeHD", "Planner"]

log = logging.getLogger("aiopipe.server")


class FTPipeHD(Pipeline):
    """FTPipeHD's asynchronous pipeline (module docstring)."""

    resumable = True
    recovers_lost_devices = True  # §III-F: the round is played again without it
    device_half = FTPipeHDDevice
    links_devices = True
    round_steps = "batches"

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """Whole batches: B."""
        return [config.batch_size]

    def __init__(self, setup: Setup) -> None:
        #: the planner (built when first needed): "auto" cuts, and new ones after a
        #: device is lost
        self._planner: Planner | None = None
        #: the capacity each device last measured (1 until measured)
        self.capacity: dict[int, float] = {}
        #: the last stage's chain replicas of the latest round it sent any of, by batches
        self._chained: tuple[int, dict[int, Replica]] = (-1, {})
        super().__init__(setup)
        #: "auto" cuts are re-planned after every round from measured capacities, and a
        #: resumed run goes on with the ones the planner had chosen
        self.replanning = setup.config.options_as(FTPipeHDOptions).partition == "auto"
        self.planned_keys = ("partition",) if self.replanning else ()
        self.round_iterations = 0  # a round's batches, once `prepare` knows
        #: whether the round under way was played again after a fault
        self.recovered = False
        #: whether the round under way re-partitioned after its first batches
        self._replanned_early = False
        #: per device, (its session, its stage: units, place, the pipeline's length) when
        #: it holds, from the last round it completed, exactly the weights and momentum
        #: the coordinator has for them: its next RoundStart sends none ([Note: kept
        #: weights])
        self._held: dict[int, tuple[int, tuple[int, int, int, int]]] = {}
        #: per device, the tensors its result must hold when it was sent none
        self._returns: dict[int, Mapping[str, Any]] = {}
        #: each trainable parameter's momentum buffer (its stage's SGD state travels
        #: with its weights, aiopipe.runtime.systems.ftpipehd.async_weights)
        self.momentum: dict[str, torch.Tensor] = {}
        if setup.config.momentum:
            self.momentum = {name: torch.zeros_like(param.detach())
                             for name, param in trainable_parameters(self.model)}

    def _micro_batches(self) -> int:
        """An iteration is one whole batch (a round's are its micro-batches, `prepare`)."""
        return 1

    def _auto_cuts(self, slowdowns: Sequence[float]) -> tuple[int, ...]:
        """FTPipeHD's planner: the declared slowdowns as capacities, the uplinks as links."""
        return self.planner().cuts(slowdowns, self.workers).cuts

    def planner(self) -> Planner:
        """FTPipeHD's planner for this run (built from the cost table, or by profiling,
        when first asked)."""
        if self._planner is None:
            setup = self.setup
            costs = setup.cost_table or cached_planning_costs(
                self.config, self.model, setup.data.inputs, setup.test_set,
                sizes=planning_batch_sizes(self.config))
            self._planner = Planner.of(self.config, costs, self.model, setup.data.inputs,
                                       self.micro_batch_size)
        return self._planner

    def _cuts_among(self, workers: Sequence[int]) -> tuple[int, ...]:
        """The planner's cuts for ``workers`` with the capacities they measured (1 where
        none was: the paper's "assume the same capacity")."""
        capacities = [self.capacity.get(w, 1.0) for w in workers]
        return self.planner().cuts(capacities, workers).cuts

    def _schedule(self, n: int) -> Schedule:
        # k_p = S − p batches in flight: PipeDream's 1F1B
        warmup = [min(self.stages - p, n) for p in range(self.stages)]
        schedule = with_transfers(one_f_one_b(self.stages, n, warmup))
        check_schedule(schedule)
        return schedule

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Device 0 holds the data: rounds of ``global_replication_every`` of its batches.

        Raises:
            ConfigError: fewer than one batch.
        """
        batches = samples[0] // self.micro_batch_size
        if batches < 1:
            raise ConfigError(f"device 0 holds {samples[0]} samples, fewer than one "
                              f"batch ({self.micro_batch_size})")
        every = self.config.options_as(FTPipeHDOptions).global_replication_every
        self.iterations_per_epoch = batches
        self.round_iterations = min(every, batches) if every else batches
        self._round_of(self.round_iterations)

    def _round_of(self, batches: int) -> None:
        """The coming round has ``batches`` batches (the epoch's last may have fewer)."""
        if batches != self.parallel_batches:
            self.parallel_batches = batches
            self.schedule = self._schedule(batches)

    # -- what devices are told -----------------------------------------------------------

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per stage: its device, units (first, stop), batches per round, how many in
        flight."""
        return [{"stage": p, "device": self.workers[p], "units": [a, b],
                 "batches": self.round_iterations, "schedule": "async 1f1b",
                 "in_flight": self.stages - p}
                for p, (a, b) in enumerate(self.bounds)]

    def frame_limit(self) -> int:
        """The whole model's state and momentum, a round report's slices (a round is one
        iteration) and a round's action list."""
        return self._frame_limit(1, extra_tensors=list(self.momentum.values()))

    def round_start(self, rounds: Rounds, p: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Stage p's `RoundStart`: one iteration of ``iterations`` whole batches from
        batch ``first``; its version is the attempt's round number (a replayed round's
        messages are told apart by it). No weights when its device holds them already
        ([Note: kept weights] in aiopipe/runtime/holdings.py): the first attempt at a
        round after one its device completed, in the same session, with the same units;
        the device's result must then hold what ``state`` would have sent."""
        a, b = self.bounds[p]
        device = self.workers[p]
        self._returns.pop(device, None)
        if not self.recovered and self._held.get(device) == (rounds.session_of(device),
                                                               self._stage_of(p)):
            self._returns[device], state = state, {}
        return RoundStart(round_no, epoch, first, 1, state, p, self.stages, a, b,
                          iterations, self.micro_batch_size, round_no,
                          " ".join(map(str, self.schedule.actions[p])), self._peers(rounds, p))

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every stage's device trains the round together; their stages make the model.
        A round that cannot finish is played again by the devices still there,
        re-partitioned (`_recover`).

        Raises:
            TrainingError: device 0, which holds the data, is gone; or the round stopped
                `MAX_REPLAYS` + 1 times with the same devices.
        """
        self.recovered = False
        self._round_of(work[0])
        if self._enlist(participants):
            rounds.record_change(self._recovery(round_no, epoch, "at its start"))
        attempt = _Attempt(first, work[0])
        # the run's first re-partition, a few batches in (§III-D: after 10)
        early = self.config.options_as(FTPipeHDOptions).first_repartition_after if (
            self.replanning and (epoch, first) == (0, 0)) else 0
        self._replanned_early = False
        while True:
            part = early if 0 < early < attempt.batches else attempt.batches
            self._round_of(part)
            mark = len(rounds.recorder.slices)
            try:
                done = await self._play_round(rounds, round_no, epoch, attempt.first,
                                              [part] * len(work))
            except StageLost as lost:
                self._held.clear()  # an attempt given up on left the devices' weights
                early = 0
                round_no, attempt = await self._recover(rounds, lost, round_no, epoch, first,
                                                        attempt)
                continue
            self._held = {w: (rounds.session_of(w), self._stage_of(p))
                          for p, w in enumerate(self.workers)}
            if part == attempt.batches:
                return attempt.with_carried(done, self.workers, self.micro_batch_size)
            # the pipeline was flushed after the first `early` batches: re-partition from
            # what they measured, and play the rest of the round
            early, self._replanned_early = 0, True
            last = done[self.workers[-1]]
            attempt = attempt.resumed(part, last.loss_sum, last.correct)
            change = self._replan(rounds.recorder.take(mark), part, round_no, epoch)
            if change is not None:
                rounds.record_change({**change, "after_batches": part})
            round_no = rounds.new_round()

    def _stage_of(self, p: int) -> tuple[int, int, int, int]:
        """Stage p as a device's stage is the same one: its units, place and the
        pipeline's length (`Assignment.same_stage`)."""
        a, b = self.bounds[p]
        return a, b, p, self.stages

    async def _play(self, rounds: Rounds, device: int, start: RoundStart) -> RoundResult:
        """Stage ``start.stage``'s part of the round, on ``device``.

        Raises:
            StageLost: its device was lost, or said its round stopped.
        """
        return await play_or_lost(rounds, device, start, self._returns.pop(device, None))

    async def _recover(self, rounds: Rounds, lost: StageLost, round_no: int,
                       epoch: int, first: int, attempt: _Attempt) -> tuple[int, _Attempt]:
        """FTPipeHD's recovery (§III-F, with the choice of DESIGN §FTPipeHD): the round
        (from batch ``first``) is played again by the devices still there
        (re-partitioned when they changed): from the latest point of ``attempt`` every
        stage's state survived in the chain replication (`chain`), else
        from the attempt's start, from the weights and momentum the coordinator sent.
        The round number of the new attempt, and what it plays.

        Raises:
            TrainingError: device 0 is gone, or the round stopped once too often.
        """
        self.recovered = True
        workers, bounds = list(self.workers), list(self.bounds)
        alive = await self._regroup(rounds, lost, round_no, epoch, first,
                                    self.parallel_batches)
        point = await self._chain_point(rounds, round_no, workers, bounds, alive)
        if point is not None:
            attempt = attempt.resumed(*point)
        again = rounds.new_round()
        gone = sorted(set(self._before[0]) - set(self.workers))
        rounds.record_change(self._recovery(
            round_no, epoch, "devices lost" if gone else "stalled", lost=gone,
            stopped=lost.stalled or str(lost), replayed_as=again,
            batches=[attempt.first, attempt.first + attempt.batches],
            committed=[first, attempt.first], from_chain=point is not None),
            recovery=(lost.at, rounds.clock.now()))
        return again, attempt

    def unasked_replica(self, device_id: int, replica: Replica,
                        start: RoundStart | None) -> None:
        """The last stage's chain replica ([Note: chain replication]): kept, the latest
        `KEPT` of its round; one of an attempt given up on is let go.

        Raises:
            RemoteProtocolError: it is not the last stage's, of the round under way,
                within the round's batches.
        """
        if start is not None and replica.round < start.round:
            return  # of an attempt given up on
        if start is None or replica.round != start.round or not (
                replica.stage == start.stage == start.stages - 1
                and 0 < replica.batches < start.parallel_batches):
            raise RemoteProtocolError(f"a replica of stage {replica.stage} after "
                                      f"{replica.batches} batches of round {replica.round + 1} "
                                      "that nobody asked for")
        round_no, held = self._chained
        if replica.round != round_no:
            round_no, held = replica.round, {}
            self._chained = (round_no, held)
        held[replica.batches] = replica
        while len(held) > KEPT:
            del held[min(held)]

    def chained(self, round_no: int) -> Mapping[int, Replica]:
        """The chain replicas the last stage sent in round ``round_no``, by batches."""
        held_round, held = self._chained
        return dict(held) if held_round == round_no else {}

    async def _chain_point(self, rounds: Rounds, round_no: int, workers: Sequence[int],
                           bounds: Sequence[tuple[int, int]], alive: Sequence[int]
                           ) -> tuple[int, float, float] | None:
        """Load the latest state of every stage of round ``round_no`` (its stage p: units
        ``bounds[p]`` on ``workers[p]``) that the chain replication kept (batches after
        which it was taken, the last stage's loss and correct count until then); None
        when none survived whole."""
        if not self.config.options_as(FTPipeHDOptions).chain_replication_every:
            return None
        sound = replica_check(self.model, bounds, round_no, self.micro_batch_size,
                              momentum=bool(self.config.momentum), what="replica")
        found = await gather(_ChainSource(self, rounds), round_no, workers, alive, sound)
        if found is None:
            return None
        batches, replicas = found
        await rounds.compute.call(partial(self._absorb, models.merge_states(
            *(state_from_wire(r.tensors) for r in replicas))))
        log.warning("round %d: every stage's state after %d of its batches survived in the "
                    "chain replication: playing the round again from there", round_no + 1,
                    batches)
        return batches, replicas[-1].loss_sum, replicas[-1].correct

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """With "auto" cuts, re-partition after the round (§III-D): each stage's capacity
        is the compute time its device spent on the round over the planner's time for
        its units, and the cuts that the planner gives for those capacities are taken
        when they promise at least 5% less time per batch. The next round hands each
        device its new units' weights (from the global model). A round that was played
        again after a fault measured nothing reliable: its record is the recovery's."""
        if self.recovered or self._replanned_early or not self.replanning:
            return None
        return self._replan(slices, self.parallel_batches, round_no, epoch)

    def _replan(self, slices: Sequence[Slice], batches: int, round_no: int, epoch: int
                ) -> dict[str, Any] | None:
        """Re-partition from ``slices``, the trace of ``batches`` batches under the
        current cuts (`after_round`): the capacities, and the links to the next stage
        where they were measured; the record of the change, if any."""
        links = self._measured_links(slices)
        measured_links = {w: rate for w, rate in zip(self.workers, links, strict=False)
                          if rate is not None}
        if measured_links:
            self._planner = self.planner().with_uplinks(measured_links)
            log.info("round %d: links to the next stage measured at %s MB/s", round_no + 1,
                     ", ".join(f"device {w}: {rate / 1e6:.3g}"
                               for w, rate in measured_links.items()))
        planner = self.planner()
        measured = [math.fsum(s.duration for s in slices if s.track == f"device{w}/compute"
                              and s.name in ("f", "b", "s")) for w in self.workers]
        capacities = planner.capacities(self.bounds, measured, batches)
        self.capacity.update(zip(self.workers, capacities, strict=True))
        cuts = tuple(self._cuts())
        current = planner.time(cuts, capacities, self.workers)
        chosen = planner.cuts(capacities, self.workers)
        if chosen.cuts == cuts or not chosen.time_s < 0.95 * current:
            return None
        was = self.plan_entries()
        self._place(chosen.cuts)
        log_lines(log, logging.INFO, f"re-partitioned after round {round_no + 1} (epoch "
                  f"{epoch + 1}): cuts {list(cuts)} -> {list(chosen.cuts)} for capacities "
                  f"{[round(c, 2) for c in capacities]} (estimated {current:.3g} -> "
                  f"{chosen.time_s:.3g} s a batch):", change_lines(was, self.plan_entries()))
        return {"round": round_no, "epoch": epoch, "before": list(cuts),
                "after": list(chosen.cuts), "capacities": capacities, "link_rates": links,
                "estimated_s": [current, chosen.time_s]}

    def _measured_links(self, slices: Sequence[Slice]) -> list[float | None]:
        """Each stage's link to the next as ``slices`` measured it (§III-B: each worker
        measures its bandwidth to the next): the bytes of its activations over the
        seconds their sends held the link; None where they took no time (an unshaped
        link in virtual time)."""
        sizes = self.planner().sizes
        rates: list[float | None] = []
        for p, w in enumerate(self.workers[:-1]):
            track = f"device{w}->device{self.workers[p + 1]}"
            sends = [s.duration for s in slices if s.track == track and s.name == "u"]
            seconds = math.fsum(sends)
            size = sizes[self.bounds[p][1] - 1]
            rates.append(len(sends) * size / seconds if sends and seconds > 0 else None)
        return rates

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The global model and every parameter's momentum (compute thread)."""
        tensors = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        tensors.update({MOMENTUM + k: v.clone() for k, v in self.momentum.items()})
        return tensors

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Load a checkpoint's model, momentum and cuts ("auto": the ones the planner
        had chosen)."""
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        self.momentum.update({k[len(MOMENTUM):]: v.clone() for k, v in tensors.items()
                              if k.startswith(MOMENTUM)})
        if self.planned_keys:
            self._place(tuple(int(c) for c in config["partition"]))


@dataclass(frozen=True, slots=True)
class _Attempt:
    """What an attempt at a round plays: ``batches`` batches from batch ``first``, after
    ``carried`` batches of the round applied before (by an attempt whose state the chain
    replication kept, or before the run's first re-partition), whose loss and correct
    count they carry."""

    first: int
    batches: int
    carried: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0

    def resumed(self, batches: int, loss_sum: float, correct: float) -> _Attempt:
        """The attempt after the first ``batches`` of this one survived."""
        return _Attempt(self.first + batches, self.batches - batches, self.carried + batches,
                        self.loss_sum + loss_sum, self.correct + correct)

    def with_carried(self, done: dict[int, RoundResult], workers: Sequence[int],
                     batch_size: int) -> dict[int, RoundResult]:
        """The round's results: the attempt's, with what it carried counted (device 0's
        samples, the last stage's loss and correct count)."""
        if not self.carried:
            return done
        first, last = workers[0], workers[-1]
        done[first] = replace(done[first], samples=done[first].samples
                              + self.carried * batch_size)
        done[last] = replace(done[last], loss_sum=done[last].loss_sum + self.loss_sum,
                             correct=done[last].correct + self.correct)
        return done


@dataclass(frozen=True, slots=True)
class Planner:
    """FTPipeHD's planner for one run: each unit's time per batch (the cost table's
    forward, backward and optimizer step: every batch ends in its own update), its
    output per batch, and each device's uplink (bytes/s): a stage's link to the next is
    its device's uplink.

    The step is in a unit's time because it is in what a stage takes per batch, and in
    what a device measures of itself (its backward slices hold the update): without it
    the planner misjudged units of many parameters and little compute (fully connected
    layers, ResNet's last blocks on small images) and read a stage holding them as a
    slower device than it was."""

    times: tuple[float, ...]
    sizes: tuple[float, ...]
    uplinks: tuple[float, ...]

    @classmethod
    def of(cls, config: RunConfig, costs: CostTable, model: torch.nn.Sequential,
           inputs: Crossing, batch: int) -> Planner:
        """The planner of ``config``'s run."""
        units = models.unit_count(model)
        times = tuple(costs.forward_time(u, u + 1, batch) + costs.backward_time(u, u + 1, batch)
                      + costs.step_time(u, u + 1) for u in range(units))
        crossings = unit_crossings(model, inputs)
        sizes = tuple(float(crossing_bytes(crossings[u]) * batch) for u in range(units))
        rates = [config.device_network(k).up.bandwidth_bps for k in range(config.devices)]
        return cls(times, sizes, tuple(r / 8 if r is not None else math.inf for r in rates))

    def with_uplinks(self, measured: Mapping[int, float]) -> Planner:
        """This planner with the uplinks ``measured`` (bytes/s, by device) in place of the
        declared ones."""
        return replace(self, uplinks=tuple(measured.get(k, rate)
                                           for k, rate in enumerate(self.uplinks)))

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


class _ChainSource:
    """Where `gather` finds replicas: the last stage's, kept by the system, and the
    devices' answers, through the coordinator."""

    def __init__(self, system: FTPipeHD, rounds: Rounds) -> None:
        self.chained = system.chained
        self.replicas = rounds.replicas
