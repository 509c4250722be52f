"""FedBuff (``mode = "fedbuff"``): asynchronous buffered aggregation for whole-model
training (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous
Aggregation").

Placement: as fl's, the whole model on each device, on its own data; the coordinator
holds the global model and the buffer (aiopipe.runtime.systems.fedbuff.buffer).

[Note: FedBuff rounds] Devices train at their own pace: each takes the global model as
it is, trains Q mini-batches (``local_steps``: one of the runtime's rounds, played with
`Rounds.play` like fl's, numbered afresh each time) and uploads its model; the
coordinator buffers its delta, weighted by its staleness, and answers at once with a
new `RoundStart` of the newest global model, without waiting for the others. Every K
arrivals (``buffer_size``) the server applies the buffer and its version advances. The
global model is read (a device's start) and replaced (an update) under one lock, and
the version advances once the update is installed: the version a device is told is the
model it got. Arrivals while an update computes wait in the buffer for the next one.

The coordinator's epoch loop sees an epoch as one round (`round_iterations` and
`iterations` are 1): `run_round` runs the asynchronous loop of every participant under
one task group, until the server has taken the epoch's updates,
``ceil(sum of the devices' mini-batches / (K * Q))`` (the fleet trains about as many
samples as it holds, as an fl epoch does), counted from the run's start (an update
past the last epoch's target counts to this one's). Then no device is sent a new round;
those under way finish, and their deltas wait in the buffer for the next epoch: the
epoch's end is a barrier of at most one round of the slowest device, the price of
evaluating a consistent model at the coordinator's epochs.

A device lost mid-round: its round under way is dropped (its delta never arrives), the
others go on; restarted, it trains again from the next epoch.

Left out: sampling devices per round (``devices_per_round`` is refused: every device
trains all the time; the paper's concurrency limit is not modelled), checkpoints (not
resumable), the run's aggregation strategies and update judge (the buffer's rule is the
aggregation).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.config import RunConfig
from aiopipe.metrics.trace import MAX_REPORT_SLICES, REPORT_SLICE_BYTES
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.systems.base import Rounds, Setup, SystemDefaults, mini_batches
from aiopipe.runtime.systems.fedbuff.buffer import ServerBuffer, delta_of
from aiopipe.runtime.systems.fedbuff.device import FedBuffDevice
from aiopipe.runtime.systems.fedbuff.options import FedBuffOptions
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.wording import plural

__all__ = ["FedBuff"]

log = logging.getLogger("aiopipe.server")

#: fl's actions of one iteration: the whole model's forward and backward, then a step
_ACTIONS = "0FB0 0STEP"


@dataclass(slots=True)
class _Tally:
    """One device's rounds in an epoch, as one `RoundResult` for the epoch loop."""

    round: int
    rounds: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    #: the staleness of each of its deltas
    taus: list[int] = field(default_factory=list)

    def add(self, result: RoundResult) -> None:
        self.rounds += 1
        self.samples += result.samples
        self.loss_sum += result.loss_sum
        self.correct += result.correct

    def result(self) -> RoundResult:
        return RoundResult(self.round, self.samples, self.loss_sum, self.correct, {})


