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

[Note: FedBuff concurrency] The paper trains a large population a few clients at a
time: ``concurrency`` C of them train at once, and each time one uploads, the next is
drawn from those not training. Here an epoch runs C slots (every participant's when C
is 0); a slot draws an idle device uniformly, plays its round, puts it back and draws
again, so a device may be drawn again at once. The draws come from one generator seeded
by the run's seed and the epoch, taken in the order rounds end: the same config in
virtual time draws the same devices in every run, and a run resumed at an epoch draws
what the undisturbed one would have. ``devices_per_round`` (a fresh draw each
synchronous round) is fl's way and is refused here.

A device lost mid-round: its round under way is dropped (its delta never arrives), the
others go on (its slot draws another device); restarted, it trains again from the next
epoch.

Checkpoints: at an epoch's end no round is under way, so a checkpoint holds all there
is: the global model, the server's version, the deltas waiting in the buffer (with
their staleness weights) and each device's count of deltas taken; a resumed run goes on
from them (`checkpoint_tensors`, `restore`).

Left out: the run's aggregation strategies and update judge (the buffer's rule is the
aggregation).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
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
from aiopipe.runtime.systems.fedbuff.buffer import ServerBuffer, delta_of, staleness_weight
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


class _Pool:
    """The devices of an epoch that may be drawn to train ([Note: FedBuff concurrency]):
    the idle ones, where each stands in its data (mini-batches so far), one generator.
    Undrawn (every device trains all the time), `take` gives the lowest idle device: as
    many slots as devices, so each device trains again as soon as its round ends (in
    whichever slot draws next: one waiting on the server's update may be overtaken)."""

    def __init__(self, devices: Sequence[int], seed: int, epoch: int, drawn: bool) -> None:
        self.idle = set(devices)
        self.training: set[int] = set()
        #: the most devices training at once so far (for the record)
        self.peak = 0
        self.cursor = dict.fromkeys(devices, 0)
        self._draw = random.Random(f"aiopipe fedbuff concurrency {seed} {epoch}") if drawn else None

    def take(self) -> int | None:
        """An idle device, now training (None: none is idle)."""
        if not self.idle:
            return None
        k = (min(self.idle) if self._draw is None else
             self._draw.choice(sorted(self.idle)))
        self.idle.discard(k)
        self.training.add(k)
        self.peak = max(self.peak, len(self.training))
        return k

    def back(self, k: int, lost: bool = False) -> None:
        """Device k's round is over: idle again, or gone for the epoch (``lost``)."""
        self.training.discard(k)
        if not lost:
            self.idle.add(k)


class FedBuff(SystemDefaults):
    """FedBuff's coordinator side (module docstring)."""

    device_half = FedBuffDevice
    recovers_lost_devices = True  # a lost device's round under way is dropped; the rest go on
    resumable = True  # at an epoch's end (module docstring)
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

    @property
    def devices_sit_out(self) -> bool:
        """Where fewer than all train at once ([Note: FedBuff concurrency])."""
        return 0 < self.options.concurrency < self.config.devices

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
        slots = min(self.options.concurrency or len(participants), len(participants))
        pool = _Pool(participants, self.config.seed, epoch, slots < len(participants))
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:
                for _ in range(slots):
                    tasks.create_task(self._slot(rounds, pool, epoch, target, round_no,
                                                 tallies))
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
            "buffered": len(self.buffer.entries), "most_at_once": pool.peak})
        return done

    async def _slot(self, rounds: Rounds, pool: _Pool, epoch: int, target: int,
                    round_no: int, tallies: Mapping[int, _Tally]) -> None:
        """One slot of ``concurrency``: rounds of devices drawn from the idle, each from
        the newest global model, until the server reaches version ``target`` or no
        device is idle. A device's first round of the epoch is numbered ``round_no``
        (every device's), its others afresh."""
        q = self.options.local_steps
        while self.buffer.version < target:
            k = pool.take()
            if k is None:
                return
            cursor = pool.cursor[k]  # its mini-batches so far this epoch (round and round)
            number = rounds.new_round() if cursor else round_no
            version, start = await self._start(rounds, k, number, epoch, cursor, q)
            pool.cursor[k] = cursor + q
            try:
                result = await rounds.play(k, start, None)
                if result is None:  # lost: its round is dropped, the others go on
                    pool.back(k, lost=True)
                    continue
                tallies[k].add(result)
                delta = await rounds.compute.call(
                    partial(self._delta, result, self._snapshots[version][0]))
            finally:
                self._release(version)
            tallies[k].taus.append(self.buffer.version - version)
            self.contributions[k] += 1
            pool.back(k)
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

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The global model, the server's version, each device's deltas taken and the
        buffered deltas with their staleness (module docstring: at an epoch's end)."""
        tensors = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        tensors["fedbuff/version"] = torch.tensor(self.buffer.version)
        tensors["fedbuff/contributions"] = torch.tensor(self.contributions)
        for i, ((_, delta), tau) in enumerate(zip(self.buffer.entries, self.buffer.taus,
                                                  strict=True)):
            tensors[f"fedbuff/buffered/{i}/tau"] = torch.tensor(tau)
            tensors.update({f"fedbuff/buffered/{i}/delta/{key}": value.clone()
                            for key, value in delta.items()})
        return tensors

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Go on from `checkpoint_tensors`'s: the model, the version, the counts and
        the buffer (each delta's weight recomputed from its staleness)."""
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        self.buffer.version = int(tensors["fedbuff/version"])
        self.contributions = [int(c) for c in tensors["fedbuff/contributions"]]
        entries: dict[int, dict[str, torch.Tensor]] = {}
        taus: dict[int, int] = {}
        for name, value in tensors.items():
            if not name.startswith("fedbuff/buffered/"):
                continue
            index, kind, *key = name[len("fedbuff/buffered/"):].split("/", 2)
            if kind == "tau":
                taus[int(index)] = int(value)
            else:
                entries.setdefault(int(index), {})[key[0]] = value.clone()
        self.buffer.entries = [(staleness_weight(taus[i], self.buffer.staleness), entries[i])
                               for i in sorted(taus)]
        self.buffer.taus = [taus[i] for i in sorted(taus)]
        self._snapshots.clear()
