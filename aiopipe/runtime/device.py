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
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from aiopipe import data as datasets
from aiopipe import models
from aiopipe.clock import Clock, SystemClock
from aiopipe.config import RunConfig
from aiopipe.errors import RemoteProtocolError, TrainingError
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
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.peer import Peer
from aiopipe.runtime.plan import build_model, device_indices, train_dataset
from aiopipe.runtime.tasks import first_error
from aiopipe.scheduler.costs import CostTable
from aiopipe.scheduler.schedule import pipar_order
from aiopipe.transport import Link, WebSocketLink, network_spec

__all__ = ["DeviceSummary", "run_device"]


@dataclass(frozen=True, slots=True)
class DeviceSummary:
    """What a device did in a run."""

    device_id: int
    rounds: int
    samples: int
    reason: str


async def run_device(link: Link, device_id: int, *, clock: Clock | None = None,
                     cost_table: CostTable | None = None, clock_offset: float | None = None,
                     model: nn.Sequential | None = None,
                     max_frame_bytes: int | None = None,
                     shape_uplink: bool = False) -> DeviceSummary:
    """Run device ``device_id`` over an open link until the server says Bye.

    Args:
        link: connected to the server.
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
        TrainingError: the server refused us or the conversation broke down.
        TransportError: the link failed.
    """
    node = _DeviceNode(link, device_id, clock or SystemClock(), cost_table, clock_offset, model,
                       max_frame_bytes)
    node.shape_uplink = shape_uplink
    try:
        return await node.run()
    finally:
        node.compute.close()