class FedBuff(SystemDefaults):
    """FedBuff's coordinator side (module docstring)."""

    device_half = FedBuffDevice
    recovers_lost_devices = True  # a lost device's round under way is dropped; the rest go on
    round_iterations = 1  # an epoch is one round of the epoch loop: [Note: FedBuff rounds]

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """Whole batches: B."""
        return [config.batch_size]

    def __init__(self, setup: Setup) -> None:
        self.setup, self.config, self.model = setup, setup.config, setup.model
        self.units = models.unit_count(self.model)
        self.frozen = models.frozen_parameters(self.model)
        options = self.config.options_as(FedBuffOptions)
        self.options = options
        self.buffer = ServerBuffer(options.buffer_size, options.server_learning_rate,
                                   options.staleness)
        self.batches: list[int] = []
        #: the global states devices started from, by version, with how many use each
        self._snapshots: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        #: held while the global model is read or replaced (snapshots vs. updates)
        self._model_lock = asyncio.Lock()
        #: per device, the server updates its deltas went into and their staleness
        self.contributions = [0] * self.config.devices
        self._last: list[dict[str, Any]] = []

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Each device's mini-batches.

        Raises:
            ConfigError: a device holds fewer samples than a mini-batch.
        """
        self.batches = mini_batches(samples, self.config.batch_size)
        log.info("planned fedbuff: %s of %s each, a server update every %s, %s an epoch",
                 "rounds", plural(self.options.local_steps, "mini-batch"),
                 plural(self.options.buffer_size, "arrival"),
                 plural(self.updates_per_epoch(), "update"))

    def updates_per_epoch(self) -> int:
        """Server updates an epoch: enough for the fleet to train about the mini-batches
        it holds ([Note: FedBuff rounds])."""
        per_update = self.options.buffer_size * self.options.local_steps
        return max(1, math.ceil(sum(self.batches) / per_update))

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per device, the last epoch's: its rounds, the server updates so far, the
        staleness of its deltas."""
        return list(self._last)

    def iterations(self, device_id: int) -> int:
        """One: the epoch is one round of the epoch loop ([Note: FedBuff rounds])."""
        return 1

    def frame_limit(self) -> int:
        """The whole model's state, or the largest round report."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        slices = 128 * (4 * self.options.local_steps + 16)
        report = max(REPORT_SLICE_BYTES * MAX_REPORT_SLICES, slices)
        return int(max(state_bytes + 256 * len(state), report) + HEADER_SLACK_BYTES + 4096)

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """The epoch: every participant's asynchronous loop until the server has taken
        the epoch's updates; per device, its rounds as one result."""
        target = max((epoch + 1) * self.updates_per_epoch(), self.buffer.version + 1)
        tallies = {k: _Tally(round_no) for k in participants}
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:
                for k in participants:
                    tasks.create_task(self._device_loop(rounds, k, epoch, target, round_no,
                                                        tallies[k]))
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {k: t.result() for k, t in tallies.items() if t.rounds}
        self._last = [{"device": k, "rounds": t.rounds, "updates": self.contributions[k],
                       "staleness": t.taus} for k, t in tallies.items()]
        rounds.record_change({
            "kind": "fedbuff-epoch", "epoch": epoch, "version": self.buffer.version,
            "rounds": [tallies[k].rounds if k in tallies else 0
                       for k in range(self.config.devices)],
            "staleness": [tallies[k].taus if k in tallies else []
                          for k in range(self.config.devices)],
            "buffered": len(self.buffer.entries)})
        return done

    async def _device_loop(self, rounds: Rounds, k: int, epoch: int, target: int,
                           round_no: int, tally: _Tally) -> None:
        """Device k's rounds, each from the newest global model, until the server
        reaches version ``target`` (or the device is lost); the first numbered
        ``round_no`` (every device's), the others afresh."""
        q = self.options.local_steps
        cursor = 0  # the device's mini-batches so far this epoch (its data, round and round)
        while self.buffer.version < target:
            if cursor:
                round_no = rounds.new_round()
            version, start = await self._start(rounds, k, round_no, epoch, cursor, q)
            cursor += q
            try:
                result = await rounds.play(k, start, None)
                if result is None:  # lost: its round is dropped, the others go on
                    return
                tally.add(result)
                delta = await rounds.compute.call(
                    partial(self._delta, result, self._snapshots[version][0]))
            finally:
                self._release(version)
            tally.taus.append(self.buffer.version - version)
            self.contributions[k] += 1
            if self.buffer.add(delta, version):
                await self._update(rounds, epoch)

    async def _start(self, rounds: Rounds, k: int, round_no: int, epoch: int, first: int,
                     q: int) -> tuple[int, RoundStart]:
        """Device k's next round: the global model as it is now, and its version."""
        async with self._model_lock:
            version = self.buffer.version
            if version not in self._snapshots:
                state = await rounds.compute.call(self._snapshot)
                self._snapshots[version] = (state, 0)
            state, users = self._snapshots[version]
            self._snapshots[version] = (state, users + 1)
        tensors = await rounds.compute.call(partial(state_to_wire, state))
        start = RoundStart(round_no, epoch, first, q, tensors, 0, 1, 0, self.units, 1,
                           self.config.batch_size, epoch * self.batches[k] + first, _ACTIONS)
        return version, start

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """The global model's state as devices get it: no frozen parameters (compute
        thread)."""
        return {key: v.detach().clone() for key, v in self.model.state_dict().items()
                if key not in self.frozen}

    def _release(self, version: int) -> None:
        state, users = self._snapshots[version]
        if users > 1 or version == self.buffer.version:
            self._snapshots[version] = (state, users - 1)
        else:
            del self._snapshots[version]

    @staticmethod
    def _delta(result: RoundResult, start: Mapping[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
        """Delta = the device's model - the one it started from (compute thread)."""
        return delta_of(state_from_wire(result.tensors), start)

    async def _update(self, rounds: Rounds, epoch: int) -> None:
        """Apply the full buffer to the global model (the server's step), K deltas at a
        time while K wait: arrivals meanwhile may have filled it again, or another
        arrival's call may have applied it already (the lock orders them)."""
        cost_table = rounds.cost_table
        cost = cost_table.aggregate_time(self.buffer.size) if cost_table else None
        async with self._model_lock:
            while self.buffer.full:
                taken = self.buffer.take()
                await rounds.compute.run("agg", partial(self._apply, taken), cost=cost,
                                         epoch=epoch)
                self.buffer.version += 1  # (after the install: [Note: FedBuff rounds])
            self._snapshots = {v: s for v, s in self._snapshots.items() if s[1] > 0}

    def _apply(self, taken: list[tuple[float, dict[str, torch.Tensor]]]) -> None:
        """The buffer's update, installed (compute thread)."""
        self.model.load_state_dict(self.buffer.combine(self.model.state_dict(), taken))
