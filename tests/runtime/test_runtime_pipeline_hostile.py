"""A pipeline peer that authenticates but then breaks the plan is refused by its
neighbour with the reason, and the run ends with one TrainingError instead of training
on what it sent or waiting for ever (the pipeline would go on without the device, but
this one is device 0, which holds the data).

Device 0 is a script here: it says hello to the coordinator, takes its `Plan` (with its
pair key) and first `RoundStart`, dials device 1 over the memory fabric with that key
and sends what an honest stage 0 never would: an activation twice, more activations
than two iterations' worth ahead of device 1, or a frame larger than the round allows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest
import torch

from aiopipe import RunConfig, TrainingError, VirtualClock
from aiopipe.errors import AiopipeError
from aiopipe.protocol import (
    PROTOCOL_VERSION,
    Activation,
    ErrorMessage,
    Hello,
    Message,
    Plan,
    RoundStart,
    decode,
    encode,
    to_tensor_data,
)
from aiopipe.runtime.coordinator import Coordinator
from aiopipe.runtime.device import run_device
from aiopipe.scheduler.costs import CostTable
from aiopipe.testing import ready_for
from aiopipe.transport import MemoryLink, open_memory_link_pair
from aiopipe.transport.fabric import MemoryEndpoint, MemoryFabric
from aiopipe.transport.peering import dial_peer

pytestmark = pytest.mark.timeout(60)

MICRO = 4  # batch 8 / N 2
CONFIG = RunConfig(mode="pipeline", model="vgg5", devices=2, samples_per_device=40,
                   batch_size=8, parallel_batches=2, epochs=1,
                   test_samples=20, heartbeat_interval=0.5, device_timeout=2.0,
                   reconnect_grace=1.0, options={"partition": [2]})
COSTS = CostTable.uniform(5, forward=0.01, backward=0.02, batch=2)


def _activation(plan: Plan, start: RoundStart, iteration: int, micro_batch: int,
                shape: tuple[int, ...] = (MICRO, 64, 8, 8)) -> Activation:
    """What an honest stage 0 sends for (iteration, micro_batch) of ``start``'s round."""
    return Activation(plan.run_id, 0, start.epoch, iteration, micro_batch,
                      start.version + iteration - start.first_iteration, "device0", "device1",
                      (to_tensor_data(torch.zeros(shape)),),
                      to_tensor_data(torch.zeros(shape[0], dtype=torch.int64)))


def _twice(plan: Plan, start: RoundStart) -> list[Message]:
    return [_activation(plan, start, 0, 0)] * 2


def _ahead(plan: Plan, start: RoundStart) -> list[Message]:
    # 5 iterations x 2 micro-batches, all at once: device 1 has taken at most one
    return [_activation(plan, start, i, m) for i in range(5) for m in range(2)]


def _oversized(plan: Plan, start: RoundStart) -> list[Message]:
    return [_activation(plan, start, 0, 0, shape=(MICRO, 64, 64, 64))]


CASES: dict[str, tuple[Callable[[Plan, RoundStart], list[Message]], str]] = {
    "an activation twice": (_twice, "sent F (0, 0, 0) twice"),
    "two iterations ahead": (_ahead, "more than two iterations' messages ahead"),
    "a frame too large": (_oversized, "frame of"),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_peer_that_breaks_the_plan_is_refused_and_the_run_ends(case: str) -> None:
    make, reason = CASES[case]
    clock = VirtualClock()
    node = Coordinator(CONFIG, clock=clock, cost_table=COSTS)
    fabric = MemoryFabric(clock)
    answers: list[Message] = []
    outcome: list[BaseException] = []

    async def serve(link: MemoryLink) -> None:
        with contextlib.suppress(AiopipeError):
            await node.serve_link(link)

    async def hostile(link: MemoryLink, endpoint: MemoryEndpoint) -> None:
        await link.send(encode(Hello(PROTOCOL_VERSION, 0, 0, endpoint.address)))
        plan = decode(await link.receive())
        assert isinstance(plan, Plan)
        await link.send(encode(ready_for(plan, CONFIG.device_samples_of(0))))
        start = decode(await link.receive())
        assert isinstance(start, RoundStart)
        async with dial_peer(endpoint, start.peers["device1"]["address"], me="device0",
                             peer="device1", key=bytes.fromhex(plan.peer_keys["device1"]),
                             clock=clock, timeout=5.0) as peer:
            for message in make(plan, start):
                await peer.send(encode(message))
            with contextlib.suppress(AiopipeError):
                while True:  # heartbeats, then the refusal, then the link closes
                    answer = decode(await peer.receive())
                    if isinstance(answer, ErrorMessage):
                        answers.append(answer)

    async def honest(link: MemoryLink, endpoint: MemoryEndpoint) -> None:
        try:
            await run_device(link, 1, clock=clock, clock_offset=0.0, endpoint=endpoint,
                             cost_table=COSTS)
        except TrainingError as exc:
            outcome.append(exc)
        finally:
            link.break_("device 1 ended")

    async def train() -> None:
        # device 1 says its round stopped; the pipeline would play it again without the
        # device that broke the plan, but that is device 0, which holds the data
        with pytest.raises(TrainingError, match=r"device 0 is gone: it holds the data"):
            await node.train()

    links = [open_memory_link_pair(clock) for _ in range(2)]
    endpoints = [fabric.endpoint(f"device{k}") for k in range(2)]
    async with asyncio.TaskGroup() as tasks:
        for _, server_end in links:
            tasks.create_task(serve(server_end))
        tasks.create_task(hostile(links[0][0], endpoints[0]))
        tasks.create_task(honest(links[1][0], endpoints[1]))
        await train()
        links[0][0].break_("the script is done")
    for endpoint in endpoints:
        await endpoint.aclose()
    await clock.aclose()
    assert len(answers) == 1
    assert isinstance(answers[0], ErrorMessage)
    assert answers[0].code == "protocol"
    assert reason in answers[0].message
    # device 1 ended with the run (told mid-round, or after), not on device 0's faults
    assert all(str(o).startswith("the server ended the run") for o in outcome), outcome
