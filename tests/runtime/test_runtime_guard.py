"""Connections are bounded before they are a device's ([Note: bounded before
authentication] in aiopipe/runtime/guard.py), over real sockets in one event loop: idle
and slow connections are closed at the handshake timeout, no more than ``max_pending``
stay open at once, a token holds at most ``max_per_device`` websockets past their hello
(silent ones hold none), a frame above the
hello size is refused before the hello; meanwhile ``/status`` answers and the devices
join and train. (Between processes, under a small ``ulimit -n``:
tests/test_hostile_processes.py.)"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from test_runtime_websocket import CONFIG, SECRET, _device

from aiopipe import ConfigError, ConnectionLimits, Server
from aiopipe.auth import mint_token
from aiopipe.protocol import PROTOCOL_VERSION, Hello, Plan, decode, encode

LIMITS = ConnectionLimits(handshake_timeout=1.0, max_pending=4)


async def _closed_by_server(reader: asyncio.StreamReader, within: float) -> bool:
    """Whether the server closed this connection within ``within`` seconds."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True


@pytest.mark.slow  # (about 2 s)
async def test_idle_and_slow_connections_are_closed_and_the_devices_still_train() -> None:
    async with Server(CONFIG, token_secret=SECRET, join_timeout=60, limits=LIMITS) as server:
        host, port = "127.0.0.1", int(server.url.split(":")[2].split("/")[0])
        base = server.url.removesuffix("/ws")
        idle = [await asyncio.open_connection(host, port) for _ in range(10)]
        slow_reader, slow_writer = await asyncio.open_connection(host, port)
        slow_writer.write(b"GET /status HTTP/1.1\r\n")  # and the rest never comes
        await asyncio.sleep(0.2)
        # one more than max_pending closed the oldest: 7 of the 11 are gone at once
        early = [await _closed_by_server(r, 0.05) for r, _ in idle]
        assert sum(early) == 7, early
        async with aiohttp.ClientSession() as http, http.get(f"{base}/status") as response:
            assert response.status == 200
            assert (await response.json())["mode"] == "pipar"
        started = time.monotonic()
        assert await _closed_by_server(slow_reader, 3.0)
        assert time.monotonic() - started < 1.5
        assert all([await _closed_by_server(r, 1.5) for r, _ in idle])
        async with asyncio.TaskGroup() as tasks:
            for k in range(CONFIG.devices):
                tasks.create_task(_device(server.url, k))
            result = await server.run()
        for _, writer in [*idle, (slow_reader, slow_writer)]:
            writer.close()
    assert [e.samples for e in result.epochs] == [160, 160]
    # the 11 strangers went, each once; /status closed its own connection
    assert server.guard.evicted + server.guard.timed_out == 11
    assert server.guard.evicted >= 8  # 7, and one for /status's connection


async def test_a_token_holds_a_slot_only_from_its_hello_and_takes_only_a_hello_first(
) -> None:
    """[Note: device slots] in aiopipe/runtime/http.py."""
    limits = ConnectionLimits(max_per_device=1)
    # device 0 joins and leaves: the server's exit waits out its reconnect_grace (real
    # seconds), which this test has no use for
    config = CONFIG.replace(reconnect_grace=0.5)
    async with (Server(config, token_secret=SECRET, join_timeout=60, limits=limits) as server,
                aiohttp.ClientSession() as http):
        headers = {"Authorization": f"Bearer {mint_token(SECRET, 0)}"}
        silent = [await http.ws_connect(server.url, headers=headers) for _ in range(3)]
        first = silent[0]  # three silent websockets, and none holds the only slot
        await first.send_bytes(b"\0" * (64 * 1024))  # above the hello's 16 KiB
        closing = await first.receive()
        assert closing.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert first.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        device = await http.ws_connect(server.url, headers=headers)
        await device.send_bytes(encode(Hello(PROTOCOL_VERSION, 0, 0, "")))
        assert isinstance(decode(await device.receive_bytes()), Plan)
        # its hello took the slot: one more connection with the token is refused
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server.url, headers=headers)
        assert refused.value.status == 429
        for ws in [*silent, device]:
            await ws.close()


@pytest.mark.parametrize(("field", "value"), [("handshake_timeout", 0.0), ("max_pending", 0),
                                          ("max_per_device", True),
                                          ("hello_frame_bytes", 1.5)])
def test_limits_refuse_nonsense(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        ConnectionLimits(**{field: value})  # type: ignore[arg-type]


def test_a_server_wants_connection_limits() -> None:
    with pytest.raises(ConfigError, match="ConnectionLimits"):
        Server(CONFIG, limits={"max_pending": 3})  # type: ignore[arg-type]
