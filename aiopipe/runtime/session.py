"""The server's side of one device (PiPar Algorithm 2, per device k).

A session lives as long as its device takes part in the run; connections come and go
under it. While a connection is attached, `DeviceSession.serve` runs five tasks:
- the receive loop validates every message against the device's plan and routes it:
  activations to the worker, round results to the coordinator;
- the worker runs each activation through device k's server-half replica on the
  server's shared compute queue (forward, loss, backward: one ``s`` slice), posts the
  activation's gradient at once, and steps the replica after the iteration's N-th
  micro-batch;
- the send loop (`Peer.send_loop`) moves gradients and models over the downlink;
- heartbeats to the device, and a watchdog that gives up on a connection that has been
  silent for ``device_timeout``.

[Note: reconnection] When a connection breaks or goes silent, the session detaches and
waits up to ``reconnect_grace`` for the device to connect again (the server's
`ServerNode.serve_link` re-attaches it). Its queues, its replica and its round survive.
What was in flight is sent again: the server re-posts the round's `RoundStart` (and a
pending `Bye`); the device re-sends the activations whose gradients it lacks and an
unacknowledged round result. Work is never done twice: a re-sent activation that was
already computed gets its cached gradient again, one still queued is ignored; a repeated
round result is ignored. On one connection, by contrast, a repeated activation is a
protocol error (a replay). A message that breaks the contract ends the session at once,
with an `ErrorMessage` naming the problem; other devices are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from aiopipe.clock import wait_for
from aiopipe.errors import (
    DeviceLostError,
    LinkBrokenError,
    ProtocolError,
    RemoteProtocolError,
    TransportError,
)
from aiopipe.metrics.trace import Slice
from aiopipe.protocol import (
    Activation,
    Bye,
    ErrorMessage,
    Gradient,
    Heartbeat,
    RoundReport,
    RoundResult,
    RoundStart,
    to_tensor_data,
    to_torch,
)
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.plan import DevicePlan
from aiopipe.transport import Link

if TYPE_CHECKING:
    from aiopipe.runtime.server import ServerNode

__all__ = ["DeviceSession"]

log = logging.getLogger("aiopipe.server")

Key = tuple[int, int, int]  # (epoch, iteration, micro-batch)


@dataclass(slots=True)
class RoundWindow:
    """Which activations the current round accepts."""

    round: int
    epoch: int
    first_iteration: int
    iterations: int
    start: RoundStart


class DeviceSession:
    """Server side of device ``plan.device_id``, across its connections."""

    def __init__(self, node: ServerNode, peer: Peer, plan: DevicePlan,
                 activation_shape: tuple[int, ...], *,
                 earlier_bytes: tuple[int, int] = (0, 0)) -> None:
        self.node = node
        self.peer = peer
        self.plan = plan
        self.device_id = plan.device_id
        self.activation_shape = activation_shape
        self.window: RoundWindow | None = None
        self.seen: set[Key] = set()  # activations accepted this round
        self.seen_on_link: set[Key] = set()  # ... on the current connection
        self.gradients: dict[Key, Gradient] = {}  # computed, for re-sending (one iteration)
        self.done_per_iteration: Counter[tuple[int, int]] = Counter()
        self.work: asyncio.Queue[Activation | object] = asyncio.Queue()
        self.result: asyncio.Future[RoundResult] | None = None
        self.round_result: RoundResult | None = None  # waiting for its RoundReport
        self.last_round_done = -1
        # server-side loss of the round in progress (split modes); it counts only when the
        # round completes, so a lost device's partial round is not counted
        self.round_loss_sum = 0.0
        self.round_correct = 0
        self.served = 0  # micro-batches computed this round (for re-planning)
        self.closing = False  # we said goodbye: the connection may end
        self.ended = False  # the session is over (goodbye, or the device was lost)
        self.attached = asyncio.Event()  # set when a connection is attached
        self.idle = asyncio.Event()  # set while no connection is attached
        self.idle.set()
        self.last_heard = node.clock.now()
        self.earlier_bytes = earlier_bytes  # (up, down) over connections that have ended
        self.nonce = secrets.randbits(62)  # `Plan.session`: who the device is talking to

    # -- driven by the coordinator -----------------------------------------------------

    def start_round(self, message: RoundStart) -> asyncio.Future[RoundResult]:
        """Send the round's weights and work; the future resolves with the device's result
        (with the server-side loss in split modes) or fails with `DeviceLostError`."""
        future: asyncio.Future[RoundResult] = asyncio.get_running_loop().create_future()
        if self.ended:
            future.set_exception(DeviceLostError(f"device {self.device_id} is gone"))
            return future
        self.window = RoundWindow(message.round, message.epoch, message.first_iteration,
                                  message.iterations, message)
        self.seen.clear()
        self.gradients.clear()
        self.round_loss_sum, self.round_correct = 0.0, 0
        self.served = 0
        self.result = future
        self.peer.post(message, "m", epoch=message.epoch)
        return future

    def link_bytes(self) -> tuple[int, int]:
        """Bytes received from and sent to the device over all its connections so far."""
        stats = self.peer.link.statistics()
        return (self.earlier_bytes[0] + stats.received.bytes,
                self.earlier_bytes[1] + stats.sent.bytes)

    def replan(self, plan: DevicePlan, activation_shape: tuple[int, ...]) -> None:
        """Validate the next rounds against a new plan (set between rounds)."""
        self.plan = plan
        self.activation_shape = activation_shape

    def say_bye(self, reason: str) -> None:
        """End the conversation after everything already queued."""
        self.closing = True
        self.bye = Bye(reason)
        self.peer.post(self.bye, "bye")
        self.peer.finish()

    def end(self, reason: str) -> None:
        """The device is gone for good: fail its round."""
        self.ended = True
        self.attached.set()  # a connection waiting to be re-attached stops waiting
        if self.result is not None and not self.result.done():
            self.result.set_exception(DeviceLostError(f"device {self.device_id} was lost: "
                                                      f"{reason}"))

    # -- connections ---------------------------------------------------------------------

    def attach(self, link: Link, *, resumed: bool) -> None:
        """Serve the device over ``link`` from now on; re-post what may have been lost."""
        if link is not self.peer.link:  # count the bytes the old connection moved
            self.earlier_bytes = self.link_bytes()
        self.peer.link = link
        self.seen_on_link.clear()
        self.last_heard = self.node.clock.now()
        self.idle.clear()  # until `serve` of this connection returns
        self.attached.set()
        if not resumed:
            return
        if self.closing:
            self.peer.post(self.bye, "bye")
            self.peer.finish()
        elif self.window is not None and self.result is not None and not self.result.done():
            self.peer.post(self.window.start, "m", epoch=self.window.epoch)

    async def wait_reattached(self, seconds: float) -> bool:
        """After a connection broke: whether the device came back within ``seconds``."""
        self.attached.clear()
        try:
            await wait_for(self.node.clock, self.attached.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def serve(self) -> None:
        """Serve the attached connection until it ends (see [Note: reconnection]).

        Raises:
            ProtocolError: the device broke the contract (it was told why).
            TransportError: the connection broke or went silent.
        """
        try:
            stop = object()  # this connection's worker stops at this token
            async with asyncio.TaskGroup() as tasks:
                sender = tasks.create_task(self.peer.send_loop())
                worker = tasks.create_task(self._work_loop(stop))
                others = [tasks.create_task(self._watchdog()),
                          tasks.create_task(self._heartbeat_loop())]
                try:
                    await self._receive_loop()
                finally:
                    for task in others:
                        task.cancel()
                    # the worker finishes what it was given (gradients are cached and
                    # re-sent on the next connection), then stops
                    self.work.put_nowait(stop)
                    if not self.closing:
                        sender.cancel()
                    await asyncio.wait([worker])
        except* ProtocolError as group:
            problem = group.exceptions[0]
            log.warning("device %d: %s", self.device_id, problem)
            with contextlib.suppress(TransportError):
                await self.peer.send(ErrorMessage("protocol", str(problem)))
            await self.peer.link.aclose(str(problem)[:100])
            raise problem from None
        except* TransportError as group:
            if not self.closing:
                raise group.exceptions[0] from None
        finally:
            self.idle.set()

    async def _watchdog(self) -> None:
        """Give up on a connection that has been silent for ``device_timeout`` (a large
        frame still arriving is not silence)."""
        config, clock = self.node.config, self.node.clock
        while True:
            silent = clock.now() - max(self.last_heard, self.peer.link.last_received())
            # a relative tolerance: sleeping the float remainder could advance no time
            if silent >= config.device_timeout * (1 - 1e-9):
                await self.peer.link.aclose("silent for too long")
                raise LinkBrokenError(f"device {self.device_id} was silent for "
                                      f"{silent:.1f} s (device_timeout)")
            await clock.sleep(config.device_timeout - silent)

    async def _heartbeat_loop(self) -> None:
        seq = 0
        while True:
            await self.node.clock.sleep(self.node.config.heartbeat_interval)
            seq += 1
            await self.peer.send(Heartbeat(seq))

    async def _receive_loop(self) -> None:
        while True:
            try:
                message = await self.peer.receive()
            except TransportError:
                if self.closing:
                    return
                raise
            self.last_heard = self.node.clock.now()
            if isinstance(message, Activation):
                if self._accept_activation(message):
                    self.work.put_nowait(message)
            elif isinstance(message, RoundResult):
                self._accept_result(message)
            elif isinstance(message, RoundReport):
                self._complete_round(message)
            elif isinstance(message, Heartbeat):
                continue
            elif isinstance(message, Bye):
                if not self.closing:
                    raise RemoteProtocolError(f"device {self.device_id} left: {message.reason}")
                return
            else:
                raise RemoteProtocolError(f"the server does not accept {type(message).__name__} "
                                          "here")

    def _accept_activation(self, message: Activation) -> bool:
        """Validate an activation; whether it is new work (False: a re-sent duplicate)."""
        window, plan = self.window, self.plan
        key = (message.epoch, message.iteration, message.micro_batch)
        if key in self.seen_on_link:
            raise RemoteProtocolError(f"activation {key} sent twice")
        self.seen_on_link.add(key)
        if key in self.seen:  # re-sent after a reconnection
            if key in self.gradients:
                self.peer.post(self.gradients[key], "d", epoch=key[0], iteration=key[1],
                               micro_batch=key[2])
            return False
        if self.node.config.mode == "fl":
            raise RemoteProtocolError("activations are not part of an fl run")
        if window is None or self.result is None or self.result.done():
            if window is not None and message.epoch <= window.epoch:
                return False  # a late re-send for a round that is over
            raise RemoteProtocolError("activation outside a round")
        if message.epoch != window.epoch or not (
            window.first_iteration <= message.iteration
            < window.first_iteration + window.iterations
        ) or message.micro_batch >= plan.parallel_batches:
            last = window.first_iteration + window.iterations - 1
            raise RemoteProtocolError(
                f"activation ids {key} outside round {window.round} (epoch {window.epoch}, "
                f"iterations {window.first_iteration}..{last}, "
                f"{plan.parallel_batches} micro-batches)")
        expected = (plan.micro_batch_size, *self.activation_shape)
        if message.tensor.dtype != "float32" or message.tensor.shape != expected:
            raise RemoteProtocolError(
                f"activation {key} is {message.tensor.dtype} {message.tensor.shape}, "
                f"the plan says float32 {expected}")
        if message.labels.dtype != "int64" or message.labels.shape != (plan.micro_batch_size,):
            raise RemoteProtocolError(
                f"labels {key} are {message.labels.dtype} {message.labels.shape}, the plan "
                f"says int64 ({plan.micro_batch_size},)")
        self.seen.add(key)
        return True

    def _accept_result(self, message: RoundResult) -> None:
        if message.round <= self.last_round_done or (
                self.round_result is not None and self.round_result.round == message.round):
            return  # re-sent after a reconnection
        window = self.window
        if window is None or self.result is None or self.result.done():
            raise RemoteProtocolError("round result outside a round")
        if message.round != window.round:
            raise RemoteProtocolError(f"result for round {message.round}, expected "
                                      f"{window.round}")
        expected = self.node.device_half_specs(self.device_id)
        if set(message.tensors) != set(expected):
            raise RemoteProtocolError("round result does not hold the device half's tensors")
        for name, tensor in message.tensors.items():
            if (tensor.dtype, tensor.shape) != expected[name]:
                raise RemoteProtocolError(
                    f"round result {name} is {tensor.dtype} {tensor.shape}, the model has "
                    f"{expected[name][0]} {expected[name][1]}")
            if tensor.dtype.startswith(("float", "bfloat")) and not bool(
                    torch.isfinite(to_torch(tensor)).all()):
                raise RemoteProtocolError(f"round result {name} holds NaN or Inf")
        plan, work = self.plan, window.iterations
        if self.node.config.mode == "fl":
            samples = work * self.node.config.batch_size
        else:  # exactly what the server computed with this device this round
            samples = work * plan.micro_batch_size * plan.parallel_batches
            if len(self.seen) * plan.micro_batch_size != samples:
                raise RemoteProtocolError(
                    f"round result before the round's work was done ({len(self.seen)} of "
                    f"{work * plan.parallel_batches} micro-batches)")
        if message.samples != samples:
            raise RemoteProtocolError(f"round result claims {message.samples} samples, the "
                                      f"round has {samples}")
        self.round_result = message

    def _complete_round(self, message: RoundReport) -> None:
        if message.round <= self.last_round_done:
            return  # re-sent after a reconnection
        result, self.round_result = self.round_result, None
        if result is None or self.result is None or self.result.done():
            raise RemoteProtocolError("round report without a round result")
        if message.round != result.round:
            raise RemoteProtocolError(f"report for round {message.round}, expected "
                                      f"{result.round}")
        try:
            slices = [Slice.from_list(s) for s in message.report.get("slices", ())]
        except (TypeError, ValueError, OverflowError) as exc:
            raise RemoteProtocolError(f"round report holds a bad slice: {exc}") from None
        mine = f"device{self.device_id}/"
        if any(not s.track.startswith(mine) for s in slices):
            raise RemoteProtocolError("round report names another device's resources")
        self.node.recorder.extend(slices)
        if self.node.config.mode != "fl":  # the server computed the loss, not the device
            result = dataclasses.replace(result, loss_sum=self.round_loss_sum,
                                         correct=self.round_correct)
        self.last_round_done = result.round
        self.result.set_result(result)

    async def _work_loop(self, stop: object) -> None:
        """Serve queued activations until ``stop`` comes out of the queue.

        Each activation is processed under `asyncio.shield`: when a broken connection
        cancels this loop, the item in progress still completes (its gradient is cached
        and re-sent later), so an activation is never half-applied to the replica.
        """
        if self.node.config.mode == "fl":
            return  # no server half: devices train whole models
        while (item := await self.work.get()) is not stop:
            if isinstance(item, Activation):  # (a stale stop token of an earlier link: skip)
                await asyncio.shield(self._process(item))

    async def _process(self, message: Activation) -> None:
        node, plan = self.node, self.plan
        replica, optimizer = node.replicas[self.device_id]
        costs = node.cost_table
        q, p, micro = node.units, plan.split_point, plan.micro_batch_size
        epoch, iteration, n = message.epoch, message.iteration, message.micro_batch
        grad, loss_sum, correct = await node.compute.run(
            "s", lambda: _server_pass(replica, message, plan.parallel_batches, node.num_classes),
            cost=(costs.forward_time(p, q, micro) + costs.backward_time(p, q, micro)
                  if costs else None),
            epoch=epoch, iteration=iteration, micro_batch=n)
        self.round_loss_sum += loss_sum
        self.round_correct += correct
        self.served += 1
        gradient = Gradient(epoch, iteration, n, to_tensor_data(grad))
        # the device moves to iteration i+1 only with every gradient of i: older ones
        # will never be asked for again
        for key in [k for k in self.gradients if k[:2] != (epoch, iteration)]:
            del self.gradients[key]
        self.gradients[(epoch, iteration, n)] = gradient
        self.peer.post(gradient, "d", epoch=epoch, iteration=iteration, micro_batch=n)
        self.done_per_iteration[(epoch, iteration)] += 1
        if self.done_per_iteration[(epoch, iteration)] == plan.parallel_batches:
            del self.done_per_iteration[(epoch, iteration)]
            await node.compute.run("step", lambda: _step(optimizer),
                                   cost=costs.step_time(p, q) if costs else None,
                                   epoch=epoch, iteration=iteration)


def _server_pass(replica: nn.Sequential, message: Activation, parallel_batches: int,
                 num_classes: int) -> tuple[torch.Tensor, float, int]:
    """Forward, loss and backward of one micro-batch; the activation's gradient.

    The loss is the micro-batch mean divided by N, so N accumulated micro-batch gradients
    equal the gradient of the whole batch's mean loss (PiPar Eq. 26).
    """
    activation = to_torch(message.tensor).detach().requires_grad_(True)
    labels = to_torch(message.labels)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise RemoteProtocolError(f"labels outside 0..{num_classes - 1}")
    if not torch.isfinite(activation).all():
        raise RemoteProtocolError("activation holds NaN or Inf")
    logits = replica(activation)
    loss = nn.functional.cross_entropy(logits, labels)
    # finite values can still be too large for the model: refuse them before they reach
    # the replica's weights (and, through FedAvg, every device's)
    if not torch.isfinite(loss):
        raise RemoteProtocolError("activation gives a NaN or Inf loss: its values are out "
                                  "of range")
    torch.autograd.backward(loss / parallel_batches)
    assert activation.grad is not None
    if not torch.isfinite(activation.grad).all():
        replica.zero_grad(set_to_none=True)
        raise RemoteProtocolError("activation gives NaN or Inf gradients: its values are "
                                  "out of range")
    correct = int((logits.detach().argmax(1) == labels).sum())
    return activation.grad, float(loss.detach()) * labels.numel(), correct


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
