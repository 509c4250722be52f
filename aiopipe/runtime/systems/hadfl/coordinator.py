"""HADFL (``mode = "hadfl"``): decentralized asynchronous federated learning on
heterogeneous devices (`../shared/papers/hadfl.txt` §III).

Placement: every device trains the whole model on its own data; devices synchronise
among themselves over authenticated device-to-device links; the coordinator plans and
keeps a backup, off the data path: what it sends and receives is control messages, but
for the model's backup once an epoch (and a backup to a device that rejoins).

The coordinator's four components (§III-A), here:
- *liveness monitor*: the coordinator's sessions (heartbeats, `settled_alive`): each
  round is planned among the devices alive as it starts;
- *strategy generator* and *runtime supervisor*: `aiopipe.scheduler.hadfl.
  StrategyGenerator`, from the mutual negotiation's times and each round's versions
  (Holt's prediction, Eq. 8's selection, a random ring);
- *model manager*: the ring's sender returns the round's average in the last round of
  each epoch (the backup, which the coordinator evaluates and checkpoints to disk with
  ``checkpoint_dir``), and a device that rejoins starts from it.

Rounds (the coordinator's epoch loop sees each synchronisation round as one iteration):
- the first ``warmup_epochs`` epochs are the *mutual negotiation* (§III-B): one round
  each, in which every device trains one epoch of its data at ``warmup_learning_rate``
  and the whole fleet averages (a ring of all); each device's seconds of compute in
  these rounds (its trace) are its ``T_i``, from which the strategy comes;
- after it, each epoch has as many rounds as it takes the fleet to train about as many
  mini-batches as it holds (``ceil(sum of batches / sum of local steps)``); in each,
  every device trains its E_i local steps, the ring's members average, and the sender
  posts the average to the others (aiopipe.runtime.systems.hadfl.partial_sync [Note: HADFL rounds]).

A device lost mid-round: the ring bypasses it ([Note: HADFL bypass]); the coordinator
waits for it as for any device (``reconnect_grace``), then plans the next rounds
without it; if it comes back (a new process), it starts from the backup.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from aiopipe import models
from aiopipe.auth import pair_key
from aiopipe.config import RunConfig
from aiopipe.metrics.trace import MAX_REPORT_SLICES, REPORT_SLICE_BYTES, Slice, device_of
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    Hello,
    RoundResult,
    RoundStart,
    TensorData,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.holdings import load_stage_state
from aiopipe.runtime.plan_text import log_plan
from aiopipe.runtime.systems.base import Rounds, Setup, SystemDefaults, mini_batches
from aiopipe.runtime.systems.hadfl.device import HADFLDevice
from aiopipe.runtime.systems.hadfl.options import HADFLOptions
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.estimate import DeviceProfile
from aiopipe.scheduler.hadfl import StrategyGenerator, groups_of
from aiopipe.wording import plural

__all__ = ["HADFL"]

log = logging.getLogger("aiopipe.server")


class HADFL(SystemDefaults):
    """HADFL's coordinator side (module docstring)."""

    planned_keys: tuple[str, ...] = ()
    resumable = True
    recovers_lost_devices = True  # the ring bypasses a lost device
    device_half = HADFLDevice
    links_devices = True
    serves_stages = False
    round_iterations = 1  # an "iteration" of the epoch loop is a synchronisation round

    @staticmethod
    def micro_batch_sizes(config: RunConfig) -> list[int]:
        """Whole batches: B."""
        return [config.batch_size]
    wants_profiles = False  # the negotiation measures the devices

    def __init__(self, setup: Setup) -> None:
        self.setup, self.config, self.model = setup, setup.config, setup.model
        self.units = models.unit_count(self.model)
        devices = self.config.devices
        self.batches: list[int] = []
        self.generator: StrategyGenerator | None = None
        #: seconds of compute each device spent in the negotiation (its T_i)
        self.warmup_times = [0.0] * devices
        #: each device's model version (epochs) at the end of its last round
        self.versions = [0.0] * devices
        self._holt_started = False
        #: the backup's version (what a device that rejoins starts from)
        self.backup_version = 0.0
        self._sessions: dict[int, int] = {}
        #: devices whose next round starts from the backup (all, after a resume)
        self._from_backup: set[int] = set()
        self._rounds_run = 0  # rounds since the negotiation (groups: which are inter-group)
        self._rng = random.Random(self.config.seed)  # the negotiation's rings
        self._secret = setup.run_secret
        #: the last round's plan, per device (`plan_entries`)
        self._last: list[dict[str, Any]] = []

    def prepare(self, samples: Sequence[int],
                devices: Sequence[DeviceProfile] | None = None) -> None:
        """Each device's mini-batches per epoch; without a negotiation, the strategy
        (fixed local steps).

        Raises:
            ConfigError: a device holds fewer samples than a mini-batch.
        """
        self.batches = mini_batches(samples, self.config.batch_size)
        if self._options.warmup_epochs == 0:
            self._strategy([1.0] * len(self.batches))
            self._log_strategy("planned hadfl")
        else:
            log.info("planned hadfl: a mutual negotiation of %s first (every device trains "
                     "its data once an epoch, then all average), then local steps by each "
                     "device's measured speed",
                     plural(self._options.warmup_epochs, "epoch"))

    @property
    def _options(self) -> HADFLOptions:
        return self.config.options_as(HADFLOptions)

    def _strategy(self, times: Sequence[float]) -> None:
        config = self.config
        options = config.options_as(HADFLOptions)
        fixed = options.local_steps if isinstance(options.local_steps, int) else None
        self.generator = StrategyGenerator(
            times, max(1, options.warmup_epochs), self.batches, periods=options.sync_periods,
            selected=options.ring_members(config.devices), alpha=options.version_smoothing,
            seed=config.seed, fixed_steps=fixed)

    def _log_strategy(self, header: str) -> None:
        """The strategy in the log, a line per device (aiopipe.runtime.plan_text): its
        local steps a round and, negotiated, its seconds a step."""
        generator, config = self.generator, self.config
        assert generator is not None
        timed = isinstance(self._options.local_steps, str)  # by speed: from the negotiation
        entries = [{"device": k, "local_steps": steps, **({"step_s": t} if timed else {})}
                   for k, (steps, t) in enumerate(zip(generator.steps, generator.step_times,
                                                      strict=True))]
        options = config.options_as(HADFLOptions)
        rings = (f"groups of {options.group_size}" if 0 < options.group_size < config.devices
                 else f"rings of {plural(options.ring_members(config.devices), 'device')}")
        log_plan(log, logging.INFO, header, entries, units=self.units,
                 batch_size=config.batch_size,
                 notes=[f"{plural(self.rounds_per_epoch(), 'round')} an epoch", rings])

    def rounds_per_epoch(self) -> int:
        """Rounds of the epoch to come: one in the negotiation; after it, enough for
        the fleet to train about the mini-batches it holds."""
        if self.generator is None:
            return 1
        return max(1, math.ceil(sum(self.batches) / sum(self.generator.steps)))

    # -- what devices are told -----------------------------------------------------------

    def plan_entries(self) -> list[dict[str, Any]]:
        """Per device, the last round's: local steps, whether it was in the ring (and
        sent the average), and the version it reached."""
        return list(self._last)

    def iterations(self, device_id: int) -> int:
        """Rounds per epoch (`round_iterations` is 1: a round is an iteration here)."""
        return self.rounds_per_epoch()

    def refuse_hello(self, hello: Hello) -> str:
        """A device must listen for its peers."""
        if not hello.address:
            return (f"mode hadfl links devices directly: start device {hello.device_id} "
                    "with an address its peers can reach (python -m aiopipe.device "
                    "--listen HOST:PORT)")
        return ""

    def peer_keys(self, device_id: int) -> dict[str, str]:
        """Keys of device ``device_id``'s pairs with every other device (any two may
        share a ring, or a broadcast)."""
        me = f"device{device_id}"
        return {f"device{k}": pair_key(self._secret, me, f"device{k}").hex()
                for k in range(self.config.devices) if k != device_id}

    def frame_limit(self) -> int:
        """The whole model's state (a backup, an average) or the largest round report,
        and a RoundStart's ring and addresses."""
        state = self.model.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in state.values())
        report = REPORT_SLICE_BYTES * MAX_REPORT_SLICES
        return int(max(state_bytes + 256 * len(state), report) + HEADER_SLACK_BYTES
                   + 256 * self.config.devices)

    def _start(self, rounds: Rounds, round_no: int, epoch: int, steps: int,
               sync: dict[str, Any], tensors: Mapping[str, TensorData],
               peers: Sequence[int]) -> RoundStart:
        return RoundStart(round_no, epoch, 0, steps, tensors, 0, 1, 0, self.units, 1,
                          self.config.batch_size, 0, "",
                          {f"device{d}": {"stage": 0, "address": rounds.address_of(d)}
                           for d in peers},
                          sync=sync)

    # -- rounds --------------------------------------------------------------------------

    async def run_round(self, rounds: Rounds, round_no: int, epoch: int, first: int,
                        work: Sequence[int], participants: Sequence[int]
                        ) -> dict[int, RoundResult]:
        """Plan the round among ``participants``, play it on every one of them, keep
        the versions they reached and, in a backup round, the first ring's average."""
        config = self.config
        alive = sorted(participants)
        backup = self.generator is None or first == self.rounds_per_epoch() - 1
        rings, predicted = self._rings(alive, backup)
        steps = ({k: self.batches[k] for k in alive} if self.generator is None
                 else {k: self.generator.steps[k] for k in alive})
        lr = self._options.warmup_learning_rate if self.generator is None else config.learning_rate
        # each ring's sender sends its average to the devices of its pool left out
        receivers = {ring[0]: [k for k in pool if k not in ring] for ring, pool in rings}
        sender = rings[0][0][0]  # (its average is the backup)
        template = await rounds.compute.call(lambda: state_to_wire(  # [Note: frozen bases]
            {k: v.detach().clone() for k, v in models.without_frozen(
                self.model.state_dict(), self.model).items()}))
        starts: dict[int, RoundStart] = {}
        for ring, pool in rings:
            for k in pool:
                rejoined = self._rejoined(rounds, k)
                sync = {"ring": ring, "sender": ring[0],
                        "receivers": receivers[ring[0]] if k in ring else [],
                        "learning_rate": lr, "backup": backup and k == sender,
                        "version": self.backup_version if rejoined else 0.0,
                        "budget_s": self._budget(k)}
                peers = [*ring, *receivers[ring[0]]] if k in ring else ring
                starts[k] = self._start(rounds, round_no, epoch, steps[k], sync,
                                        template if rejoined else {},
                                        [d for d in peers if d != k])
        rounds.copy_checkpoint()
        try:
            async with asyncio.TaskGroup() as tasks:
                played = {k: tasks.create_task(rounds.play(
                    k, start, None, returns=template if k == sender and backup else {}))
                    for k, start in starts.items()}
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        done = {k: r for k, t in played.items() if (r := t.result()) is not None}
        for k, result in done.items():
            self.versions[k] = result.version
        if sender in done and done[sender].tensors:
            await rounds.compute.run("backup", partial(self._keep_backup, done[sender]),
                                     cost=0.0 if rounds.cost_table else None, epoch=epoch)
        if self.generator is None:
            self._negotiated(rounds, epoch, alive)
        in_ring = {k for ring, _ in rings for k in ring}
        self._last = [{"device": k, "local_steps": steps[k], "in_ring": k in in_ring,
                       "sender": k in receivers, "version": round(self.versions[k], 6)}
                      for k in alive]
        rounds.record_change({
            "kind": "hadfl-round", "round": round_no, "epoch": epoch,
            "rings": [ring for ring, _ in rings],
            "steps": [steps.get(k, 0) for k in range(config.devices)],
            "trained": [done[k].samples // config.batch_size if k in done else 0
                        for k in range(config.devices)], "predicted": predicted,
            "lost": sorted(set(alive) - set(done)),
            "versions": [round(v, 6) for v in self.versions]})
        return done

    def _rings(self, alive: list[int], backup: bool
               ) -> tuple[list[tuple[list[int], list[int]]], list[float] | None]:
        """The round's rings, each with the devices its sender serves (its pool), and the
        versions the strategy predicted (None in the negotiation).

        In the negotiation, one ring of every device. Then, with one group (or in an
        inter-group round: every ``inter_group_every``-th, and each epoch's last, whose
        average is the backup), one ring drawn among all and the rest served; with
        groups, one ring per group, drawn within it, serving the group's rest."""
        generator = self.generator
        if generator is None:
            ring = list(alive)
            self._rng.shuffle(ring)
            return [(ring, alive)], None
        config = self.config
        expected = generator.predict(self.versions if self._holt_started else None)
        self._holt_started = True
        groups = [[k for k in g if k in alive]
                  for g in groups_of(config.devices, self._options.group_size)]
        groups = [g for g in groups if g]
        self._rounds_run += 1
        if len(groups) == 1:
            drawn = generator.draw(expected, alive, self._options.ring_members(config.devices))
            return [(list(drawn), alive)], [round(v, 6) for v in expected]
        if backup or self._rounds_run % self._options.inter_group_every == 0:
            across = [generator.draw(expected, g, 1)[0] for g in groups]
            self._rng.shuffle(across)
            return [(across, alive)], [round(v, 6) for v in expected]
        return ([(list(generator.draw(expected, g, self._options.ring_members(len(g)))), g)
                 for g in groups], [round(v, 6) for v in expected])

    def _budget(self, k: int) -> float:
        """The seconds device k's local steps should take, by the negotiation (0: no
        limit: the negotiation itself, or fixed local steps)."""
        generator = self.generator
        if generator is None or not isinstance(self._options.local_steps, str):
            return 0.0
        return generator.steps[k] * generator.step_times[k]

    def _rejoined(self, rounds: Rounds, k: int) -> bool:
        """Whether device k starts this round from the backup: a new process since its
        last round, or every device after a resume."""
        session = rounds.session_of(k)
        rejoined = (k in self._sessions and self._sessions[k] != session
                    ) or k in self._from_backup
        self._sessions[k] = session
        self._from_backup.discard(k)
        return rejoined

    def _keep_backup(self, result: RoundResult) -> None:
        """The sender's average is the model manager's backup; the frozen parameters,
        which did not travel, as they are (compute thread)."""
        load_stage_state(self.model, state_from_wire(result.tensors), "the ring's average")
        self.backup_version = result.version

    def _negotiated(self, rounds: Rounds, epoch: int, alive: Sequence[int]) -> None:
        """Add each device's seconds of compute in the negotiation's round (its trace's
        training steps); after the last one, the strategy."""
        for s in rounds.recorder.slices:
            k = device_of(s.track)
            if s.epoch == epoch and s.name == "FB" and s.track.endswith("/compute") and (
                    k is not None):
                self.warmup_times[k] += s.end - s.start
        if epoch + 1 >= self._options.warmup_epochs:
            missing = [k for k, t in enumerate(self.warmup_times) if t <= 0]
            fallback = max(self.warmup_times)
            # a device that missed the negotiation is taken as the slowest one
            self._strategy([t if t > 0 else fallback for t in self.warmup_times])
            self._log_strategy("hadfl's strategy from the negotiation")
            if missing:
                log.warning("devices %s missed the negotiation: taken as the slowest",
                            missing)

    async def after_round(self, rounds: Rounds, round_no: int, epoch: int,
                          slices: Sequence[Slice], served: Sequence[int],
                          paced: Sequence[bool]) -> dict[str, Any] | None:
        """Nothing: each round's strategy and the versions it led to went on the record
        as it ended (``EpochMetrics.changes``)."""
        return None

    # -- checkpoints ---------------------------------------------------------------------

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The model manager's backup, the negotiation's times and the versions."""
        tensors = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        tensors["hadfl/warmup_times"] = torch.tensor(self.warmup_times, dtype=torch.float64)
        tensors["hadfl/versions"] = torch.tensor([*self.versions, self.backup_version],
                                                 dtype=torch.float64)
        return tensors

    def restore(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
        """Go on from a checkpoint: the backup (every device starts from it), the
        negotiation's times (the strategy, once it is complete) and the versions
        (Holt's smoothing starts again from them)."""
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        self.warmup_times = [float(t) for t in tensors["hadfl/warmup_times"]]
        *versions, self.backup_version = (float(v) for v in tensors["hadfl/versions"])
        self.versions = versions
        self._from_backup = set(range(self.config.devices))  # every device starts from it
        if all(t > 0 for t in self.warmup_times) and self.batches:
            self._strategy(self.warmup_times)