class _DeviceNode:
    def __init__(self, link: Link, device_id: int, clock: Clock, cost_table: CostTable | None,
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
        self.peer = Peer(link, clock, self.recorder, f"device{device_id}/uplink",
                         max_frame_bytes=max_frame_bytes)
        self.control: asyncio.Queue[RoundStart | Bye] = asyncio.Queue()
        self.pending: dict[tuple[int, int, int], asyncio.Future[Gradient]] = {}

    async def run(self) -> DeviceSummary:
        start = self.clock.now()
        await self.peer.send(Hello(PROTOCOL_VERSION, self.device_id))
        plan = await self.peer.receive()
        if isinstance(plan, ErrorMessage):
            raise TrainingError(f"server refused device {self.device_id}: {plan.message}")
        if not isinstance(plan, Plan) or plan.device_id != self.device_id:
            raise RemoteProtocolError(f"expected a Plan for device {self.device_id}, "
                                      f"got {type(plan).__name__}")
        if self.clock_offset is None:
            self.clock_offset = plan.server_time - (start + self.clock.now()) / 2
        await self.compute.call(lambda: self._set_up(plan))
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.peer.send_loop())
                receiver = tasks.create_task(self._receive_loop())
                heartbeat = tasks.create_task(self._heartbeat_loop())
                summary = await self._train_loop()
                self.peer.finish()
                receiver.cancel()
                heartbeat.cancel()
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return summary

    def _set_up(self, plan: Plan) -> None:
        run = dict(plan.run)
        config = RunConfig.from_mapping(run) if run.get("model") != "custom" else (
            RunConfig.from_mapping({**run, "model": "vgg5"}).replace(model=self.custom_model))
        if config.model is None:
            raise TrainingError("the server runs a custom model; pass model= to the device")
        torch.set_num_threads(config.torch_threads)
        self.config = config
        self.plan = plan
        self.dataset = train_dataset(config)
        self.indices = device_indices(config, self.dataset, self.device_id)
        whole = build_model(config, num_classes=self.dataset.num_classes,
                            in_shape=self.dataset.in_shape)
        self.units = models.unit_count(whole)
        self.half = models.split(whole, plan.split_point)[0]
        self.optimizer = torch.optim.SGD(self.half.parameters(), lr=config.learning_rate,
                                         momentum=config.momentum)
        self.compute.slowdown = config.device_slowdown_of(self.device_id)
        self.schedule = pipar_order(plan.parallel_batches)
        if (self.shape_uplink and config.shape_links
                and isinstance(self.peer.link, WebSocketLink)):
            self.peer.link.reshape(network_spec(config.network).up)

    # -- loops ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            message = await self.peer.receive()
            if isinstance(message, Gradient):
                key = (message.epoch, message.iteration, message.micro_batch)
                future = self.pending.pop(key, None)
                if future is None or future.done():
                    raise RemoteProtocolError(f"unexpected gradient for epoch {key[0]}, "
                                              f"iteration {key[1]}, micro-batch {key[2]}")
                future.set_result(message)
            elif isinstance(message, RoundStart | Bye):
                self.control.put_nowait(message)
                if isinstance(message, Bye):
                    # the server may end the run mid-round (it failed): stop waiting
                    for future in self.pending.values():
                        if not future.done():
                            future.set_exception(TrainingError(
                                f"the server ended the run: {message.reason}"))
                    self.pending.clear()
                    return
            elif isinstance(message, ErrorMessage):
                raise TrainingError(f"server error {message.code}: {message.message}")
            elif not isinstance(message, Heartbeat):
                raise RemoteProtocolError(f"a device does not accept {type(message).__name__}")

    async def _heartbeat_loop(self) -> None:
        """Tell the server we are alive, between (never inside) other frames."""
        seq = 0
        while True:
            await self.clock.sleep(self.config.heartbeat_interval)
            seq += 1
            await self.peer.send(Heartbeat(seq))

    async def _train_loop(self) -> DeviceSummary:
        rounds = samples = 0
        while True:
            message = await self.control.get()
            if isinstance(message, Bye):
                return DeviceSummary(self.device_id, rounds, samples, message.reason)
            mark = len(self.recorder.slices)
            state = state_from_wire(message.tensors)
            await self.compute.call(partial(self.half.load_state_dict, state))
            order = datasets.epoch_order(self.indices, epoch=message.epoch, seed=self.config.seed)
            totals = np.zeros(3)  # samples, loss_sum, correct
            for iteration in range(message.first_iteration,
                                   message.first_iteration + message.iterations):
                if self.config.mode == "fl":
                    totals += await self._fl_iteration(order, message.epoch, iteration)
                else:
                    await self._split_iteration(order, message.epoch, iteration)
                    totals[0] += self.plan.micro_batch_size * self.plan.parallel_batches
            rounds += 1
            samples += int(totals[0])
            weights = await self.compute.call(
                lambda: state_to_wire({k: v.detach().clone()
                                       for k, v in self.half.state_dict().items()}))
            await self.peer.post(RoundResult(message.round, int(totals[0]), float(totals[1]),
                                             int(totals[2]), weights), "m", epoch=message.epoch)
            # the report follows the weights so that it can include their upload
            offset = self.clock_offset or 0.0
            report: dict[str, Any] = {
                "slices": [s.shifted(offset).to_list() for s in self.recorder.take(mark)],
            }
            self.peer.post(RoundReport(message.round, report), "report", epoch=message.epoch)

    async def _split_iteration(self, order: np.ndarray, epoch: int, iteration: int) -> None:
        """Run the plan's schedule for one iteration (see `aiopipe.scheduler.schedule`)."""
        micro, p = self.plan.micro_batch_size, self.plan.split_point
        base = iteration * micro * self.plan.parallel_batches
        loop = asyncio.get_running_loop()
        outputs: dict[int, torch.Tensor] = {}
        waiting: dict[int, asyncio.Future[Gradient]] = {}
        costs = self.costs
        for action in self.schedule:
            n = action.micro_batch
            if action.kind == "F":
                batch_indices = order[base + n * micro: base + (n + 1) * micro]
                _, y, out = await self.compute.run(
                    "f", partial(self._forward, batch_indices),
                    cost=costs.forward_time(0, p, micro) if costs else None,
                    epoch=epoch, iteration=iteration, micro_batch=n)
                outputs[n] = out
                waiting[n] = self.pending[(epoch, iteration, n)] = loop.create_future()
                self.peer.post(Activation(epoch, iteration, n, to_tensor_data(out.detach()),
                                          to_tensor_data(y)), "u",
                               epoch=epoch, iteration=iteration, micro_batch=n)
            elif action.kind == "B":
                grad = to_torch((await waiting.pop(n)).tensor)
                out = outputs.pop(n)
                if grad.shape != out.shape or grad.dtype != out.dtype:
                    raise RemoteProtocolError(
                        f"gradient of shape {tuple(grad.shape)} {grad.dtype} for an activation "
                        f"of shape {tuple(out.shape)} {out.dtype}")
                await self.compute.run(
                    "b", partial(_backward, out, grad),
                    cost=costs.backward_time(0, p, micro) if costs else None,
                    epoch=epoch, iteration=iteration, micro_batch=n)
            else:
                await self.compute.run("step", self._step,
                                       cost=costs.step_time(0, p) if costs else None,
                                       epoch=epoch, iteration=iteration)

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
            epoch=epoch, iteration=iteration)
        return np.array([len(batch_indices), loss_sum, correct], dtype=np.float64)


def _backward(output: torch.Tensor, gradient: torch.Tensor) -> None:
    torch.autograd.backward(output, gradient)
