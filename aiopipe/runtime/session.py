"""The server's side of one device connection (PiPar Algorithm 2, per device k).

A session owns three tasks while its device is connected:
- the receive loop validates every message against the device's plan and routes it:
  activations to the worker, round results to the coordinator;
- the worker runs each activation through device k's server-half replica on the
  server's shared compute queue (forward, loss, backward: one ``s`` slice), posts the
  activation's gradient at once, and steps the replica after the iteration's N-th
  micro-batch;
- the send loop (`Peer.send_loop`) moves gradients and models over the downlink.
A message that breaks the contract ends this session only, with an `ErrorMessage`
naming the problem; other devices are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from aiopipe.errors import (
    DeviceLostError,
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

if TYPE_CHECKING:
    from aiopipe.runtime.server import ServerNode

__all__ = ["DeviceSession"]

log = logging.getLogger("aiopipe.server")


@dataclass(slots=True)
class RoundWindow:
    """Which activations the current round accepts."""

    round: int
    epoch: int
    first_iteration: int
    iterations: int


class DeviceSession:
    """Server side of device ``plan.device_id``'s connection."""

    def __init__(self, node: ServerNode, peer: Peer, plan: DevicePlan,
                 activation_shape: tuple[int, ...]) -> None:
        self.node = node
        self.peer = peer
        self.plan = plan
        self.device_id = plan.device_id
        self.activation_shape = activation_shape
        self.window: RoundWindow | None = None
        self.seen: set[tuple[int, int, int]] = set()
        self.done_per_iteration: Counter[tuple[int, int]] = Counter()
        self.work: asyncio.Queue[Activation | None] = asyncio.Queue()
        self.result: asyncio.Future[RoundResult] | None = None
        self.round_result: RoundResult | None = None  # waiting for its RoundReport
        # server-side loss of the round in progress (split modes); it counts only when the
        # round completes, so a lost device's partial round is not counted
        self.round_loss_sum = 0.0
        self.round_correct = 0
        self.closing = False  # we said goodbye: the connection may end
        self.ended = False  # the connection has ended
        self.last_heard = node.clock.now()

    # -- driven by the coordinator -----------------------------------------------------

    def start_round(self, message: RoundStart) -> asyncio.Future[RoundResult]:
        """Send the round's weights and work; the future resolves with the device's result
        (with the server-side loss in split modes) or fails with `DeviceLostError`."""
        if self.ended:
            lost: asyncio.Future[RoundResult] = asyncio.get_running_loop().create_future()
            lost.set_exception(DeviceLostError(f"device {self.device_id} is gone"))
            return lost
        self.window = RoundWindow(message.round, message.epoch, message.first_iteration,
                                  message.iterations)
        self.round_loss_sum, self.round_correct = 0.0, 0
        self.result = asyncio.get_running_loop().create_future()
        self.peer.post(message, "m", epoch=message.epoch)
        return self.result

    def say_bye(self, reason: str) -> None:
        """End the conversation after everything already queued."""
        self.closing = True
        self.peer.post(Bye(reason), "bye")
        self.peer.finish()

    # -- the session's own tasks -------------------------------------------------------

    async def serve(self) -> None:
        """Run until the device leaves or the run ends.

        Raises:
            TransportError, ProtocolError: the connection failed or the device broke the
                contract (after telling it why); only this session ends.
        """
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.peer.send_loop())
                worker = tasks.create_task(self._work_loop())
                watchdog = tasks.create_task(self._watchdog())
                try:
                    await self._receive_loop()
                finally:
                    watchdog.cancel()
                    self.work.put_nowait(None)
                    if not self.closing:
                        worker.cancel()
        except* ProtocolError as group:
            problem = group.exceptions[0]
            log.warning("device %d: %s", self.device_id, problem)
            await self._refuse(problem)
            raise problem from None
        except* TransportError as group:
            if not self.closing:
                raise group.exceptions[0] from None
        except* DeviceLostError as silent:
            lost = silent.exceptions[0]
            await self.peer.link.aclose(str(lost))
            raise lost from None

    async def _watchdog(self) -> None:
        """Declare the device lost when it has been silent for ``device_timeout``."""
        config, clock = self.node.config, self.node.clock
        while True:
            silent = clock.now() - self.last_heard
            # a relative tolerance: sleeping the float remainder could advance no time
            if silent >= config.device_timeout * (1 - 1e-9):
                raise DeviceLostError(f"device {self.device_id} was silent for "
                                      f"{silent:.1f} s (device_timeout)")
            await clock.sleep(config.device_timeout - silent)

    async def _refuse(self, problem: BaseException) -> None:
        with contextlib.suppress(TransportError):
            await self.peer.send(ErrorMessage("protocol", str(problem)))
        await self.peer.link.aclose()

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
                self._check_activation(message)
                self.work.put_nowait(message)
            elif isinstance(message, RoundResult):
                self._check_result(message)
                self.round_result = message
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

    def _check_activation(self, message: Activation) -> None:
        window, plan = self.window, self.plan
        key = (message.epoch, message.iteration, message.micro_batch)
        if window is None or self.result is None or self.result.done():
            raise RemoteProtocolError("activation outside a round")
        if self.node.config.mode == "fl":
            raise RemoteProtocolError("activations are not part of an fl run")
        if message.epoch != window.epoch or not (
            window.first_iteration <= message.iteration
            < window.first_iteration + window.iterations
        ) or message.micro_batch >= plan.parallel_batches:
            last = window.first_iteration + window.iterations - 1
            raise RemoteProtocolError(
                f"activation ids {key} outside round {window.round} (epoch {window.epoch}, "
                f"iterations {window.first_iteration}..{last}, "
                f"{plan.parallel_batches} micro-batches)")
        if key in self.seen:
            raise RemoteProtocolError(f"activation {key} sent twice")
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

    def _complete_round(self, message: RoundReport) -> None:
        result, self.round_result = self.round_result, None
        if result is None or self.result is None or self.result.done():
            raise RemoteProtocolError("round report without a round result")
        if message.round != result.round:
            raise RemoteProtocolError(f"report for round {message.round}, expected "
                                      f"{result.round}")
        try:
            slices = [Slice.from_list(s) for s in message.report.get("slices", ())]
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"round report holds a bad slice: {exc}") from None
        mine = f"device{self.device_id}/"
        if any(not s.track.startswith(mine) for s in slices):
            raise RemoteProtocolError("round report names another device's resources")
        self.node.recorder.extend(slices)
        if self.node.config.mode != "fl":  # the server computed the loss, not the device
            result = dataclasses.replace(result, loss_sum=self.round_loss_sum,
                                         correct=self.round_correct)
        self.result.set_result(result)

    def _check_result(self, message: RoundResult) -> None:
        window = self.window
        if (window is None or self.result is None or self.result.done()
                or self.round_result is not None):
            raise RemoteProtocolError("round result outside a round")
        if message.round != window.round:
            raise RemoteProtocolError(f"result for round {message.round}, expected "
                                      f"{window.round}")
        expected = self.node.device_half_keys(self.device_id)
        if set(message.tensors) != expected:
            raise RemoteProtocolError("round result does not hold the device half's tensors")

    async def _work_loop(self) -> None:
        node, plan = self.node, self.plan
        if node.config.mode == "fl":
            return  # no server half: devices train whole models
        replica, optimizer = node.replicas[self.device_id]
        costs = node.cost_table
        q, p, micro = node.units, plan.split_point, plan.micro_batch_size
        s_cost = (costs.forward_time(p, q, micro) + costs.backward_time(p, q, micro)
                  if costs else None)
        step_cost = costs.step_time(p, q) if costs else None
        while (message := await self.work.get()) is not None:
            epoch, iteration, n = message.epoch, message.iteration, message.micro_batch

            def server_pass(m: Activation = message) -> tuple[torch.Tensor, float, int]:
                return _server_pass(replica, m, plan.parallel_batches, node.num_classes)

            grad, loss_sum, correct = await node.compute.run(
                "s", server_pass, cost=s_cost, epoch=epoch, iteration=iteration, micro_batch=n)
            self.round_loss_sum += loss_sum
            self.round_correct += correct
            self.peer.post(Gradient(epoch, iteration, n, to_tensor_data(grad)), "d",
                           epoch=epoch, iteration=iteration, micro_batch=n)
            self.done_per_iteration[(epoch, iteration)] += 1
            if self.done_per_iteration[(epoch, iteration)] == plan.parallel_batches:
                del self.done_per_iteration[(epoch, iteration)]
                await node.compute.run("step", lambda: _step(optimizer), cost=step_cost,
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
    torch.autograd.backward(loss / parallel_batches)
    assert activation.grad is not None
    correct = int((logits.detach().argmax(1) == labels).sum())
    return activation.grad, float(loss.detach()) * labels.numel(), correct


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
