"""A fleet is started by hand in any order: a device started before its server waits for
it (retrying with backoff up to ``connect_timeout``) and trains once it listens; with
nobody listening it gives up after ``connect_timeout`` with one line."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from test_runtime_websocket import CONFIG, SECRET

from aiopipe import ConfigError, Device, Server, TrainingError
from aiopipe.auth import mint_token


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
async def test_devices_started_before_the_server_wait_for_it() -> None:
    port = _free_port()
    url = f"ws://127.0.0.1:{port}/ws"

    async def device(k: int) -> None:
        async with Device(url, k, token=mint_token(SECRET, k), connect_timeout=60) as node:
            await node.run()

    async with asyncio.TaskGroup() as tasks:
        for k in range(CONFIG.devices):
            tasks.create_task(device(k))
        await asyncio.sleep(1.5)  # the devices have been refused a few times by now
        async with Server(CONFIG, port=port, token_secret=SECRET, join_timeout=60) as server:
            result = await server.run()
    assert [e.samples for e in result.epochs] == [160, 160]


async def test_a_device_gives_up_after_its_connect_timeout() -> None:
    url = f"ws://127.0.0.1:{_free_port()}/ws"
    started = time.monotonic()
    with pytest.raises(TrainingError, match=r"no server at .* within 0.5 s \(Connection refused"):
        async with Device(url, 0, connect_timeout=0.5):
            pass
    assert time.monotonic() - started < 3.0


def test_connect_timeout_is_checked() -> None:
    with pytest.raises(ConfigError, match="connect_timeout"):
        Device("ws://127.0.0.1:1/ws", 0, connect_timeout=-1)
