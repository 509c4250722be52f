"""Devices fail and come back (DESIGN §7), in virtual time: a lost device's unfinished
round is excluded from aggregation, the others go on, and a device that returns with its
id is given the latest global model and contributes again from the next round."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch

from aiopipe import CostTable, RunConfig, TrainingError, VirtualClock, simulate
from aiopipe.errors import AiopipeError
from aiopipe.protocol import PROTOCOL_VERSION, Hello, Plan, decode, encode
from aiopipe.runtime.device import run_device
from aiopipe.runtime.server import ServerNode
from aiopipe.transport import Link, LinkSpec, MemoryLink, open_memory_link_pair

COSTS = CostTable.uniform(5, forward=0.01, backward=0.02, step=0.001, batch=10)
# 3 devices x 80 samples, B=20: 4 iterations per epoch, 2 rounds of 2 iterations
CONFIG = RunConfig(mode="pipar", devices=3, samples_per_device=80, batch_size=20, epochs=3,
                   split_point=2, parallel_batches=2, aggregation_every=2, test_samples=20,
                   network={"up_mbps": 50, "down_mbps": 50, "latency_ms": 5},
                   heartbeat_interval=1.0, device_timeout=10.0)
WIRE = LinkSpec(50e6, 0.005)


class Fleet:
    """A server node and devices that connect over fresh memory links, in one task group.

    A device reconnects by itself when its link breaks (``cut``); ``kill`` ends the
    device itself, as SIGKILL would, and ``start_device`` starts it again.
    """

    def __init__(self, config: RunConfig, clock: VirtualClock, tasks: asyncio.TaskGroup) -> None:
        self.node = ServerNode(config, clock=clock, cost_table=COSTS)
        self.clock, self.tasks = clock, tasks
        self.links: dict[int, MemoryLink] = {}
        self.devices: dict[int, asyncio.Task[None]] = {}
        self.outcomes: dict[int, list[object]] = {}

    def connect(self) -> tuple[MemoryLink, MemoryLink]:
        device_end, server_end = open_memory_link_pair(self.clock, a_to_b=WIRE, b_to_a=WIRE)
        self.tasks.create_task(self._serve(server_end))
        return device_end, server_end

    async def _serve(self, link: MemoryLink) -> None:
        with contextlib.suppress(AiopipeError):
            await self.node.serve_link(link)

    def connector(self, k: int) -> Callable[[], contextlib.AbstractAsyncContextManager[Link]]:
        @contextlib.asynccontextmanager
        async def open_link() -> AsyncIterator[Link]:
            device_end, _ = self.connect()
            self.links[k] = device_end
            try:
                yield device_end
            finally:
                await device_end.aclose()

        return open_link

    def start_device(self, k: int) -> None:
        self.devices[k] = self.tasks.create_task(self._device(k))

    def cut(self, k: int) -> None:
        self.links[k].break_(f"the link of device {k} was cut")

    def kill(self, k: int) -> None:
        self.devices[k].cancel()
        self.links[k].break_(f"device {k} was killed")

    async def _device(self, k: int) -> None:
        try:
            summary = await run_device(self.connector(k), k, clock=self.clock,
                                       cost_table=COSTS, clock_offset=0.0)
        except AiopipeError as exc:
            self.outcomes.setdefault(k, []).append(exc)
        except asyncio.CancelledError:
            self.outcomes.setdefault(k, []).append("killed")
        else:
            self.outcomes.setdefault(k, []).append(summary)

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self.clock.sleep(0.001)


def start_of(fleet: Fleet) -> float:
    """When the current round's device-2 session lost its link (approximately)."""
    return fleet.node.sessions[2].last_heard


def _activations_in(fleet: Fleet, k: int, round_no: int) -> int:
    session = fleet.node.sessions.get(k)
    window = session.window if session else None
    return len(session.seen) if session and window and window.round == round_no else 0


async def test_a_killed_device_is_excluded_and_a_restarted_one_rejoins() -> None:
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        # kill device 2 in the middle of round 3 (epoch 1's second round)
        await fleet.until(lambda: fleet.node.rounds == 4 and _activations_in(fleet, 2, 3) > 0)
        fleet.kill(2)
        # it stays away longer than device_timeout: the server gives up on it
        await fleet.until(lambda: fleet.node.sessions[2].ended)
        assert clock.now() - start_of(fleet) >= CONFIG.device_timeout
        fleet.start_device(2)  # restarted, it says hello again
        result = await training
    await clock.aclose()
    epochs = result.epochs
    # epoch 1: device 2's second round was excluded; it came back after round 4 had
    # started, so it contributes again from round 5 (epoch 2's second round)
    assert [e.device_samples for e in epochs] == [(80, 80, 80), (80, 80, 40), (80, 80, 40)]
    assert [e.devices_lost for e in epochs] == [(), (2,), ()]
    assert [e.samples for e in epochs] == [240, 200, 200]
    killed, rejoined = fleet.outcomes[2]
    assert killed == "killed"
    assert rejoined.rounds == 1  # type: ignore[attr-defined]
    for value in result.model.state_dict().values():
        assert torch.isfinite(value).all()


