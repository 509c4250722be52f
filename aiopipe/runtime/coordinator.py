"""The coordinator: admits devices, drives rounds and epochs, evaluates and records.

It is the same for every system; what differs (placement, what devices are told, the
coordinator's own stages, how results become the model) is the `System` chosen once from
``config.mode`` (`aiopipe.runtime.systems`). Its parts, each one idea:
- `Admission` (aiopipe/runtime/admission.py): hellos, sessions, connections;
- `DeviceSession` (session.py): one device's connection, rounds, and the stage the
  coordinator runs for it;
- the system's rounds, and `after_round` (re-planning);
- `Checkpoints` (checkpoint.py): checkpoints written while training goes on;
- the epoch loop here: rounds, tallies, metrics, evaluation on the held-out test set.

In the split modes (PiPar's server) the coordinator is also a stage host: its compute
queue runs every device's server half; in a pipeline it runs no stage and is off the
data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import secrets
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from aiopipe import data as datasets
from aiopipe.auth import new_run_secret
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import ConfigError, DeviceLostError, TrainingError
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.metrics.trace import RESOURCE_KINDS, Recorder, resource_kind
from aiopipe.protocol import Hello, Plan, RoundResult, RoundStart
from aiopipe.runtime.admission import Admission
from aiopipe.runtime.checkpoint import Checkpoints, load_checkpoint
from aiopipe.runtime.compute import Compute, warm_up_torch
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.runtime.stage import ServerStage
from aiopipe.runtime.systems import Setup, System, system_for
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.transport import Link

__all__ = ["Coordinator"]

log = logging.getLogger("aiopipe.server")

T = TypeVar("T")


class Coordinator:
    """Coordinator (and, in the split modes, stage host) of one run.

    Args:
        config: the run; "auto" plans are resolved by the system, and ``self.config`` is
            the resolved config that devices receive.
        clock: the node's clock.
        cost_table: charge compute from this table (virtual-time simulation); also what
            planners plan with. Without it, "auto" measures one on this machine.
        join_timeout: seconds to wait for every device to say hello.
        progress: called with each finished epoch's metrics.
        checkpoint_dir: write a checkpoint there after every round (atomically).
        resume: continue from the checkpoint in ``checkpoint_dir``; the config must be
            the one it was written for.

    Raises:
        ConfigError: the config cannot run, or there is no checkpoint to resume from.
    """

    def __init__(self, config: RunConfig, *, clock: Clock, cost_table: CostTable | None = None,
                 join_timeout: float = 300.0,
                 progress: Any = None, checkpoint_dir: Path | None = None,
                 resume: bool = False) -> None:
        warm_up_torch()
        self.clock = clock
        self.cost_table = cost_table
        self.join_timeout = join_timeout
        self.progress = progress
        train = train_dataset(config)
        self.test_set = datasets.open_dataset(config.dataset, split="test",
                                              size=config.test_samples, seed=config.seed)
        model = build_model(config, num_classes=train.num_classes, in_shape=train.in_shape)
        samples = [len(device_indices(config, train, k)) for k in range(config.devices)]
        #: names the run in every stage-addressed message
        self.run_id = (1 << 61) | secrets.randbits(61)  # 9 bytes in msgpack: frame sizes fixed
        self.system: System = system_for(Setup(config, model, train, samples, cost_table,
                                               new_run_secret()))
        self.max_frame_bytes = self.system.frame_limit()
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, "server/compute",
                               charge_costs=cost_table is not None)
        self.admission = Admission(self)
        self.sessions = self.admission.sessions
        self.connected = self.admission.connected
        self.joined = self.admission.joined
        #: why the coordinator's own work failed ([Note: server faults]); train() raises it
        self.failure: TrainingError | None = None
        self._failed = asyncio.Event()
        self.epoch = -1
        self.finished = False  # train() has returned: no more admissions
        self._epoch_start = 0.0
        self.rounds = 0
        self.epochs: list[EpochMetrics] = []
        self.replans: list[dict[str, Any]] = []
        self._tally: dict[str, Any] = {}
        if not self.system.resumable:
            if resume:
                self.system.restore({}, {})  # raises, saying why
            checkpoint_dir = None  # nothing a run could resume from
        self.checkpoints = Checkpoints(checkpoint_dir, clock=clock, compute=self.compute,
                                       tensors=self.system.checkpoint_tensors)
        if resume:
            if checkpoint_dir is None:
                raise ConfigError("resuming needs the checkpoint directory")
            self._restore(checkpoint_dir)

    @property
    def config(self) -> RunConfig:
        """The run's config, "auto" resolved (and re-planned): what devices receive."""
        return self.system.config

    @property
    def model(self) -> torch.nn.Sequential:
        """The global model."""
        return self.system.model

    # -- what admission and sessions ask -----------------------------------------------

    async def serve_link(self, link: Link, *, device_id: int | None = None) -> None:
        """Run one device connection from hello to goodbye (see `Admission.serve_link`).

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection failed.
        """
        await self.admission.serve_link(link, device_id=device_id)

    async def wait_disconnected(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until every device connection has closed; whether
        they all did."""
        return await self.admission.wait_disconnected(seconds)

    def plan_for(self, device_id: int, session: int) -> Plan:
        """The `Plan` answering device ``device_id``'s hello."""
        return Plan(device_id, self.config.mode, self.config.to_mapping(), self.run_id,
                    server_time=self.clock.now(), session=session,
                    peer_keys=self.system.peer_keys(device_id))

    def refuse_hello(self, hello: Hello) -> str:
        """Why the system cannot take this device ("" when it can)."""
        return self.system.refuse_hello(hello)

    def address_of(self, device_id: int) -> str:
        """Where device ``device_id`` listens for peers ("" when it does not)."""
        return self.admission.addresses.get(device_id, "")

    def server_failed(self, device_id: int, error: BaseException) -> None:
        """[Note: server faults] The coordinator's own work for a device failed (a pass
        that ran out of memory, a bug). That is not the device's doing, and it would
        happen again: the device would reconnect, resend, and fail the same pass, for
        ever. So the device's session ends, the error is logged with its traceback once,
        the device is told why, and the run stops with a `TrainingError` naming it."""
        cause = first_error(error) if isinstance(error, BaseExceptionGroup) else error
        failure = TrainingError(f"the server's work for device {device_id} failed: "
                                f"{type(cause).__name__}: {cause}")
        session = self.sessions.get(device_id)
        log.error("%s", failure, exc_info=cause)
        if self.failure is None:
            self.failure = failure
            self._failed.set()
        if session is not None and not session.ended:
            session.end(str(failure))
            if not session.closing:
                session.say_bye(f"training failed: {failure}")

    # -- what systems ask ----------------------------------------------------------------

    async def play(self, device_id: int, start: RoundStart,
                   stage: ServerStage | None) -> RoundResult | None:
        """Device ``device_id``'s part of a round; None when it was lost meanwhile."""
        session = self.sessions[device_id]
        if session.window is None and start.round > 0:
            log.warning("device %d takes part again from round %d", device_id, start.round)
        try:
            return await session.run_round(start, stage)
        except DeviceLostError as exc:
            log.warning("round %d goes on without device %d: %s", start.round, device_id,
                        exc)
            return None

    def copy_checkpoint(self) -> None:
        """Let a pending checkpoint's copy go now (see [Note: background checkpoints])."""
        self.checkpoints.copy()

    # -- training ---------------------------------------------------------------------

    async def train(self) -> RunResult:
        """Wait for every device, run every epoch, say goodbye; the run's result.

        Raises:
            TrainingError: devices did not join in time, or the run could not go on.
        """
        try:
            await wait_for(self.clock, self.joined.wait(), self.join_timeout)
        except TimeoutError:
            missing = sorted(set(range(self.config.devices)) - set(self.sessions))
            raise TrainingError(f"devices {missing} did not join within "
                                f"{self.join_timeout:g} s") from None
        origin = self.clock.now()
        reason = "training finished"
        try:
            for epoch in range(len(self.epochs), self.config.epochs):
                self.epochs.append(await self._unless_failed(self._epoch(epoch)))
                if self.progress is not None:
                    self.progress(self.epochs[-1])
                await self.checkpoints.save(self._checkpoint_meta(epoch + 1, 0, 0.0), epoch)
            await self.checkpoints.written()
        except BaseException as exc:
            reason = f"training failed: {exc}"
            raise
        finally:
            self.finished = True
            for session in self.sessions.values():
                if not session.closing and not session.ended:
                    session.say_bye(reason)
            try:  # training failed: let the checkpoint in flight (or pending) end
                await self.checkpoints.written()
            except Exception as exc:  # the failure being raised wins
                log.error("the last checkpoint could not be written: %s", exc)
            self.compute.close()
        return RunResult(self.config, list(self.epochs), self.model,
                         list(self.recorder.slices), origin)

    async def _unless_failed(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``'s result, unless the coordinator's own work fails first: then
        ``work`` is cancelled and the failure raised ([Note: server faults]).

        Raises:
            TrainingError: the coordinator's work failed.
        """
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.failure is not None:
            raise self.failure
        return task.result()

    async def _epoch(self, epoch: int) -> EpochMetrics:
        self.epoch = epoch
        start = self._epoch_start = self.clock.now()
        stats_before = self._link_bytes()
        system, devices = self.system, self.config.devices
        iterations = [system.iterations(k) for k in range(devices)]
        period = self.config.aggregation_every or max(iterations)
        tally = self._tally if self._tally.get("epoch") == epoch else _new_tally(epoch, devices)
        self._tally = tally
        round_count = math.ceil(max(iterations) / period)
        for r in range(int(tally["next_round"]), round_count):
            first = r * period
            round_no = self.rounds
            self.rounds += 1
            work = [max(0, min(period, n - first)) for n in iterations]
            participants = await self._participants()
            mark = len(self.recorder.slices)
            done = await system.run_round(self, round_no, epoch, first, work, participants)
            tally["lost"] = sorted(set(tally["lost"]) | (set(participants) - set(done)))
            for k, result in done.items():
                tally["device_samples"][k] += result.samples
                tally["loss_sum"] += result.loss_sum
                tally["correct"] += result.correct
            tally["next_round"] = r + 1
            if r + 1 < round_count or epoch + 1 < self.config.epochs:
                await self._after_round(round_no, epoch, mark)
            if r + 1 < round_count:  # after the last one, `train` checkpoints the epoch
                await self.checkpoints.save(
                    self._checkpoint_meta(epoch, r + 1, self.clock.now() - start), epoch)
        end = self.clock.now()
        accuracy = await self.compute.call(self._evaluate)
        up, down = (a - b for a, b in zip(self._link_bytes(), stats_before, strict=True))
        device_samples = tuple(int(n) for n in tally["device_samples"])
        samples = system.epoch_samples(device_samples)
        elapsed = end - start + float(tally["elapsed_before"])  # time before a restart too
        by_track = self.recorder.busy_by_track(start, end)
        busy = self._busy(by_track)
        return EpochMetrics(
            epoch=epoch, time_s=elapsed, busy_s=busy,
            idle_s={k: elapsed - v for k, v in busy.items()},
            loss=float(tally["loss_sum"]) / max(1, samples), accuracy=accuracy,
            train_accuracy=int(tally["correct"]) / max(1, samples), samples=samples,
            bytes_up=int(up), bytes_down=int(down), plan=system.plan_entries(),
            device_samples=device_samples, devices_lost=tuple(tally["lost"]),
            stages=system.stage_figures(by_track, elapsed, {
                k: s.peak_live for k, s in self.sessions.items()}),
            links={track: {"busy_s": seconds, "idle_s": elapsed - seconds}
                   for track, seconds in sorted(by_track.items()) if "->" in track},
        )

    async def _after_round(self, round_no: int, epoch: int, mark: int) -> None:
        devices = self.config.devices
        served = [self.sessions[k].served if k in self.sessions else 0 for k in range(devices)]
        paced = [k not in self.sessions or self.sessions[k].peer.link.paces_sends()
                 for k in range(devices)]
        change = await self.system.after_round(self, round_no, epoch,
                                               self.recorder.take(mark), served, paced)
        if change is not None:
            self.replans.append(change)

    async def _participants(self) -> list[int]:
        """Devices taking part (connected, or reconnecting within reconnect_grace); if none,
        wait (join_timeout) for one to come back.

        Raises:
            TrainingError: every device was lost and none returned in time.
        """
        if not self.admission.alive():
            log.warning("every device was lost; waiting up to %g s for one to rejoin",
                        self.join_timeout)
            self.checkpoints.copy()  # no round is coming soon: save now
            try:
                await wait_for(self.clock, self.admission.wait_for_someone(),
                               self.join_timeout)
            except TimeoutError:
                raise TrainingError(f"every device was lost and none rejoined within "
                                    f"{self.join_timeout:g} s") from None
        return self.admission.alive()

    def _evaluate(self) -> float:
        model = self.model
        model.eval()
        correct = 0
        try:
            with torch.no_grad():
                for first in range(0, len(self.test_set), 500):
                    x, y = self.test_set.batch(range(first, min(first + 500, len(self.test_set))))
                    correct += int((model(x).argmax(1) == y).sum())
        finally:
            model.train()
        return correct / max(1, len(self.test_set))

    def _busy(self, by_track: Mapping[str, float]) -> dict[str, float]:
        """Busy seconds per resource kind; device kinds are means over devices."""
        totals = dict.fromkeys(RESOURCE_KINDS, 0.0)
        for track, busy in by_track.items():
            kind = resource_kind(track)
            if kind in totals:
                totals[kind] += busy
        k = self.config.devices
        return {kind: value if kind == "server" else value / k
                for kind, value in totals.items()}

    def _link_bytes(self) -> tuple[int, int]:
        up = down = 0
        for session in self.sessions.values():
            received, sent = session.link_bytes()
            up += received
            down += sent
        return up, down

    # -- checkpoints ---------------------------------------------------------------------

    def _checkpoint_meta(self, epoch: int, next_round: int, elapsed: float) -> dict[str, Any]:
        """What a checkpoint holds besides tensors: config, position, tally, epochs."""
        # a deep copy: the next round adds to the tally's lists while the file is written
        tally = (copy.deepcopy(self._tally) if next_round
                 else _new_tally(epoch, self.config.devices))
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0)) + elapsed
        return {"config": self.config.to_mapping(), "epoch": epoch,
                "rounds": self.rounds, "tally": {**tally, "epoch": epoch,
                                                 "next_round": next_round},
                "epochs": [e.to_mapping() for e in self.epochs]}

    def _restore(self, directory: Path) -> None:
        tensors, meta = load_checkpoint(directory)
        saved = dict(meta.get("config", {}))
        current = self.config.to_mapping()
        for key in ("out_dir", *self.system.planned_keys):  # "auto" plans: the checkpoint's
            saved.pop(key, None)
            current.pop(key, None)
        if saved != current:
            changed = sorted(k for k in set(saved) | set(current)
                             if saved.get(k) != current.get(k))
            raise ConfigError(f"the checkpoint in {str(directory)!r} is for another run "
                              f"(different {', '.join(changed)})")
        self.system.restore(tensors, meta["config"])
        self.rounds = int(meta["rounds"])
        self.epochs = [_epoch_from(e) for e in meta.get("epochs", [])]
        tally = dict(meta["tally"])
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0))
        self._tally = tally
        log.warning("resuming at epoch %d, round %d of the epoch, from %s",
                    int(meta["epoch"]) + 1, int(tally["next_round"]), directory)

    # -- status --------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Live state for ``GET /status``: devices, plan, progress, and the busy fraction of
        each resource kind in the epoch so far (device figures are means over devices;
        device-side work is known once a device reports its round)."""
        now = self.clock.now()
        live: dict[str, float] = {}
        if self.epoch >= 0 and now > self._epoch_start:
            elapsed = now - self._epoch_start
            by_track = self.recorder.busy_by_track(self._epoch_start, now)
            live = {kind: round(busy / elapsed, 4)
                    for kind, busy in self._busy(by_track).items()}
        return {
            "mode": self.config.mode, "devices": self.config.devices,
            "joined": sorted(self.sessions), "connected": sorted(self.connected),
            "epoch": self.epoch, "round": self.rounds,
            "epochs": self.config.epochs,
            "busy_fraction": live,
            "plan": self.system.plan_entries(),
            "replans": list(self.replans),
            "finished_epochs": [e.to_mapping() for e in self.epochs],
        }


def _new_tally(epoch: int, devices: int) -> dict[str, Any]:
    """An epoch's running totals (what a checkpoint needs to finish the epoch exactly)."""
    return {"epoch": epoch, "next_round": 0, "device_samples": [0] * devices,
            "loss_sum": 0.0, "correct": 0, "lost": [], "elapsed_before": 0.0}


def _epoch_from(values: Mapping[str, Any]) -> EpochMetrics:
    fields = dict(values)
    fields["device_samples"] = tuple(fields.get("device_samples", ()))
    fields["devices_lost"] = tuple(fields.get("devices_lost", ()))
    fields["stages"] = tuple(fields.get("stages", ()))
    fields["links"] = dict(fields.get("links", {}))
    return EpochMetrics(**fields)

