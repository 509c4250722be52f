"""What the runtime's own machinery costs per work item and per micro-batch.

The cost table charges these besides the units' compute ([Note: per-stage costs] in
aiopipe/scheduler/costs.py). Both are timed here through the runtime's real parts on an
event loop of their own, with no-op work and no wire time:

- a *hand-over*: one work item through `Compute.run` (the compute lock, the hand-over to
  the node's compute thread, the loop's wake-up when it is done, the trace slice);
- a micro-batch's *messages*: a device `Peer` posts an `Activation` over an unshaped
  memory link pair, a server `Peer` receives it, decodes it and posts its `Gradient`
  back, and the device receives that and resolves the future its iteration awaits, as
  the sessions do (codec, send queues, link, the tasks' hand-offs; no session checks).

Most of a hand-over is the event loop's wake-up and bookkeeping, not the thread: a bare
thread pool round trip is a small part of it, so the hand-over is timed through
`Compute.run` itself.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from aiopipe.clock import SystemClock
from aiopipe.metrics.trace import Recorder
from aiopipe.protocol import Activation, Gradient, to_tensor_data, to_torch
from aiopipe.runtime.compute import Compute
from aiopipe.runtime.peer import Peer
from aiopipe.transport import open_memory_link_pair

__all__ = ["RuntimeOverheads", "measure_runtime_overheads"]

T = TypeVar("T")


class RuntimeOverheads(NamedTuple):
    """Seconds the runtime adds to compute (medians, measured on this machine)."""

    handover: float
    """One work item through a node's `Compute`, the work itself excluded."""
    message: float
    """One micro-batch's activation up and gradient down, both ends' event loops."""


def measure_runtime_overheads(activation_shape: Sequence[int], *, repeats: int = 200,
                              warmup: int = 20) -> RuntimeOverheads:
    """Median hand-over and message seconds (see the module), each over ``repeats`` timed
    runs after ``warmup`` untimed ones; activations of ``activation_shape`` (the batch
    dimension included).

    The loop runs in a thread of its own, so this may be called from inside a running
    event loop; it blocks the caller meanwhile (``warmup`` + ``repeats`` hand-overs and
    as many micro-batches' messages).
    """
    shape = tuple(activation_shape)

    async def measure() -> RuntimeOverheads:
        return RuntimeOverheads(await _handovers(repeats, warmup),
                                await _round_trips(shape, repeats, warmup))

    return _in_own_loop(measure())


def _in_own_loop(main: Coroutine[Any, Any, T]) -> T:
    """``main`` run to completion on a new event loop in a new thread."""
    result: list[T] = []
    failure: list[BaseException] = []

    def thread_main() -> None:
        try:
            result.append(asyncio.run(main))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=thread_main, name="aiopipe-profile-runtime")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


async def _handovers(repeats: int, warmup: int) -> float:
    compute = Compute(SystemClock(), Recorder(), "profile/compute")
    times = []
    try:
        for _ in range(repeats + warmup):
            start = time.perf_counter()
            await compute.run("f", _nothing)
            times.append(time.perf_counter() - start)
    finally:
        compute.close()
    return statistics.median(times[warmup:])


async def _round_trips(shape: tuple[int, ...], repeats: int, warmup: int) -> float:
    clock = SystemClock()
    device_end, server_end = open_memory_link_pair(clock)
    recorder = Recorder()
    device = Peer(device_end, clock, recorder, "device/uplink", max_frame_bytes=None)
    server = Peer(server_end, clock, recorder, "server/downlink", max_frame_bytes=None)
    total = repeats + warmup
    waiting: dict[int, asyncio.Future[Gradient]] = {}
    activation = to_tensor_data(torch.zeros(shape))
    labels = to_tensor_data(torch.zeros(shape[0], dtype=torch.int64))

    async def serve() -> None:
        for _ in range(total):
            message = await server.receive()
            if not isinstance(message, Activation):
                raise TypeError(f"expected an Activation, got {type(message).__name__}")
            gradient = to_tensor_data(to_torch(message.tensors[0]))
            server.post(Gradient(0, 1, 0, 0, message.micro_batch, 0, "server", "device0",
                                 (gradient,)), "d",
                        micro_batch=message.micro_batch)

    async def answer() -> None:
        for _ in range(total):
            message = await device.receive()
            if not isinstance(message, Gradient):
                raise TypeError(f"expected a Gradient, got {type(message).__name__}")
            waiting.pop(message.micro_batch).set_result(message)

    loop = asyncio.get_running_loop()
    times = []
    try:
        async with asyncio.TaskGroup() as tasks:
            for work in (serve(), answer(), device.send_loop(), server.send_loop()):
                tasks.create_task(work)
            for n in range(total):
                start = time.perf_counter()
                waiting[n] = loop.create_future()
                device.post(Activation(0, 0, 0, 0, n, 0, "device0", "server", (activation,),
                                       labels), "u", micro_batch=n)
                to_torch((await waiting[n]).tensors[0])
                times.append(time.perf_counter() - start)
            device.finish()
            server.finish()
    finally:
        await device_end.aclose()
        await server_end.aclose()
    return statistics.median(times[warmup:])


def _nothing() -> None:
    return None
