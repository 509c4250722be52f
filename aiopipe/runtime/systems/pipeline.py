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
as capacities and each device's uplink as the link to the next stage.

Faults: a synchronous pipeline cannot go on without one of its stages, so a device lost
mid-round ends the run with a `TrainingError` naming it (FTPipeHD's re-partitioning and
recovery are their own system). Optimizer state lives on the devices, so a run cannot
resume from a checkpoint: none is written.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.auth import pair_key
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, TrainingError
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Hello,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
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
from aiopipe.scheduler.ftpipehd import ftpipehd_partition
from aiopipe.scheduler.partition import balanced_partition
from aiopipe.scheduler.placement import chain
from aiopipe.scheduler.schedule import (
    Schedule,
    check_schedule,
    gpipe,
    one_f_one_b,
    with_transfers,
)

__all__ = ["Pipeline"]


class Pipeline:
    """The synchronous multi-device pipeline (module docstring)."""

    planned_keys: tuple[str, ...] = ()
    resumable = False
    wants_profiles = False  # "auto" cuts are balanced on the coordinator's table

    def __init__(self, setup: Setup) -> None:
        config = setup.config
        self.setup = setup
        self.model = setup.model
        self.units = models.unit_count(self.model)
        self.stages = config.devices
        self.asynchronous = config.mode == "ftpipehd"
        n = 1 if self.asynchronous else config.parallel_batches
        if not isinstance(n, int):
            raise ConfigError("config key 'parallel_batches': mode pipeline takes one "
                              "integer (micro-batches per iteration)")
        self.parallel_batches = n  # ftpipehd: the epoch's batches, once `prepare` knows
        self.micro_batch_size = config.batch_size // n
        if self.stages > self.units:
            raise ConfigError(f"config key 'devices': {self.stages} stages, but "
                              f"{config.model if isinstance(config.model, str) else 'the model'}"
                              f" has only {self.units} units")
        cuts = config.partition
        if cuts == "auto":
            costs = setup.cost_table or measure_planning_costs(
                config, self.model, setup.in_shape, setup.test_set)
            slowdowns = [config.device_slowdown_of(p) for p in range(self.stages)]
            if self.asynchronous:  # FTPipeHD's planner: capacities and links (§III-D)
                cuts = self._ftpipehd_cuts(config, costs, setup.in_shape, slowdowns)
            else:
                cuts = tuple(balanced_partition(costs, self.stages, self.micro_batch_size,
                                                slowdowns))
            config = config.replace(partition=cuts)
        assert isinstance(cuts, tuple)
        try:
            self.placement = chain(cuts, self.units,
                                   [f"device{p}" for p in range(self.stages)])
        except ConfigError as exc:
            raise ConfigError(f"config key 'partition': {exc} for a model of {self.units} "
                              "units") from None
        self.config = config
        self.pipeline = self.placement.pipelines[0]
        #: (first, stop) units of each stage
        self.bounds = [(s.first_unit, s.stop_unit) for s in self.pipeline.stages]
        self.iterations_per_epoch = 0  # `prepare` knows: device 0's announced samples
        check_trainable(self.model, setup.in_shape,
                        [DevicePlan(0, self.units, n, self.micro_batch_size, 0)], config)
        self.activation_shapes = unit_output_shapes(self.model, setup.in_shape)
        self.schedule: Schedule = self._schedule(n)
        self._secret = setup.run_secret

    def _ftpipehd_cuts(self, config: RunConfig, costs: CostTable, in_shape: tuple[int, ...],
                       slowdowns: Sequence[float]) -> tuple[int, ...]:
        """The partition of FTPipeHD's planner for the declared capacities
        (``device_slowdown``) and links (device p's uplink carries its activations)."""
        batch = self.micro_batch_size
        times = [costs.forward_time(u, u + 1, batch) + costs.backward_time(u, u + 1, batch)
                 for u in range(self.units)]
        shapes = unit_output_shapes(self.model, in_shape)
        sizes = [4.0 * math.prod(shapes[u]) * batch for u in range(self.units)]
        rates = [config.device_network(p).up.bandwidth_bps for p in range(self.stages - 1)]
        bandwidths = [r / 8 if r is not None else math.inf for r in rates]
        return ftpipehd_partition(times, sizes, self.stages, capacities=slowdowns,
                                  bandwidths=bandwidths).cuts

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
        if self.asynchronous:  # one iteration of the epoch's whole batches
            batches = samples[0] // self.micro_batch_size
            if batches < 1:
                raise ConfigError(f"device 0 holds {samples[0]} samples, fewer than one "
                                  f"batch ({self.micro_batch_size})")
            self.parallel_batches, self.iterations_per_epoch = batches, 1
            self.schedule = self._schedule(batches)
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
            return [{"stage": p, "device": p, "units": [a, b], "batches": self.parallel_batches,
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
        stages."""
        me = f"device{device_id}"
        return {node: pair_key(self._secret, me, node).hex()
                for _, node in self.pipeline.neighbours(me)}

    def frame_limit(self) -> int:
        """The whole model's state (a stage's share is less), a round report's slices
        and a round's action list."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        n = self.parallel_batches
        slices = self.iterations_per_epoch * (4 * n + 2) + 16
        actions = 16 * (6 * n + 2)
        return int(state_bytes + HEADER_SLACK_BYTES + 256 * len(state) + 128 * slices
                   + actions)

    def round_start(self, rounds: Rounds, p: int, round_no: int, epoch: int, first: int,
                    iterations: int, state: Mapping[str, Any]) -> RoundStart:
        """Stage p's `RoundStart`: its units' weights, actions and neighbours."""
        a, b = self.bounds[p]
        # stage q runs on device q (a chain)
        peers = {node: {"stage": q, "address": rounds.address_of(q)}
                 for q, node in self.pipeline.neighbours(f"device{p}")}
        return RoundStart(round_no, epoch, first, iterations, state, p, self.stages, a, b,
                          self.parallel_batches, self.micro_batch_size,
                          epoch * self.iterations_per_epoch + first,
                          " ".join(map(str, self.schedule.actions[p])), peers)

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Every stage's device trains the round together; their stages make the model.

        Raises:
            TrainingError: a stage's device is missing or was lost.
        """
        missing = sorted(set(range(self.stages)) - set(participants))
        if missing:
            raise TrainingError(f"device {missing[0]} (stage {missing[0]}) is gone: a "
                                "synchronous pipeline cannot go on without a stage")
        states = await rounds.compute.call(self._stage_states)
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:  # the first stage lost ends them all
                played = {p: tasks.create_task(self._play(
                    rounds, p, self.round_start(rounds, p, round_no, epoch, first, work[p],
                                                states[p]))) for p in range(self.stages)}
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {p: task.result() for p, task in played.items()}
        await rounds.compute.run("agg", partial(self._merge, done),
                                 cost=0.0 if rounds.cost_table else None, epoch=epoch)
        return done

    @staticmethod
    async def _play(rounds: Rounds, p: int, start: RoundStart) -> RoundResult:
        """Stage p's part of the round.

        Raises:
            TrainingError: its device was lost.
        """
        result = await rounds.play(p, start, None)
        if result is None:
            raise TrainingError(f"device {p} (stage {p}) was lost in round {start.round}: a "
                                "synchronous pipeline cannot go on without a stage")
        return result

    def _stage_states(self) -> list[dict[str, Any]]:
        stages = models.partition(self.model, [b for _, b in self.bounds[:-1]])
        return [state_to_wire({k: v.detach().clone() for k, v in stage.state_dict().items()})
                for stage in stages]

    def _merge(self, results: Mapping[int, RoundResult]) -> None:
        """The stages side by side are the whole model (compute thread)."""
        state = models.merge_states(*(state_from_wire(results[p].tensors)
                                      for p in range(self.stages)))
        self.model.load_state_dict(state)

    def refused_updates(self) -> list[int]:
        """A pipeline's stages are put side by side, not aggregated: none."""
        return []

    def epoch_samples(self, device_samples: Sequence[int]) -> int:
        """The samples that went through the whole pipeline (the last stage's)."""
        return device_samples[-1] if device_samples else 0

    def stage_figures(self, busy: Mapping[str, float], elapsed: float,
                      peaks: Mapping[int, int]) -> list[dict[str, Any]]:
        """Per stage: its device, units, compute busy and idle seconds, and the most
        micro-batches whose activations it held at once."""
        return [{"stage": p, "device": p, "units": [a, b],
                 "busy_s": busy.get(f"device{p}/compute", 0.0),
                 "idle_s": elapsed - busy.get(f"device{p}/compute", 0.0),
                 "peak_live": peaks.get(p, 0)} for p, (a, b) in enumerate(self.bounds)]

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """A synchronous pipeline keeps its partition."""
        return None

    # -- checkpoints ---------------------------------------------------------------------

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
