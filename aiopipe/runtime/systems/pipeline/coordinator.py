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

Faults (`Pipeline._play_again`): a round that cannot finish (a device lost, or silent past
``device_timeout``; a neighbour's link broken) is played again from its start by the
devices alive, the model re-partitioned among them (balanced over their declared
slowdowns, as "auto" plans), from the weights and SGD momentum the coordinator holds: it
sent them for the round, and every round returns them. So a replay computes what the
round would have, and only the round under way is lost (a round is an epoch, or
``aggregation_every`` iterations). Another optimizer's state stays on the devices and is
not rolled back. Device 0 holds the data: without it the run ends. Not resumable: no
checkpoint is written. (FTPipeHD recovers on the same machinery, from chain replicas
too: `aiopipe.runtime.systems.ftpipehd`.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import torch

from aiopipe import models
from aiopipe.auth import pair_key
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, RoundStalledError, TrainingError
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Hello,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.device_half import DeviceHalf
from aiopipe.runtime.holdings import load_stage_state
from aiopipe.runtime.momentum import (
    MOMENTUM,
    backs_up_momentum,
    split_momentum,
    trainable_parameters,
)
from aiopipe.runtime.plan import (
    DevicePlan,
    cached_planning_costs,
    check_trainable,
    unit_crossings,
)
from aiopipe.runtime.plan_text import log_plan
from aiopipe.runtime.systems.base import Rounds, Setup, SystemDefaults, planning_batch_sizes
from aiopipe.runtime.systems.pipeline.device import PipelineDevice
from aiopipe.runtime.systems.pipeline.options import cut_options, scheduled_options
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.partition import balanced_partition
from aiopipe.scheduler.placement import chain
from aiopipe.scheduler.schedule import (
    Schedule,
    check_schedule,
    gpipe,
    one_f_one_b,
    with_transfers,
)

__all__ = ["MAX_REPLAYS", "REPLAY_VERSIONS", "Pipeline", "StageLost", "play_or_lost"]

log = logging.getLogger("aiopipe.server")

#: How many times in a row a round may be played again with the same devices (a fault
#: that no re-partition removes) before the run ends.
MAX_REPLAYS = 3
#: How far a replay's weight versions are above the attempt's before (and those of every
#: round after it): more than any run's optimizer steps, so the devices drop what an
#: attempt given up on still sends.
REPLAY_VERSIONS = 1 << 32


class Pipeline(SystemDefaults):
    """The synchronous multi-device pipeline (module docstring)."""

    planned_keys: tuple[str, ...] = ()
    resumable = False
    recovers_lost_devices = True  # `_play_again`: the round again, re-planned without it
    device_half: ClassVar[type[DeviceHalf]] = PipelineDevice
    links_devices = True
    serves_stages = False
    round_iterations = 0  # a round is an epoch

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """B' = B/N for the configured N (B while it is "auto")."""
        n = config.parallel_batches
        return [config.batch_size // n if isinstance(n, int) else config.batch_size]
    round_steps = "iterations"  # what a round is made of, in words
    wants_profiles = False  # "auto" cuts are balanced on the coordinator's table

    def __init__(self, setup: Setup) -> None:
        config = setup.config
        self.setup, self.config = setup, config
        self.model = setup.model
        #: each trainable parameter's momentum, sent with the stages' weights when not
        #: empty (and then returned with them: a replay starts from the round's momentum)
        self.momentum: dict[str, torch.Tensor] = {}
        if backs_up_momentum(config):
            self.momentum = {name: torch.zeros_like(param.detach())
                             for name, param in trainable_parameters(self.model)}
        #: the round last played again, (epoch, first iteration), and how many times in
        #: a row with the same devices
        self._replayed: tuple[int, int] | None = None
        self._replays = 0
        #: added to every weight version since the run's first replay (`REPLAY_VERSIONS`
        #: per replay)
        self._version_shift = 0
        self.units = models.unit_count(self.model)
        self.stages = config.devices
        #: the device of each stage
        self.workers = list(range(self.stages))
        n = self._micro_batches()
        self.parallel_batches = n
        self.micro_batch_size = config.batch_size // n
        if self.stages > self.units:
            raise ConfigError(f"config key 'devices': {self.stages} stages, but "
                              f"{config.model if isinstance(config.model, str) else 'the model'}"
                              f" has only {self.units} units")
        cuts = cut_options(config).partition
        if cuts == "auto":
            cuts = self._auto_cuts([config.device_slowdown_of(p) for p in range(self.stages)])
        assert isinstance(cuts, tuple)
        self._place(cuts)
        #: the worker list and cuts before the last change (`_enlist`)
        self._before: tuple[list[int], list[int]] = (list(self.workers), self._cuts())
        self.iterations_per_epoch = 0  # `prepare` knows: device 0's announced samples
        check_trainable(self.model, setup.data.inputs,
                        [DevicePlan(0, self.units, n, self.micro_batch_size, 0)], config)
        self.crossings = unit_crossings(self.model, setup.data.inputs)
        self.schedule: Schedule = self._schedule(n)
        self._secret = setup.run_secret

    def _micro_batches(self) -> int:
        """N, the micro-batches of an iteration.

        Raises:
            ConfigError: ``parallel_batches`` is not one integer.
        """
        n = self.config.parallel_batches
        if not isinstance(n, int):
            raise ConfigError("config key 'parallel_batches': mode pipeline takes one "
                              "integer (micro-batches per iteration)")
        return n

    def _auto_cuts(self, slowdowns: Sequence[float]) -> tuple[int, ...]:
        """Balanced stages of the cost table, one per slowdown (each device's compute
        times its slowdown)."""
        setup = self.setup
        costs = setup.cost_table or cached_planning_costs(
            self.config, self.model, setup.data.inputs, setup.test_set,
            sizes=planning_batch_sizes(self.config))
        return tuple(balanced_partition(costs, len(slowdowns), self.micro_batch_size,
                                        slowdowns))

    def _cuts_among(self, workers: Sequence[int]) -> tuple[int, ...]:
        """The cuts of a chain on ``workers`` (after a loss): "auto"'s, over their declared
        slowdowns."""
        return self._auto_cuts([self.config.device_slowdown_of(w) for w in workers])

    def _cuts(self) -> list[int]:
        return [b for _, b in self.bounds[:-1]]

    def _place(self, cuts: tuple[int, ...]) -> None:
        """Stage p of the chain on device ``workers[p]``, cut at ``cuts``.

        Raises:
            ConfigError: the cuts do not fit the model.
        """
        try:
            self.placement = chain(cuts, self.units, [f"device{w}" for w in self.workers])
        except ConfigError as exc:
            raise ConfigError(f"config key 'partition': {exc} for a model of {self.units} "
                              "units") from None
        if len(self.workers) == self.config.devices:  # (after a loss the plan tells)
            self.config = self.config.replace(options={"partition": cuts})
        self.pipeline = self.placement.pipelines[0]
        #: (first, stop) units of each stage
        self.bounds = [(s.first_unit, s.stop_unit) for s in self.pipeline.stages]

    def _schedule(self, n: int) -> Schedule:
        schedule = with_transfers(one_f_one_b(self.stages, n)
                                  if scheduled_options(self.config).schedule == "1f1b"
                                  else gpipe(self.stages, n))
        check_schedule(schedule)
        return schedule

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Device 0 holds the data: its samples make the epoch.

        Raises:
            ConfigError: fewer than one iteration's samples.
        """
        per_iteration = self.micro_batch_size * self.parallel_batches
        self.iterations_per_epoch = samples[0] // per_iteration
        if self.iterations_per_epoch < 1:
            raise ConfigError(f"device 0 holds {samples[0]} samples, fewer than one "
                              f"iteration ({per_iteration})")

    # -- what devices are told -----------------------------------------------------------

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per stage: its device, units (first, stop), micro-batches and schedule."""
        return [{"stage": p, "device": self.workers[p], "units": [a, b],
                 "parallel_batches": self.parallel_batches,
                 "schedule": scheduled_options(self.config).schedule}
                for p, (a, b) in enumerate(self.bounds)]

    def iterations(self, device_id: int) -> int:
        """Every stage runs the data holder's iterations."""
        return self.iterations_per_epoch

    def refuse_hello(self, hello: Hello) -> str:
        """A device must listen for its peers."""
        if not hello.address:
            return (f"mode {self.config.mode} links devices directly: start device "
                    f"{hello.device_id} with an address its peers can reach (python -m "
                    "aiopipe.device --listen HOST:PORT)")
        return ""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """The keys of device ``device_id``'s pairs with every other device (whose stage
        may come next to its own after a device is lost)."""
        return self._pair_keys(device_id, [f"device{k}" for k in range(self.config.devices)
                                           if k != device_id])

    def _pair_keys(self, device_id: int, nodes: Sequence[str]) -> dict[str, str]:
        me = f"device{device_id}"
        return {node: pair_key(self._secret, me, node).hex() for node in nodes}

    def frame_limit(self) -> int:
        """The whole model's state and momentum (a stage's share is less), a round
        report's slices and a round's action list."""
        return self._frame_limit(self.iterations_per_epoch,
                                 extra_tensors=list(self.momentum.values()))

    def _frame_limit(self, iterations: int, extra_tensors: Sequence[torch.Tensor]) -> int:
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size()
                          for t in [*state.values(), *extra_tensors])
        n = self.parallel_batches
        slices = iterations * (4 * n + 2) + 16
        actions = 16 * (6 * n + 2)
        return int(state_bytes + HEADER_SLACK_BYTES + 256 * (len(state) + len(extra_tensors))
                   + 128 * slices + actions)

    def _peers(self, rounds: Rounds, p: int) -> dict[str, dict[str, Any]]:
        """Stage p's neighbours: their stage and where their devices listen."""
        return {node: {"stage": q, "address": rounds.address_of(self.workers[q])}
                for q, node in self.pipeline.neighbours(f"device{self.workers[p]}")}

    def round_start(self, rounds: Rounds, p: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Stage p's `RoundStart`: its units' weights (and momentum), actions and
        neighbours; its weights' version counts the optimizer steps before it (shifted by
        the replays so far)."""
        a, b = self.bounds[p]
        return RoundStart(round_no, epoch, first, iterations, state, p, self.stages, a, b,
                          self.parallel_batches, self.micro_batch_size,
                          epoch * self.iterations_per_epoch + first + self._version_shift,
                          " ".join(map(str, self.schedule.actions[p])), self._peers(rounds, p))

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every stage's device trains the round together; their stages make the model.
        A round that cannot finish is played again from its start by the devices still
        there, re-partitioned among them (`_play_again`).

        Raises:
            TrainingError: device 0, which holds the data, is gone; or the round stopped
                `MAX_REPLAYS` + 1 times with the same devices.
        """
        if self._enlist(participants):
            rounds.record_change(self._recovery(round_no, epoch, "at its start"))
        while True:
            try:
                return await self._play_round(rounds, round_no, epoch, first, work)
            except StageLost as lost:
                round_no = await self._play_again(rounds, lost, round_no, epoch, first,
                                                  max(work))

    def _enlist(self, alive: Sequence[int]) -> bool:
        """The worker list is the devices alive, in id order (FTPipeHD §III-F: a lost
        one's successors move up one place; one that came back takes its place again);
        when it changed, the model is re-partitioned among them (`_cuts_among`). Whether
        it changed (what it was is kept for the record: `_recovery`).

        Raises:
            TrainingError: device 0 (the data) is gone.
        """
        workers = sorted(set(alive) & set(range(self.config.devices)))
        if 0 not in workers:
            raise TrainingError("device 0 is gone: it holds the data (the pipeline's first "
                                "stage), so the run cannot go on without it")
        self._before = (list(self.workers), self._cuts())
        if workers == self.workers:
            return False
        cuts = self._cuts_among(workers)
        self.workers, self.stages = workers, len(workers)
        self._place(cuts)
        self.schedule = self._schedule(self.parallel_batches)
        return True

    def _recovery(self, round_no: int, epoch: int, when: str, **more: Any) -> dict[str, Any]:
        """The record of a change of the worker list (see `_enlist`)."""
        workers, cuts = self._before
        after = self._cuts()
        log_plan(log, logging.WARNING, f"round {round_no + 1} ({when}): the pipeline runs on "
                 f"devices {self.workers} instead of {workers}",
                 self.plan_entries(), units=self.units, batch_size=self.config.batch_size)
        return {"round": round_no, "epoch": epoch, "kind": "recovery",
                "workers": list(self.workers), "workers_before": workers, "before": cuts,
                "after": after, **more}

    async def _play_again(self, rounds: Rounds, lost: StageLost, round_no: int, epoch: int,
                          first: int, iterations: int) -> int:
        """The round (``iterations`` from iteration ``first``) is played again from its
        start by the devices still there (re-partitioned when they changed), from the
        weights and momentum the coordinator sent for it: the model it holds until the
        round ends. The round number of the new attempt.

        Raises:
            TrainingError: device 0 is gone, or the round stopped once too often.
        """
        await self._regroup(rounds, lost, round_no, epoch, first, iterations)
        again = rounds.new_round()
        self._version_shift += REPLAY_VERSIONS
        gone = sorted(set(self._before[0]) - set(self.workers))
        rounds.record_change(self._recovery(
            round_no, epoch, "devices lost" if gone else "stalled", lost=gone,
            stopped=lost.stalled or str(lost), replayed_as=again,
            iterations=[first, first + iterations]),
            recovery=(lost.at, rounds.clock.now()))
        return again

    async def _regroup(self, rounds: Rounds, lost: StageLost, round_no: int, epoch: int,
                       first: int, count: int) -> list[int]:
        """After ``lost`` stopped the round (``count`` iterations, or FTPipeHD's batches,
        from ``first``): once no device is between connections, the devices alive are
        the workers (`_enlist`); those devices.

        Raises:
            TrainingError: device 0 is gone, or the round stopped `MAX_REPLAYS` + 1
                times in a row with the same devices.
        """
        if lost.stalled:
            log.warning("round %d: %s; playing the round again", round_no + 1, lost.stalled)
        else:
            log.warning("round %d: device %d (stage %d) was lost; playing the round again "
                        "without it", round_no + 1, lost.device, lost.stage)
        if lost.stalled:
            # a neighbour's link may break a moment before the coordinator's own link to
            # a dead device does: give that a heartbeat interval (at most 1 s) to show
            await rounds.clock.sleep(min(1.0, self.config.heartbeat_interval))
        alive = await rounds.settled_alive()
        changed = self._enlist(alive)
        key = (epoch, first)
        self._replays = self._replays + 1 if key == self._replayed and not changed else 0
        self._replayed = key
        if self._replays >= MAX_REPLAYS:
            raise TrainingError(
                f"the round of {self.round_steps} {first + 1}..{first + count} of epoch "
                f"{epoch + 1} stopped {MAX_REPLAYS + 1} times with the same devices; the "
                f"last time: {lost}")
        return alive

    async def _play_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                          work: Sequence[int]) -> dict[int, RoundResult]:
        """One attempt at the round with the current worker list; results by device.

        Raises:
            Exception: what `_play` raises for a stage's device.
        """
        states = await rounds.compute.call(self._stage_states)
        rounds.copy_checkpoint()
        starts = self._starts(rounds, round_no, epoch, first, work, states)
        try:
            async with asyncio.TaskGroup() as tasks:  # the first stage lost ends them all
                played = {w: tasks.create_task(self._play(rounds, w, start))
                          for w, start in starts.items()}
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {w: task.result() for w, task in played.items()}
        await rounds.compute.run("agg", partial(self._merge, done),
                                 cost=0.0 if rounds.cost_table else None, epoch=epoch)
        return done

    def _starts(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                work: Sequence[int], states: Sequence[Mapping[str, Any]]
                ) -> dict[int, RoundStart]:
        """Each worker's `RoundStart` of the round, by device."""
        return {w: self.round_start(rounds, p, round_no, epoch, first, work[w], states[p])
                for p, w in enumerate(self.workers)}

    async def _play(self, rounds: Rounds, device: int, start: RoundStart) -> RoundResult:
        """Stage ``start.stage``'s part of the round, on ``device``.

        Raises:
            StageLost: its device was lost, or said its round stopped.
        """
        return await play_or_lost(rounds, device, start, None)

    def _stage_states(self) -> list[dict[str, Any]]:
        """Each stage's weights for its `RoundStart` (compute thread)."""
        stages = models.partition(self.model, [b for _, b in self.bounds[:-1]])
        return [state_to_wire(self._stage_state(stage)) for stage in stages]

    def _stage_state(self, stage: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A stage's weights less its frozen parameters (the devices hold them: [Note:
        frozen bases] in aiopipe/runtime/systems/star/coordinator.py), and each trainable
        parameter's momentum when the coordinator holds it (``momentum``: a pipeline's
        and FTPipeHD's with SGD's momentum, Asteroid's for a replay from a backup point)."""
        state = {k: v.detach().clone()
                 for k, v in models.without_frozen(stage.state_dict(), stage).items()}
        if self.momentum:
            state.update({MOMENTUM + name: self.momentum[name].clone()
                          for name, _ in trainable_parameters(stage)})
        return state

    def _merge(self, results: Mapping[int, RoundResult]) -> None:
        """The stages side by side are the whole model (compute thread)."""
        self._absorb(models.merge_states(
            *(state_from_wire(results[w].tensors) for w in self.workers)))

    def _absorb(self, state: dict[str, torch.Tensor]) -> None:
        """The model (and momentum) from ``state``, the stages side by side; the frozen
        parameters, which did not travel, as they are."""
        weights, momentum = split_momentum(state)
        load_stage_state(self.model, weights, "the stages side by side")
        self.momentum.update({name: buf.clone() for name, buf in momentum.items()})

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """The samples that went through the whole pipeline (device 0's: it holds the
        data, and its stage is the first)."""
        return device_samples[0] if device_samples else 0

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int], memory: Mapping[int, int]
                      ) -> list[dict[str, Any]]:
        """Per stage: its device, units, compute busy and idle seconds, and the most
        micro-batches whose activations it held at once."""
        return [{"stage": p, "device": w, "units": [a, b],
                 "busy_s": busy.get(f"device{w}/compute", 0.0),
                 "idle_s": elapsed - busy.get(f"device{w}/compute", 0.0),
                 "peak_live": peaks.get(w, 0)}
                for p, (w, (a, b)) in enumerate(zip(self.workers, self.bounds, strict=True))]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Not resumable: nothing (see the module docstring)."""
        return {}

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Refused (see the module docstring).

        Raises:
            ConfigError: always.
        """
        raise ConfigError("mode pipeline cannot resume from a checkpoint: its optimizer "
                          "state lives on the devices")


class StageLost(TrainingError):
    """A stage's device was lost mid-round, or said its round stopped (``stalled``: why),
    noticed at ``at``: a system that recovers (FTPipeHD, Asteroid) plays the round again."""

    def __init__(self, device: int, stage: int, at: float, stalled: str = "") -> None:
        super().__init__(stalled or f"device {device} (stage {stage}) was lost")
        self.device, self.stage, self.at, self.stalled = device, stage, at, stalled


async def play_or_lost(rounds: Rounds, device: int, start: RoundStart,
                       returns: Mapping[str, Any] | None) -> RoundResult:
    """Stage ``start.stage``'s part of the round on ``device`` (``returns``: as
    `Rounds.play`'s).

    Raises:
        StageLost: its device was lost, or said its round stopped.
    """
    try:
        result = await rounds.play(device, start, None, returns=returns)
    except RoundStalledError as exc:
        raise StageLost(device, start.stage, rounds.clock.now(), str(exc)) from None
    if result is None:
        raise StageLost(device, start.stage, rounds.clock.now())
    return result
