"""The server node: admits devices, runs rounds, aggregates, evaluates, records.

The coordinator (`ServerNode.train`) drives rounds; each connected device has a
`DeviceSession`. Per round (an epoch, or ``aggregation_every`` iterations):
- fl: send the global model to every device; devices train it whole; FedAvg the results;
- sfl / pipar: send every device its half of the global model; sessions serve
  activations on the shared compute queue; when every device's result is in, rebuild
  M_k = M^s_k (+) M^c_k per device, FedAvg weighted by samples (Eq. 3), split back (Eq. 4);
- sl: devices take turns; each starts from the previous one's weights; one server half.
After each epoch the global model is evaluated on the server's held-out test set.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.clock import Clock, wait_for
from aiopipe.config import RunConfig
from aiopipe.errors import (
    AiopipeError,
    ConfigError,
    DeviceLostError,
    RemoteProtocolError,
    TrainingError,
    TransportError,
)
from aiopipe.metrics.results import EpochMetrics, RunResult
from aiopipe.metrics.trace import RESOURCE_KINDS, Recorder, resource_kind
from aiopipe.protocol import (
    HEADER_SLACK_BYTES,
    PROTOCOL_VERSION,
    ErrorMessage,
    Hello,
    Plan,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
)
from aiopipe.runtime.aggregation import fedavg
from aiopipe.runtime.checkpoint import load_checkpoint, save_checkpoint
from aiopipe.runtime.compute import Compute, warm_up_torch
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.plan import (
    build_model,
    device_indices,
    device_plans,
    needs_planner,
    profile_batch_sizes,
    resolve_auto,
    train_dataset,
    unit_output_shapes,
)
from aiopipe.runtime.session import DeviceSession
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable, measure_costs
from aiopipe.transport import Link

__all__ = ["ServerNode"]

log = logging.getLogger("aiopipe.server")

#: Seconds a new connection has to say hello before it is dropped.
HELLO_TIMEOUT_S = 30.0


class ServerNode:
    """Coordinator and server-side compute of one run.

    Args:
        config: the run; "auto" split points and micro-batch counts are resolved here by
            the planner (`aiopipe.runtime.plan.resolve_auto`), and ``self.config`` is the
            resolved config that devices receive.
        clock: the node's clock.
        cost_table: charge compute from this table (virtual-time simulation); also what
            the planner plans with. Without it, "auto" measures one on this machine.
        join_timeout: seconds to wait for every device to say hello.
        progress: called with one line per finished epoch.
        checkpoint_dir: write a checkpoint there after every round (atomically).
        resume: continue from the checkpoint in ``checkpoint_dir``; the config must be
            the one it was written for.
    """

    def __init__(self, config: RunConfig, *, clock: Clock, cost_table: CostTable | None = None,
                 join_timeout: float = 300.0,
                 progress: Any = None, checkpoint_dir: Path | None = None,
                 resume: bool = False) -> None:
        warm_up_torch()
        self.config = config
        self.clock = clock
        self.cost_table = cost_table
        self.join_timeout = join_timeout
        self.progress = progress
        train = train_dataset(config)
        self.num_classes = train.num_classes
        self.in_shape = train.in_shape
        self.test_set = datasets.open_dataset(config.dataset, split="test",
                                              size=config.test_samples, seed=config.seed)
        self.model = build_model(config, num_classes=self.num_classes, in_shape=self.in_shape)
        self.units = models.unit_count(self.model)
        samples = [len(device_indices(config, train, k)) for k in range(config.devices)]
        if needs_planner(config):
            if cost_table is None:
                cost_table = measure_costs(self.model, self.in_shape, profile_batch_sizes(config))
                charge = False  # measured only to plan: real runs keep real time
            else:
                charge = True
            config = resolve_auto(config, self.model, self.in_shape, samples, cost_table)
            self.config = config
            if not charge:
                cost_table = None
            self.cost_table = cost_table
        self.plans = device_plans(config, self.units, samples)
        self.activation_shapes = unit_output_shapes(self.model, self.in_shape)
        self.max_frame_bytes = self._frame_limit()
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, "server/compute",
                               charge_costs=cost_table is not None)
        self.replicas: dict[int, tuple[nn.Sequential, torch.optim.Optimizer]] = {}
        for plan in self.plans if config.mode != "fl" else ():
            half = copy.deepcopy(models.split(self.model, plan.split_point)[1])  # only that half
            optimizer = torch.optim.SGD(half.parameters(), lr=config.learning_rate,
                                        momentum=config.momentum)
            self.replicas[plan.device_id] = (half, optimizer)
        self.sessions: dict[int, DeviceSession] = {}  # every device that joined the run
        self.connected: set[int] = set()  # devices whose connection is open now
        self._left = asyncio.Event()  # set whenever a connection closes
        self._arrived = asyncio.Event()  # set whenever a device is admitted
        self.joined = asyncio.Event()  # set once every device has said hello
        self.epoch = -1
        self.finished = False  # train() has returned: no more admissions
        self._half_specs: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._epoch_start = 0.0
        self.rounds = 0
        self.epochs: list[EpochMetrics] = []
        self._tally: dict[str, Any] = {}
        self.checkpoint_dir = checkpoint_dir
        if resume:
            if checkpoint_dir is None:
                raise ConfigError("resuming needs the checkpoint directory")
            self._restore(checkpoint_dir)

    # -- admission ----------------------------------------------------------------------

    async def serve_link(self, link: Link, *, device_id: int | None = None) -> None:
        """Run one device connection from hello to goodbye (the websocket handler's body).

        ``device_id``: the id the connection authenticated as (from its token); a Hello
        for any other id is refused.

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection failed.
        """
        peer = Peer(link, self.clock, self.recorder, "server/unknown",
                    max_frame_bytes=self.max_frame_bytes)
        try:
            hello: object = await wait_for(self.clock, peer.receive(), HELLO_TIMEOUT_S)
        except TimeoutError:
            hello = None
            problem = f"no hello within {HELLO_TIMEOUT_S:g} s"
        except RemoteProtocolError as exc:
            hello = None
            problem = f"bad hello: {exc}"
        else:
            problem = self._check_hello(hello, device_id)
        if problem:
            log.warning("refused a device: %s", problem)
            code = "busy" if problem.endswith("already connected") else "refused"
            with contextlib.suppress(TransportError):
                await peer.send(ErrorMessage(code, problem))
            await link.aclose()
            raise RemoteProtocolError(problem)
        assert isinstance(hello, Hello)
        k = hello.device_id
        session = self.sessions.get(k)
        resumed = session is not None and not session.ended and hello.session == session.nonce
        if session is not None and not session.ended:
            await self._supersede(session)
        if session is not None and not resumed:
            # a device that starts afresh cannot continue its old round: drop that round
            session.end("it restarted")
        if session is None or not resumed:
            plan = self.plans[k]
            session = DeviceSession(
                self, Peer(link, self.clock, self.recorder, f"device{k}/downlink",
                           max_frame_bytes=self.max_frame_bytes),
                plan, self.activation_shapes[plan.split_point - 1])
            self.sessions[k] = session
        plan = self.plans[k]
        await peer.send(Plan(k, self.config.mode, plan.split_point, plan.parallel_batches,
                             plan.micro_batch_size, self.config.to_mapping(),
                             server_time=self.clock.now(), session=session.nonce))
        session.attach(link, resumed=resumed)
        if len(self.sessions) == self.config.devices:
            self.joined.set()
        self.connected.add(k)
        self._arrived.set()
        try:
            await session.serve()
        except TransportError as exc:
            # [Note: reconnection] wait for the device to come back before giving up
            self.connected.discard(k)
            self._left.set()
            log.warning("device %d: %s; waiting %g s for it to reconnect", k, exc,
                        self.config.device_timeout)
            if await session.wait_reattached(self.config.device_timeout):
                return  # the new connection's serve_link carries on
            session.end(f"{exc}, and it did not reconnect within "
                        f"{self.config.device_timeout:g} s")
            log.warning("device %d was lost", k)
            raise
        except (AiopipeError, OSError) as exc:
            session.end(str(exc))
            log.warning("device %d was lost: %s", k, exc)
            raise
        else:
            session.end("it said goodbye")
        finally:
            if self.sessions.get(k) is session and session.ended:
                self.connected.discard(k)
                self._left.set()

    async def _supersede(self, session: DeviceSession) -> None:
        """A device (authenticated as itself) said hello again: retire its old connection,
        which may still look alive (a stalled link)."""
        if not session.idle.is_set():
            await session.peer.link.aclose("superseded by a new connection")
            try:
                await wait_for(self.clock, session.idle.wait(), 30.0)
            except TimeoutError:
                raise RemoteProtocolError(f"device {session.device_id}'s old connection "
                                          "did not close") from None

    async def wait_disconnected(self, seconds: float) -> bool:
        """Wait up to ``seconds`` until every device connection has closed (after Bye).

        Returns whether they all did. Closing the listening site earlier would drop the
        devices' close handshakes.
        """

        async def all_gone() -> None:
            while self.connected:
                self._left.clear()
                await self._left.wait()

        try:
            await wait_for(self.clock, all_gone(), seconds)
        except TimeoutError:
            return False
        return True

    def _check_hello(self, hello: object, authenticated: int | None) -> str:
        if not isinstance(hello, Hello):
            return f"expected Hello, got {type(hello).__name__}"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        if self.finished:
            return "the run is over"
        if authenticated is not None and hello.device_id != authenticated:
            return f"token is for device {authenticated}, not device {hello.device_id}"
        session = self.sessions.get(hello.device_id)
        if authenticated is None and session is not None and not session.idle.is_set():
            # only a connection authenticated as this device may take over a live one
            return f"device id {hello.device_id} is already connected"
        if hello.version != PROTOCOL_VERSION:
            return f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        if not hello.device_id < self.config.devices:
            return f"device id {hello.device_id} is not in 0..{self.config.devices - 1}"
        return ""

    def device_half_specs(self, device_id: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Wire dtype and shape of every state-dict entry of device ``device_id``'s half."""
        specs = self._half_specs.get(device_id)
        if specs is None:
            half = models.split(self.model, self.plans[device_id].split_point)[0]
            specs = {name: (wire.dtype, wire.shape) for name, wire in
                     state_to_wire({k: v.detach() for k, v in half.state_dict().items()}).items()}
            self._half_specs[device_id] = specs
        return specs

    # -- training ---------------------------------------------------------------------

    async def train(self) -> RunResult:
        """Wait for every device, run every epoch, say goodbye; the run's result.

        Raises:
            TrainingError: devices did not join in time, or one was lost.
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
                self.epochs.append(await self._epoch(epoch))
                if self.progress is not None:
                    self.progress(self.epochs[-1])
                await self._save_checkpoint(epoch + 1, 0)
        except BaseException as exc:
            reason = f"training failed: {exc}"
            raise
        finally:
            self.finished = True
            for session in self.sessions.values():
                if not session.closing and not session.ended:
                    session.say_bye(reason)
            self.compute.close()
        return RunResult(self.config, list(self.epochs), self.model,
                         list(self.recorder.slices), origin)

    async def _epoch(self, epoch: int) -> EpochMetrics:
        self.epoch = epoch
        start = self._epoch_start = self.clock.now()
        stats_before = self._link_bytes()
        iterations = [p.iterations_per_epoch for p in self.plans]
        period = self.config.aggregation_every or max(iterations)
        tally = self._tally if self._tally.get("epoch") == epoch else _new_tally(
            epoch, self.config.devices)
        self._tally = tally
        for r in range(int(tally["next_round"]), math.ceil(max(iterations) / period)):
            first = r * period
            round_no = self.rounds
            self.rounds += 1
            work = [max(0, min(period, n - first)) for n in iterations]
            participants = await self._participants()
            if self.config.mode == "sl":  # devices take turns on one chain of weights
                done: dict[int, RoundResult] = {}
                for k in participants:
                    result = await self._round(k, round_no, epoch, first, work[k])
                    if result is not None:
                        done[k] = result
                        await self.compute.run("agg", partial(self._adopt, k, result),
                                               cost=0.0 if self.cost_table else None,
                                               epoch=epoch)
            else:
                try:
                    async with asyncio.TaskGroup() as tasks:
                        rounds = {k: tasks.create_task(
                            self._round(k, round_no, epoch, first, work[k]))
                            for k in participants}
                except BaseExceptionGroup as group:
                    raise first_error(group) from None
                done = {k: res for k, t in rounds.items() if (res := t.result()) is not None}
                if done:
                    await self.compute.run("agg", partial(self._aggregate, done),
                                           cost=0.0 if self.cost_table else None, epoch=epoch)
            tally["lost"] = sorted(set(tally["lost"]) | (set(participants) - set(done)))
            for k, result in done.items():
                tally["device_samples"][k] += result.samples
                tally["loss_sum"] += result.loss_sum
                tally["correct"] += result.correct
            tally["next_round"] = r + 1
            await self._save_checkpoint(epoch, r + 1, elapsed=self.clock.now() - start)
        end = self.clock.now()
        accuracy = await self.compute.call(self._evaluate)
        up, down = (a - b for a, b in zip(self._link_bytes(), stats_before, strict=True))
        device_samples = tuple(int(n) for n in tally["device_samples"])
        samples = sum(device_samples)
        busy = self._busy(start, end)
        elapsed = end - start + float(tally["elapsed_before"])  # time before a restart too
        return EpochMetrics(
            epoch=epoch, time_s=elapsed, busy_s=busy,
            idle_s={k: elapsed - v for k, v in busy.items()},
            loss=float(tally["loss_sum"]) / max(1, samples), accuracy=accuracy,
            train_accuracy=int(tally["correct"]) / max(1, samples), samples=samples,
            bytes_up=int(up), bytes_down=int(down),
            plan=[{"device": p.device_id, "split_point": p.split_point,
                   "parallel_batches": p.parallel_batches} for p in self.plans],
            device_samples=device_samples, devices_lost=tuple(tally["lost"]),
        )

    # -- checkpoints (see aiopipe.runtime.checkpoint) --------------------------------------

    async def _save_checkpoint(self, epoch: int, next_round: int, *,
                               elapsed: float = 0.0) -> None:
        """Checkpoint in the compute thread (fsync can take seconds; the loop must not
        wait), where nothing else touches the replicas meanwhile."""
        if self.checkpoint_dir is not None:
            await self.compute.call(partial(self._write_checkpoint, epoch, next_round,
                                            elapsed))

    def _write_checkpoint(self, epoch: int, next_round: int, elapsed: float) -> None:
        assert self.checkpoint_dir is not None
        tensors = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        for k, (half, optimizer) in self.replicas.items():
            tensors.update({f"replica/{k}/{name}": v for name, v in half.state_dict().items()})
            for i, param in enumerate(half.parameters()):
                buffer = optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    tensors[f"momentum/{k}/{i}"] = buffer
        tally = dict(self._tally) if next_round else _new_tally(epoch, self.config.devices)
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0)) + elapsed
        meta = {"config": self.config.to_mapping(), "epoch": epoch,
                "rounds": self.rounds, "tally": {**tally, "epoch": epoch,
                                                 "next_round": next_round},
                "epochs": [e.to_mapping() for e in self.epochs]}
        save_checkpoint(self.checkpoint_dir, tensors, meta)

    def _restore(self, directory: Path) -> None:
        tensors, meta = load_checkpoint(directory)
        saved = dict(meta.get("config", {}))
        current = self.config.to_mapping()
        for key in ("out_dir",):
            saved.pop(key, None)
            current.pop(key, None)
        if saved != current:
            changed = sorted(k for k in set(saved) | set(current)
                             if saved.get(k) != current.get(k))
            raise ConfigError(f"the checkpoint in {str(directory)!r} is for another run "
                              f"(different {', '.join(changed)})")
        self.model.load_state_dict({k[6:]: v for k, v in tensors.items()
                                    if k.startswith("model/")})
        for k, (half, optimizer) in self.replicas.items():
            prefix = f"replica/{k}/"
            half.load_state_dict({n[len(prefix):]: v for n, v in tensors.items()
                                  if n.startswith(prefix)})
            for i, param in enumerate(half.parameters()):
                buffer = tensors.get(f"momentum/{k}/{i}")
                if buffer is not None:
                    optimizer.state[param]["momentum_buffer"] = buffer.clone()
        self.rounds = int(meta["rounds"])
        self.epochs = [_epoch_from(e) for e in meta.get("epochs", [])]
        tally = dict(meta["tally"])
        tally["elapsed_before"] = float(tally.get("elapsed_before", 0.0))
        self._tally = tally
        log.warning("resuming at epoch %d, round %d of the epoch, from %s",
                    int(meta["epoch"]) + 1, int(tally["next_round"]), directory)

    async def _participants(self) -> list[int]:
        """Devices taking part (connected, or reconnecting within device_timeout); if none,
        wait (join_timeout) for one to come back.

        Raises:
            TrainingError: every device was lost and none returned in time.
        """
        def alive() -> list[int]:
            return sorted(k for k, s in self.sessions.items() if not s.ended)

        if not alive():
            log.warning("every device was lost; waiting up to %g s for one to rejoin",
                        self.join_timeout)

            async def someone() -> None:
                while not alive():
                    self._arrived.clear()
                    await self._arrived.wait()

            try:
                await wait_for(self.clock, someone(), self.join_timeout)
            except TimeoutError:
                raise TrainingError(f"every device was lost and none rejoined within "
                                    f"{self.join_timeout:g} s") from None
        return alive()

    async def _round(self, k: int, round_no: int, epoch: int, first: int,
                     iterations: int) -> RoundResult | None:
        """Device k's part of a round; None when the device was lost meanwhile."""
        session = self.sessions[k]
        optimizer = self.replicas[k][1] if k in self.replicas else None

        def prepare() -> dict[str, Any]:
            if optimizer is not None:  # a lost round may have left gradients behind
                optimizer.zero_grad(set_to_none=True)
            return self._device_half_state(k)

        half_state = await self.compute.call(prepare)
        try:
            return await session.start_round(
                RoundStart(round_no, epoch, first, iterations, half_state))
        except DeviceLostError as exc:
            log.warning("round %d goes on without device %d: %s", round_no, k, exc)
            return None

    def _device_half_state(self, k: int) -> dict[str, Any]:
        half = models.split(self.model, self.plans[k].split_point)[0]
        return state_to_wire({key: v.detach().clone() for key, v in half.state_dict().items()})

    def _whole_state(self, k: int, result: RoundResult) -> dict[str, torch.Tensor]:
        device_half = state_from_wire(result.tensors)
        if self.config.mode == "fl":
            return dict(device_half)
        server_half = self.replicas[k][0].state_dict()
        return models.merge_states(device_half, server_half)

    def _aggregate(self, results: Mapping[int, RoundResult]) -> None:
        """FedAvg over the devices whose round completed, weighted by their samples."""
        states = [self._whole_state(k, res) for k, res in results.items()]
        weights = [float(res.samples) for res in results.values()]
        if sum(weights) == 0:
            return
        self._load_global(fedavg(states, weights))

    def _adopt(self, k: int, result: RoundResult) -> None:
        """SL: the next device starts from this device's weights."""
        self._load_global(self._whole_state(k, result))

    def _load_global(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
        for half, _ in self.replicas.values():
            own = half.state_dict()
            half.load_state_dict({key: state[key] for key in own})

    def _evaluate(self) -> float:
        self.model.eval()
        correct = 0
        try:
            with torch.no_grad():
                for first in range(0, len(self.test_set), 500):
                    x, y = self.test_set.batch(range(first, min(first + 500, len(self.test_set))))
                    correct += int((self.model(x).argmax(1) == y).sum())
        finally:
            self.model.train()
        return correct / max(1, len(self.test_set))

    def _busy(self, start: float, end: float) -> dict[str, float]:
        """Busy seconds per resource kind in [start, end]; device kinds are means."""
        totals = dict.fromkeys(RESOURCE_KINDS, 0.0)
        for track, busy in self.recorder.busy_by_track(start, end).items():
            totals[resource_kind(track)] += busy
        k = self.config.devices
        return {kind: value if kind == "server" else value / k
                for kind, value in totals.items()}

    def _link_bytes(self) -> tuple[int, int]:
        up = down = 0
        for session in self.sessions.values():
            stats = session.peer.link.statistics()
            up += stats.received.bytes
            down += stats.sent.bytes
        return up, down

    def _frame_limit(self) -> int:
        state_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        batch = self.config.batch_size
        act = max(math.prod(s) for s in self.activation_shapes) * 4 * batch + 8 * batch
        # a RoundResult also carries the device's trace of the round: a few slices per
        # micro-batch, each well under 128 bytes as msgpack
        slices = max((p.iterations_per_epoch * (3 * p.parallel_batches + 2) + 16)
                     for p in self.plans)
        return int(max(state_bytes, act) + HEADER_SLACK_BYTES + 256 * len(self.model.state_dict())
                + 128 * slices)

    def describe(self) -> dict[str, Any]:
        """Live state for ``GET /status``: devices, plan, progress, and the busy fraction of
        each resource kind in the epoch so far (device figures are means over devices;
        device-side work is known once a device reports its round)."""
        now = self.clock.now()
        live: dict[str, float] = {}
        if self.epoch >= 0 and now > self._epoch_start:
            elapsed = now - self._epoch_start
            live = {kind: round(busy / elapsed, 4)
                    for kind, busy in self._busy(self._epoch_start, now).items()}
        return {
            "mode": self.config.mode, "devices": self.config.devices,
            "joined": sorted(self.sessions), "connected": sorted(self.connected),
            "epoch": self.epoch, "round": self.rounds,
            "epochs": self.config.epochs,
            "busy_fraction": live,
            "plan": [{"device": p.device_id, "split_point": p.split_point,
                      "parallel_batches": p.parallel_batches,
                      "micro_batch_size": p.micro_batch_size} for p in self.plans],
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
    return EpochMetrics(**fields)
