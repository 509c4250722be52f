"""The device node: trains the first P units on local data (PiPar Algorithm 1).

One event loop, one compute thread. Four tasks run while training (a fourth, not listed,
sends a heartbeat every ``heartbeat_interval``):
- the train loop: per round, per iteration, it runs the iteration's schedule (data, see
  `aiopipe.scheduler.schedule`); PiPar's is: forward N micro-batches back to back,
  posting each activation as soon as it exists; then, in micro-batch order, wait for
  that micro-batch's gradient and run its backward; then one optimizer step (Eq. 26);
- the send loop (`Peer.send_loop`): moves posted activations and models over the
  uplink, one at a time;
- the receive loop: routes gradients to the micro-batch waiting for them and control
  messages (`RoundStart`, `Bye`) to the train loop.
The data never leaves the device: only activations, labels and model halves do.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import partial
from typing import TypeAlias, cast

import numpy as np
import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.clock import Clock, SystemClock
from aiopipe.config import RunConfig
from aiopipe.errors import LinkBrokenError, RemoteProtocolError, TrainingError, TransportError
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import (
    PROTOCOL_VERSION,
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    Heartbeat,
    Hello,
    Plan,
    RoundReport,
    RoundResult,
    RoundStart,
    state_from_wire,
    state_to_wire,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.compute import Compute, warm_up_torch
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.runtime.replan import make_optimizer
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.schedule import pipar_order
from aiopipe.transport import Link, WebSocketLink, network_spec

__all__ = ["Connector", "DeviceSummary", "run_device"]

log = logging.getLogger("aiopipe.device")


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    """What a device did in a run."""

    device_id: int
    rounds: int
    samples: int
    reason: str


#: Opens a new link to the server (an async context manager that closes it).
Connector: TypeAlias = Callable[[], AbstractAsyncContextManager[Link]]


async def run_device(server: Link | Connector, device_id: int, *, clock: Clock | None = None,
                     cost_table: CostTable | None = None, clock_offset: float | None = None,
                     model: nn.Sequential | None = None,
                     max_frame_bytes: int | None = None,
                     shape_uplink: bool = False) -> DeviceSummary:
    """Run device ``device_id`` until the server says Bye.

    Args:
        server: an open link to the server, or a connector (a callable returning an async
            context manager that opens a new link) so that the device can reconnect
            with backoff when a link breaks or goes silent ([Note: reconnection]).
        device_id: this device's id, 0..K-1.
        clock: defaults to the system clock.
        cost_table: charge compute from this table (virtual-time simulation).
        clock_offset: server clock minus this clock; estimated from the handshake when
            None.
        model: the user's own model when the config names "custom".
        max_frame_bytes: refuse larger frames from the server.
        shape_uplink: pace a websocket uplink at the plan's network rate (sender-side
            shaping, to emulate a slow link on one machine).

    Raises:
        TrainingError: the server refused us, the conversation broke down, or the device
            could not reconnect.
        TransportError: the link failed and there is no connector to reconnect with.
    """
    warm_up_torch()
    node = _DeviceNode(server, device_id, clock or SystemClock(), cost_table, clock_offset, model,
                       max_frame_bytes)
    node.shape_uplink = shape_uplink
    try:
        return await node.run()
    finally:
        node.compute.close()


class _DeviceNode:
    def __init__(self, server: Link | Connector, device_id: int, clock: Clock,
                 cost_table: CostTable | None,
                 clock_offset: float | None, model: nn.Sequential | None,
                 max_frame_bytes: int | None) -> None:
        self.device_id = device_id
        self.clock = clock
        self.costs = cost_table
        self.clock_offset = clock_offset
        self.custom_model = model
        self.shape_uplink = False
        self.recorder = Recorder()
        self.compute = Compute(clock, self.recorder, f"device{device_id}/compute",
                               charge_costs=cost_table is not None)
        self.connector: Connector | None = None
        if hasattr(server, "receive"):
            link = cast(Link, server)
        else:
            self.connector, link = server, cast(Link, None)
        self.peer = Peer(link, clock, self.recorder, f"device{device_id}/uplink",
                         max_frame_bytes=max_frame_bytes)
        self.control: asyncio.Queue[RoundStart | Bye] = asyncio.Queue()
        self.pending: dict[tuple[int, int, int], asyncio.Future[Gradient]] = {}
        self.sent_activations: dict[tuple[int, int, int], Activation] = {}
        self.round = -1  # the round being worked on (or last finished)
        self.last_round_received = -1
        self.round_task: asyncio.Task[int] | None = None
        self.round_dropped = False
        self.server_session: int | None = None
        self.unacked: list[RoundResult | RoundReport] = []  # until the next RoundStart
        self.result_sent = asyncio.Event()
        self.last_heard = clock.now()
        self.random = random.Random(device_id)
        #: set when the server said Bye: the run is over, mid-round or not
        self.ended: TrainingError | None = None

    async def run(self) -> DeviceSummary:
        async with contextlib.AsyncExitStack() as links:
            self.plan = await self._connect(links)
            self.config = self._run_config(self.plan)  # cheap: heartbeats need it
            self._shape_uplink()
            try:
                async with asyncio.TaskGroup() as tasks:
                    training = tasks.create_task(self._train_loop())
                    while True:
                        try:
                            await self._serve_link(training)
                            break
                        except TransportError as exc:
                            if self.connector is None:
                                raise
                            await links.aclose()
                            await self._reconnect(links, exc)
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            return training.result()

    async def _handshake(self) -> Plan:
        start = self.clock.now()
        await self.peer.send(Hello(PROTOCOL_VERSION, self.device_id, self.server_session or 0))
        plan = await self.peer.receive()
        if isinstance(plan, ErrorMessage) and plan.code == "busy" and self.connector:
            # our old connection is still open on the server side: try again shortly
            raise LinkBrokenError(f"server busy: {plan.message}")
        if isinstance(plan, ErrorMessage):
            raise TrainingError(f"server refused device {self.device_id}: {plan.message}")
        if not isinstance(plan, Plan) or plan.device_id != self.device_id:
            raise RemoteProtocolError(f"expected a Plan for device {self.device_id}, "
                                      f"got {type(plan).__name__}")
        if self.clock_offset is None:
            self.clock_offset = plan.server_time - (start + self.clock.now()) / 2
        self.last_heard = self.clock.now()
        if self.server_session is not None and plan.session != self.server_session:
            # the server restarted (or gave up on us): it knows nothing of our round
            log.warning("device %d: the server has a new session for us; starting afresh",
                        self.device_id)
            self.last_round_received = -1
            self.unacked.clear()
            self.peer.clear()
            self._drop_round()
        self.server_session = plan.session
        return plan

    async def _serve_link(self, training: asyncio.Task[DeviceSummary]) -> None:
        """Move messages over the current link until training ends or the link fails."""
        try:
            async with asyncio.TaskGroup() as tasks:
                sender = tasks.create_task(self.peer.send_loop())
                receiver = tasks.create_task(self._receive_loop())
                link_tasks = [receiver, tasks.create_task(self._heartbeat_loop()),
                              tasks.create_task(self._watchdog())]
                await asyncio.wait([training, *link_tasks],
                                   return_when=asyncio.FIRST_COMPLETED)
                if receiver.done() and not receiver.cancelled() and not receiver.exception():
                    await asyncio.wait([training])  # Bye arrived: training ends now
                if training.done():
                    self.peer.finish()  # the send loop ends after the last queued message
                    for task in link_tasks:
                        task.cancel()
                else:
                    sender.cancel()
        except BaseExceptionGroup as group:
            raise first_error(group) from None

    async def _connect(self, links: contextlib.AsyncExitStack, *,
                       patience: float = 60.0, first_delay: float = 0.0) -> Plan:
        """Connect and say hello, retrying with exponential backoff and jitter while the
        server is unreachable or still holds our previous connection.

        Raises:
            TrainingError: no connection within ``patience`` seconds, or refused.
            TransportError: the link failed and there is no connector to retry with.
        """
        if self.connector is None:
            return await self._handshake()
        deadline = self.clock.now() + patience
        delay = 0.2
        await self.clock.sleep(first_delay)
        while True:
            try:
                self.peer.link = await links.enter_async_context(self.connector())
                return await self._handshake()
            except TransportError as exc:
                await links.aclose()
                if self.clock.now() >= deadline:
                    raise TrainingError(f"device {self.device_id} could not connect within "
                                        f"{patience:g} s: {exc}") from None
                log.info("device %d: %s; retrying", self.device_id, exc)
            await self.clock.sleep(delay * (0.5 + self.random.random()))
            delay = min(delay * 2, 5.0)

    async def _reconnect(self, links: contextlib.AsyncExitStack, cause: Exception) -> None:
        """Reconnect ([Note: reconnection]) and re-send what may have been lost.

        Raises:
            TrainingError: no connection within 5 x device_timeout, or refused.
        """
        log.warning("device %d: %s; reconnecting", self.device_id, cause)
        await self._connect(links, patience=5 * self.config.device_timeout,
                            first_delay=0.1 * self.random.random())
        self._shape_uplink()
        self.peer.clear()  # re-post in order what may not have arrived, once
        for key, activation in self.sent_activations.items():
            if key in self.pending:
                self.peer.post(activation, "u", epoch=key[0], iteration=key[1],
                               micro_batch=key[2])
        for message in self.unacked:
            self._post_round_message(message)

    async def _watchdog(self) -> None:
        """The server sends heartbeats: silence for device_timeout means a dead link (a
        large frame still arriving is not silence)."""
        timeout = self.config.device_timeout
        while True:
            silent = self.clock.now() - max(self.last_heard, self.peer.link.last_received())
            if silent >= timeout * (1 - 1e-9):
                raise LinkBrokenError(f"the server was silent for {silent:.1f} s")
            await self.clock.sleep(timeout - silent)

    def _run_config(self, plan: Plan) -> RunConfig:
        run = dict(plan.run)
        if run.get("model") != "custom":
            return RunConfig.from_mapping(run)
        if self.custom_model is None:
            raise TrainingError("the server runs a custom model; pass model= to the device")
        return RunConfig.from_mapping({**run, "model": "vgg5"}).replace(model=self.custom_model)

    def _set_up(self) -> None:
        """Build the model half, the optimizer and the local data (in the compute thread,
        while the link loops already answer heartbeats)."""
        config, plan = self.config, self.plan
        torch.set_num_threads(config.torch_threads)
        self.dataset = train_dataset(config)
        self.indices = device_indices(config, self.dataset, self.device_id)
        whole = build_model(config, num_classes=self.dataset.num_classes,
                            in_shape=self.dataset.in_shape)
        self.units = models.unit_count(whole)
        self.half = models.split(whole, plan.split_point)[0]
        self.optimizer = make_optimizer(self.half, config)
        self.compute.slowdown = config.device_slowdown_of(self.device_id)
        self.schedule = pipar_order(plan.parallel_batches)

    def _replan(self, message: RoundStart) -> None:
        """Switch to the round's plan (the coordinator re-planned): rebuild the device
        half at the new split point, keeping the momentum of the parameters that stay
        (see aiopipe.runtime.replan [Note: switching]).

        Raises:
            RemoteProtocolError: the plan cannot be this run's.
        """
        config = self.config
        p, n, micro = message.split_point, message.parallel_batches, message.micro_batch_size
        if config.mode not in ("sfl", "pipar") or not 1 <= p < self.units or n < 1 or (
                micro != config.batch_size // n) or (config.mode == "sfl" and n != 1):
            raise RemoteProtocolError(
                f"round {message.round} asks for split point {p}, {n} micro-batches of "
                f"{micro}: not a plan for this {config.mode} run of {self.units} units, "
                f"batch size {config.batch_size}")
        whole = build_model(config, num_classes=self.dataset.num_classes,
                            in_shape=self.dataset.in_shape)
        half = models.split(whole, p)[0]
        self.optimizer = make_optimizer(half, config, previous=(self.half, self.optimizer))
        self.half = half
        self.plan = dataclasses.replace(self.plan, split_point=p, parallel_batches=n,
                                        micro_batch_size=micro)
        self.schedule = pipar_order(n)
        log.info("device %d: round %d switches to split point %d, %d micro-batches",
                 self.device_id, message.round, p, n)

    def _shape_uplink(self) -> None:
        """Pace a websocket uplink at the network's rate (sender-side shaping)."""
        if (self.shape_uplink and self.config.shape_links
                and isinstance(self.peer.link, WebSocketLink)):
            self.peer.link.reshape(network_spec(self.config.network).up)

    # -- loops ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            message = await self.peer.receive()
            self.last_heard = self.clock.now()
            if isinstance(message, Gradient):
                key = (message.epoch, message.iteration, message.micro_batch)
                future = self.pending.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(message)
                # else: a gradient sent again after a reconnection; we have it already
            elif isinstance(message, RoundStart):
                if message.round <= self.last_round_received:
                    continue  # sent again after a reconnection: we have it already
                self.last_round_received = message.round
                self._drop_round()  # if still on an older one, the server gave up on it
                self.control.put_nowait(message)
            elif isinstance(message, Bye):
                self.control.put_nowait(message)
                # the server may end the run mid-round (it failed): stop waiting, now and
                # for any micro-batch the round would still send
                self.ended = TrainingError(f"the server ended the run: {message.reason}")
                self._abandon(self.ended)
                return
            elif isinstance(message, ErrorMessage):
                raise TrainingError(f"server error {message.code}: {message.message}")
            elif not isinstance(message, Heartbeat):
                raise RemoteProtocolError(f"a device does not accept {type(message).__name__}")

    def _drop_round(self) -> None:
        """Stop working on the current round (the server no longer waits for it)."""
        self.pending.clear()
        self.sent_activations.clear()
        if self.round_task is not None and not self.round_task.done():
            log.warning("device %d: dropping round %d", self.device_id, self.round)
            self.round_dropped = True
            self.round_task.cancel()

    def _abandon(self, reason: Exception) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(reason)
        self.pending.clear()
        self.sent_activations.clear()

    def _post_round_message(self, message: RoundResult | RoundReport) -> None:
        if isinstance(message, RoundResult):
            sent = self.peer.post(message, "m", epoch=self.epoch)
            sent.add_done_callback(lambda _: self.result_sent.set())
        else:
            self.peer.post(message, "report", epoch=self.epoch)

    async def _heartbeat_loop(self) -> None:
        """Tell the server we are alive, between (never inside) other frames."""
        seq = 0
        while True:
            await self.clock.sleep(self.config.heartbeat_interval)
            seq += 1
            await self.peer.send(Heartbeat(seq))

    async def _train_loop(self) -> DeviceSummary:
        await self.compute.call(self._set_up)
        rounds = samples = 0
        while True:
            message = await self.control.get()
            self.unacked.clear()  # the next round (or goodbye) acknowledges the last
            if isinstance(message, Bye):
                return DeviceSummary(self.device_id, rounds, samples, message.reason)
            self.round, self.epoch = message.round, message.epoch
            self.round_task = asyncio.create_task(self._run_round(message))
            try:
                done = await self.round_task
            except asyncio.CancelledError:
                if not self.round_dropped:
                    raise
                self.round_dropped = False
                continue
            rounds += 1
            samples += done

    async def _run_round(self, message: RoundStart) -> int:
        """Train the round's iterations, upload the weights, then the report; samples."""
        mark = len(self.recorder.slices)
        state = state_from_wire(message.tensors)

        def load() -> None:
            self.half.load_state_dict(state)
            self.optimizer.zero_grad(set_to_none=True)

        if message.split_point and (message.split_point, message.parallel_batches,
                                    message.micro_batch_size) != (
                self.plan.split_point, self.plan.parallel_batches, self.plan.micro_batch_size):
            await self.compute.call(partial(self._replan, message))
        await self.compute.call(load)
        order = datasets.epoch_order(self.indices, epoch=message.epoch, seed=self.config.seed)
        totals = np.zeros(3)  # samples, loss_sum, correct
        for iteration in range(message.first_iteration,
                               message.first_iteration + message.iterations):
            if self.config.mode == "fl":
                totals += await self._fl_iteration(order, message.epoch, iteration)
            else:
                await self._split_iteration(order, message.epoch, iteration)
                totals[0] += self.plan.micro_batch_size * self.plan.parallel_batches
        weights = await self.compute.call(
            lambda: state_to_wire({k: v.detach().clone()
                                   for k, v in self.half.state_dict().items()}))
        result = RoundResult(message.round, int(totals[0]), float(totals[1]), int(totals[2]),
                             weights)
        self.unacked = [result]
        self.result_sent.clear()
        self._post_round_message(result)
        await self.result_sent.wait()
        # the report follows the weights so that it can include their upload
        offset = self.clock_offset or 0.0
        report = RoundReport(message.round, {
            "slices": [s.shifted(offset).to_list() for s in self.recorder.take(mark)],
        })
        self.unacked.append(report)
        self._post_round_message(report)
        return int(totals[0])

    async def _split_iteration(self, order: np.ndarray, epoch: int, iteration: int) -> None:
        """Run the plan's schedule for one iteration (see `aiopipe.scheduler.schedule`)."""
        micro, p = self.plan.micro_batch_size, self.plan.split_point
        base = iteration * micro * self.plan.parallel_batches
        loop = asyncio.get_running_loop()
        outputs: dict[int, torch.Tensor] = {}
        waiting: dict[int, asyncio.Future[Gradient]] = {}
        costs = self.costs
        compute = self.compute
        for i, action in enumerate(self.schedule):
            n = action.micro_batch
            # an action whose input is at hand was ready when the previous one ended
            # ([Note: emulated slow devices]); a backward waits for its gradient
            ready = compute.last_end if i > 0 and (
                action.kind != "B" or waiting[n].done()) else None
            if action.kind == "F":
                batch_indices = order[base + n * micro: base + (n + 1) * micro]
                _, y, out = await compute.run(
                    "f", partial(self._forward, batch_indices),
                    cost=costs.forward_time(0, p, micro) if costs else None,
                    epoch=epoch, iteration=iteration, micro_batch=n, ready_at=ready)
                outputs[n] = out
                if self.ended is not None:  # no gradient will come
                    raise self.ended
                waiting[n] = self.pending[(epoch, iteration, n)] = loop.create_future()
                activation = Activation(epoch, iteration, n, to_tensor_data(out.detach()),
                                        to_tensor_data(y))
                self.sent_activations[(epoch, iteration, n)] = activation
                self.peer.post(activation, "u", epoch=epoch, iteration=iteration, micro_batch=n,
                               ready_at=compute.last_end)
            elif action.kind == "B":
                grad = to_torch((await waiting.pop(n)).tensor)
                out = outputs.pop(n)
                if grad.shape != out.shape or grad.dtype != out.dtype:
                    raise RemoteProtocolError(
                        f"gradient of shape {tuple(grad.shape)} {grad.dtype} for an activation "
                        f"of shape {tuple(out.shape)} {out.dtype}")
                await compute.run(
                    "b", partial(_backward, out, grad),
                    cost=costs.backward_time(0, p, micro) if costs else None,
                    epoch=epoch, iteration=iteration, micro_batch=n, ready_at=ready)
            else:
                await compute.run("step", self._step,
                                  cost=costs.step_time(0, p) if costs else None,
                                  epoch=epoch, iteration=iteration, ready_at=ready)
        self.sent_activations.clear()  # every gradient of the iteration has arrived

    def _forward(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.dataset.batch(indices)
        return x, y, self.half(x)

    def _step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    async def _fl_iteration(self, order: np.ndarray, epoch: int, iteration: int) -> np.ndarray:
        batch = self.config.batch_size
        batch_indices = order[iteration * batch:(iteration + 1) * batch]
        q = self.units
        costs = self.costs

        def forward() -> tuple[torch.Tensor, float, int]:
            x, y = self.dataset.batch(batch_indices)
            logits = self.half(x)
            loss = nn.functional.cross_entropy(logits, y)
            return loss, float(loss.detach()) * len(y), int((logits.argmax(1) == y).sum())

        loss, loss_sum, correct = await self.compute.run(
            "f", forward, cost=costs.forward_time(0, q, batch) if costs else None,
            epoch=epoch, iteration=iteration)

        def backward() -> None:
            torch.autograd.backward(loss)
            self._step()

        await self.compute.run(
            "b", backward,
            cost=costs.backward_time(0, q, batch) + costs.step_time(0, q) if costs else None,
            epoch=epoch, iteration=iteration, ready_at=self.compute.last_end)
        return np.array([len(batch_indices), loss_sum, correct], dtype=np.float64)


def _backward(output: torch.Tensor, gradient: torch.Tensor) -> None:
    torch.autograd.backward(output, gradient)
