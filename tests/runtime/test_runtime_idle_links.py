"""[Note: idle links rest] (aiopipe.runtime.liveness): in a simulation that samples
devices per round, a device in no round costs no heartbeat, no timer and no task of its
link's liveness, at either end; a drawn device's link wakes, and its silence is still
found within ``device_timeout``; what the run computes does not change."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import torch

from aiopipe import RunConfig, VirtualClock, simulate
from aiopipe.clock import Clock
from aiopipe.metrics.results import RunResult
from aiopipe.runtime.liveness import Liveness
from aiopipe.runtime.sampling import sampled_devices
from aiopipe.scheduler.costs import CostTable
from tests.runtime.fleet import suite_fleet

COSTS = CostTable.uniform(5, forward=0.001, backward=0.002, step=0.0005, batch=1)


def _config(**changes: Any) -> RunConfig:
    values: dict[str, Any] = {
        "mode": "fl", "model": "vgg5", "devices": 12, "samples_per_device": 10,
        "batch_size": 10, "epochs": 3, "test_samples": 10, "devices_per_round": 2,
        "network": "4g", "seed": 2}
    values.update(changes)
    return RunConfig(**values)


def _loops() -> Counter[str]:
    """The running tasks by their coroutine's name."""
    return Counter(task.get_coro().__qualname__  # type: ignore[union-attr]
                   for task in asyncio.all_tasks())


async def test_an_idle_device_holds_no_liveness_task_timer_or_wake_up() -> None:
    """After each round only the devices of the round just played (awake until the next
    draw rests them) have heartbeats and watchdogs, two of each per device; the clock
    holds no other sleeper; an idle device has four tasks (its run, its control loop, the
    receive loops at both ends), not the 11 it had, and no send loop."""
    config = _config(devices=30, epochs=4)
    clock = VirtualClock()
    seen: list[tuple[Counter[str], int]] = []

    def note(epoch: Any) -> None:
        sleepers = sum(1 for *_, future in clock._sleepers if not future.done())
        seen.append((_loops(), sleepers))

    await simulate(config, clock=clock, cost_table=COSTS, progress=note)
    assert len(seen) == 4
    awake = 2 * config.round_size(config.devices)  # a device's end and the server's
    for loops, sleepers in seen:
        assert loops["Liveness.beat"] == awake
        assert loops["Liveness.watch"] == awake
        assert sleepers <= 2 * awake
        # the device's own (its run, its control loop, its receive loop) and the server's
        # (its receive loop); no send loop while nothing is queued
        assert loops["Peer.send_loop"] + loops["Peer._drain"] <= awake
        assert sum(loops.values()) <= 4 * config.devices + 3 * awake + 4


async def _sleeps_per_round(devices: int) -> list[int]:
    clock = _CountingClock()
    counts: list[int] = []

    def note(epoch: Any) -> None:
        counts.append(clock.sleeps)

    await simulate(_config(devices=devices, epochs=4, heartbeat_interval=0.25,
                           device_timeout=1.0),
                   clock=clock, cost_table=COSTS, progress=note)
    return [b - a for a, b in itertools.pairwise(counts)]


class _CountingClock(VirtualClock):
    def __init__(self) -> None:
        super().__init__()
        self.sleeps = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += seconds > 0
        await super().sleep(seconds)


async def test_a_round_s_wake_ups_do_not_grow_with_idle_devices() -> None:
    """With heartbeats every 0.25 s (a round lasts seconds), a round's timed sleeps are
    about the same for 10 devices as for 40, 2 drawn in each (other devices are drawn:
    a heartbeat more or less), where 38 idle devices' heartbeats would add hundreds:
    idle devices wake no one."""
    small, large = await _sleeps_per_round(10), await _sleeps_per_round(40)
    assert max(large) <= max(small) + 4


async def _fleet_run(config: RunConfig, *, rest: bool) -> RunResult:
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks, rest_idle_links=rest)
        for k in range(config.devices):
            fleet.start_device(k)
        result = await fleet.node.train()
    await clock.aclose()
    return result


