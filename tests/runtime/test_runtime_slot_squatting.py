"""A stolen token cannot squat its device's connection slots (issue 41; [Note: device
slots] in aiopipe/runtime/http.py). Over real sockets in one event loop: device 1 talks to
the server through a TCP proxy; once it trains, a squatter holding device 1's token keeps
as many silent websockets open as the server lets it (never saying hello, reopening each
one the server closes), and the proxy then resets device 1's connection. The honest
device must get back in within ``reconnect_grace`` and the run must count every sample.
(Before the fix the squatter's silent connections held both of device 1's slots and its
reconnections were refused with HTTP 429 until it was lost.)"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from real_processes import TcpProxy
from test_runtime_websocket import CONFIG, SECRET, _device

from aiopipe import Server
from aiopipe.auth import mint_token

RUN = CONFIG.replace(epochs=4, reconnect_grace=3.0)
SQUATTED = 1  # the device whose token was stolen


class Squatter:
    """Keeps up to ``holding`` silent websockets open with one device's token."""

    def __init__(self, url: str, device_id: int, holding: int) -> None:
        self.url, self.holding = url, holding
        self.headers = {"Authorization": f"Bearer {mint_token(SECRET, device_id)}"}
        self.open: list[aiohttp.ClientWebSocketResponse] = []
        self.refused = 0  # upgrades the server refused (HTTP 429 and the like)
        self.most = 0  # the most silent websockets it held at once

    async def run(self, http: aiohttp.ClientSession) -> None:
        """Open silent websockets whenever fewer than ``holding`` are open, forever."""
        while True:
            self.open = [ws for ws in self.open if not ws.closed]
            if len(self.open) < self.holding:
                try:
                    self.open.append(await http.ws_connect(self.url, headers=self.headers,
                                                           autoclose=False, heartbeat=None))
                except aiohttp.WSServerHandshakeError:
                    self.refused += 1
            self.most = max(self.most, len(self.open))
            await asyncio.sleep(0.01)


@pytest.mark.slow
async def test_silent_connections_with_a_stolen_token_cannot_keep_the_device_out() -> None:
    trained = asyncio.Event()  # an epoch finished: device 1 is in the run
    async with (Server(RUN, token_secret=SECRET, join_timeout=60,
                       progress=lambda _: trained.set()) as server,
                aiohttp.ClientSession() as http):
        host, port = "127.0.0.1", int(server.url.split(":")[2].split("/")[0])
        async with TcpProxy(host, port) as proxy, asyncio.TaskGroup() as tasks:
            tasks.create_task(_device(server.url, 0))
            via_proxy = f"ws://127.0.0.1:{proxy.port}/ws"
            tasks.create_task(_device(via_proxy, SQUATTED))
            training = tasks.create_task(server.run())
            async with asyncio.timeout(60):
                await trained.wait()
            squatter = Squatter(server.url, SQUATTED, holding=4)
            squatting = tasks.create_task(squatter.run(http))
            await asyncio.sleep(0.3)  # it holds what it can get
            proxy.drop()  # the honest device's network blips
            result = await training
            squatting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await squatting
            for ws in squatter.open:
                await ws.close()
    assert proxy.connections >= 2  # device 1 did reconnect through the proxy
    assert squatter.most == 4  # silent connections got in, but held no slot
    assert [e.samples for e in result.epochs] == [160] * 4
    assert [e.devices_lost for e in result.epochs] == [()] * 4
