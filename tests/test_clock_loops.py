"""A `VirtualClock` on a loop it cannot drive (uvloop's) is a `ConfigError` before
anything starts (issue 42, item 2): `simulate`, `open_fleet`, `run_undisturbed`, `Fleet`,
`Server`, `Device`. On the old code each device logged a traceback and the run waited
300 s for them to join; each attempt here gives up after a few seconds instead of
hanging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from aiopipe import Device, RunConfig, Server, simulate
from aiopipe.clock import VirtualClock
from aiopipe.errors import ConfigError
from aiopipe.testing import Fleet, open_fleet, run_undisturbed, uniform_costs

uvloop = pytest.importorskip("uvloop")

CONFIG = RunConfig(mode="pipar", devices=2, samples_per_device=20, batch_size=10, epochs=1,
                   split_point=1, parallel_batches=2, test_samples=0)
HOW = r"asyncio\.run\(\.\.\.\).*no uvloop event loop policy.*pytest-asyncio's default loop"


async def _simulate() -> Any:
    return await simulate(CONFIG, clock=VirtualClock(), cost_table=uniform_costs(CONFIG))


async def _open_fleet() -> Any:
    async with open_fleet(CONFIG) as fleet:  # its own VirtualClock
        return await fleet.train()


async def _fleet() -> Any:
    try:
        async with asyncio.TaskGroup() as tasks:
            return Fleet(CONFIG, VirtualClock(), tasks)
    except* ConfigError as group:  # the task group wraps it
        raise group.exceptions[0] from None


async def _undisturbed() -> Any:
    return await run_undisturbed(CONFIG)


async def _server() -> Any:
    async with Server(CONFIG, clock=VirtualClock()) as server:  # embedded, no port
        return await server.run()


async def _device() -> Any:
    async with Device("ws://127.0.0.1:9/ws", 0, clock=VirtualClock()) as device:
        return await device.run()


@pytest.mark.parametrize("attempt", [_simulate, _open_fleet, _fleet, _undisturbed, _server,
                                     _device],
                         ids=["simulate", "open_fleet", "Fleet", "run_undisturbed", "Server",
                              "Device"])
def test_a_virtual_clock_on_uvloop_is_a_config_error_at_once(
        attempt: Callable[[], Awaitable[Any]]) -> None:
    async def within_seconds() -> Any:
        tasks = len(asyncio.all_tasks())
        try:
            return await asyncio.wait_for(attempt(), 10.0)
        finally:
            assert len(asyncio.all_tasks()) == tasks  # nothing was started

    start = time.monotonic()
    with pytest.raises(ConfigError, match=HOW) as refused:
        uvloop.run(within_seconds())
    assert "uvloop.Loop" in str(refused.value)  # the loop it was given
    assert time.monotonic() - start < 5.0


def test_check_loop_passes_the_standard_loop_and_no_loop() -> None:
    VirtualClock.check_loop()  # no running loop: nothing to check
    asyncio.run(_check_running())
    loop = uvloop.new_event_loop()
    try:
        with pytest.raises(ConfigError, match=HOW):
            VirtualClock.check_loop(loop)
    finally:
        loop.close()


async def _check_running() -> None:
    VirtualClock.check_loop()