async def test_resting_changes_nothing_the_run_computes() -> None:
    """The same sampled run with links resting and with heartbeats throughout: the same
    draws, samples and final model, bit for bit; epoch times agree to a heartbeat's wire
    time (a heartbeat that took the wire just before a drawn device's frame delayed it)."""
    config = _config(devices=8, devices_per_round=3, momentum=0.9)
    resting, beating = (await _fleet_run(config, rest=True),
                        await _fleet_run(config, rest=False))
    for a, b in zip(resting.epochs, beating.epochs, strict=True):
        assert a.sampled == b.sampled
        assert a.device_samples == b.device_samples
        assert abs(a.time_s - b.time_s) < 1e-3
    for (key, a_tensor), (_, b_tensor) in zip(resting.model.state_dict().items(),
                                              beating.model.state_dict().items(),
                                              strict=True):
        assert torch.equal(a_tensor, b_tensor), key


async def test_a_silent_device_is_found_once_drawn() -> None:
    """A device whose link goes silent while it rests (its link held for good) is not
    noticed while nothing is expected of it; once drawn, the server gives the silent
    connection up ``device_timeout`` after its RoundStart left, and the round goes on
    without it. (Resting, the device does not watch either: it learns of it when the
    held link lets the server's close through, here when the stall is released, and
    rejoins afresh.)"""
    config = _config(devices=6, epochs=4, heartbeat_interval=0.5, device_timeout=3.0,
                     reconnect_grace=1.0)
    draws = [sampled_devices(config.seed, e, 0, range(6), 2) for e in range(4)]
    silent = next(k for k in draws[2] if k not in draws[0] + draws[1])
    track = f"device{silent}/connection"
    clock = VirtualClock()
    async with asyncio.TaskGroup() as tasks:
        fleet = suite_fleet(config, clock, tasks, rest_idle_links=True)
        for k in range(config.devices):
            fleet.start_device(k)
        training = fleet.train()
        await fleet.until(fleet.node.joined.is_set)
        fleet.stall(silent)  # held for good: nothing it carries arrives any more
        stalled_at = clock.now()
        await fleet.until(lambda: any(s.track == track for s in fleet.node.recorder.slices))
        fleet.release(silent)
        result = await training
    await clock.aclose()
    (gap,) = [s for s in result.trace if s.track == track]
    assert gap.name == "lost"
    third = sum(e.time_s for e in result.epochs[:2])  # (about when round 3 began)
    assert gap.start > stalled_at + config.device_timeout  # not while it rested
    assert third - 1.0 <= gap.start <= third + config.device_timeout + 2.0
    assert [e.device_samples[silent] for e in result.epochs[:3]] == [0, 0, 0]
    assert len(result.epochs) == 4


def test_a_resting_liveness_has_no_loop_and_wakes_with_its_watch_after_the_send(
) -> None:
    """`Liveness` at rest runs neither loop; woken with a message still to leave, it
    beats at once and watches from when the message has left."""

    async def main() -> None:
        clock: Clock = VirtualClock()
        liveness = Liveness(clock, interval=1.0, timeout=5.0)
        liveness.restart(resting=True)
        peer: Any = _Peer()
        async with asyncio.TaskGroup() as tasks:
            liveness.attach(tasks, peer, "the peer")
            assert _loops()["Liveness.beat"] == 0
            assert _loops()["Liveness.watch"] == 0
            sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            liveness.wake(sent)
            await asyncio.sleep(0)
            assert _loops()["Liveness.beat"] == 1
            assert _loops()["Liveness.watch"] == 0
            sent.set_result(None)
            await asyncio.sleep(0)
            assert _loops()["Liveness.watch"] == 1
            liveness.rest()
            await asyncio.sleep(0)
            assert _loops()["Liveness.beat"] == 0
            assert _loops()["Liveness.watch"] == 0
            liveness.detach()
        assert isinstance(clock, VirtualClock)
        await clock.aclose()

    asyncio.run(main())


class _Peer:
    class link:
        @staticmethod
        def last_received() -> float:
            return 0.0

    async def send(self, message: object) -> None:
        await asyncio.sleep(0)


async def test_epochs_share_an_unchanged_plan() -> None:
    """The plan is an entry per device: epochs whose plan did not change share one
    (else each epoch's record of a population's run keeps its own, 25 MB an epoch for
    100,000 devices)."""
    result = await simulate(_config(), clock=VirtualClock(), cost_table=COSTS)
    first, *others = (e.plan for e in result.epochs)
    assert len(first) == 12
    assert all(plan is first for plan in others)