async def test_a_restarted_device_drops_its_round_and_rejoins_at_the_next() -> None:
    """A device process killed mid-round and started again at once: the new process knows
    nothing of the round (its Hello names no session), so that round goes on without it
    and it takes part again from the next round; nothing is counted twice."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        await fleet.until(lambda: fleet.node.rounds == 4 and _activations_in(fleet, 2, 3) > 0)
        fleet.kill(2)
        fleet.start_device(2)  # a fresh process with the same id, within device_timeout
        result = await training
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80), (80, 80, 40),
                                                        (80, 80, 80)]
    assert [e.devices_lost for e in result.epochs] == [(), (2,), ()]


async def test_a_silent_device_is_declared_lost_after_the_timeout() -> None:
    config = CONFIG.replace(devices=2, epochs=1, aggregation_every=0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(config, clock, tasks)
        fleet.start_device(0)
        silent, _ = fleet.connect()  # a device that never speaks after its hello
        await silent.send(encode(Hello(PROTOCOL_VERSION, 1)))
        assert isinstance(decode(await silent.receive()), Plan)
        start = clock.now()
        result = await fleet.node.train()  # device 1 never says anything again
    await clock.aclose()
    assert result.final.devices_lost == (1,)
    assert result.final.device_samples == (80, 0)
    # silence for device_timeout ends the connection, then reconnect_grace passes: the
    # server gave up on device 1 then, not later, and not forever
    limit = config.device_timeout + config.reconnect_grace
    assert limit - 1 <= result.final.time_s <= limit + 5
    assert clock.now() - start < 60


async def test_the_run_fails_when_every_device_is_gone_for_good() -> None:
    config = CONFIG.replace(devices=1, epochs=2, aggregation_every=0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(config, clock, tasks)
        fleet.node.join_timeout = 30.0
        fleet.start_device(0)

        async def kill() -> None:
            await fleet.until(lambda: _activations_in(fleet, 0, 0) > 0)
            fleet.kill(0)

        tasks.create_task(kill())
        with pytest.raises(TrainingError, match="none rejoined within 30 s"):
            await fleet.node.train()
    await clock.aclose()


async def test_a_cut_link_is_repaired_and_nothing_is_lost_or_counted_twice() -> None:
    """Cut device 1's link three times mid-round; it reconnects by itself each time. The
    run computes exactly what an undisturbed run computes."""
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(CONFIG, clock, tasks)
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        for round_no in (1, 3, 4):
            await fleet.until(lambda r=round_no: _activations_in(fleet, 1, r) > 1)  # type: ignore[misc]
            fleet.cut(1)
        result = await training
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    (summary,) = fleet.outcomes[1]
    assert summary.rounds == 6  # type: ignore[attr-defined]
    undisturbed = await simulate(CONFIG, clock=VirtualClock(), cost_table=COSTS)
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)


async def test_a_restarted_server_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Kill the server mid-epoch; a new server resumes from the last round checkpoint,
    the devices reconnect by themselves, and every epoch sees exactly its samples: the
    final model equals an uninterrupted run's (momentum 0: device state is just weights)."""
    config = CONFIG.replace(momentum=0.0)
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = Fleet(config, clock, tasks)
        fleet.node.checkpoint_dir = tmp_path
        for k in range(3):
            fleet.start_device(k)
        training = tasks.create_task(fleet.node.train())
        # the server dies in the middle of round 3 (epoch 1's second round)
        await fleet.until(lambda: fleet.node.rounds == 4 and _activations_in(fleet, 2, 3) > 0)
        training.cancel()
        for k in range(3):
            fleet.links[k].break_("the server process died")
        with contextlib.suppress(asyncio.CancelledError):
            await training
        fleet.node = ServerNode(config, clock=clock, cost_table=COSTS, checkpoint_dir=tmp_path,
                                resume=True)
        assert fleet.node.rounds == 3  # rounds 0-2 were checkpointed; 3 runs again
        result = await fleet.node.train()
    await clock.aclose()
    assert [e.device_samples for e in result.epochs] == [(80, 80, 80)] * 3
    assert [e.devices_lost for e in result.epochs] == [(), (), ()]
    undisturbed = await simulate(config, clock=VirtualClock(), cost_table=COSTS)
    assert [e.loss for e in result.epochs] == pytest.approx(
        [e.loss for e in undisturbed.epochs], rel=1e-6)
    got, want = result.model.state_dict(), undisturbed.model.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7)
